"""No uninvited instance: the rendezvous admits only instances that prove the job's secret.

An instance without the secret is refused with a named cause before JAX starts, and the real
instances run on unharmed; a connection that does not speak the protocol is ignored; a default
launch listens on the loopback address only. Every process runs on the loopback address under a
hard time bound, and its whole process group is checked gone afterwards.
"""

from __future__ import annotations

import io
import socket
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from test_instance_faults import BOUND, EXAMPLE, finish, free_port, meet, start

import popart_kit as pk
from popart_kit._config.popdist import SECRET
from popart_kit._runtime.xla import distributed
from popart_kit._runtime.xla.distributed import World
from popart_kit.launcher import LaunchError, launch


def weights(directory) -> dict[str, np.ndarray]:
    return {k: v for k, v in np.load(directory / "instance0.npz").items() if k.startswith("weight")}


def listening(port: int, timeout: float) -> None:
    """Wait until something listens at the loopback ``port`` (a connection that sends nothing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail(f"nothing listens at 127.0.0.1:{port} after {timeout} s")


def test_an_instance_without_the_secret_is_refused_and_the_run_is_untouched(tmp_path):
    """Instance 0 waits; a stray connection sends garbage, an intruder claims to be instance 1
    with another secret and is refused (a ConfigError naming the cause), then the real
    instance 1 joins: the weights equal those of a run without them."""
    started = time.monotonic()
    port = free_port()
    alone = [start(i, port, "--steps", "2", "--out", str(tmp_path / "alone"), start_timeout=60)
             for i in (0, 1)]
    for p in alone:
        assert finish(p, started)[0] == 0
    port = free_port()
    first = start(0, port, "--steps", "2", "--out", str(tmp_path / "run"), start_timeout=60)
    listening(port, BOUND)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as stray:
        stray.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
    status, err, took = finish(start(1, port, "--steps", "2", secret="not-the-job's",
                                     start_timeout=60), time.monotonic())
    print(f"intruder refused after {took:.1f} s")
    assert status == 1, err[-3000:]
    assert "ConfigError" in err and (f"instance 0 at the coordinator 127.0.0.1:{port} refused "
                                     f"it: it did not prove the job's secret") in err, err[-3000:]
    second = start(1, port, "--steps", "2", "--out", str(tmp_path / "run"), start_timeout=60)
    for p in (first, second):
        status, err, _ = finish(p, started)
        assert status == 0, err[-3000:]
        if p is first:
            assert "refused a connection from 127.0.0.1:" in err and "as instance 1 of 2" in err
    got, want = weights(tmp_path / "run"), weights(tmp_path / "alone")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    print(f"intruder test: {time.monotonic() - started:.1f} s")


def test_garbage_and_wrong_secrets_do_not_stop_the_meeting():
    """Without JAX: a garbage connection, a silent one and an instance with another secret come
    first; instance 0 ignores or refuses them and the real instances meet."""
    address = f"127.0.0.1:{free_port()}"
    job = [World(2, 0, address, 1, "test", 5, b"job"), World(2, 1, address, 1, "test", 5, b"job")]
    intruder = World(2, 1, address, 1, "test", 5, b"other")
    found: dict[str, object] = {}

    def stray() -> None:
        conn = distributed._connect("127.0.0.1", int(address.rpartition(":")[2]),
                                    time.monotonic() + 5)
        with conn:
            conn.sendall(b"\x00garbage\n")
            silent = socket.create_connection(conn.getpeername()[:2])
        time.sleep(0.2)
        try:
            distributed.rendezvous(intruder)
        except Exception as err:
            found["intruder"] = err
        silent.close()

    def delayed() -> None:
        time.sleep(1.0)
        found["real"] = meet([job[1]])[1]

    threads = [threading.Thread(target=f, daemon=True) for f in (stray, delayed)]
    for t in threads:
        t.start()
    with pytest.warns(pk.PopartKitWarning, match="did not prove the job's secret"):
        found["instance 0"] = meet([job[0]])[0]
    for t in threads:
        t.join(BOUND)
    assert found["instance 0"] is None and found["real"] is None, found
    assert isinstance(found["intruder"], pk.ConfigError), found
    assert "refused it: it did not prove the job's secret" in str(found["intruder"])


def test_no_secret_warns_once_naming_the_fix():
    here = World(2, 1, "10.0.0.1:29500", 5, "test")
    with pytest.warns(pk.PopartKitWarning, match=f"{SECRET} is not set: anyone who can reach "
                                                 f"the coordinator 10.0.0.1:29500 can join"):
        assert distributed._with_job(here, {}).secret == b""
    assert distributed._with_job(here, {SECRET: "s"}).secret == b"s"


def test_several_hosts_need_a_shared_secret(tmp_path):
    kw = dict(num_instances=2, num_replicas=2, hosts=["h0", "h1"], coordinator="h0:29500",
              host_index=1, env={})
    with pytest.raises(LaunchError, match="2 hosts need one job secret shared by every host"):
        launch([sys.executable, "-c", "pass"], **kw)
    empty = tmp_path / "job.secret"
    empty.write_text("\n")
    with pytest.raises(LaunchError, match="is empty"):
        launch([sys.executable, "-c", "pass"], secret_file=str(empty), **kw)


PROBE = textwrap.dedent("""
    import os, runpy, sys
    sys.argv = [sys.argv[0], "--steps", "1"]
    runpy.run_path(%r, run_name="__main__")
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    for table in ("tcp", "tcp6"):
        for row in open(f"/proc/net/{table}").readlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in mine:  # LISTEN
                print("listening", table, cols[1])
    print("secret set", bool(os.environ.get(%r)))
""")


def loopback(table: str, address: str) -> bool:
    """Whether a /proc/net/tcp{,6} local address (hex, host byte order per 32-bit word) is a
    loopback address: 127.0.0.0/8, ::1 or ::ffff:127.x."""
    host = address.split(":")[0]
    if table == "tcp":
        return host[-2:] == "7F"  # little-endian: the first octet is the last byte
    return host in ("00000000000000000000000001000000", ) or (
        host[:24] == "0000000000000000FFFF0000" and host[-2:] == "7F")


def test_a_default_launch_listens_on_loopback_only(tmp_path):
    program = tmp_path / "probe.py"
    program.write_text(PROBE % (str(EXAMPLE), SECRET))
    out, err = io.StringIO(), io.StringIO()
    status = launch([sys.executable, str(program)], num_instances=2, num_replicas=2,
                    timeout=BOUND, out=out, err=err, env={k: v for k, v in
                                                          __import__("os").environ.items()
                                                          if k != SECRET})
    assert status == 0, err.getvalue() + out.getvalue()[-3000:]
    found = [line.split()[-2:] for line in out.getvalue().splitlines() if "listening" in line]
    print("\n".join(" ".join(f) for f in found))
    assert any(table for table, _ in found)  # JAX's coordinator and gloo were seen listening
    assert all(loopback(table, address) for table, address in found), found
    assert out.getvalue().count("secret set True") == 2
    assert "is not set: anyone" not in out.getvalue() + err.getvalue()
