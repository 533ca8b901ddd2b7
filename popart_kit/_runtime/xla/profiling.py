"""Profiling on the xla backend: what ``profiling.auto_report_dir`` writes, and its summary.

PopART writes Poplar's auto-report there; the xla backend writes what an XLA user looks at:

* ``trace/``: a JAX profiler trace of the session's first :data:`TRACED_RUNS` runs
  (``jax.profiler``; open it in Perfetto or TensorBoard's profile plugin);
* ``popart_kit_report.json``: each compiled program's cost analysis (flops, bytes accessed) and
  memory analysis (argument, output, temporary and code bytes), the compile time and every run's
  wall time.

:func:`summary` checks the JSON's structure (every problem at once) and turns it into the table
``popart-kit report DIR`` prints. With no directory set, :func:`compiled` and :func:`run` do
nothing.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from ..._base.atomic import write_atomic
from ...errors import ConfigError, InvalidConfig

__all__ = ["REPORT", "TRACED_RUNS", "compiled", "run", "summary"]

REPORT = "popart_kit_report.json"
TRACED_RUNS = 3  # a trace per run costs time: the first runs show the steady state already
_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                  "alias_size_in_bytes", "generated_code_size_in_bytes")
_COST_FIELDS = ("flops", "transcendentals", "bytes accessed")


def _directory(backend: Any) -> Path | None:
    folder = backend.config.profiling.auto_report_dir
    return Path(folder) if folder else None


def _state(backend: Any) -> dict[str, Any]:
    if not hasattr(backend, "_profile"):
        backend._profile = {"backend": type(backend).__name__, "programs": [],
                            "compile_seconds": None, "run_seconds": []}
    return backend._profile


def _write(folder: Path, state: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / REPORT, json.dumps(state, indent=2) + "\n")


def _cost(program: Any) -> dict[str, float]:
    try:
        cost = program.cost_analysis()
    except Exception:  # some platforms have none
        return {}
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    # XLA counts -1 where it cannot tell (a program handing work to onnxruntime): left out
    return {k: float(cost[k]) for k in _COST_FIELDS if cost and k in cost and cost[k] >= 0}


def _memory(program: Any) -> dict[str, int]:
    try:
        memory = program.memory_analysis()
    except Exception:
        return {}
    return {k: int(getattr(memory, k)) for k in _MEMORY_FIELDS if hasattr(memory, k)}


def compiled(backend: Any, programs: list[Any], seconds: float) -> None:
    """Record the compiled programs' cost and memory analysis and the compile time."""
    folder = _directory(backend)
    if folder is None:
        return
    state = _state(backend)
    state["compile_seconds"] = seconds
    state["programs"] = [{"cost": _cost(p), "memory": _memory(p)} for p in programs]
    _write(folder, state)


@contextlib.contextmanager
def run(backend: Any) -> Iterator[None]:
    """Time one run (and trace it while fewer than :data:`TRACED_RUNS` were traced)."""
    folder = _directory(backend)
    if folder is None:
        yield
        return
    import jax

    state = _state(backend)
    traced = False
    if len(state["run_seconds"]) < TRACED_RUNS:
        try:
            jax.profiler.start_trace(str(folder / "trace"))
            traced = True
        except RuntimeError:  # another profiler session is active: time, do not trace
            pass
    started = time.perf_counter()
    try:
        yield
    finally:
        if traced:
            jax.profiler.stop_trace()
    state["run_seconds"].append(time.perf_counter() - started)
    _write(folder, state)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _text(value: str) -> str:
    """``value``, refused where it holds a lone surrogate (JSON's ``"\\ud800"``): such text
    cannot be printed or written as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"a lone surrogate at position {err.start}; text must be UTF-8"
                         ) from None
    return value


#: Text a JSON file may hold: a string that encodes as UTF-8 (so can be printed).
Utf8Text = Annotated[str, Field(strict=True), AfterValidator(_text)]
_Seconds = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0)]
_Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_Bytes = Annotated[int, Field(strict=True, ge=0, lt=2**63)]


class _Program(BaseModel):
    """One compiled program's cost and memory analysis."""

    model_config = ConfigDict(extra="allow")
    cost: dict[str, _Number] = {}
    memory: dict[str, _Bytes] = {}


class _Report(BaseModel):
    """The report as :func:`compiled` and :func:`run` write it: what :func:`summary` reads."""

    model_config = ConfigDict(extra="allow")
    backend: Utf8Text = "?"
    compile_seconds: _Seconds | None = None
    run_seconds: list[_Seconds] = []
    programs: list[_Program] = []


def _read(folder: str | Path) -> dict[str, Any]:
    """The report in ``folder``; refuses a missing or unreadable file, text that is not JSON,
    and a structure other than :class:`_Report`'s (every problem at once)."""
    path = Path(folder) / REPORT
    fix = f"Fix: run an xla session with profiling.auto_report_dir={str(folder)!r} first"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        why = "nested too deeply" if isinstance(err, RecursionError) else type(err).__name__
        raise ConfigError(f"{path}: no readable xla profiling report ({why}). {fix}.",
                          rule="K-report-missing") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{path}: expected an object at the top level of an xla profiling "
                          f"report, got {type(state).__name__}. {fix}.", rule="K-report-missing")
    try:
        _Report.model_validate(state)
    except ValidationError as err:
        raise InvalidConfig.of(f"{path} is not an xla profiling report; {fix}", [
            ("popart_kit.K-report-missing", e["loc"], e["msg"], e.get("input"))
            for e in err.errors(include_url=False)]) from None
    return state


def summary(folder: str | Path) -> list[tuple[str, str]]:
    """``(what, value)`` rows summarising the report in ``folder``; refuses a folder without
    one, or with a malformed one (:func:`_read`), saying how to make it."""
    state = _read(folder)
    runs = state.get("run_seconds", [])
    rows = [("backend", state.get("backend", "?")),
            ("compile time", f"{state['compile_seconds']:.3f} s"
             if state.get("compile_seconds") is not None else "-"),
            ("runs", str(len(runs)))]
    if runs:
        rows += [("first run", f"{runs[0] * 1e3:.2f} ms"),
                 ("later runs (mean)", f"{sum(runs[1:]) / len(runs[1:]) * 1e3:.2f} ms"
                  if len(runs) > 1 else "-"),
                 ("fastest run", f"{min(runs) * 1e3:.2f} ms")]
    for i, program in enumerate(state.get("programs", [])):
        tag = f"program {i}: "
        cost, memory = program.get("cost", {}), program.get("memory", {})
        if "flops" in cost:
            rows.append((tag + "flops", f"{cost['flops']:,.0f}"))
        if "bytes accessed" in cost:
            rows.append((tag + "bytes accessed", _bytes(cost["bytes accessed"])))
        for key in _MEMORY_FIELDS:
            if key in memory:
                rows.append((tag + key.removesuffix("_size_in_bytes").replace("_", " ")
                             + " memory", _bytes(memory[key])))
    traces = sorted(p for p in (Path(folder) / "trace").rglob("*") if p.is_file()) if (
        Path(folder) / "trace").is_dir() else []
    rows.append(("trace files", f"{len(traces)} under {Path(folder) / 'trace'} (Perfetto, "
                                f"TensorBoard)" if traces else "none"))
    return rows
