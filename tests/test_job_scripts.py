"""SLURM batch scripts and Kubernetes Indexed Jobs: what they ask for, what each instance is told,
that hostile arguments arrive as given, refusals, and the CLI's exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import popart_kit as pk
from popart_kit.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

HOSTILE = ["it's", "$(touch pwned)", "`id`", "a b", "\"q\"", "x;y", "--", "-n", "new\nline",
           "*", "${HOME}", "\\", ""]
ECHO_ARGS = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]


def plan(local: int, total: int, ipus: int = 1) -> pk.Plan:
    return pk.SessionConfig(mode="training", ipus_per_replica=ipus,
                            replication={"local_factor": local, "global_factor": total}).plan()


def directives(script: str) -> dict[str, str]:
    return dict(line.removeprefix("#SBATCH --").split("=", 1)
                for line in script.splitlines() if line.startswith("#SBATCH "))


def bash_syntax_ok(script: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def run_batch_script(script: str, tmp_path: Path, job_id: int = 12345) -> dict:
    """Run ``script`` as sbatch would on the allocation's first host, with stand-ins for
    scontrol and srun; what srun got (its arguments and the variables the tasks inherit)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node07\\nnode08\\n'\n")
    (bin_dir / "srun").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, "
        f"open({str(tmp_path / 'srun.json')!r}, 'w'))\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[07-08]",
           "SLURM_JOB_ID": str(job_id)}
    proc = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "pwned").exists()
    return json.loads((tmp_path / "srun.json").read_text())


# -- SLURM -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("local,total,ipus,nodes,per_node", [
    (1, 1, 1, None, 1),      # one instance
    (2, 4, 1, None, 1),      # 2 instances, one per host by default
    (2, 8, 2, 2, 2),         # 4 instances over 2 hosts
    (1, 16, 4, 4, 4),        # a POD64 shape: 16 instances x 4 IPUs over 4 hosts
])
def test_slurm_script_asks_for_one_task_per_instance(local, total, ipus, nodes, per_node):
    p = plan(local, total, ipus)
    script = p.slurm_script("python3 train.py", job_name="bert", nodes=nodes, cpus_per_task=8,
                            time="1-00:00:00")
    bash_syntax_ok(script)
    assert script.startswith("#!/bin/bash\n")
    assert directives(script) == {
        "job-name": "bert", "nodes": str(p.instances // per_node), "ntasks": str(p.instances),
        "ntasks-per-node": str(per_node), "cpus-per-task": "8", "time": "1-00:00:00"}
    assert script.splitlines()[-1] == ("srun --kill-on-bad-exit=1 --cpus-per-task=8 python3 "
                                       "train.py")


def test_slurm_script_leaves_unset_options_to_slurm():
    script = plan(1, 2).slurm_script(["python3", "train.py"])
    assert directives(script) == {"job-name": "popart-kit-job", "nodes": "2", "ntasks": "2",
                                  "ntasks-per-node": "1"}
    assert script.splitlines()[-1] == "srun --kill-on-bad-exit=1 python3 train.py"


def test_slurm_tasks_get_the_job_facts_coordinator_secret_and_args_as_given(tmp_path):
    script = plan(2, 8, 2).slurm_script([*ECHO_ARGS, *HOSTILE], nodes=2, port=29400,
                                        setup=["cd .", "export SETUP_RAN=1"])
    bash_syntax_ok(script)
    srun = run_batch_script(script, tmp_path)
    assert srun["argv"] == ["--kill-on-bad-exit=1", *ECHO_ARGS, *HOSTILE]
    env = srun["env"]
    assert env["POPDIST_NUM_TOTAL_REPLICAS"] == "8" and env["POPDIST_NUM_IPUS_PER_REPLICA"] == "2"
    assert "POPDIST_NUM_LOCAL_REPLICAS" not in env  # from the task count: see the next test
    assert env["POPART_KIT_COORDINATOR"] == "node07:29400"
    assert re.fullmatch(r"[0-9a-f]{64}", env["POPART_KIT_JOB_SECRET"])
    assert env["SETUP_RAN"] == "1"
    again = run_batch_script(script, tmp_path)["env"]["POPART_KIT_JOB_SECRET"]
    assert again != env["POPART_KIT_JOB_SECRET"]  # a fresh secret for every job


def test_slurm_default_port_is_the_jobs_own(tmp_path):
    from popart_kit._config.cluster import SLURM_BASE_PORT

    srun = run_batch_script(plan(1, 2).slurm_script("python3 t.py"), tmp_path, job_id=70000)
    assert srun["env"]["POPART_KIT_COORDINATOR"] == f"node07:{SLURM_BASE_PORT + 70000 % 4096}"


def test_each_slurm_task_finds_its_replicas(tmp_path):
    from popart_kit._config.cluster import popdist_env

    env = run_batch_script(plan(2, 8, 2).slurm_script("python3 t.py", nodes=2), tmp_path)["env"]
    for task in range(4):  # what srun adds to each task
        found = popdist_env({**env, "SLURM_PROCID": str(task), "SLURM_NTASKS": "4",
                                 "SLURM_STEP_NODELIST": "node[07-08]"})
        assert (found.total_replicas, found.local_replicas, found.replica_index_offset,
                found.ipus_per_replica) == (8, 2, 2 * task, 2)


@pytest.mark.parametrize("options,named", [
    ({"nodes": 3}, "nodes=3 does not split the 4 instance(s) evenly over hosts. Fix: one of "
                   "1, 2, 4"),
    ({"nodes": 0}, "nodes=0"),
    ({"nodes": True}, "nodes=True"),
    ({"cpus_per_task": 0}, "cpus_per_task=0"),
    ({"time": "2 hours"}, "time='2 hours' is not a SLURM time limit"),
    ({"job_name": "my job\n#SBATCH --x"}, "job_name='my job\\n#SBATCH --x' is not a plain "
                                           "job name"),
    ({"port": 70000}, "port=70000 is not a TCP port"),
])
def test_slurm_refusals_name_the_thing_and_the_fix(options, named):
    with pytest.raises(pk.ConfigError) as info:
        plan(2, 8).slurm_script("python3 t.py", **options)
    assert named in str(info.value) and "Fix:" in str(info.value)
    assert info.value.rule == "K-launch-slurm"


def test_slurm_refuses_every_problem_at_once_and_programs_that_are_not_one():
    with pytest.raises(pk.ConfigError) as info:
        plan(2, 8).slurm_script("python3 t.py", nodes=3, time="soon", job_name="")
    assert all(f in str(info.value) for f in ("nodes=3", "time='soon'", "job_name=''"))
    with pytest.raises(pk.ConfigError, match="several shell commands.*srun starts one") as info:
        plan(2, 8).slurm_script("cd /app && python3 t.py")
    assert info.value.rule == "K-launch-program"
    with pytest.raises(pk.ConfigError, match="no program for srun"):
        plan(2, 8).slurm_script([])


# -- Kubernetes ------------------------------------------------------------------------------------

def k8s_objects(p: pk.Plan, **options) -> dict[str, dict]:
    options.setdefault("secret", "0123456789abcdef")
    docs = list(yaml.safe_load_all(p.k8s_job_yaml("registry.example/kit:1", "python3 train.py",
                                                  "bert", **options)))
    assert len({d["kind"] for d in docs}) == len(docs)
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("local,total,ipus", [(1, 1, 1), (2, 4, 1), (1, 16, 4)])
def test_k8s_indexed_job_runs_one_pod_per_instance(local, total, ipus):
    p = plan(local, total, ipus)
    objects = k8s_objects(p)
    assert list(objects) == ["Service", "Secret", "Job"]
    service, secret, job = objects["Service"], objects["Secret"], objects["Job"]
    assert service["metadata"]["name"] == "bert"
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
    assert service["spec"]["selector"] == {"job-name": "bert"}
    assert secret["stringData"] == {"POPART_KIT_JOB_SECRET": "0123456789abcdef"}
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == (
        "Indexed", p.instances, p.instances)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "bert" and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/kit:1"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env == {
        "POPDIST_NUM_TOTAL_REPLICAS": str(total), "POPDIST_NUM_IPUS_PER_REPLICA": str(ipus),
        "POPART_KIT_NUM_INSTANCES": str(p.instances),
        "POPART_KIT_COORDINATOR": "bert-0.bert:29500",
        "POPART_KIT_JOB_SECRET": {"secretKeyRef": {"name": "bert-secret",
                                                   "key": "POPART_KIT_JOB_SECRET"}}}
    assert "resources" not in container


def test_k8s_options_setup_resources_port_and_an_existing_secret():
    objects = k8s_objects(plan(2, 4), secret=None, port=8476, setup=["cd /app"], cpu=8,
                          memory="16Gi")
    assert list(objects) == ["Service", "Job"]  # the Secret is made with kubectl
    container = objects["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["cd /app\nexec python3 train.py\n"]
    assert container["resources"] == {"limits": {"cpu": 8, "memory": "16Gi"}}
    assert {"name": "POPART_KIT_COORDINATOR", "value": "bert-0.bert:8476"} in container["env"]
    assert objects["Service"]["spec"]["ports"] == [{"name": "coordinator", "port": 8476}]


def test_k8s_pod_script_passes_hostile_arguments_as_given(tmp_path):
    manifest = plan(1, 2).k8s_job_manifests("img", [*ECHO_ARGS, *HOSTILE], "bert",
                                            setup=[f"cd {tmp_path}"])
    container = manifest[-1]["spec"]["template"]["spec"]["containers"][0]
    bash_syntax_ok(container["args"][0])
    proc = subprocess.run([*container["command"], *container["args"]], capture_output=True,
                          text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == HOSTILE and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("name,args,named", [
    ("Bad_Name", {}, "name='Bad_Name' is not a valid Kubernetes name: it must be a DNS-1035 "
                     "label"),
    ("8ipus", {}, "Fix: use name='job-8ipus'"),
    ("a" * 62, {}, "of at most 61 characters (the pods' host names append '-1')"),
    ("bert", {"image": "two words"}, "image='two words'"),
    ("bert", {"port": 0}, "port=0"),
    ("bert", {"cpu": -1}, "cpu=-1"),
    ("bert", {"memory": "lots"}, "memory='lots' is not a Kubernetes quantity"),
    ("bert", {"secret": "two\nlines"}, "secret is not a printable ASCII word"),
])
def test_k8s_refusals_name_the_thing_and_the_fix(name, args, named):
    image = args.pop("image", "img")
    with pytest.raises(pk.ConfigError) as info:
        plan(1, 2).k8s_job_manifests(image, "python3 t.py", name, **args)
    assert named in str(info.value) and "Fix:" in str(info.value)
    assert info.value.rule == "K-launch-k8s"


def test_k8s_name_suggestions_are_valid_names():
    from popart_kit._config.job_artefacts import k8s_name

    for text in ("8ipus", "BERT large!", "---", "a" * 100, "x" * 61 + "-y"):
        name = k8s_name(text, 61)
        assert len(name) <= 61 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
        plan(1, 2).k8s_job_manifests("img", "python3 t.py", name)


# -- the command line ------------------------------------------------------------------------------

@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "4x2.toml"
    path.write_text('mode = "training"\n[replication]\nlocal_factor = 2\nglobal_factor = 8\n')
    return path


def test_cli_slurm_prints_the_script(config, capsys):
    assert main(["slurm", str(config), "--nodes", "2", "--time", "30", "--setup=module load x",
                 "--", "python3", "train.py", "--lr", "0.1"]) == 0
    script = capsys.readouterr().out
    bash_syntax_ok(script)
    assert directives(script) == {"job-name": "job-4x2", "nodes": "2", "ntasks": "4",
                                  "ntasks-per-node": "2", "time": "30"}
    assert "\nmodule load x\n" in script
    assert script.endswith("\nsrun --kill-on-bad-exit=1 python3 train.py --lr 0.1\n")


def test_cli_k8sjob_prints_the_manifest_with_a_fresh_secret(config, capsys):
    argv = ["k8sjob", str(config), "--image", "img:1", "--", "python3", "train.py"]
    assert main(argv) == 0
    first = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in first] == ["Service", "Secret", "Job"]
    assert first[2]["metadata"]["name"] == "job-4x2" and first[2]["spec"]["completions"] == 4
    secret = first[1]["stringData"]["POPART_KIT_JOB_SECRET"]
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    assert main(argv) == 0
    assert list(yaml.safe_load_all(capsys.readouterr().out))[1]["stringData"] != {
        "POPART_KIT_JOB_SECRET": secret}
    assert main([*argv[:4], "--existing-secret", "--name", "bert", *argv[4:]]) == 0
    assert [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)] == ["Service", "Job"]


@pytest.mark.parametrize("argv,named", [
    (["slurm", "{config}", "--nodes", "3", "--", "python3", "t.py"], "nodes=3"),
    (["slurm", "{config}", "--time", "soon", "--", "python3"], "time='soon'"),
    (["slurm", "{config}"], "no program for srun"),
    (["slurm", "{missing}", "--", "python3"], "missing.toml"),
    (["k8sjob", "{config}", "--image", "img", "--name", "Bad", "--", "python3"], "name='Bad'"),
    (["k8sjob", "{config}", "--image", "img", "--memory", "lots", "--", "x"], "memory='lots'"),
    (["k8sjob", "{config}", "--image", "img"], "no program for the pod"),
])
def test_cli_refusals_exit_2_without_a_traceback(argv, named, config, capsys):
    argv = [a.format(config=config, missing=config.parent / "missing.toml") for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert named in " ".join(captured.err.split())  # the message, unwrapped


def test_cli_as_a_user_runs_it(config):
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "popart_kit.cli", *argv],
                              capture_output=True, text=True)

    ok = run("slurm", str(config), "--", "python3", "train.py")
    assert ok.returncode == 0 and ok.stdout.startswith("#!/bin/bash")
    for bad in (run("slurm", str(config), "--nodes", "many", "--", "python3"),
                run("k8sjob", str(config), "--", "python3"),  # --image is required
                run("slurm", str(config), "--time", "1-00:00:00:00", "--", "python3")):
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stdout == ""
