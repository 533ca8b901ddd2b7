"""Issue 11: every Python block of the README runs as written, in order, from the repository
root (the Poplar SDK is not needed)."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _run_blocks(blocks: list[tuple[int, str]], namespace: dict) -> None:
    """Run ``blocks`` (README index, code) one after the other in ``namespace``; fail on an
    error, or on a warning whose text the block does not show in a ``# warns: <text>``
    comment."""
    for i, block in blocks:
        shown = [w.strip() for w in re.findall(r"# warns: (.*)", block)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                exec(compile(block, f"README.md block {i}", "exec"), namespace)
            except Exception as err:  # pragma: no cover - the message says which block
                raise AssertionError(f"README.md python block {i} fails: {err!r}\n{block}") \
                    from err
        unshown = [str(w.message) for w in caught
                   if not any(text in " ".join(str(w.message).split()) for text in shown)]
        assert not unshown, f"README.md python block {i} warns what it does not show: {unshown}"


@pytest.fixture
def readme_env(monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in [v for v in os.environ if v.startswith("POPDIST_")]:
        monkeypatch.delenv(var)


def test_readme_python_blocks_run_alone_and_in_order(readme_env) -> None:
    blocks = _blocks(ROOT / "README.md")
    assert len(blocks) >= 5
    for i, block in enumerate(blocks):        # alone: each block is a whole program
        _run_blocks([(i, block)], {"__name__": "readme"})
    _run_blocks(list(enumerate(blocks)), {"__name__": "readme"})  # in order, as a reader does


def test_every_example_config_with_train_py_runs_or_is_refused_clearly() -> None:
    import subprocess
    import sys

    for config in sorted((ROOT / "examples" / "configs").iterdir()):
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--config",
                               str(config), "--runs", "1", "--backend", "xla"],
                              capture_output=True, text=True, timeout=240, cwd=ROOT)
        text = proc.stdout + proc.stderr
        assert "Traceback" not in text, f"{config.name}:\n{text[-2000:]}"
        assert proc.returncode == 0 or (proc.returncode == 2 and "does not fit this example"
                                        in text), f"{config.name}: rc {proc.returncode}\n{text}"


def test_every_popart_example_runs_unchanged_through_the_drop_in() -> None:
    """examples/popart_*.py are plain PopART programs (``import popart``); each runs through
    ``python -m popart_kit.popart`` (what ``popart-kit run`` does) and reports steps whose loss
    goes down."""
    import subprocess
    import sys

    examples = sorted((ROOT / "examples").glob("popart_*.py"))
    assert len(examples) >= 2
    for example in examples:
        proc = subprocess.run([sys.executable, "-m", "popart_kit.popart", str(example)],
                              capture_output=True, text=True, timeout=240, cwd=ROOT)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "Traceback" not in text, f"{example.name}:\n{text[-2000:]}"
        losses = [float(m) for m in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
        assert len(losses) >= 5 and losses[-1] < losses[0], f"{example.name}:\n{proc.stdout}"


def test_train_py_without_the_sdk_says_so_for_the_popart_backend() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--backend",
                           "popart", "--runs", "1"], capture_output=True, text=True, timeout=240,
                          cwd=ROOT)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in text
    assert "--backend popart cannot run here" in text and "Poplar SDK" in text
