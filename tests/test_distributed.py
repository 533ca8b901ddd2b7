"""Global replication over real processes: `popart-kit launch` and the xla backend's instances.

Every process runs on the loopback address under a hard time bound (the launcher's own timeout
stops every instance it started); equivalence is checked against one instance running all the
replicas on the same global data.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import popart_kit as pk
from popart_kit._runtime.xla.distributed import world
from popart_kit.launcher import PIN_CORES, LaunchError, core_share, launch, topology

EXAMPLE = Path(__file__).parents[1] / "examples" / "distributed_training.py"
BOUND = 240  # seconds: no launch in these tests may run longer
FAULT = 5  # seconds: the fault timeout the fault tests use


def run_launch(program, **kw):
    out, err = io.StringIO(), io.StringIO()
    status = launch(program, timeout=BOUND, out=out, err=err, **kw)
    return status, out.getvalue(), err.getvalue()


def saved(directory: Path, instances: int) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(directory / f"instance{i}.npz")) for i in range(instances)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One instance with all four replicas, training and inference."""
    found = {}
    for mode in ("train", "infer"):
        out = tmp_path_factory.mktemp(f"one_{mode}")
        subprocess.run([sys.executable, str(EXAMPLE), "--replicas", "4", "--out", str(out),
                        *(["--inference"] if mode == "infer" else [])],
                       check=True, timeout=BOUND, capture_output=True)
        found[mode] = saved(out, 1)[0]
    return found


@pytest.mark.parametrize("instances,mode", [(2, "train"), (4, "train"), (2, "infer")])
def test_instances_match_one_instance_with_all_replicas(reference, tmp_path, instances, mode):
    status, out, err = run_launch(
        [sys.executable, str(EXAMPLE), "--out", str(tmp_path),
         *(["--inference"] if mode == "infer" else [])],
        num_instances=instances, num_replicas=4)
    assert status == 0, err + out[-3000:]
    parts, whole = saved(tmp_path, instances), reference[mode]
    local = 4 // instances
    worst = 0.0
    for key, value in whole.items():
        if key.startswith("weight:"):
            for part in parts:  # every instance holds the same weights as one instance
                assert part[key].shape == value.shape
                worst = max(worst, float(np.abs(part[key] - value).max()))
            assert all(np.array_equal(parts[0][key], p[key]) for p in parts)
        else:  # each instance's anchors cover only its local replicas, as PopART gives them
            axis = -1 if mode == "train" else 1  # loss All [bps, A, R]; probs All [bps, R, ...]
            if local == 1:
                assert parts[0][key].shape == np.delete(value, 0, axis).shape[:axis % value.ndim] \
                    + value.shape[axis % value.ndim + 1:]
                joined = np.stack([p[key] for p in parts], axis=axis)
            else:
                assert parts[0][key].shape[axis] == local
                joined = np.concatenate([p[key] for p in parts], axis=axis)
            worst = max(worst, float(np.abs(joined - value).max()))
    print(f"{instances} instances x {local} replicas vs 1 x 4 ({mode}): max difference {worst:.3g}")
    assert worst < 1e-5


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_pipelined_instances_match_one_instance_with_all_replicas(tmp_path, workers):
    """Each replica two pipeline stages (in stage threads, or worker processes), two
    instances: every gradient is reduced over the replicas of both instances, so each ends
    with the weights one unpipelined instance with all four replicas reaches, and its losses
    are its replicas' share."""
    subprocess.run([sys.executable, str(EXAMPLE), "--replicas", "4", "--accumulation", "4",
                    "--out", str(tmp_path / "one")], check=True, timeout=BOUND,
                   capture_output=True)
    status, out, err = run_launch(
        [sys.executable, str(EXAMPLE), "--pipeline", "--accumulation", "4",
         *(["--stage-processes"] if workers == "processes" else []),
         "--out", str(tmp_path / "two")], num_instances=2, num_replicas=4, ipus_per_replica=2)
    assert status == 0, err + out[-3000:]
    whole, parts = saved(tmp_path / "one", 1)[0], saved(tmp_path / "two", 2)
    worst = 0.0
    for key, value in whole.items():
        if key.startswith("weight:"):
            assert all(np.array_equal(parts[0][key], p[key]) for p in parts)
            worst = max(worst, float(np.abs(parts[0][key] - value).max()))
        else:  # loss All [bps, A, R]: each instance has its two replicas
            joined = np.concatenate([p[key] for p in parts], axis=-1)
            worst = max(worst, float(np.abs(joined - value).max()))
    print(f"pipelined ({workers}), 2 instances x 2 replicas vs unpipelined 1 x 4: max "
          f"difference {worst:.3g}")
    assert worst < 1e-5


def test_a_killed_instance_stops_the_launch_within_the_bound(tmp_path):
    """Instance 1 is killed mid-training; the launcher exits non-zero naming it, in time."""
    program = tmp_path / "forever.py"
    program.write_text(
        "import os, runpy, sys, time\n"
        f"example = runpy.run_path({str(EXAMPLE)!r})\n"
        "import popart_kit as pk\n"
        "model, names = example['build']()\n"
        "cfg = pk.SessionConfig(mode='training').with_popdist_env()\n"
        "sess = pk.TrainingSession(model, cfg, loss=names['loss'], optimizer=pk.SGD(0.1),"
        " backend='xla')\n"
        "step = 0\n"
        "while True:\n"
        "    data = example['global_data'](step, 1, 1, cfg.replication.global_replicas, names)\n"
        "    sess.run(sess.io.shard(data))\n"
        "    if step == 1:\n"
        f"        open(os.path.join({str(tmp_path)!r}, 'ready%d' % "
        "cfg.replication.instance_index), 'w').write(str(os.getpid()))\n"
        "    step += 1\n"
        "    time.sleep(0.01)\n")
    result = {}

    def go():
        result["launch"] = run_launch([sys.executable, str(program)], num_instances=2,
                                      num_replicas=2, fault_timeout=FAULT)
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=go)
    thread.start()
    ready = tmp_path / "ready1"
    deadline = time.monotonic() + BOUND
    while not ready.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), result
    time.sleep(0.1)
    pid = int(ready.read_text())
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(BOUND)
    assert not thread.is_alive()
    status, out, err = result["launch"]
    took = result["ended"] - killed
    print(f"killed instance 1: the launch ended {took:.2f} s later (fault timeout {FAULT} s)")
    assert status == 128 + signal.SIGKILL, err + out[-4000:]
    assert "instance 1 failed (killed by SIGKILL)" in err
    assert took < FAULT + 5  # the others' bound plus stopping them
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "ready0").read_text()), 0)  # nothing left running


def test_an_instance_that_never_comes_is_named(tmp_path):
    program = tmp_path / "late.py"
    program.write_text(
        "import os, runpy, sys, time\n"
        "if os.environ['POPDIST_REPLICA_INDEX_OFFSET'] != '0':\n"
        "    time.sleep(600)\n"
        f"sys.argv = [sys.argv[0]]\nrunpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n")
    start = time.monotonic()
    status, _, err = run_launch([sys.executable, str(program)], num_instances=2,
                                num_replicas=2, fault_timeout=3, start_timeout=3)
    assert status != 0
    assert "instance(s) 1 never came to meet the others" in err
    assert time.monotonic() - start < 60


def test_exit_status_of_the_first_failing_instance_and_prefixed_output():
    code = ("import os, sys; i = int(os.environ['POPDIST_REPLICA_INDEX_OFFSET']); "
            "print('hello', os.environ['POPDIST_NUM_LOCAL_REPLICAS'], "
            "os.environ['POPART_KIT_COORDINATOR']); sys.exit(7 if i == 1 else 0)")
    status, out, err = run_launch([sys.executable, "-c", code], num_instances=2,
                                  num_replicas=2)
    assert status == 7 and "instance 1 failed (exit status 7)" in err
    assert "[instance 0] hello 1 127.0.0.1:" in out and "[instance 1] hello 1" in out


@pytest.mark.parametrize("cores, count, shares", [
    ([0, 1], 2, [[0], [1]]), ([0, 1], 4, [[0], [1], [0], [1]]),
    ([4, 5, 6, 7, 8, 9, 10], 3, [[4, 5, 6], [7, 8], [9, 10]]), ([3, 1], 1, [[1, 3]])])
def test_each_instance_on_a_host_gets_its_share_of_the_cores(cores, count, shares):
    assert [core_share(cores, count, i) for i in range(count)] == shares


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_getaffinity")
@pytest.mark.parametrize("pin", ["1", "0"])
def test_launched_instances_run_on_their_share_unless_told_not_to(pin):
    """XLA and onnxruntime size their thread pools by the cores a process may use, so
    instances sharing a host do not oversubscribe it."""
    code = ("import os; print('cores', os.environ['POPDIST_LOCAL_INSTANCE_INDEX'], "
            "sorted(os.sched_getaffinity(0)))")
    status, out, _ = run_launch([sys.executable, "-c", code], num_instances=2, num_replicas=2,
                                env={**os.environ, PIN_CORES: pin})
    assert status == 0
    mine = sorted(os.sched_getaffinity(0))
    for i in range(2):
        want = core_share(mine, 2, i) if pin == "1" else mine
        assert f"[instance {i}] cores {i} {want}" in out


def test_cli_launch_passes_the_status_through():
    found = subprocess.run(
        [sys.executable, "-m", "popart_kit.cli", "launch", "--num-instances", "2",
         "--num-replicas", "4", "--print-topology", "--", sys.executable, "-c",
         "import sys; sys.exit(3)"], capture_output=True, text=True, timeout=60)
    assert found.returncode == 3, found.stderr
    row = next(line for line in found.stderr.splitlines() if line.startswith("| replicas"))
    assert row.split("|")[2:-1] and [c.strip() for c in row.split("|")[2:-1]] == [
        "0", "1", "2", "3"]


def test_launch_refuses_bad_input_at_once_and_starts_nothing():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError) as err:
            launch(["no-such-program-here"], num_instances=2, num_replicas=3,
                   coordinator=f"127.0.0.1:{port}")
    text = str(err.value)
    assert "--num-replicas 3 is not a multiple of --num-instances 2" in text
    assert "'no-such-program-here' is not on PATH" in text
    assert f"port {port} on 127.0.0.1 is already in use" in text
    with pytest.raises(LaunchError, match="does not exist"):
        launch(["./missing/train.py"], num_instances=1, num_replicas=1)


def test_topology_table():
    table = topology(2, 4, 2)
    assert "| instances |     0     |     1     |" in table
    assert "| IPUs      | 0-1 | 2-3 | 0-1 | 2-3 |" in table


@pytest.mark.parametrize("args", [(2, 4, 1, ["node-a.cluster.example.com", "b"]), (1, 1, 1),
                                  (12, 12, 1), (4, 8, 3, ["h" * 40, "x"])])
def test_topology_rows_fit_their_border_whatever_the_names(args):
    table = topology(*args)
    assert len({len(line) for line in table.splitlines()}) == 1, table
    for host in args[3] if len(args) > 3 else ["localhost"]:
        assert f" {host} " in table


# -- the instance's view of its environment (no processes) ------------------------------------


def env_of(total, local, offset, **more):
    return {**pk.PopdistEnv(total, local, offset, 1).to_env(),
            "POPART_KIT_COORDINATOR": "127.0.0.1:29500", **more}


def test_offsets_not_matching_the_environment_are_refused():
    rep = pk.Replication(local_factor=2, global_factor=4, global_offset=2)
    assert world(rep, env_of(4, 2, 2)).process_id == 1
    with pytest.raises(pk.ConfigError, match=r"POPDIST_REPLICA_INDEX_OFFSET=0\) but the session's "
                                             r"replication has global_factor=4, local_factor=2, "
                                             r"global_offset=2"):
        world(rep, env_of(4, 2, 0))
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    with pytest.raises(pk.ConfigError, match="OMPI_COMM_WORLD_RANK=0 but the session's "
                                             "global_offset=2 makes it instance 1"):
        world(rep, mpi)
    with pytest.raises(pk.ConfigError, match="OMPI_COMM_WORLD_SIZE=3 processes but .* has 2"):
        world(rep, {**mpi, "OMPI_COMM_WORLD_SIZE": "3"})
    with pytest.raises(pk.ConfigError, match="POPART_KIT_COORDINATOR='nowhere' is not HOST:PORT"):
        world(rep, {**env_of(4, 2, 2), "POPART_KIT_COORDINATOR": "nowhere"})
    with pytest.raises(pk.ConfigError, match="POPART_KIT_FAULT_TIMEOUT='-1' is not"):
        world(rep, {**env_of(4, 2, 2), "POPART_KIT_FAULT_TIMEOUT": "-1"})


def test_with_popdist_env_reports_conflicts_naming_both_values():
    env = {**pk.PopdistEnv(4, 2, 2, 2).to_env()}
    cfg = pk.SessionConfig(mode="inference", ipus_per_replica=4, batches_per_step=4,
                           pipeline={"enabled": True, "stages": 4})
    with pytest.raises(pk.ConfigError, match="POPDIST_NUM_IPUS_PER_REPLICA=2 but the config has "
                                             "ipus_per_replica=4 and pipeline.stages=4"):
        cfg.with_popdist_env(env)
    with pytest.raises(pk.ConfigError, match="POPDIST_NUM_LOCAL_REPLICAS=2.* but the config has "
                                             "replication.local_factor=4"):
        pk.SessionConfig(mode="inference", replication={"local_factor": 4}).with_popdist_env(env)
    taken = pk.SessionConfig(mode="inference").with_popdist_env(env)  # defaults: env fills them
    assert taken.replication.replica_ids == range(2, 4) and taken.ipus_per_replica == 2


# -- the instances' shared-memory exchange on one host (no JAX) ---------------------------------

EXCHANGE_PEER = """
import sys
import numpy as np
from popart_kit._runtime.xla import host_exchange as hx
processes, me, prefix, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
exchange = hx.LocalJob(processes, me, prefix, patience=20).exchange("w", [5, 300], np.float32)
rng = np.random.default_rng(me)
with open(out, "wb") as f:
    for step in range(40):
        bucket = step % 2
        values = rng.normal(size=exchange.sizes[bucket]).astype(np.float32)
        np.save(f, exchange.reduce(bucket, values))
        np.save(f, values)
"""


def exchange_prefix() -> str:
    from popart_kit._runtime.xla import host_exchange

    return host_exchange.segment_prefix(os.urandom(16), "127.0.0.1:1")


def segments(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def test_exchange_sums_every_bucket_in_instance_order_and_unlinks_its_segment(tmp_path):
    """Three processes sum two buckets 20 times each: every process gets the same bits, the
    sum in instance order of what each gave; the segment's name is gone once all mapped it."""
    prefix = exchange_prefix()
    peers = [subprocess.Popen([sys.executable, "-c", EXCHANGE_PEER, "3", str(i), prefix,
                               str(tmp_path / f"{i}.npy")]) for i in range(3)]
    try:
        assert [p.wait(timeout=60) for p in peers] == [0, 0, 0]
    finally:
        for p in peers:
            p.kill()
    found = []
    for i in range(3):
        with open(tmp_path / f"{i}.npy", "rb") as stream:
            found.append([(np.load(stream), np.load(stream)) for _ in range(40)])
    for step in range(40):
        expected = found[0][step][1] + found[1][step][1] + found[2][step][1]  # instance order
        for mine in found:
            assert mine[step][0].dtype == np.float32
            assert np.array_equal(mine[step][0], expected)
    assert segments(prefix) == []


def test_exchange_segment_is_private_and_what_it_holds_is_checked(tmp_path):
    from popart_kit._runtime.xla import host_exchange as hx

    prefix = exchange_prefix()
    maker = hx.LocalJob(2, 0, prefix, patience=0.3).exchange("w", [8], np.float32)
    maker._attach()
    try:
        info = os.stat(maker.path)
        assert info.st_mode & 0o777 == 0o600 and info.st_uid == os.getuid()
        # another layout under the same name (it cannot happen by name; by hand it can)
        other = hx.LocalJob(2, 1, prefix, patience=0.3).exchange("w", [8], np.float32)
        other.sizes, other.digest = [8], b"x" * 32
        with pytest.raises(hx.ExchangeFailed, match="holds another exchange"):
            other._attach()
        os.chmod(maker.path, 0o644)
        opener = hx.LocalJob(2, 1, prefix, patience=0.3).exchange("w", [8], np.float32)
        with pytest.raises(hx.ExchangeFailed, match=r"others may access it \(mode 644"):
            opener._attach()
        os.chmod(maker.path, 0o600)
        os.truncate(maker.path, 4096)
        with pytest.raises(hx.ExchangeFailed, match="its size is 4096 bytes, not the"):
            opener._attach()
        with pytest.raises(hx.ExchangeFailed, match=r"bucket 0 got float64\[8\], expected "
                                                    r"float32\[8\]"):
            opener.reduce(0, np.zeros(8))
    finally:
        maker.unlink()
    assert segments(prefix) == []


def test_exchange_without_its_peer_fails_in_bounded_time_naming_it():
    from popart_kit._runtime.xla import host_exchange as hx
    from popart_kit._runtime.xla.distributed import peer_failure

    prefix = exchange_prefix()
    lone = hx.LocalJob(2, 0, prefix, patience=0.3).exchange("w", [4], np.float32)
    start = time.monotonic()
    with pytest.raises(hx.ExchangeFailed, match="instance 1 did not reach the exchange of "
                                                "bucket 0 within 0.3 s") as err:
        lone.reduce(0, np.ones(4, np.float32))
    assert time.monotonic() - start < 5
    assert "instance 0 of 2: a collective" in str(peer_failure(err.value, 2, 0))
    hx.LocalJob(2, 0, prefix, 0.3).cleanup()  # nothing of its own: a no-op
    lone.unlink()
    with pytest.raises(hx.ExchangeFailed, match="instance 0 did not make the segment"):
        hx.LocalJob(2, 1, prefix, patience=0.3).exchange("w", [4], np.float32).reduce(
            0, np.ones(4, np.float32))
    assert segments(prefix) == []


def test_launch_removes_the_segments_its_instances_left(tmp_path):
    """Instances killed before they unlinked their segment: the launcher removes it."""
    from popart_kit._runtime.xla import host_exchange as hx

    secret = "launch-test-" + os.urandom(8).hex()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    left = os.path.join("/dev/shm", hx.segment_prefix(secret, address) + "-abc")
    code = f"import os; os.close(os.open({left!r}, os.O_CREAT | os.O_WRONLY, 0o600)); os._exit(9)"
    status, _, err = run_launch([sys.executable, "-c", code], num_instances=2, num_replicas=2,
                                coordinator=address,
                                env={**os.environ, "POPART_KIT_JOB_SECRET": secret})
    assert status == 9, err
    assert not os.path.exists(left)


def test_gradients_leave_the_program_in_buckets_in_one_order_and_come_back_whole():
    """Inside a program over the (process, replica) mesh: whole weights per bucket, the last
    weights first, each bucket's exchange after the one before, and every gradient back in
    its shape (one instance: the sum is what it gave)."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from popart_kit._runtime.xla import host_exchange as hx

    job = hx.LocalJob(1, 0, exchange_prefix(), patience=5)
    calls = []
    original = hx.Exchange.reduce

    def reduce(self, bucket, values, out=None):
        calls.append((bucket, values.size, values.dtype.name))
        return original(self, bucket, values, out)

    rng = np.random.default_rng(0)
    grads = {"a": rng.normal(size=(16, 8)).astype(np.float32),  # 512 bytes
             "b": rng.normal(size=(40,)).astype(np.float32),
             "c": rng.normal(size=(3, 50)).astype(np.float32),
             "d": rng.normal(size=(4,)).astype(np.float16)}
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("process", "replica"))
    program = jax.jit(jax.shard_map(
        lambda g: hx.sum_over_instances(g, ("process", "replica"), "process", bucket_bytes=500),
        mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    hx.start(job)
    try:
        hx.Exchange.reduce = reduce
        out = jax.device_get(program(grads))
    finally:
        hx.Exchange.reduce = original
        hx.start(None)
        job.cleanup()
    # reversed names: d (float16, alone), c (600 bytes), b + a (160 < 500, then a)
    assert calls == [(0, 4, "float16"), (0, 150, "float32"), (1, 40 + 128, "float32")]
    for name, value in grads.items():
        assert out[name].dtype == value.dtype and np.array_equal(out[name], value)
