"""``popart-kit launch``: start the instances of a distributed session as poprun would.

Each instance is one process of ``PROGRAM`` with the environment poprun gives it (the POPDIST_*
variables: total and local replicas, replica offset, IPUs per replica, local instance index)
plus the coordinator the xla backend's instances meet at (``POPART_KIT_COORDINATOR``, on the
loopback address by default), how long they wait to meet (``POPART_KIT_START_TIMEOUT``), the
fault bound (``POPART_KIT_FAULT_TIMEOUT``) and the job's secret (``POPART_KIT_JOB_SECRET``: a
random one per launch, or the one shared by every host's launch, from ``secret_file`` or that
variable), which an instance must prove to join. Option names are poprun's, so a command line
moves between the two by changing the program name.

The instances on a host share its cores: each runs on its own contiguous share of the
launcher's (:func:`core_share`), so that XLA's and onnxruntime's thread pools, sized by the
cores a process may use, do not oversubscribe the host (2 instances x 2 replicas on 2 cores:
0.36x of 1 x 4's throughput on all cores, 0.67x pinned; ``POPART_KIT_PIN_CORES=0`` leaves
every instance on all of them).

Each instance's output is forwarded line by line with an ``[instance i]`` prefix. When an
instance fails, the others get ``fault_timeout`` seconds to stop on their own (the xla backend's
instances notice a stopped peer at their next collective, or by its missing heartbeat), then
are stopped; the launcher returns the first failing instance's status and names it. Nothing it
started is left running, nor any shared-memory segment of the instances' gradient exchange.
The module does not import JAX.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from ._config.cluster import PER_PROCESS
from ._config.popdist import (
    COORDINATOR,
    FAULT_TIMEOUT,
    FAULT_TIMEOUT_VARIABLE,
    JOINED,
    PEER_FAILED,
    SECRET,
    START_TIMEOUT,
    START_TIMEOUT_VARIABLE,
    PopdistEnv,
)
from .errors import ConfigError

__all__ = ["PIN_CORES", "LaunchError", "core_share", "launch", "topology"]

#: Environment variable: "0" leaves every instance on all the launcher's cores.
PIN_CORES = "POPART_KIT_PIN_CORES"

_POLL = 0.05
_KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL


class LaunchError(ConfigError):
    """A launch refused before any instance started."""

    rule = "K-launch"


def _check(program: str | Sequence[str], instances: int, replicas: int, ipus: int,
           coordinator: str | None, hosts: Sequence[str], host_index: int,
           fault_timeout: float, start_timeout: float) -> tuple[list[str], str]:
    """Every problem of a launch at once; the program resolved and the coordinator to use."""
    problems = []
    for name, value in (("--num-instances", instances), ("--num-replicas", replicas),
                        ("--ipus-per-replica", ipus)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} {value!r} is not a positive integer")
    counts_ok = not problems
    if counts_ok and replicas % instances:
        problems.append(f"--num-replicas {replicas} is not a multiple of --num-instances "
                        f"{instances}: every instance runs the same number of replicas (use "
                        f"{replicas // instances * instances or instances} or "
                        f"{(replicas // instances + 1) * instances})")
    if hosts and counts_ok and instances % len(hosts):
        problems.append(f"--num-instances {instances} cannot be split evenly over "
                        f"{len(hosts)} hosts ({', '.join(hosts)})")
    if not 0 <= host_index < max(len(hosts), 1):
        problems.append(f"--host-index {host_index} is not one of the {max(len(hosts), 1)} "
                        f"host(s) (0..{max(len(hosts), 1) - 1})")
    if not 0 < fault_timeout <= 3600:
        problems.append(f"--fault-timeout {fault_timeout} is not between 0 and 3600 seconds")
    if not 0 < start_timeout <= 3600:
        problems.append(f"--start-timeout {start_timeout} is not between 0 and 3600 seconds")
    # a command line given as one string is split as a shell splits it (no shell runs it)
    resolved = shlex.split(program) if isinstance(program, str) else list(program)
    if not resolved:
        problems.append("no program given: put it after '--', e.g. -- python3 train.py")
    else:
        found = shutil.which(resolved[0])
        if found is None:
            what = ("is not an executable file" if os.path.exists(resolved[0]) else
                    "does not exist" if os.sep in resolved[0] else "is not on PATH")
            problems.append(f"program {resolved[0]!r} {what}")
    if coordinator is None and len(hosts) > 1:
        problems.append(f"{len(hosts)} hosts need --coordinator HOST:PORT, the address of "
                        f"instance 0 on {hosts[0]} that every host can reach")
    address = coordinator or ""
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(f"--coordinator {coordinator!r} is not HOST:PORT "
                            f"(e.g. 127.0.0.1:29500)")
        elif host_index == 0 and not _port_free(host, int(port)):
            problems.append(f"--coordinator {coordinator}: port {port} on {host} is already in "
                            f"use (another launch still running?); choose another port or leave "
                            f"--coordinator out to pick a free one on this host")
    else:
        address = f"127.0.0.1:{_free_port()}"
    if problems:
        raise LaunchError("popart-kit launch: " + "; ".join(problems) + ".")
    return resolved, address


def _secret(base: Mapping[str, str], secret_file: str | None, hosts: Sequence[str]) -> str:
    """The job's secret: read from ``secret_file``, else ``base``'s, else (one host) a new
    random one. Refuses an unreadable or empty file, and several hosts without a shared one."""
    if secret_file is not None:
        try:
            with open(secret_file, encoding="utf-8") as f:
                found = f.read(4096).strip()
        except (OSError, UnicodeDecodeError) as err:
            raise LaunchError(f"popart-kit launch: --secret-file {secret_file!r} cannot be read "
                              f"({err}).") from None
        if not found:
            raise LaunchError(f"popart-kit launch: --secret-file {secret_file!r} is empty. Fix: "
                              f"write a random value into it, e.g. `python3 -c 'import secrets; "
                              f"print(secrets.token_hex(32))' > {secret_file}`.")
        return found
    if base.get(SECRET):
        return base[SECRET]
    if len(hosts) > 1:
        raise LaunchError(f"popart-kit launch: {len(hosts)} hosts need one job secret shared by "
                          f"every host's launch, so that no other process can join as an "
                          f"instance. Fix: give each host's launch --secret-file FILE with the "
                          f"same content (e.g. from `python3 -c 'import secrets; "
                          f"print(secrets.token_hex(32))'`), or set {SECRET} to the same value "
                          f"on every host.")
    return secrets.token_hex(32)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def topology(num_instances: int, num_replicas: int, ipus_per_replica: int = 1,
             hosts: Sequence[str] = ("localhost",)) -> str:
    """A table like poprun's --print-topology: hosts, instances, replicas and the IPUs of each
    replica (ids within its instance's device)."""
    local = num_replicas // num_instances
    per_host = num_instances // len(hosts)
    k = ipus_per_replica
    ipus = [f"{r % local * k}" if k == 1 else f"{r % local * k}-{r % local * k + k - 1}"
            for r in range(num_replicas)]
    # a replica's cell and its separator: wide enough for its own labels, and together with the
    # other replicas of its host (instance) for the host's name (the instance's number)
    cell = max(max(len(c) for c in [*ipus, str(num_replicas - 1)]) + 3,
               *(-(-(len(h) + 3) // (per_host * local)) for h in hosts),
               -(-(len(str(num_instances - 1)) + 3) // local))
    title = "popart-kit launch topology"
    cell = max(cell, -(-(len(title) + 4 - 11) // num_replicas))  # the title fits too

    def row(label: str, cells: list[str], span: int) -> str:
        return f"| {label:<9} |" + "".join(f"{c:^{span * cell - 1}}|" for c in cells)

    line = "-" * (11 + num_replicas * cell)
    rows = [row("hosts", list(hosts), per_host * local),
            row("instances", [str(i) for i in range(num_instances)], local),
            row("replicas", [str(r) for r in range(num_replicas)], 1),
            row("IPUs", ipus, 1)]
    return "\n".join([f" {line} ", f"|{title:^{len(line)}}|", f"|{line}|",
                      *(f"{r}\n|{line}|" for r in rows[:-1]), rows[-1], f" {line} "])


def _remove_segments(secret: str, coordinator: str) -> None:
    """Unlink the shared-memory segments of the instances' gradient exchange that they left
    (killed before every instance had mapped one; see :mod:`popart_kit._runtime.xla.
    host_exchange`), once none of them runs."""
    from ._runtime.xla.host_exchange import remove_segments, segment_prefix

    remove_segments(segment_prefix(secret, coordinator))


def _forward(stream: IO[bytes], prefix: str, out: IO[str] | None, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        if out is None:
            continue
        with lock:
            out.write(prefix + raw.decode("utf-8", "replace").rstrip("\n") + "\n")
            out.flush()
    stream.close()


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    if status == PEER_FAILED:
        return (f"exit status {status}: another instance of the job stopped or hung, as its "
                f"message above says")
    return f"exit status {status}"


def _first_failure(processes: Mapping[int, subprocess.Popen]) -> tuple[int, int] | None:
    """The first failed instance and its status, by instance order, preferring one that did
    not end because another failed (status PEER_FAILED); None when none failed yet."""
    failed = [(i, p.returncode) for i, p in processes.items() if p.returncode not in (None, 0)]
    return min(failed, key=lambda f: f[1] == PEER_FAILED, default=None)


def _stop(processes: Mapping[int, subprocess.Popen]) -> None:
    """Stop every process still running (its whole process group), and reap them."""
    running = [p for p in processes.values() if p.poll() is None]
    for p in running:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()


def core_share(cores: Sequence[int], count: int, index: int) -> list[int]:
    """The cores instance ``index`` of ``count`` on this host runs on: a contiguous share of
    ``cores`` (the launcher's), the first ``len(cores) % count`` shares one core larger; with
    fewer cores than instances, core ``index % len(cores)``."""
    ordered = sorted(cores)
    if count <= 1 or not ordered:
        return ordered
    if len(ordered) < count:
        return [ordered[index % len(ordered)]]
    size, extra = divmod(len(ordered), count)
    start = index * size + min(index, extra)
    return ordered[start:start + size + (index < extra)]


def _start_instance(cores: Sequence[int] = ()) -> None:
    """In the child before exec: its own process group (so stopping it stops what it started),
    on Linux SIGKILL when the launcher dies, so no instance outlives it, and its share of the
    cores (``cores``; none given: the launcher's)."""
    os.setsid()
    if cores and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_DEATHSIG


def _signal(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(p.pid, sig)


def launch(program: str | Sequence[str], *, num_instances: int, num_replicas: int,
           ipus_per_replica: int = 1, coordinator: str | None = None,
           hosts: Sequence[str] = (), host_index: int = 0,
           fault_timeout: float = FAULT_TIMEOUT, start_timeout: float = START_TIMEOUT,
           secret_file: str | None = None, print_topology: bool = False,
           only_output_from_instance: int | None = None, env: Mapping[str, str] | None = None,
           timeout: float | None = None, out: IO[str] | None = None,
           err: IO[str] | None = None) -> int:
    """Run ``program`` (a list of arguments, or one command line split as a shell splits it:
    ``"python3 train.py --lr 0.1"``) as ``num_instances`` instances sharing ``num_replicas``
    replicas (on this host; with ``hosts``, the instances of host ``host_index``). Returns 0
    when every instance
    succeeded, else the first failing instance's status (128 + signal when it was killed).
    ``timeout`` (seconds) bounds the whole run: instances still running then are stopped and
    the launch fails (status 124, as timeout(1)). The instances wait ``start_timeout`` seconds
    to meet, and an instance that stops or hangs later ends the others within
    ``fault_timeout`` (status 3). Each launch makes a random job secret, which an instance must
    prove to join; several hosts share one: ``secret_file``, or ``POPART_KIT_JOB_SECRET`` set
    alike on each.
    Bad arguments, a missing program, a coordinator port in use or several hosts without a
    shared secret raise LaunchError before anything starts."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    program, address = _check(program, num_instances, num_replicas, ipus_per_replica,
                              coordinator, hosts, host_index, fault_timeout, start_timeout)
    local = num_replicas // num_instances
    per_host = num_instances // max(len(hosts), 1)
    mine = range(host_index * per_host, (host_index + 1) * per_host)
    if print_topology:
        err.write(topology(num_instances, num_replicas, ipus_per_replica,
                           list(hosts) or ["localhost"]) + "\n")
    base = {k: v for k, v in (os.environ if env is None else env).items()
            if k not in PER_PROCESS}  # an enclosing srun/mpirun placed this launcher, not these
    secret = _secret(base, secret_file, hosts)
    joined = tempfile.TemporaryDirectory(prefix="popart-kit-launch-")
    lock = threading.Lock()
    processes: dict[int, subprocess.Popen] = {}
    mine_cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = base.get(PIN_CORES, "1") != "0"
    readers = []
    failed: tuple[int, int] | None = None
    try:
        for i in mine:
            variables = PopdistEnv(num_replicas, local, i * local, ipus_per_replica,
                                   i - mine.start).to_env()
            variables.update({COORDINATOR: address, FAULT_TIMEOUT_VARIABLE:
                              str(max(1, round(fault_timeout))), START_TIMEOUT_VARIABLE:
                              str(max(1, round(start_timeout))), SECRET: secret,
                              JOINED: joined.name, "PYTHONUNBUFFERED": "1"})
            share = core_share(mine_cores, len(mine), i - mine.start) if pin else []
            p = subprocess.Popen(program, env={**base, **variables}, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 preexec_fn=functools.partial(_start_instance, share))
            processes[i] = p
            shown = only_output_from_instance is None or only_output_from_instance == i
            reader = threading.Thread(target=_forward, daemon=True, args=(
                p.stdout, f"[instance {i}] ", out if shown else None, lock))
            reader.start()
            readers.append(reader)
        deadline = 0.0
        end = None if timeout is None else time.monotonic() + timeout
        while [p.poll() for p in processes.values()].count(None):  # poll every one
            if failed is None and end is not None and time.monotonic() > end:
                left = [i for i, p in processes.items() if p.poll() is None]
                failed = (left[0], 124)
                with lock:
                    err.write(f"popart-kit launch: instance(s) {', '.join(map(str, left))} "
                              f"still running after the launch's timeout of {timeout:g} s; "
                              f"stopping them.\n")
                break
            if failed is None:
                failed = _first_failure(processes)
                if failed is not None:
                    deadline = time.monotonic() + fault_timeout
                    with lock:
                        err.write(f"popart-kit launch: instance {failed[0]} (pid "
                                  f"{processes[failed[0]].pid}) failed ({_describe(failed[1])}"
                                  f"); the others stop within {fault_timeout:g} s.\n")
            elif time.monotonic() > deadline:
                left = [i for i, p in processes.items() if p.poll() is None]
                with lock:
                    err.write(f"popart-kit launch: stopping instance(s) "
                              f"{', '.join(map(str, left))}, still running {fault_timeout:g} s "
                              f"after instance {failed[0]} failed.\n")
                break
            time.sleep(_POLL)
        if failed is None:  # every one ended: the first to fail, by instance order
            failed = _first_failure(processes)
        # instances of a distributed session that never came to meet the others (the xla
        # backend marks coming); only meaningful when some did
        marked = {int(n) for n in os.listdir(joined.name) if n.isdigit()}
        missing = [i for i in processes if i not in marked] if marked else []
    finally:
        _stop(processes)
        for reader in readers:
            reader.join(timeout=5)
        joined.cleanup()
        _remove_segments(secret, address)
    if failed is None:
        return 0
    index, status = failed
    with lock:
        if missing and index not in missing:
            err.write(f"popart-kit launch: instance(s) {', '.join(map(str, missing))} never "
                      f"came to meet the others (within {start_timeout:g} s).\n")
        err.write(f"popart-kit launch: instance {index} failed ({_describe(status)}).\n")
        err.flush()
    return 128 - status if status < 0 else status
