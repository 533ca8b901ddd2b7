"""Bad input to the CLI and the bench: refused quickly with one short message naming the thing,
the numbers and the fix, exit 2 and no traceback; never unbounded work before the refusal."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

import popart_kit as pk
from popart_kit._runtime.xla.profiling import REPORT
from popart_kit.bench import MAX_LAYERS, MAX_MODEL_BYTES, MAX_REPEAT, MAX_VARIANTS
from popart_kit.cli import LISTED, main

QUICK = 10.0  # seconds: a refusal does no real work (a hang would take far longer)


def refused(argv: list[str], capsys) -> str:
    """Run the CLI in-process; assert it refused (exit 2) without a traceback; its stderr."""
    started = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - started < QUICK
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return " ".join(captured.err.split())  # one line, whatever the console's width


# -- A. unbounded work ---------------------------------------------------------------------------

def axes_spec(values: int, axes: int) -> str:
    names = ["replication", "batches_per_step", "accumulation", "stages", "instances",
             "micro_batch"][:axes]
    lists = ", ".join(f"{n}: [{', '.join(str(v) for v in range(1, values + 1))}]" for n in names)
    return f"benchmarks:\n  big: {{{lists}}}\n"


def test_a_spec_of_billions_of_variants_is_refused_before_they_are_made(tmp_path):
    spec = tmp_path / "big.yaml"
    spec.write_text(axes_spec(59, 6))  # 59**6 = 42180533641 variants
    out = subprocess.run([sys.executable, "-m", "popart_kit.cli", "bench", "--spec", str(spec),
                          "--no-progress", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    text = " ".join(out.stderr.split())
    assert f"{59**6:,} variants" in text and f"more than {MAX_VARIANTS:,}" in text
    assert "replication 59 × batches_per_step 59" in text and "Fix:" in text


def test_variants_are_counted_across_the_benchmarks_of_a_spec(tmp_path, capsys):
    spec = tmp_path / "two.yaml"
    spec.write_text(axes_spec(30, 1) + "".join(
        f"  b{i}: {{replication: [{', '.join(map(str, range(1, 31)))}], micro_batch: [1, 2]}}\n"
        for i in range(17)))  # 30 + 17 * 60 = 1050
    text = refused(["bench", "--spec", str(spec), "--out", str(tmp_path / "o")], capsys)
    assert "1,050 variants" in text and "b0: 60 (replication 30 × micro_batch 2)" in text


def test_a_huge_range_is_counted_not_listed():
    started = time.perf_counter()
    with pytest.raises(pk.ConfigError, match=r"replication 999,999 × batches_per_step 999,999"):
        pk.bench.variants(replication=range(1, 10**6), batches_per_step=range(1, 10**6))
    assert time.perf_counter() - started < QUICK


@pytest.mark.parametrize("model, setting, value", [
    ("mlp", "width", 10**8), ("convnet", "width", 10**400), ("mlp", "micro_batch", 10**9),
    ("encoder", "seq", 10**7), ("convnet", "image", 10**6), ("encoder", "heads", 2**40)],
    ids=lambda v: str(v)[:12])
def test_model_sizes_that_cannot_fit_are_refused_before_allocating(model, setting, value,
                                                                   tmp_path, capsys):
    spec = tmp_path / "huge.yaml"
    sizes = {"width": 16, setting: value}
    spec.write_text(f"benchmarks:\n  huge: {{model: {model}, "
                    + ", ".join(f"{k}: {v}" for k, v in sizes.items()) + "}\n")
    text = refused(["bench", "--spec", str(spec), "--no-progress", "--out",
                    str(tmp_path / "o")], capsys)
    assert f"huge: bench: the {model} of " in text and "Fix:" in text
    assert f"more than the {MAX_MODEL_BYTES / 2**30:.0f} GiB" in text


def test_a_model_too_deep_to_build_is_refused(tmp_path, capsys):
    text = refused(["bench", "--layers", str(10**12), "--width", "1", "--no-progress", "--out",
                    str(tmp_path / "o")], capsys)
    assert f"more than {MAX_LAYERS} a built-in model may have" in text


def test_a_step_whose_inputs_cannot_fit_is_refused(tmp_path, capsys):
    text = refused(["bench", "--micro-batch", "100000", "--batches-per-step", "100000",
                    "--width", "1024", "--no-progress", "--out", str(tmp_path / "o")], capsys)
    assert "mlp" in text and "GiB" in text


def test_a_repeat_count_that_explodes_is_refused(tmp_path, capsys):
    text = refused(["bench", "--repeat", str(10**12), "--no-progress", "--out",
                    str(tmp_path / "o")], capsys)
    assert f"at most {MAX_REPEAT:,}" in text and str(10**12) in text


# -- B. a one-line refusal, never a traceback -----------------------------------------------------

@pytest.mark.parametrize("content, named", [
    ("[1, 2]", "an object"),
    ('{"run_seconds": 5}', "run_seconds"),
    ('{"run_seconds": ["a"]}', "run_seconds.0"),
    ('{"compile_seconds": "x"}', "compile_seconds"),
    ('{"programs": [1]}', "programs.0"),
    ('{"programs": [{"cost": {"flops": "x"}}]}', "programs.0.cost.flops"),
    ('{"run_seconds": [1e999]}', "run_seconds.0"),
    ('{"programs": [{"memory": {"temp_size_in_bytes": 1e400}}]}', "temp_size_in_bytes"),
    ('{"backend": "\\ud800"}', "backend"),
    ("[" * 100_000, "nested"),
])
def test_a_malformed_report_is_refused_naming_the_key(content, named, tmp_path, capsys):
    (tmp_path / REPORT).write_text(content)
    text = refused(["report", str(tmp_path)], capsys)
    assert named in text and REPORT in text


def test_every_problem_of_a_report_is_listed(tmp_path, capsys):
    (tmp_path / REPORT).write_text('{"run_seconds": [1, "a", -1], "compile_seconds": "x"}')
    text = refused(["report", str(tmp_path)], capsys)
    assert "run_seconds.1" in text and "run_seconds.2" in text and "compile_seconds" in text


def test_a_valid_report_still_summarises(tmp_path, capsys):
    (tmp_path / REPORT).write_text(json.dumps({
        "backend": "XlaBackend", "compile_seconds": 1.5, "run_seconds": [0.5, 0.25, 0.25],
        "programs": [{"cost": {"flops": 1000.0}, "memory": {"temp_size_in_bytes": 2048}}]}))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1.500 s" in out and "250.00 ms" in out and "2.0 KiB" in out


OK_ROW = {"name": "a", "status": "ok", "replication": 1, "batches_per_step": 1,
          "samples_per_s": 10.0, "step_ms": 1.0}


@pytest.mark.parametrize("results, named", [
    ({"variants": [{"status": "ok"}]}, "variants.0.name"),
    ({"variants": [{**OK_ROW, "samples_per_s": 0}]}, "variants.0.samples_per_s"),
    ({"variants": [{**OK_ROW, "replication": "2"}]}, "variants.0.replication"),
    ({"variants": [{k: v for k, v in OK_ROW.items() if k != "step_ms"}]}, "variants.0.step_ms"),
    ({"variants": [{**OK_ROW, "model": ["x"]}]}, "variants.0.model"),
    ({"variants": [{**OK_ROW, "bubble_measured": "x"}]}, "variants.0.bubble_measured"),
    ({"variants": [OK_ROW], "machine": {"libraries": 3}}, "machine.libraries"),
    ({"variants": [OK_ROW], "machine": {"load_start": "high"}}, "machine.load_start"),
    ({"variants": [1]}, "variants.0"),
    ({"variants": {}}, "variants"),
])
@pytest.mark.parametrize("command", ["compare", "plot"])
def test_malformed_results_are_refused_naming_the_key(results, named, command, tmp_path,
                                                      capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    argv = ["--compare", str(path), str(path)] if command == "compare" else ["--plot", str(path)]
    text = refused(["bench", *argv], capsys)
    assert named in text and str(path) in text


def test_every_problem_of_a_results_file_is_listed(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"variants": [{"status": "ok"}, {**OK_ROW, "step_ms": -1}]}))
    text = refused(["bench", "--plot", str(path)], capsys)
    for key in ("variants.0.name", "variants.0.samples_per_s", "variants.1.step_ms"):
        assert key in text


def test_a_long_list_of_problems_is_cut_short(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"variants": [{"status": "skipped"}] * 500}))
    text = refused(["bench", "--plot", str(path)], capsys)
    assert f"the first {LISTED} of 500 problems" in text
    assert "variants.19.name" in text and "variants.20.name" not in text


def test_rows_that_did_not_run_need_only_a_name(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"variants": [OK_ROW, {"name": "b", "status": "skipped"}]}))
    assert main(["bench", "--compare", str(path), str(path)]) == 0
    assert "1.00x" in capsys.readouterr().out


@pytest.mark.parametrize("body, named", [
    ('{width: "abc"}', "big.width"), ("{heads: 0}", "big.heads"), ("{layers: true}", "big.layers"),
    ("{replication: 3.5}", "big.replication"), ("{replication: []}", "big.replication"),
    ("{replication: null}", "big.replication"), ("{mode: 5}", "big.mode"),
])
def test_bad_spec_values_are_refused_naming_them(body, named, tmp_path, capsys):
    spec = tmp_path / "bad.yaml"
    spec.write_text(f"benchmarks:\n  big: {body}\n")
    text = refused(["bench", "--spec", str(spec), "--no-progress", "--out", str(tmp_path / "o")],
                   capsys)
    assert named in text and "Fix:" in text


@pytest.mark.parametrize("defaults, named", [
    ("5", "defaults"), ("{repeat: abc}", "repeat"), ("{warmup: -1}", "warmup"),
    ("{baselines: maybe}", "baselines"), ("{repeat: 1.5}", "repeat"),
])
def test_bad_spec_options_are_refused(defaults, named, tmp_path, capsys):
    spec = tmp_path / "bad.yaml"
    spec.write_text(f"defaults: {defaults}\nbenchmarks:\n  a: {{replication: [1]}}\n")
    text = refused(["bench", "--spec", str(spec), "--no-progress", "--out", str(tmp_path / "o")],
                   capsys)
    assert named in text


def test_a_lone_surrogate_in_a_debug_context_is_refused_at_the_call():
    b = pk.Builder()
    with pytest.raises(pk.ModelError, match=r"name scope .*\\ud800.*position 1"):
        b.nameScope("a\ud800")
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    with pytest.raises(pk.ModelError, match="debugContext"):
        b.addInputTensor(pk.TensorInfo("FLOAT", [2]), "\udfff")
    with pytest.raises(pk.ModelError, match="debugContext"):
        b.aiOnnx.relu([x], "\udfff")
    with pytest.raises(pk.ModelError, match="debugContext"):
        b.addInitializedInputTensor(np.ones(2, np.float32), "\ud800")
    with pytest.raises(pk.ModelTypeError, match="debugContext"):
        b.aiOnnx.relu([x], 5)
    b.addOutputTensor(b.aiOnnx.relu([x], "fine ✓"))
    assert pk.PipelineLayout.from_model(b.getModelProto())  # the builder is still usable


def test_a_script_exiting_with_a_message_prints_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the script's, while it runs
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit('the input file is missing')\n")
    assert main(["run", str(script)]) == 1
    assert capsys.readouterr().err == "the input file is missing\n"
