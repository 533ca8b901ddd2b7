"""Issue 11: every problem at once, did-you-mean for keys and keywords, launch artefacts, ..."""

from __future__ import annotations

import inspect
import pathlib

import pytest

import popart_kit as pk
from popart_kit.errors import ConfigTypeError, InvalidConfig

# -- 1. unknown keys reported with every other problem, each with a suggestion ------------------

def test_an_unknown_key_does_not_hide_the_other_problems() -> None:
    with pytest.raises(InvalidConfig) as info:
        pk.SessionConfig(mode="inference", batch_size=8, batches_per_step=2, ipus_per_replica=2,
                         accumulation={"factor": 4, "facter": 3},
                         pipeline={"enabled": True, "stages": 4},
                         popart_options={"enableStochasticRoundin": True})
    err = info.value
    assert sorted(err.rules) == sorted(["V18", "V7", "K-option-unknown", "K-unknown-key",
                                        "K-unknown-key"])
    text = str(err)
    assert "did you mean micro_batch_size" in text
    assert "did you mean accumulation.factor" in text
    assert "Extra inputs" not in text


@pytest.mark.parametrize("make, expect", [
    (lambda: pk.SessionConfig(mode="training", batch_per_step=4), "batches_per_step"),
    (lambda: pk.SGD(0.1, momentun=0.9), "momentum"),
    (lambda: pk.Adam(0.1, lr=0.2), "learning_rate"),
    (lambda: pk.Replication(local_fator=2), "local_factor"),
    (lambda: pk.SessionConfig(mode="training", replicatedGraphCount=2),
     "replication.local_factor"),
    (lambda: pk.SessionConfig(mode="training", enableStochasticRounding=True),
     "precision.stochastic_rounding"),
    (lambda: pk.SessionConfig(mode="training", enableOutlining=False),
     "popart_options.enableOutlining"),
])
def test_a_misspelt_field_gets_a_suggestion_and_no_pydantic_url(make, expect) -> None:
    with pytest.raises(InvalidConfig, match="K-unknown-key") as info:
        make()
    assert expect in str(info.value)
    assert "errors.pydantic.dev" not in str(info.value)


def test_unknown_keys_in_a_file_are_reported_with_the_rules(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('mode = "inference"\nbatch_size = 4\nbatches_per_step = 2\n'
                    'ipus_per_replica = 2\n[accumulation]\nfactor = 4\n'
                    '[pipeline]\nenabled = true\nstages = 4\n')
    with pytest.raises(InvalidConfig) as info:
        pk.SessionConfig.from_file(path)
    assert set(info.value.rules) == {"V18", "V7", "K-unknown-key"}


def test_session_keywords_get_the_kits_error_and_keep_their_signature() -> None:
    with pytest.raises(ConfigTypeError, match=r"'backnd' \(did you mean backend\?\)") as info:
        pk.InferenceSession(b"", None, backnd="xla", anchor={})
    assert isinstance(info.value, TypeError)
    assert "anchors?" in str(info.value)
    assert "micro_batches_per_chunk" in inspect.signature(pk.InferenceSession).parameters
    assert "loss" in inspect.signature(pk.TrainingSession).parameters


# -- 3. launch artefacts from the command line -------------------------------------------------

SEED_SETUP = """cd ;
mkdir build;
cd build ;
git clone https://github.com/graphcore/examples.git;
cd examples/nlp/bert/pytorch;
apt update ;
apt upgrade -y;
DEBIAN_FRONTEND=noninteractive TZ='Europe/London' apt install $(< required_apt_packages.txt) -y ;
pip3 install -r requirements.txt ;
"""
# Graphcore's POD64 BERT job (the IPUJob of "Scaling up IPU count and using Poprun")
SEED_POD64 = """
apiVersion: graphcore.ai/v1alpha1
kind: IPUJob
metadata:
  generateName: bert-poprun-64ipus-
spec:
  jobInstances: 1
  modelReplicasPerWorker: "16"
  ipusPerJobInstance: "64"
  workers:
    template:
      spec:
        containers:
        - name: bert-poprun-64ipus
          image: graphcore/pytorch:3.3.0
          command: [/bin/bash, -c, --]
          args:
            - |
{setup}              OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_ALLOW_RUN_AS_ROOT=1 \\
              poprun \\
              --allow-run-as-root 1 \\
              --vv \\
              --num-instances 1 \\
              --num-replicas 16 \\
               --mpi-global-args="--tag-output" \\
              --ipus-per-replica 4 \\
              python3 run_pretraining.py \\
              --config pretrain_large_128_POD64 \\
              --dataset generated --training-steps 1
          resources:
            limits:
              cpu: 32
              memory: 200Gi
          securityContext:
            capabilities:
              add:
              - IPC_LOCK
          volumeMounts:
          - mountPath: /dev/shm
            name: devshm
        restartPolicy: Never
        hostIPC: true
        volumes:
        - emptyDir:
            medium: Memory
            sizeLimit: 10Gi
          name: devshm
""".replace("{setup}", "".join("              " + line + "\n"
                                for line in SEED_SETUP.splitlines()))


def _commands(script: str) -> list[list[str]]:
    """A bash script's commands as argv lists (continuations joined, ';' and newlines split)."""
    import shlex

    text = script.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        for part in line.split(";"):
            if part.strip():
                out.append(shlex.split(part.replace("$(< required_apt_packages.txt)", "APT")))
    return out


def _poprun_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """poprun's options (``--a b`` and ``--a=b``) and the program after them."""
    opts, i = {}, argv.index("poprun") + 1
    while argv[i].startswith("--"):
        if "=" in argv[i]:
            key, value = argv[i].split("=", 1)
            opts[key] = value
            i += 1
        elif argv[i] == "--vv":
            opts[argv[i]] = ""
            i += 1
        else:
            opts[argv[i]], i = argv[i + 1], i + 2
    return opts, argv[i:]


def test_ipujob_cli_gives_seed_004s_pod64_job(tmp_path, capsys) -> None:
    import yaml

    from popart_kit.cli import main

    cfg = tmp_path / "pod64.toml"
    cfg.write_text('mode = "training"\nipus_per_replica = 4\n[replication]\nlocal_factor = 16\n')
    setup = [c for line in SEED_SETUP.splitlines() for c in [line.rstrip(" ;")] if c]
    argv = ["ipujob", str(cfg), "--image", "graphcore/pytorch:3.3.0", "--name",
            "bert-poprun-64ipus", *[f"--setup={c}" for c in setup], "--poprun-arg=--vv",
            "--poprun-arg=--mpi-global-args=--tag-output", "--",
            "python3", "run_pretraining.py", "--config", "pretrain_large_128_POD64",
            "--dataset", "generated", "--training-steps", "1"]
    assert main(argv) == 0
    ours, seed = yaml.safe_load(capsys.readouterr().out), yaml.safe_load(SEED_POD64)
    ours_c = ours["spec"]["workers"]["template"]["spec"]["containers"][0]
    seed_c = seed["spec"]["workers"]["template"]["spec"]["containers"][0]
    ours_script, seed_script = ours_c.pop("args")[0], seed_c.pop("args")[0]
    assert ours == seed  # every other field, equal
    mine, theirs = _commands(ours_script), _commands(seed_script)
    assert mine[:-1] == theirs[:-1]  # the setup commands, in order, before poprun
    assert mine[-1][:2] == theirs[-1][:2]  # OMPI_ALLOW_RUN_AS_ROOT*
    (our_opts, our_prog), (seed_opts, seed_prog) = map(_poprun_options, (mine[-1], theirs[-1]))
    assert our_prog == seed_prog  # the program runs under poprun
    # the kit's one stated addition: --print-topology yes
    assert our_opts == {**seed_opts, "--print-topology": "yes"}


def test_ipujob_cli_of_seed_004s_single_job(tmp_path, capsys) -> None:
    import yaml

    from popart_kit.cli import main

    cfg = tmp_path / "bert4.toml"
    cfg.write_text('mode = "training"\nipus_per_replica = 4\n')
    assert main(["ipujob", str(cfg), "--image", "graphcore/pytorch:3.3.0", "--setup=cd",
                 "--", "python3", "run_pretraining.py", "--config", "pretrain_base_128_pod4"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["metadata"] == {"generateName": "bert4-"}
    assert job["spec"]["ipusPerJobInstance"] == "4" and "modelReplicasPerWorker" not in job["spec"]
    container = job["spec"]["workers"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["cd\npython3 run_pretraining.py --config pretrain_base_128_pod4\n"]
    assert container["resources"] == {"limits": {"cpu": 32, "memory": "200Gi"}}


def test_launch_refusals(tmp_path, capsys) -> None:
    from popart_kit.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text('mode = "training"\nipus_per_replica = 4\n[replication]\nlocal_factor = 2\n')
    plan = pk.SessionConfig.from_file(cfg).plan()
    with pytest.raises(pk.ConfigError, match="several shell commands") as info:
        plan.poprun_command("cd /app; pip install x; python3 train.py")
    assert info.value.rule == "K-launch-program"
    with pytest.raises(pk.ConfigError, match="DNS-1123.*name='bad-name'"):
        plan.ipujob_manifest("img", "python3 t.py", "Bad_Name!")
    with pytest.raises(pk.ConfigError, match="--num-replicas"):
        plan.poprun_command("python3 t.py", poprun_args=["--num-replicas", "8"])
    assert main(["ipujob", str(cfg), "--image", "img", "--memory", "lots", "--", "x"]) == 2
    assert "Kubernetes quantity" in capsys.readouterr().err
    assert main(["poprun", str(cfg), "--setup=cd /app", "--poprun-arg=--vv", "--",
                 "python3", "train.py", "--lr", "0.1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["cd /app", "poprun --vv --num-instances 1 --num-replicas 2 "
                   "--ipus-per-replica 4 --print-topology yes python3 train.py --lr 0.1"]


# -- 4. --json problems on stdout, --version ---------------------------------------------------

def test_plan_and_check_json_problems_on_stdout(tmp_path, capsys) -> None:
    import json

    import numpy as np

    from popart_kit.cli import REFUSED, main

    bad = tmp_path / "bad.toml"
    bad.write_text('mode = "inference"\nbatch_size = 4\n[accumulation]\nfactor = 4\n')
    assert main(["plan", str(bad), "--json"]) == REFUSED
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert {p["rule"] for p in out["problems"]} == {"V18", "K-unknown-key"}
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 4]))
    w = b.addInitializedInputTensor(np.zeros((4, 4), np.float32))
    with b.pipelineStage(0), b.virtualGraph(0):
        h = b.aiOnnx.matmul([x, w])
    with b.pipelineStage(1), b.virtualGraph(1):
        y = b.aiOnnx.relu([h])
    b.addOutputTensor(y)
    model = tmp_path / "m.onnx"
    model.write_bytes(b.getModelProto())
    cfg = tmp_path / "c.toml"
    cfg.write_text('mode = "inference"\nipus_per_replica = 2\nbatches_per_step = 8\n'
                   '[pipeline]\nenabled = true\nstages = 4\n')
    assert main(["check", str(model), "--config", str(cfg), "--json"]) == REFUSED
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["problems"] and out["problems"][0]["rule"]
    assert main(["check", str(model), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["forward_stages"] == 2


def test_version(capsys) -> None:
    from popart_kit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"popart-kit {pk.__version__}"


# -- 5. warnings point at the user's line ------------------------------------------------------

def test_warnings_are_attributed_to_the_callers_line() -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pk.SessionConfig(mode="training", ipus_per_replica=4, batches_per_step=8,
                         pipeline={"enabled": True, "stages": 4}, accumulation={"factor": 8})
        cfg = pk.SessionConfig.model_validate({"mode": "inference", "batches_per_step": 5,
                                               "ipus_per_replica": 4,
                                               "pipeline": {"enabled": True, "stages": 4}})
        io = pk.StepIOFactory(cfg, inputs={"x": pk.TensorSpec((2, 3))})
        list(io.batches({"x": __import__("numpy").zeros((11, 3), "float32")}))
    kit = [w for w in caught if issubclass(w.category, pk.PopartKitWarning)]
    assert len(kit) >= 3
    assert {w.filename for w in kit} == {__file__}, [(w.filename, w.lineno) for w in kit]
    assert all("docs/rules.md#" in str(w.message) for w in kit[:2])


# -- 2. micro_batch_size against the model -----------------------------------------------------

def _linear(batch: int = 8):
    import numpy as np

    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [batch, 16]))
    w = b.addInitializedInputTensor(np.zeros((16, 4), np.float32))
    y = b.aiOnnx.matmul([x, w])
    b.addOutputTensor(y)
    return b.getModelProto(), x, y


def test_session_refuses_a_micro_batch_size_the_inputs_do_not_have() -> None:
    model, x, _ = _linear(8)
    cfg = pk.SessionConfig(mode="inference", batches_per_step=3, micro_batch_size=4)
    with pytest.raises(pk.ConfigError, match=rf"micro_batch_size=4.*'{x}' has 8.*"
                                             r"Fix: set micro_batch_size=8") as info:
        pk.InferenceSession(model, cfg, backend="xla")
    assert info.value.rule == "K-micro-batch-size"


def test_session_plan_counts_the_samples_a_run_processes() -> None:
    model, x, y = _linear(8)
    sess = pk.InferenceSession(model, pk.SessionConfig(mode="inference", batches_per_step=3),
                               backend="xla")
    assert sess.plan.micro_batch_size == 8
    out = sess.run(sess.io.allocate_inputs("random"))
    assert sess.plan.samples_per_step == out[y].shape[0] * out[y].shape[1] == 24
    same = pk.InferenceSession(model, pk.SessionConfig(mode="inference", batches_per_step=3,
                                                       micro_batch_size=8), backend="xla")
    assert same.plan == sess.plan


# -- 10. random integer inputs in the range the model says --------------------------------------

def test_random_labels_stay_below_the_class_count_of_onnx_losses() -> None:
    import numpy as np

    b = pk.Builder(opsets={"ai.onnx": 13})
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 3]))
    label = b.addInputTensor(pk.TensorInfo("INT64", [4]))
    w = b.addInitializedInputTensor(np.zeros((3, 5), np.float32))
    scores = b.aiOnnx.logsoftmax([b.aiOnnx.matmul([x, w])])
    loss = b.aiOnnx.negativeloglikelihoodloss([scores, label])
    b.addOutputTensor(loss)
    sess = pk.InferenceSession(b.getModelProto(), pk.SessionConfig(
        mode="inference", batches_per_step=50), anchors={loss: "All"}, backend="xla")
    labels = sess.io.allocate_inputs("random", seed=1)[label]
    assert labels.min() >= 0 and labels.max() == 4  # 5 classes: 0..4 drawn, never 5..9
    sess.run(sess.io.allocate_inputs("random", seed=1))  # the index check accepts them


# -- 7. profiling on xla -----------------------------------------------------------------------

def test_xla_session_writes_a_profile_and_report_summarises_it(tmp_path, capsys) -> None:
    import json

    from popart_kit.cli import main

    model, x, y = _linear(8)
    folder = tmp_path / "prof"
    cfg = pk.SessionConfig(mode="inference", batches_per_step=2,
                           profiling={"auto_report_dir": str(folder)})
    sess = pk.InferenceSession(model, cfg, backend="xla")
    sess.runtime.graph.delegation = None  # the MatMul by XLA, which counts its flops
    for _ in range(2):
        sess.run(sess.io.allocate_inputs("random"))
    report = json.loads((folder / "popart_kit_report.json").read_text())
    assert report["compile_seconds"] > 0 and len(report["run_seconds"]) == 2
    assert report["programs"] and report["programs"][0]["memory"]
    assert report["programs"][0]["cost"].get("flops", 0) >= 2 * 8 * 16 * 4 * 2
    assert any(p.is_file() for p in (folder / "trace").rglob("*"))  # jax.profiler's trace
    assert main(["report", str(folder)]) == 0
    table = capsys.readouterr().out
    assert "compile time" in table and "flops" in table and "trace files" in table
    assert main(["report", str(tmp_path / "nothing")]) == 2


# -- 9. docs in the repository -----------------------------------------------------------------

def test_rules_reference_lists_every_rule_and_is_generated() -> None:
    import re
    from pathlib import Path

    from popart_kit._base.rule_docs import RULES, markdown

    root = Path(pk.__file__).parent
    used = set()
    for path in root.rglob("*.py"):
        used |= set(re.findall(r"[\"'](V\d+|P\d+|P-[a-z-]+|K-[a-z0-9-]+)[\"']",
                               path.read_text()))
    used |= {"K-sgd-finite", "K-adam-finite", "K-adam-beta1", "K-adam-beta2"}  # built names
    assert used - set(RULES) == set(), "rules without an entry in rule_docs.RULES"
    docs = root.parent / "docs"
    assert (docs / "rules.md").read_text() == markdown(), \
        "regenerate: python -m popart_kit._base.rule_docs > docs/rules.md"
    assert (docs / "design.md").is_file()


def test_package_and_docs_refer_to_nothing_outside_the_repository() -> None:
    from pathlib import Path

    root = Path(pk.__file__).parent.parent
    files = [*root.joinpath("popart_kit").rglob("*.py"), *root.joinpath("docs").rglob("*.md"),
             root / "README.md"]
    for path in files:
        text = path.read_text()
        for outside in ("DESIGN.md", "shared/", "seed 0", "seeds/"):
            assert outside not in text, f"{path} refers to {outside}"


def test_docs_operators_md_is_generated_from_the_operator_table():
    from popart_kit._runtime.xla.operator_docs import markdown

    docs = pathlib.Path(__file__).parent.parent / "docs"
    assert (docs / "operators.md").read_text() == markdown(), \
        "regenerate: python -m popart_kit._runtime.xla.operator_docs > docs/operators.md"
