"""Several instances as one JAX program: ``jax.distributed`` started from the launch environment.

An instance of a distributed session is one process of a JAX multi-process runtime (gloo
collectives on CPU). Which process it is, how many there are and where the coordinator listens
come from, in order: Open MPI's ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_RANK`` (mpirun,
poprun), else the session's replication (instance = global_offset / local_factor) with the
coordinator in ``POPART_KIT_COORDINATOR`` (set by ``popart-kit launch``, or by hand for several
hosts). Under Open MPI without ``POPART_KIT_COORDINATOR`` JAX finds the coordinator itself.

Failures are bounded by ``POPART_KIT_FAULT_TIMEOUT`` seconds (default :data:`FAULT_TIMEOUT`):
an instance that never arrives fails the others' start after it, and one that stops sending
heartbeats is detected after it (collectives with a closed peer fail at once). The instances meet
at the coordinator's port before JAX starts (:func:`rendezvous`), because JAX's own wait for a
missing instance or an unreachable coordinator aborts the process instead of raising.

:func:`world` reads the environment without JAX; :func:`initialize` starts the runtime.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, PopartKitError
from ..._config.popdist import COORDINATOR, FAULT_TIMEOUT_VARIABLE, JOINED

__all__ = ["COORDINATOR", "FAULT_TIMEOUT", "FAULT_TIMEOUT_VARIABLE", "World", "world",
           "initialize", "rendezvous", "watching", "InstanceFailed"]

FAULT_TIMEOUT = 30  # seconds, as the launcher's default
OMPI_SIZE, OMPI_RANK, OMPI_URI = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                                  "OMPI_MCA_orte_hnp_uri")
_RULE = "K-xla-distributed-env"
_HELLO = "popart-kit-instance"  # a joining instance's greeting: HELLO PROCESSES PROCESS_ID
_PATIENCE = 0.5  # seconds: instance 0's longest wait for one greeting or answer, and between
# its checks that the instances that came still wait


class InstanceFailed(PopartKitError):
    """Another instance of a distributed session stopped or never arrived."""

    rule = "K-instance-failed"


@dataclass(frozen=True)
class World:
    """This process's place among the instances, and how to reach the others."""

    processes: int
    process_id: int
    coordinator: str | None  # None: JAX finds it (Open MPI)
    timeout: int
    source: str  # where the process id came from, for messages


def _timeout(env: Mapping[str, str]) -> int:
    raw = env.get(FAULT_TIMEOUT_VARIABLE)
    if raw is None:
        return FAULT_TIMEOUT
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= 3600:
        raise ConfigError(f"{FAULT_TIMEOUT_VARIABLE}={raw[:20]!r} is not a whole number of "
                          f"seconds from 1 to 3600. Fix: set it to e.g. {FAULT_TIMEOUT}, or unset "
                          f"it.", rule=_RULE)
    return int(raw)


def world(replication: Any, env: Mapping[str, str] | None = None) -> World:
    """Where this instance stands, from ``env`` (``os.environ``) and the session's
    ``replication``; every disagreement between them is reported in one ConfigError."""
    env = os.environ if env is None else env
    instances, index = replication.instances, replication.instance_index
    coordinator = env.get(COORDINATOR) or None
    problems = []
    if OMPI_SIZE in env or OMPI_RANK in env:
        size, rank = env.get(OMPI_SIZE, ""), env.get(OMPI_RANK, "")
        if not (size.isascii() and size.isdigit() and rank.isascii() and rank.isdigit()):
            raise ConfigError(f"Open MPI environment {OMPI_SIZE}={size[:20]!r}, {OMPI_RANK}="
                              f"{rank[:20]!r} is not two integers. Fix: start the program with "
                              f"mpirun, or unset them.", rule=_RULE)
        processes, process_id, source = int(size), int(rank), f"{OMPI_RANK}={rank}"
        if processes != instances:
            problems.append(f"{OMPI_SIZE}={size} processes but the session's replication "
                            f"(global_factor={replication.global_replicas} / local_factor="
                            f"{replication.local_factor}) has {instances} instances")
        elif process_id != index:
            problems.append(f"{OMPI_RANK}={rank} but the session's global_offset="
                            f"{replication.global_offset} makes it instance {index} (offset = "
                            f"instance x local_factor {replication.local_factor}); the offset "
                            f"must be {process_id * replication.local_factor}")
        if coordinator is None and OMPI_URI not in env:
            problems.append(f"no coordinator: neither {COORDINATOR} nor Open MPI's {OMPI_URI} "
                            f"is set")
    elif coordinator is None:
        raise ConfigError(
            f"replication over {instances} instances (global_factor="
            f"{replication.global_replicas}, local_factor={replication.local_factor}) needs the "
            f"instances started together, but {COORDINATOR} is not set and this is not an Open "
            f"MPI process. Fix: start the program with `popart-kit launch --num-instances "
            f"{instances} --num-replicas {replication.global_replicas} -- ...` or mpirun; on "
            f"several hosts set {COORDINATOR}=HOST:PORT of instance 0.", rule=_RULE)
    else:
        processes, process_id, source = instances, index, "the session's global_offset"
    from ..._config.popdist import OFFSET, TOTAL, PopdistEnv

    if OFFSET in env or TOTAL in env:
        found = PopdistEnv.read(env).replication()
        if (found.global_replicas, found.local_factor, found.global_offset) != (
                replication.global_replicas, replication.local_factor,
                replication.global_offset):
            problems.append(
                f"the environment gives this instance replicas {found.replica_ids.start}.."
                f"{found.replica_ids.stop - 1} of {found.global_replicas} ({found.local_factor} "
                f"local, {OFFSET}={found.global_offset}) but the session's replication has "
                f"global_factor={replication.global_replicas}, local_factor="
                f"{replication.local_factor}, global_offset={replication.global_offset}")
    if problems:
        raise ConfigError("distributed replication: " + "; ".join(problems) + ". Fix: take the "
                          "replication from the environment (cfg.with_popdist_env()), or start "
                          "the instances with matching settings.", rule=_RULE)
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{COORDINATOR}={coordinator[:80]!r} is not HOST:PORT. Fix: give "
                              f"instance 0's address and a free port, e.g. 127.0.0.1:29500.",
                              rule=_RULE)
    return World(processes, process_id, coordinator, _timeout(env), source)


def initialize(replication: Any, env: Mapping[str, str] | None = None) -> World:
    """Start the multi-process runtime for ``replication`` (once per process; a second call
    checks the running one agrees). Must run before JAX starts its devices. Raises
    :class:`InstanceFailed` naming the instances that did not come within the fault timeout."""
    import jax
    from jax._src import distributed, xla_bridge

    here = world(replication, env)
    state = distributed.global_state
    if state.client is not None:  # already started (by an earlier session, or the user)
        if (state.num_processes, state.process_id) != (here.processes, here.process_id):
            raise ConfigError(
                f"JAX's distributed runtime already runs as process {state.process_id} of "
                f"{state.num_processes}, but this session is instance {here.process_id} of "
                f"{here.processes}. Fix: give every session of the process the same "
                f"replication.", rule=_RULE)
        return here
    if xla_bridge.backends_are_initialized():
        raise ConfigError(
            "JAX started its devices before this distributed session, so it cannot join the "
            "other instances. Fix: create the distributed session before any other JAX work "
            "(other sessions included) in the process.", rule=_RULE)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU; GPUs use NCCL
    marks = (os.environ if env is None else env).get(JOINED)
    if marks:  # tell popart-kit launch this instance came to meet the others (it names those that
        # never did)
        with contextlib.suppress(OSError):
            open(os.path.join(marks, str(here.process_id)), "w").close()
    bind = None
    if here.coordinator is not None:  # under Open MPI alone JAX finds (and waits for) the others
        rendezvous(here)
        bind = here.coordinator if _local(here.coordinator) else None
    try:
        jax.distributed.initialize(
            here.coordinator, here.processes, here.process_id,
            initialization_timeout=here.timeout, heartbeat_timeout_seconds=here.timeout,
            shutdown_timeout_seconds=here.timeout, coordinator_bind_address=bind)
    except Exception as err:  # jax raises RuntimeError / XlaRuntimeError, text only
        raise InstanceFailed(
            f"instance {here.process_id} of {here.processes} could not join the others at "
            f"{here.coordinator or 'the Open MPI coordinator'} within {here.timeout} s: "
            f"{str(err).splitlines()[0][:300]}. Fix: check every instance started (the "
            f"launcher names any that stopped), that the coordinator port is free, or raise "
            f"{FAULT_TIMEOUT_VARIABLE}.") from None
    return here


def rendezvous(here: World) -> None:
    """Wait until every instance reached the coordinator, at most ``here.timeout`` seconds, so
    that JAX (whose own wait aborts the process) starts only when all are there. Instance 0
    listens at the coordinator's port and answers the others once all came; raises
    :class:`InstanceFailed` naming the instances that did not come (or instance 0, when it
    cannot be reached), and ConfigError when instance 0 cannot listen there or refuses a
    joining instance of another launch. ``here`` must name the coordinator."""
    host, _, port = here.coordinator.rpartition(":")
    if here.process_id == 0:
        _gather(here, host, int(port))
    else:
        _join(here, host, int(port))


def _gather(here: World, host: str, port: int) -> None:
    """Instance 0's side: wait for the others and tell them all to go, or who never came."""
    deadline = time.monotonic() + here.timeout
    try:
        server = _listen(host, port)
    except OSError as err:
        raise ConfigError(
            f"instance 0 of {here.processes} cannot listen at the coordinator {COORDINATOR}="
            f"{here.coordinator} ({err.strerror or err}). Fix: give an address of instance 0's "
            f"host and a free port, e.g. 127.0.0.1:29500 on one host.", rule=_RULE) from None
    joined: dict[int, socket.socket] = {}
    try:
        with server:
            while True:
                for gone in [i for i, conn in joined.items() if _closed(conn)]:
                    joined.pop(gone).close()  # it stopped while waiting: it must come again
                left = deadline - time.monotonic()
                if len(joined) == here.processes - 1 or left <= 0:
                    break
                server.settimeout(min(left, _PATIENCE))
                with contextlib.suppress(TimeoutError):
                    _admit(server.accept()[0], here, joined)
        missing = [i for i in range(1, here.processes) if i not in joined]
        reply = "missing " + ",".join(map(str, missing)) if missing else "go"
        for conn in joined.values():
            with contextlib.suppress(OSError):
                conn.settimeout(_PATIENCE)
                conn.sendall(reply.encode() + b"\n")
    finally:
        for conn in joined.values():
            conn.close()
    if missing:
        raise InstanceFailed(_never_came(here, missing))


def _admit(conn: socket.socket, here: World, joined: dict[int, socket.socket]) -> None:
    """Take a joining instance's greeting into ``joined``; refuse (and close) one that does not
    belong to this launch, ignore anything that is not a greeting."""
    try:
        words = _line(conn, _PATIENCE).split()
    except OSError:
        words = []
    if len(words) != 3 or words[0] != _HELLO or not all(w.isdigit() for w in words[1:]):
        conn.close()
        return
    processes, process_id = int(words[1]), int(words[2])
    problem = (f"it is one of {processes} instances, instance 0 one of {here.processes}"
               if processes != here.processes else
               f"its index {process_id} is not one of 1..{here.processes - 1}"
               if not 0 < process_id < here.processes else
               f"instance {process_id} already came" if process_id in joined else None)
    if problem is None:
        joined[process_id] = conn
        return
    with contextlib.suppress(OSError), conn:
        conn.sendall(f"refused {problem}\n".encode())


def _join(here: World, host: str, port: int) -> None:
    """Another instance's side: reach instance 0, greet it and wait for its answer."""
    deadline = time.monotonic() + here.timeout
    conn = _connect(host, port, deadline)
    if conn is None:
        raise InstanceFailed(_never_came(here, [0]))
    with conn:
        try:
            conn.sendall(f"{_HELLO} {here.processes} {here.process_id}\n".encode())
            reply = _line(conn, here.timeout + 1)  # instance 0 answers by its own deadline
        except OSError:
            reply = ""
    if reply == "go":
        return
    missing = reply[8:].split(",") if reply.startswith("missing ") else []
    if missing and all(i.isdigit() for i in missing):
        raise InstanceFailed(_never_came(here, [int(i) for i in missing]))
    if reply.startswith("refused "):
        raise ConfigError(
            f"instance {here.process_id} of {here.processes}: instance 0 at the coordinator "
            f"{here.coordinator} refused it: {reply[8:]}. Fix: start every instance of one "
            f"launch with the same replication and a different coordinator port than other "
            f"launches.", rule=_RULE)
    raise InstanceFailed(
        f"instance {here.process_id} of {here.processes}: the coordinator {here.coordinator} "
        f"stopped or did not answer as popart-kit instance 0 within {here.timeout} s "
        f"(answer {reply[:40]!r}). Fix: see instance 0's output, and check {COORDINATOR} is "
        f"instance 0's address on every instance.")


def _never_came(here: World, missing: list[int]) -> str:
    who = "instance" if len(missing) == 1 else "instances"
    return (f"{who} {', '.join(map(str, missing))} of {here.processes} never came to meet "
            f"instance {here.process_id} at the coordinator {here.coordinator} within the fault "
            f"timeout of {here.timeout} s. Fix: start every instance (popart-kit launch "
            f"--num-instances {here.processes} starts them all) with the same {COORDINATOR}="
            f"{here.coordinator}, instance 0's address, or raise {FAULT_TIMEOUT_VARIABLE}.")


def _local(address: str) -> bool:
    """Whether the coordinator ``address`` (HOST:PORT) is a loopback address."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening at ``port``: on ``host`` when it is loopback, else on every
    interface, as JAX's coordinator does."""
    if _local(f"{host}:{port}"):
        family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), port,
                                                      type=socket.SOCK_STREAM)[0]
        return socket.create_server(address[:2], family=family)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _connect(host: str, port: int, deadline: float) -> socket.socket | None:
    """A connection to ``host:port``, tried until ``deadline`` (None if nothing answered)."""
    while (left := deadline - time.monotonic()) > 0:
        try:
            return socket.create_connection((host.strip("[]"), port), timeout=min(left, 2))
        except OSError:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    return None


def _line(conn: socket.socket, timeout: float) -> str:
    """One short text line from ``conn`` (what came before end of stream, if it ended)."""
    conn.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n") and len(data) < 200:
        chunk = conn.recv(200 - len(data))
        if not chunk:
            break
        data += chunk
    return data.decode("ascii", "replace").strip()


def _closed(conn: socket.socket) -> bool:
    """Whether the other end of ``conn`` went away."""
    conn.settimeout(0)  # look, do not wait
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def peer_failure(err: BaseException, processes: int, process_id: int) -> InstanceFailed | None:
    """A collective that failed because another instance went away, as the kit's error (None
    for any other error)."""
    text = str(err)
    if not any(w in text.lower() for w in ("gloo", "coordination", "connection closed")):
        return None
    return InstanceFailed(
        f"instance {process_id} of {processes}: a collective with the other instances failed, "
        f"so an instance stopped ({text.splitlines()[0][:300]}). Fix: see the failing "
        f"instance's output (popart-kit launch names it).")


@contextmanager
def watching(processes: int, process_id: int) -> Iterator[None]:
    """Turn a collective failed by a stopped instance into :class:`InstanceFailed`."""
    try:
        yield
    except Exception as err:
        failure = peer_failure(err, processes, process_id) if processes > 1 else None
        if failure is None:
            raise
        raise failure from err
