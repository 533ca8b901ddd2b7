"""Where a process stands in its job, from any launcher's variables; ``popdist`` on the kit.

The resolution is pure and tested per launcher, with conflicts and the refusal of a process that
a launcher says is one of several but whose session is a lone job. Real runs on 127.0.0.1
(bounded, nothing left running) train a PopART program written for poprun's popdist as two
processes - under ``popart-kit launch``, and placed only by the variables of torchrun, srun,
mpirun, a Kubernetes Indexed Job and JAX - against one process with all replicas.
"""

from __future__ import annotations

import io
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import popart_kit as pk
from popart_kit._config.cluster import Place, first_host, place, popdist_env
from popart_kit._runtime.xla.distributed import world
from popart_kit.launcher import launch

PROGRAM = Path(__file__).parent / "popart_api" / "popdist_training.py"
BOUND = 120  # seconds: no run in these tests may take longer
LAUNCH_VARIABLES = ("POPDIST_", "POPART_KIT_", "OMPI_", "PMIX_", "SLURM_", "RANK", "WORLD_SIZE",
                    "LOCAL_RANK", "MASTER_", "JAX_", "JOB_COMPLETION_INDEX")


def rep(local: int, total: int | None = None, offset: int = 0) -> pk.Replication:
    return pk.Replication(local_factor=local, global_factor=total, global_offset=offset)


@pytest.mark.parametrize("env,expected", [
    ({}, Place()),
    ({**pk.PopdistEnv(8, 2, 4, 1, 1).to_env(), "POPART_KIT_COORDINATOR": "h0:29500"},
     (4, 2, 1, "h0:29500", "poprun")),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "PMIX_RANK": "3",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:4"},
     (4, 3, 1, None, "Open MPI, PMIx")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4100",
      "SLURM_STEP_NODELIST": "gpu[07-10],cpu1"}, (8, 5, 1, "gpu07:61444", "SLURM")),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "h1,h2"},
     (2, 0, None, "h1:61440", "SLURM")),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.1.1.1",
      "MASTER_PORT": "29500"}, (2, 1, 1, "10.1.1.1:29500", "torchrun")),
    ({"JOB_COMPLETION_INDEX": "2", "POPART_KIT_NUM_INSTANCES": "3",
      "POPART_KIT_COORDINATOR": "train-0.train:29500"},
     (3, 2, None, "train-0.train:29500", "Kubernetes, POPART_KIT_*")),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "h:1234"},
     (2, 1, None, "h:1234", "JAX")),
    # POPART_KIT_COORDINATOR overrides a launcher's address (torchrun's agent holds MASTER_PORT)
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "POPART_KIT_COORDINATOR": "h:2"}, (2, 0, None, "h:2", "torchrun")),
    # srun -n 1 / mpirun -np 1 around popart-kit launch: the outer launcher of one is set aside
    ({**pk.PopdistEnv(4, 2, 2, 1, 1).to_env(), "POPART_KIT_COORDINATOR": "127.0.0.1:9",
      "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
      "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"},
     (2, 1, 1, "127.0.0.1:9", "poprun")),
    ({"SLURM_NTASKS": "4"}, Place()),  # an salloc shell: srun was not used
])
def test_each_launcher(env, expected):
    found = place(env)
    if isinstance(expected, Place):
        assert found == expected
    else:
        assert (found.processes, found.process_id, found.local_rank, found.coordinator,
                found.source) == expected
    assert found.jax_finds_coordinator == ("OMPI_MCA_orte_hnp_uri" in env)


def test_reads_os_environ(monkeypatch):
    for name in [n for n in os.environ if n.startswith(LAUNCH_VARIABLES)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert (place().processes, place().process_id) == (3, 1)


def test_every_conflict_in_one_error_naming_each_source_and_value():
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "SLURM_PROCID": "3",
           "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "JAX_COORDINATOR_ADDRESS": "a:1", "MASTER_ADDR": "b", "MASTER_PORT": "2",
           "RANK": "1", "WORLD_SIZE": "2", "JOB_COMPLETION_INDEX": "x"}
    with pytest.raises(pk.ConfigError) as info:
        place(env)
    msg = str(info.value)
    for part in ("the number of processes differs: Open MPI OMPI_COMM_WORLD_SIZE=2, SLURM "
                 "SLURM_NTASKS=4, torchrun WORLD_SIZE=2",
                 "the process index differs: Open MPI OMPI_COMM_WORLD_RANK=1, SLURM "
                 "SLURM_PROCID=3, torchrun RANK=1",
                 "the local rank differs: Open MPI OMPI_COMM_WORLD_LOCAL_RANK=1, SLURM "
                 "SLURM_LOCALID=0",
                 "the coordinator differs",
                 "JAX JAX_COORDINATOR_ADDRESS=a:1", "torchrun MASTER_ADDR:MASTER_PORT=b:2",
                 "JOB_COMPLETION_INDEX='x' is not a whole number", "Fix:"):
        assert part in msg


@pytest.mark.parametrize("env,part", [
    ({"PMIX_RANK": "2"}, "PMIx PMIX_RANK=2 names process 2 but no variable gives the number of "
                         "processes (set POPART_KIT_NUM_INSTANCES)"),
    ({"POPART_KIT_NUM_INSTANCES": "3"}, "names 3 processes but no variable says which one"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "process 2 (torchrun RANK=2) is not one of 0..1"),
    ({"OMPI_COMM_WORLD_SIZE": "0", "OMPI_COMM_WORLD_RANK": "-1"},
     "OMPI_COMM_WORLD_SIZE='0' is not a whole number of at least 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"},
     "MASTER_ADDR:MASTER_PORT='h:99999' is not HOST:PORT"),
    ({"POPDIST_NUM_TOTAL_REPLICAS": "4", "POPDIST_NUM_LOCAL_REPLICAS": "2"},
     "POPDIST_REPLICA_INDEX_OFFSET is missing"),
])
def test_malformed_or_incomplete(env, part):
    with pytest.raises(pk.ConfigError, match="the launch environment") as info:
        place(env)
    assert part in str(info.value)


def test_first_host_of_slurm_node_lists():
    assert [first_host(n) for n in ("n1", "n1,n2", "node[001-015],h2", "a[3,7-9]", "x[5]")] == [
        "n1", "n1", "node001", "a3", "x5"]


def test_a_process_of_several_never_runs_as_a_lone_job():
    """Two mpirun ranks without POPDIST_* used to run as instance 0 of 1 each."""
    for env in ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
                {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "h"},
                {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}):
        with pytest.raises(pk.ConfigError) as info:
            world(rep(4), env)
        msg = str(info.value)
        assert "2 processes but the session's replication (global_factor=4 / local_factor=4) " \
               "has 1 instance - each of the 2 would train alone" in msg
        assert "POPDIST_NUM_TOTAL_REPLICAS" in msg and "Fix:" in msg
    assert world(rep(4), {}).processes == 1  # no launcher: a lone job, as before
    assert world(rep(4), {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).processes == 1


def test_world_from_each_launcher_and_its_checks():
    here = world(rep(2, 4, 2), {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": "29500"})
    assert (here.processes, here.process_id, here.coordinator) == (2, 1, "127.0.0.1:29500")
    assert here.source == "torchrun RANK=1"
    with pytest.raises(pk.ConfigError, match="torchrun RANK=0 but the session's global_offset=2 "
                                             "makes it instance 1"):
        world(rep(2, 4, 2), {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                             "MASTER_PORT": "1"})
    with pytest.raises(pk.ConfigError, match="no coordinator: no address of process 0 from "
                                             "Kubernetes"):
        world(rep(2, 4, 2), {"JOB_COMPLETION_INDEX": "1", "POPART_KIT_NUM_INSTANCES": "2"})
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
           "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:4"}
    assert world(rep(2, 4, 2), mpi).coordinator is None  # JAX's Open MPI detection finds it
    with pytest.raises(pk.ConfigError, match="needs the instances started together"):
        world(rep(2, 4, 2), {})


def test_job_wide_popdist_variables_give_each_process_its_share():
    job = {"POPDIST_NUM_TOTAL_REPLICAS": "8", "POPDIST_NUM_IPUS_PER_REPLICA": "2",
           "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NODELIST": "h"}
    assert popdist_env(job) == pk.PopdistEnv(8, 2, 6, 2, 1)
    cfg = pk.SessionConfig(mode="training").with_popdist_env(job)
    assert cfg.replication == rep(2, 8, 6) and world(cfg.replication, job).process_id == 3
    with pytest.raises(pk.ConfigError, match="POPDIST_NUM_TOTAL_REPLICAS=6 exported for the whole "
                                             "job is not a multiple of its 4 processes"):
        popdist_env({**job, "POPDIST_NUM_TOTAL_REPLICAS": "6"})
    lone = {"POPDIST_NUM_TOTAL_REPLICAS": "4", "POPDIST_NUM_IPUS_PER_REPLICA": "1"}
    assert popdist_env(lone) == pk.PopdistEnv(4, 4, 0, 1)
    with pytest.raises(pk.ConfigError, match="POPDIST_NUM_LOCAL_REPLICAS is missing"):
        pk.PopdistEnv.read(lone)  # without a place, job-wide values are incomplete


def test_popdist_answers_under_a_launch(monkeypatch):
    import popart_kit.popart as popart
    import popart_kit.popdist as popdist
    import popart_kit.popdist.popart as popdist_popart

    for name in [n for n in os.environ if n.startswith(LAUNCH_VARIABLES)]:
        monkeypatch.delenv(name)
    assert not popdist.isPopdistEnvSet()
    assert (popdist.getNumInstances(), popdist.getInstanceIndex()) == (1, 0)
    with pytest.raises(pk.ConfigError, match="not launched by poprun"):
        popdist.getNumTotalReplicas()
    # what popart-kit launch --num-instances 4 --num-replicas 8 --ipus-per-replica 2 gives
    # instance 2
    env = {**pk.PopdistEnv(8, 2, 4, 2, 2).to_env(), "POPART_KIT_COORDINATOR": "127.0.0.1:29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert popdist.isPopdistEnvSet()
    assert (popdist.getNumInstances(), popdist.getInstanceIndex(), popdist.getNumTotalReplicas(),
            popdist.getNumLocalReplicas(), popdist.getReplicaIndexOffset(),
            popdist.getNumIpusPerReplica()) == (4, 2, 8, 2, 4, 2)
    assert popdist.checkNumIpusPerReplica(2) and not popdist.checkNumIpusPerReplica(1)
    assert popdist.getDeviceId() == 8
    opts = popart.SessionOptions()
    popdist_popart.configureSessionOptions(opts)
    assert (opts.enableReplicatedGraphs, opts.replicatedGraphCount,
            opts.enableDistributedReplicatedGraphs, opts.globalReplicationFactor,
            opts.globalReplicaOffset) == (True, 2, True, 8, 4)
    cfg = pk.SessionConfig.from_session_options(opts.changed(), mode="training")
    assert cfg.replication == rep(2, 8, 4)
    assert popdist_popart.getDevice().numIpus == 4
    with pytest.raises(popart.popart_exception, match=r"getDevice\(1\) but the launch gives 2"):
        popdist_popart.getDevice(1)


def test_popart_kit_run_aliases_popdist(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import popdist, popdist.popart\nprint(popdist.__name__, "
                      "popdist.popart.__name__, popdist.getNumInstances())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    done = subprocess.run([sys.executable, "-m", "popart_kit.popart", str(script)], env=env,
                          capture_output=True, text=True, timeout=BOUND)
    assert done.stdout.split() == ["popart_kit.popdist", "popart_kit.popdist.popart", "1"], \
        done.stderr


def clean_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    return {**env, **more}


def run_program(out: Path, *args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "popart_kit.popart", str(PROGRAM), str(out),
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.fixture(scope="module")
def one_process_weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    p = run_program(out, "4", env=clean_env())
    assert p.wait(timeout=BOUND) == 0, p.stdout.read()
    return np.load(out / "instance0.npz")["w"]


def check_instances(out: Path, reference: np.ndarray) -> float:
    parts = [np.load(out / f"instance{i}.npz")["w"] for i in range(2)]
    assert np.array_equal(parts[0], parts[1])
    worst = float(np.abs(parts[0] - reference).max())
    assert worst < 1e-5
    return worst


def test_popdist_program_under_popart_kit_launch(one_process_weights, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    status = launch([sys.executable, "-m", "popart_kit.popart", str(PROGRAM), str(tmp_path)],
                    num_instances=2, num_replicas=4, timeout=BOUND, out=out, err=err,
                    env=clean_env())
    assert status == 0, err.getvalue() + out.getvalue()[-3000:]
    assert "instance 1 of 2: replicas 2..3 of 4" in out.getvalue()
    worst = check_instances(tmp_path, one_process_weights)
    print(f"launch 2 x 2 vs 1 x 4: max difference {worst:.3g}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What each launcher gives process r of 2, with instance 0 at ADDRESS (on 127.0.0.1).
LAUNCHERS = {
    "torchrun": lambda r, address: {"WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r),
                                    "MASTER_ADDR": address.split(":")[0],
                                    "MASTER_PORT": address.split(":")[1]},
    "srun": lambda r, address: {"SLURM_NTASKS": "2", "SLURM_PROCID": str(r),
                                "SLURM_LOCALID": str(r), "SLURM_STEP_NODELIST": "localhost",
                                "SLURM_JOB_ID": "7", "POPART_KIT_COORDINATOR": address},
    "mpirun": lambda r, address: {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(r),
                                  "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                                  "POPART_KIT_COORDINATOR": address},
    "kubernetes": lambda r, address: {"JOB_COMPLETION_INDEX": str(r),
                                      "POPART_KIT_NUM_INSTANCES": "2",
                                      "POPART_KIT_COORDINATOR": address},
    "jax": lambda r, address: {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(r),
                               "JAX_COORDINATOR_ADDRESS": address},
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_popdist_program_under_each_launchers_variables(one_process_weights, tmp_path, launcher):
    """The same PopART program, unchanged, as two processes that only the launcher's own
    variables place (the job-wide POPDIST_* and the secret exported for the whole job)."""
    address = f"127.0.0.1:{_free_port()}"
    job = {"POPDIST_NUM_TOTAL_REPLICAS": "4", "POPDIST_NUM_IPUS_PER_REPLICA": "1",
           "POPART_KIT_JOB_SECRET": "test-secret", "POPART_KIT_FAULT_TIMEOUT": "20",
           "POPART_KIT_START_TIMEOUT": "60"}
    procs = [run_program(tmp_path, env=clean_env(**job, **LAUNCHERS[launcher](r, address)))
             for r in range(2)]
    try:
        for p in procs:
            assert p.wait(timeout=BOUND) == 0, p.stdout.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"{launcher} 2 x 2 vs 1 x 4: max difference "
          f"{check_instances(tmp_path, one_process_weights):.3g}")


def test_a_command_line_given_as_one_string_is_split_as_a_shell_splits_it(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    status = launch(f"{shlex.quote(sys.executable)} -c 'import sys; print(sys.argv[1:])' a 'b c'",
                    num_instances=1, num_replicas=1, timeout=BOUND, out=out, err=err,
                    env=clean_env())
    assert status == 0, err.getvalue()
    assert "['a', 'b c']" in out.getvalue()
