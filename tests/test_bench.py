"""popart_kit.bench and `popart-kit bench`: a tiny sweep end to end (files, columns, numbers
that follow from the plan), spec files, redrawing and comparing, and refusals. No speed is
asserted."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time

import pytest

import popart_kit as pk
from popart_kit.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["--width", "16", "--micro-batch", "4", "--repeat", "2", "--warmup", "0",
        "--no-progress"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    status = main(["bench", "--replication", "1,2", "--batches-per-step", "1,4", *TINY,
                   "--out", str(out)])
    assert status == 0
    return out


def test_a_sweep_writes_json_csv_and_plots(swept):
    data = json.loads((swept / "results.json").read_text())
    rows = {r["name"]: r for r in data["variants"]}
    assert sorted(rows) == ["mlp_r1_bps1", "mlp_r1_bps4", "mlp_r2_bps1", "mlp_r2_bps4"]
    for r in rows.values():
        assert r["status"] == "ok"
        assert r["samples_per_step"] == 4 * r["batches_per_step"] * r["replication"]
        assert r["samples_per_s"] == pytest.approx(r["samples_per_step"] / r["step_ms"] * 1e3)
        assert r["step_ms_min"] <= r["step_ms_p25"] <= r["step_ms"] <= r["step_ms_p75"] \
            <= r["step_ms_max"]
        assert r["runs"] == 2 and r["compile_s"] >= 0 and r["step_memory_mib"] > 0
        assert r["overhead_vs_jax"] == pytest.approx(r["step_ms"] / r["jax_step_ms"])
        assert r["overhead_vs_onnxruntime"] == pytest.approx(
            r["step_ms"] / r["onnxruntime_step_ms"])
        assert r["bubble_planned"] is None if "bubble_planned" in r else True
    # efficiency: per-replica samples/s against R=1 at the same bps
    for bps in (1, 4):
        one, two = rows[f"mlp_r1_bps{bps}"], rows[f"mlp_r2_bps{bps}"]
        assert one["efficiency"] == 1
        assert two["efficiency"] == pytest.approx(two["samples_per_s"] / 2 / one["samples_per_s"])
    machine = data["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and machine["libraries"]["jax"]
    assert machine["devices"]["platform"] == "cpu" and "load_start" in machine
    assert "compilation_cache" in machine  # off unless the process had set one
    assert set(data["columns"]) == set(pk.bench.COLUMNS)
    with (swept / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(pk.bench.COLUMNS)
    assert [t["name"] for t in table] == [r["name"] for r in data["variants"]]
    assert float(table[0]["samples_per_s"]) == pytest.approx(
        data["variants"][0]["samples_per_s"], rel=1e-5)
    for name in ("replication.png", "device_iterations.png"):
        assert (swept / name).read_bytes()[:8] == PNG
    assert not (swept / "bubble.png").exists()  # nothing pipelined


def test_plots_are_redrawn_from_saved_results(swept, tmp_path, capsys):
    assert main(["bench", "--plot", str(swept / "results.json"), "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device_iterations.png",
                                                          "replication.png"]


def test_two_results_are_compared_variant_by_variant(swept, tmp_path, capsys):
    data = json.loads((swept / "results.json").read_text())
    for r in data["variants"]:
        r["samples_per_s"] *= 2
    other = tmp_path / "b.json"
    other.write_text(json.dumps(data))
    assert main(["bench", "--compare", str(swept / "results.json"), str(other)]) == 0
    out = capsys.readouterr().out
    assert out.count("2.00x") == 4 and "mlp_r2_bps4" in out
    rows = pk.bench.compare(pk.bench.load(swept / "results.json"), pk.bench.load(other))
    assert [r["ratio"] for r in rows] == pytest.approx([2.0] * 4)


def test_a_spec_names_variants_and_pipelined_ones_report_their_bubble(tmp_path):
    spec = tmp_path / "bench.yaml"
    spec.write_text("defaults: {width: 16, micro_batch: 4, repeat: 2, warmup: 0}\n"
                    "benchmarks:\n"
                    "  infer: {batches_per_step: '2,4'}\n"
                    "  piped: {mode: training, stages: [2], accumulation: [4], layers: 2,\n"
                    "          replication: [1, 2]}\n")
    found, options = pk.bench.from_spec(spec)
    assert [v.name for v in found] == ["infer_bps2", "infer_bps4", "piped_r1", "piped_r2"]
    assert options == {"repeat": 2, "warmup": 0}
    results = pk.bench.sweep(spec=spec, out=tmp_path / "out", progress=False)
    piped = [r for r in results["variants"] if r["benchmark"] == "piped"]
    for r in piped:
        assert r["status"] == "ok" and r["mode"] == "training"
        # training over 2 stages: depth 3, 4 micro-batches per update
        assert r["bubble_planned"] == pytest.approx(
            pk.PipelineSchedule.training(stages=2, micro_batches=4).bubble_fraction)
        assert 0 <= r["bubble_measured"] < 1
        assert "onnxruntime_step_ms" not in r  # no onnxruntime baseline in training
    assert (tmp_path / "out" / "bubble.png").read_bytes()[:8] == PNG


def test_invalid_combinations_refuse_the_sweep_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "out"
    status = main(["bench", "--stages", "2", "--batches-per-step", "1,4", *TINY,
                   "--out", str(out)])
    assert status == 2
    err = capsys.readouterr().err
    assert "1 of 2 variants are invalid" in err and "mlp_bps1" in err
    assert "batches_per_step" in err and "--skip-invalid" in err
    assert not out.exists()


def test_skip_invalid_records_the_skipped_variants(tmp_path):
    results = pk.bench.sweep(stages=[2], batches_per_step=[1, 2], width=16, micro_batch=[4],
                             repeat=1, warmup=0, progress=False, skip_invalid=True,
                             baselines=False)
    status = {r["name"]: r["status"] for r in results["variants"]}
    assert status == {"mlp_bps1": "skipped", "mlp_bps2": "ok"}
    assert "depth" in results["variants"][0]["note"]


@pytest.mark.parametrize("argv, expected", [
    (["--replication", "1,x"], "'x'"),
    (["--replication", "1,1"], "repeated"),
    (["--replication", "3", "--instances", "2"], "3 replicas evenly"),
    (["--stages", "4", "--batches-per-step", "8"], "--layers 4"),
    (["--model", "encoder", "--width", "30", "--heads", "4"], "multiple of 4"),
])
def test_bad_sweeps_are_refused_naming_the_value_and_the_fix(argv, expected, tmp_path, capsys):
    assert main(["bench", *TINY, *argv, "--out", str(tmp_path / "o")]) == 2
    assert expected in " ".join(capsys.readouterr().err.split())


def test_unreadable_results_are_refused(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("not json")
    assert main(["bench", "--plot", str(bad)]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_instances_run_through_the_launcher(tmp_path):
    results = pk.bench.sweep(mode="training", replication=[2], instances=[2],
                             batches_per_step=[2], width=16, micro_batch=[4], repeat=2,
                             warmup=0, progress=False, instance_timeout=120)
    (row,) = results["variants"]
    assert row["status"] == "ok", row["note"]
    assert row["samples_per_step"] == 2 * 2 * 4 and row["samples_per_s"] > 0


def test_the_models_build_and_their_jax_forward_matches_the_session():
    import numpy as np

    from popart_kit.bench._measure import inputs_of, model_of, prepare, sample_shape

    for model in ("mlp", "convnet", "encoder"):
        v = pk.bench.Variant(name=model, model=model, width=16, micro_batch=2, seq=4, heads=2,
                             image=8)
        built = model_of(v)
        sess = prepare(v, "xla", built)
        inputs = inputs_of(sess, built)
        got = sess.run(inputs)[built.output]
        x = inputs[built.x].reshape((2, *sample_shape(built)))
        want = np.asarray(built.forward([np.asarray(w) for w in built.weights], x))
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-5)


def test_importing_the_kit_does_not_import_matplotlib_or_jax():
    script = ("import sys, popart_kit as pk; pk.bench; "
              "print('jax' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]


def test_the_readme_spec_is_valid(tmp_path):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, flags=re.S)
                if "benchmarks:" in b]
    spec = tmp_path / "bench.yaml"
    spec.write_text(block)
    found, options = pk.bench.from_spec(spec)
    assert options == {"repeat": 10} and len(found) == 12 + 4
    from popart_kit.bench import _validate

    assert {r["status"] for r in _validate(found, "xla", skip_invalid=False)} == {"ok"}


def test_a_toml_spec_reads_as_the_yaml_one(tmp_path):
    spec = tmp_path / "bench.toml"
    spec.write_text('[defaults]\nmodel = "convnet"\n[benchmarks.s]\nreplication = "1,2"\n')
    found, _ = pk.bench.from_spec(spec)
    assert [(v.name, v.model, v.replication) for v in found] == [("s_r1", "convnet", 1),
                                                                 ("s_r2", "convnet", 2)]


@pytest.mark.parametrize("block", [1, 3])
def test_interleaved_times_each_function_in_turns_of_blocks(block):
    """warmup calls, then per turn each function in turn: with block > 1 one call not timed
    (settle=0), then ``block`` timed calls in a row; every timed call counted once."""
    calls: list[str] = []
    stats = pk.bench.interleaved(2, warmup=1, block=block, settle=0.0,
                                 a=lambda: calls.append("a"), b=lambda: calls.append("b"))
    turn = ["a"] * (block + (block > 1)) + ["b"] * (block + (block > 1))
    assert calls == ["a", "b"] + turn * 2
    assert stats["a"].runs == stats["b"].runs == 2 * block


def test_a_block_is_led_in_by_uncounted_calls_for_settle_seconds():
    """Before each block, calls not timed until ``settle`` seconds have passed."""
    calls: list[float] = []

    def a() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.002)

    stats = pk.bench.interleaved(2, warmup=0, block=2, settle=0.03, a=a)
    assert stats["a"].runs == 4
    assert len(calls) >= 4 + 2 * 10  # each lead-in: 30 ms of 2 ms calls, timed ones aside
    assert calls[-1] - calls[0] >= 2 * 0.03
