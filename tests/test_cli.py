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
    assert [r["global_id"] for r in plan["replicas"] if r["instance"] == 3] == [6, 7]


def test_plan_rejects_a_missing_instance(capsys):
    assert main(["plan", str(CONFIGS / "pod_instance1_of4.yaml"), "--instance", "4"]) == 1
    assert "instance 4 does not exist" in capsys.readouterr().err


def test_plan_lists_every_problem(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('mode = "inference"\nbatches_per_step = 2\nipus_per_replica = 2\n'
                   '[accumulation]\nfactor = 4\n[pipeline]\nenabled = true\nstages = 4\n'
                   '[popart_options]\nenableOutlinning = false\n')
    assert main(["plan", str(bad)]) == 1
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
    assert main(["plan", str(bad)]) == 1
    assert "not valid YAML" in capsys.readouterr().err


def test_plan_reports_an_unreadable_file(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing.toml")]) == 1
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
