"""Instances of a distributed xla session that never meet, or stop or hang mid-run: a clear
error naming the instance in time, a documented exit status, never an abort.

Instances are started by hand with the environment `popart-kit launch` gives them, on the
loopback address only; every process runs in its own session under a hard time bound, and its
whole process group is checked gone afterwards.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import popart_kit as pk
from popart_kit._config.popdist import (
    COORDINATOR,
    FAULT_TIMEOUT_VARIABLE,
    PEER_FAILED,
    SECRET,
    START_TIMEOUT_VARIABLE,
)
from popart_kit._runtime.xla import distributed
from popart_kit._runtime.xla.distributed import InstanceFailed, World

EXAMPLE = Path(__file__).parents[1] / "examples" / "distributed_training.py"
FAULT = 5  # seconds: the fault and start timeouts these tests give the instances
MARGIN = 8  # seconds: starting Python and JAX on a busy 2-core machine, and stopping
BOUND = 120  # seconds: no process here may run longer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


FOREVER = """import os, runpy, sys, time
example = runpy.run_path(sys.argv[1])
import popart_kit as pk
model, names = example['build']()
cfg = pk.SessionConfig(mode='training').with_popdist_env()
sess = pk.TrainingSession(model, cfg, loss=names['loss'], optimizer=pk.SGD(0.1), backend='xla')
step = 0
while True:
    sess.run(sess.io.shard(example['global_data'](step, 1, 1, 2, names)))
    if step == 1:
        print('ready', flush=True)
    step += 1
    time.sleep(0.01)
"""


#: FOREVER with each replica two pipeline stages (a run's updates go through every stage).
FOREVER_PIPELINED = FOREVER.replace("example['build']()", "example['build'](True)").replace(
    "mode='training')", "mode='training', ipus_per_replica=2, pipeline={'enabled': True}, "
    "accumulation={'factor': 3})").replace("(step, 1, 1, 2, names)", "(step, 1, 3, 2, names)")


def start(index: int, port: int, *args: str, secret: str | None = "job-secret",
          start_timeout: int = FAULT, ipus: int = 1,
          program: tuple[str, ...] = (str(EXAMPLE), "--steps", "1")) -> subprocess.Popen:
    """Instance ``index`` of two (one replica each of ``ipus`` IPUs) of ``program`` with
    ``args``, as the launcher starts it (``secret`` None: none)."""
    env = {**os.environ, **pk.PopdistEnv(2, 1, index, ipus, index).to_env(),
           COORDINATOR: f"127.0.0.1:{port}", FAULT_TIMEOUT_VARIABLE: str(FAULT),
           START_TIMEOUT_VARIABLE: str(start_timeout), "PYTHONUNBUFFERED": "1"}
    env.pop(SECRET, None)
    if secret is not None:
        env[SECRET] = secret
    return subprocess.Popen([sys.executable, *program, *args], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=no_core_dump)


def finish(p: subprocess.Popen, started: float) -> tuple[int, str, float]:
    """Its status, stderr and run time; stops its group and fails past BOUND; checks nothing of
    its group is left running."""
    try:
        _, err = p.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"instance (pid {p.pid}) still running after {BOUND} s")
    took = time.monotonic() - started
    with pytest.raises(ProcessLookupError):
        os.killpg(p.pid, 0)  # nothing it started is left
    return p.returncode, err, took


def assert_clean_failure(status: int, err: str, took: float, *names: str) -> None:
    assert status > 0, f"status {status} (negative: killed by a signal)\n{err[-3000:]}"
    assert "Check failure" not in err and "Fatal Python error" not in err, err[-3000:]
    assert "InstanceFailed" in err and f"within the start timeout of {FAULT} s" in err, err[-3000:]
    for name in names:
        assert name in err, err[-3000:]
    assert took < FAULT + MARGIN, f"{took:.1f} s"


def test_an_instance_that_never_starts_fails_the_other_cleanly_in_time():
    port = free_port()
    started = time.monotonic()
    status, err, took = finish(start(0, port), started)
    print(f"instance 0 alone: exited {status} after {took:.1f} s (fault timeout {FAULT} s)")
    assert_clean_failure(status, err, took, "instance 1 of 2 never came to meet instance 0",
                         f"coordinator 127.0.0.1:{port}")


def test_a_wrong_coordinator_address_fails_both_instances_cleanly_in_time():
    port, wrong = free_port(), free_port()  # nothing listens at ``wrong``
    started = time.monotonic()
    first, second = start(0, port), start(1, wrong)
    for p, index, missing, address in ((first, 0, 1, port), (second, 1, 0, wrong)):
        status, err, took = finish(p, started)
        print(f"instance {index}: exited {status} after {took:.1f} s")
        assert_clean_failure(status, err, took,
                             f"instance {missing} of 2 never came to meet instance {index}",
                             f"coordinator 127.0.0.1:{address}")


def test_two_instances_started_by_hand_meet_and_run():
    port = free_port()
    started = time.monotonic()
    for p in [start(0, port), start(1, port)]:
        status, err, took = finish(p, started)
        assert status == 0, err[-3000:]
    print(f"two instances: done after {took:.1f} s")


def meet(worlds: list[World]) -> dict[int, Exception | None]:
    """Run the rendezvous of each World in a thread (no JAX); what each raised."""
    found: dict[int, Exception | None] = {}

    def one(here: World) -> None:
        try:
            for peer in distributed.rendezvous(here).values():
                peer.conn.close()
            found[here.process_id] = None
        except Exception as err:
            found[here.process_id] = err

    threads = [threading.Thread(target=one, args=(w,), daemon=True) for w in worlds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    assert not any(t.is_alive() for t in threads)
    return found


def test_instance_0_tells_the_waiting_instances_who_never_came():
    address = f"127.0.0.1:{free_port()}"
    found = meet([World(3, 0, address, 1, "test", 1), World(3, 1, address, 1, "test", 1)])
    for index in (0, 1):
        assert isinstance(found[index], InstanceFailed)
        assert f"instance 2 of 3 never came to meet instance {index}" in str(found[index])


def test_an_instance_of_another_launch_is_refused():
    address = f"127.0.0.1:{free_port()}"
    found = meet([World(2, 0, address, 1, "test", 1), World(3, 1, address, 1, "test", 1)])
    assert isinstance(found[0], InstanceFailed), found[0]
    assert isinstance(found[1], pk.ConfigError) and not isinstance(found[1], InstanceFailed)
    assert "refused it: it is one of 3 instances, instance 0 one of 2" in str(found[1])


@pytest.mark.parametrize("signal_name,victim,pipelined", [
    ("SIGKILL", 1, False), ("SIGSTOP", 1, False), ("SIGSTOP", 0, False), ("SIGKILL", 0, True)])
def test_an_instance_killed_or_hung_mid_run_ends_the_other_named_in_time(
        tmp_path, signal_name, victim, pipelined):
    """The survivor ends with the kit's InstanceFailed naming the instance and what was seen,
    exit status PEER_FAILED, within the fault timeout; never JAX's abort - pipelined too."""
    program = tmp_path / "forever.py"
    program.write_text(FOREVER_PIPELINED if pipelined else FOREVER)
    port = free_port()
    instances = [start(i, port, str(EXAMPLE), program=(str(program),), ipus=2 if pipelined
                       else 1) for i in (0, 1)]
    try:
        for p in instances:  # both trained two steps (gloo also writes to stdout)
            assert "ready\n" in iter(p.stdout.readline, ""), f"instance exited {p.wait()}"
        hit = time.monotonic()
        os.killpg(instances[victim].pid, getattr(signal, signal_name))
        status, err, took = finish(instances[1 - victim], hit)
    finally:
        for p in instances:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=BOUND)
    seen = "stopped: its connection closed" if signal_name == "SIGKILL" else (
        f"sent no heartbeat for {FAULT} s")
    print(f"{signal_name} to instance {victim}: instance {1 - victim} exited {status} after "
          f"{took:.2f} s (fault timeout {FAULT} s)")
    assert status == PEER_FAILED, f"status {status}\n{err[-3000:]}"
    assert "Check failure" not in err and "Fatal Python error" not in err, err[-3000:]
    assert (f"InstanceFailed: instance {1 - victim} of 2: instance {victim} of 2 (on 127.0.0.1) "
            f"{seen}") in err, err[-3000:]
    assert took < FAULT + MARGIN if signal_name == "SIGSTOP" else took < MARGIN


def launch_host(index: int, port: int, secret_file: Path, program: Path,
                start_timeout: int = 60) -> subprocess.Popen:
    """``popart-kit launch`` of host ``index`` of two (127.0.0.1 and 127.0.0.2, one instance
    each) around ``program``, as each host of a job would run it."""
    env = {k: v for k, v in os.environ.items() if k != SECRET}
    return subprocess.Popen(
        [sys.executable, "-m", "popart_kit.cli", "launch", "--num-instances", "2",
         "--num-replicas", "2", "--host", "127.0.0.1,127.0.0.2", "--host-index", str(index),
         "--coordinator", f"127.0.0.1:{port}", f"--secret-file={secret_file}",
         "--fault-timeout", str(FAULT), "--start-timeout", str(start_timeout), "--",
         sys.executable, str(program), str(EXAMPLE)],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, preexec_fn=no_core_dump)


def test_a_host_whose_launcher_is_killed_ends_the_other_host_named_in_time(tmp_path):
    """Two launches as two hosts sharing a secret file; killing host B's launcher (its instance
    dies with it) ends host A's launch with the kit's message and status PEER_FAILED."""
    program, secret = tmp_path / "forever.py", tmp_path / "secret"
    program.write_text(FOREVER)
    secret.write_text("shared-by-both-hosts\n")
    port = free_port()
    hosts = [launch_host(i, port, secret, program) for i in (0, 1)]
    try:
        for h in hosts:
            assert any(line.endswith("ready\n") for line in iter(h.stdout.readline, "")
                       if "ready" in line or not line), f"launch exited {h.wait()}"
        hit = time.monotonic()
        os.killpg(hosts[1].pid, signal.SIGKILL)
        out = hosts[0].stdout.read()  # the instance's output, forwarded: until it ends
        status, err, took = finish(hosts[0], hit)
    finally:
        for h in hosts:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(h.pid, signal.SIGKILL)
            h.communicate(timeout=BOUND)
    print(f"host B's launcher killed: host A's launch exited {status} after {took:.2f} s")
    assert status == PEER_FAILED, f"status {status}\n{err[-3000:]}"
    assert "Check failure" not in out + err and "Fatal Python error" not in out + err, out[-3000:]
    assert "InstanceFailed: instance 0 of 2: instance 1 of 2 (on 127.0.0.1) stopped" in out, \
        out[-3000:]
    assert "another instance of the job stopped or hung" in err, err[-3000:]
    assert took < MARGIN, f"{took:.1f} s"


def test_a_host_that_never_starts_is_named_by_the_other_host_in_time(tmp_path):
    program, secret = tmp_path / "forever.py", tmp_path / "secret"
    program.write_text(FOREVER)
    secret.write_text("shared-by-both-hosts\n")
    started = time.monotonic()
    host = launch_host(0, free_port(), secret, program, start_timeout=FAULT)
    out = host.stdout.read()
    status, err, took = finish(host, started)
    print(f"host B never started: host A's launch exited {status} after {took:.1f} s")
    assert status == 1, f"status {status}\n{err[-3000:]}"
    assert "instance 1 of 2 never came to meet instance 0" in out, out[-3000:]
    assert took < FAULT + MARGIN, f"{took:.1f} s"
