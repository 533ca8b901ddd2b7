"""popart-kit plan and schema, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from popart_kit.cli import main

CONFIGS = Path(__file__).parent.parent / "examples" / "configs"


def test_plan_renders_tables(capsys):
    assert main(["plan", str(CONFIGS / "bert_pod16.toml")]) == 0
    rows = {" ".join(line.split()[:-1]): line.split()[-1]
            for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["training session on target"] == "'ipu'"
    assert rows["IPUs this instance uses"] == "16"
    assert rows["micro-batches per run (per input)"] == "3,072"
    assert rows["depth (stages PopART runs)"] == "7"
    assert rows["bubble"] == "3.0%"


def test_plan_json(capsys):
    assert main(["plan", str(CONFIGS / "bert_pod16.toml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_ipus"] == 16
    assert plan["micro_batches_per_step"] == 4 * 192 * 4
    assert plan["global_batch_size"] == 2 * 192 * 4


def test_plan_of_another_instance(capsys):
    assert main(["plan", str(CONFIGS / "pod_instance1_of4.yaml"), "--json", "--instance", "3"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["instance_index"] == 3
    # the JSON lists this instance's replicas; --all-replicas lists every one
    assert [r["global_id"] for r in plan["replicas"]["placements"]] == [6, 7]
    assert plan["replicas"]["this_instance"] == {"first_global_id": 6, "last_global_id": 7}


def test_plan_json_all_replicas(capsys):
    assert main(["plan", str(CONFIGS / "pod_instance1_of4.yaml"), "--json", "--all-replicas"]) == 0
    replicas = json.loads(capsys.readouterr().out)["replicas"]
    assert replicas["listed"] == "all"
    assert [(r["instance"], r["global_id"]) for r in replicas["placements"]] == [
        (g // 2, g) for g in range(8)]


def test_plan_all_replicas_needs_json(capsys):
    assert main(["plan", str(CONFIGS / "pod_instance1_of4.yaml"), "--all-replicas"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--all-replicas" in captured.err and "Fix: add --json" in captured.err


def test_plan_rejects_a_missing_instance(capsys):
    assert main(["plan", str(CONFIGS / "pod_instance1_of4.yaml"), "--instance", "4"]) == 2
    assert "instance 4 does not exist" in capsys.readouterr().err


def test_plan_lists_every_problem(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('mode = "inference"\nbatches_per_step = 2\nipus_per_replica = 2\n'
                   '[accumulation]\nfactor = 4\n[pipeline]\nenabled = true\nstages = 4\n'
                   '[popart_options]\nenableOutlinning = false\n')
    assert main(["plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err
    for loc in ("accumulation.factor", "batches_per_step", "popart_options.enableOutlinning"):
        assert loc in err
    assert "did you mean 'enableOutlining'" in err


def test_plan_of_another_instance_prints_no_raw_warning(capsys):
    assert main(["plan", str(CONFIGS / "bert_pod16.toml"), "--instance", "0"]) == 0
    assert "PopartKitWarning" not in capsys.readouterr().err


def test_plan_reports_a_malformed_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: [training\n")
    assert main(["plan", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_plan_reports_an_unreadable_file(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err


def test_schema_is_json_schema(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "SessionConfig"
    assert "replication" in schema["properties"]


@pytest.mark.parametrize("args", [["plan", str(CONFIGS / "single_ipu.toml")], ["schema"]])
def test_console_script_runs(args):
    result = subprocess.run([sys.executable, "-m", "popart_kit.cli", *args],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout


def _pipelined_model(path: Path, stage_to_ipu=(0, 1, 2)) -> Path:
    import popart_kit as pk

    b = pk.Builder()
    pb = pk.PipelineBuilder(b, list(stage_to_ipu))
    t = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    for _ in stage_to_ipu:
        with pb.next_stage():
            t = b.aiOnnx.relu([t])
    b.saveModelProto(str(path))
    return path


def test_check_prints_the_allocation(tmp_path, capsys):
    model = _pipelined_model(tmp_path / "m.onnx")
    assert main(["check", str(model)]) == 0
    out = capsys.readouterr().out
    assert "Device allocation: 3 forward stages" in out
    assert "depth 3 in inference, 5 in training" in out


def test_check_against_a_config(tmp_path, capsys):
    model = _pipelined_model(tmp_path / "m.onnx")
    good = tmp_path / "good.toml"
    good.write_text('mode = "training"\nipus_per_replica = 4\n[accumulation]\nfactor = 8\n'
                    '[pipeline]\nenabled = true\n')
    assert main(["check", str(model), "--config", str(good)]) == 0
    assert "fits" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('mode = "training"\nipus_per_replica = 2\n[accumulation]\nfactor = 4\n'
                   '[pipeline]\nenabled = true\n')
    assert main(["check", str(model), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "IPU(s) [2]" in err and "below the pipeline depth 5" in err
    # the same form as plan's and the sessions' refusals
    assert "(see docs/rules.md#V24)" in " ".join(err.split()) and "[V24]" not in err


def test_check_reports_a_broken_model(tmp_path, capsys):
    model = _pipelined_model(tmp_path / "m.onnx", stage_to_ipu=(1, 0, 2))
    import onnx

    proto = onnx.load(model)
    for attr in proto.graph.node[1].attribute:
        if attr.name == "__pipeline_stage":
            attr.i = 0  # stage 0 on IPUs 1 and 0
    onnx.save(proto, model)
    assert main(["check", str(model)]) == 2
    assert "stage 0 has ops on IPUs [0, 1]" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "none.onnx")]) == 2


def test_check_reports_a_file_that_is_not_a_model(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00 not a protobuf \xff")
    assert main(["check", str(bad)]) == 2
    assert "is not an ONNX model" in capsys.readouterr().err


def test_every_option_of_every_command_says_what_it_does():
    import argparse

    from popart_kit.cli import _parser

    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = [f"{name} {' '.join(action.option_strings) or action.dest}"
              for name, sub in commands.choices.items() for action in sub._actions
              if not isinstance(action, argparse._HelpAction) and not action.help]
    assert not silent
