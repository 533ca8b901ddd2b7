"""Several instances as one JAX program: ``jax.distributed`` started from the launch environment.

An instance of a distributed session is one process of a JAX multi-process runtime (gloo
collectives on CPU). Which process it is, how many there are and where the coordinator listens
come from the launcher's variables - poprun / ``popart-kit launch``, mpirun, srun, torchrun, a
Kubernetes indexed Job, JAX's own (:mod:`popart_kit._config.cluster`) - and must match the
session's replication (instance = global_offset / local_factor). ``POPART_KIT_COORDINATOR``
(set by ``popart-kit launch``, or by hand) names the coordinator; under Open MPI without it JAX
finds the coordinator itself.

The instances meet at the coordinator's port before JAX starts (:func:`rendezvous`), because
JAX's own wait for a missing instance or an unreachable coordinator aborts the process instead of
raising: an instance that does not come within ``POPART_KIT_START_TIMEOUT`` seconds (default
:data:`START_TIMEOUT`) fails the others' start, and one that does not prove the job's secret
(``POPART_KIT_JOB_SECRET``, an HMAC of instance 0's nonce; the secret is never sent) is refused
while the others wait on. The connections of the meeting stay open as a side channel: each
instance sends a heartbeat over it, and a watchdog thread ends the process with a named
:class:`InstanceFailed` and exit status :data:`PEER_FAILED` when another instance's connection
closes without a goodbye (killed, crashed) or it sends nothing for ``POPART_KIT_FAULT_TIMEOUT``
seconds (hung, stopped, host or network down), before JAX's own timeouts, which abort the
process, are reached.

Where every instance runs on this host (a loopback coordinator) and the job has a secret, the
instances sum their gradients through shared memory (:mod:`.host_exchange`) instead of gloo's
sockets; ``POPART_KIT_INSTANCE_EXCHANGE=gloo`` keeps them on gloo, as across hosts.

:func:`world` reads the environment without JAX; :func:`initialize` starts the runtime.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import os
import secrets
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..._base.problems import warn
from ..._config.cluster import place, popdist_env
from ..._config.popdist import (
    COORDINATOR,
    FAULT_TIMEOUT,
    FAULT_TIMEOUT_VARIABLE,
    IPUS,
    JOINED,
    OFFSET,
    PEER_FAILED,
    SECRET,
    START_TIMEOUT,
    START_TIMEOUT_VARIABLE,
    TOTAL,
)
from ...errors import ConfigError, PopartKitError
from . import host_exchange

__all__ = ["World", "world", "initialize", "rendezvous", "watching", "InstanceFailed"]

_RULE = "K-xla-distributed-env"
_HELLO = "popart-kit-instance"  # a joining instance's greeting: HELLO PROCESSES PROCESS_ID NONCE
_NONCE = 16  # random bytes of each side's nonce
_PATIENCE = 0.5  # seconds: instance 0's longest wait for one greeting or answer, and between
# its checks that the instances that came still wait
_GRACE = 1.0  # seconds a failed collective waits for the watchdog to name the instance
_JAX_SLACK = 30  # seconds JAX's own timeouts (which abort) wait beyond the kit's
#: "gloo" keeps the instances' gradient sum on jax.distributed's collectives on one host too
EXCHANGE_VARIABLE = "POPART_KIT_INSTANCE_EXCHANGE"


class InstanceFailed(PopartKitError):
    """Another instance of a distributed session stopped or never arrived."""

    rule = "K-instance-failed"


@dataclass(frozen=True)
class World:
    """This process's place among the instances, and how to reach the others."""

    processes: int
    process_id: int
    coordinator: str | None  # None: JAX finds it (Open MPI)
    timeout: int  # the fault timeout: seconds without a heartbeat that make an instance failed
    source: str  # where the process id came from, for messages
    start_timeout: int = START_TIMEOUT  # seconds the instances wait to meet
    secret: bytes = dataclasses.field(default=b"", repr=False)  # the job's (b"": none set)


def _seconds(env: Mapping[str, str], name: str, default: int) -> int:
    """The whole number of seconds (1..3600) in variable ``name``, ``default`` when unset."""
    raw = env.get(name)
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= 3600:
        raise ConfigError(f"{name}={raw[:20]!r} is not a whole number of seconds from 1 to "
                          f"3600. Fix: set it to e.g. {default}, or unset it.", rule=_RULE)
    return int(raw)


def _with_job(here: World, env: Mapping[str, str]) -> World:
    """``here`` with the start timeout and the job's secret from ``env``; warns (once per
    process) when no secret is set, as anyone who reaches the coordinator could join."""
    secret = env.get(SECRET, "")
    if not secret and here.coordinator is not None:
        warn(f"{SECRET} is not set: anyone who can reach the coordinator {here.coordinator} can "
             f"join this job as an instance. Fix: start the instances with popart-kit launch "
             f"(which makes a secret), or set {SECRET} to the same random value on every "
             f"instance, e.g. from `python3 -c 'import secrets; print(secrets.token_hex(32))'`.")
    return dataclasses.replace(here, start_timeout=_seconds(env, START_TIMEOUT_VARIABLE,
                                                            START_TIMEOUT),
                               secret=secret.encode())


def world(replication: Any, env: Mapping[str, str] | None = None) -> World:
    """Where this instance stands: its place in the job from any launcher's variables
    (:func:`~popart_kit._config.cluster.place`, ``env`` or ``os.environ``), checked against the
    session's ``replication``. One ConfigError names every disagreement: a launcher's process
    count or index the replication does not match (a process that a launcher says is one of
    several never runs as a lone job), poprun variables that differ from the replication, and
    several instances with no coordinator."""
    env = os.environ if env is None else env
    here = place(env)
    instances, index, local = (replication.instances, replication.instance_index,
                               replication.local_factor)
    shape = f"global_factor={replication.global_replicas} / local_factor={local}"
    if not here.source and instances > 1:
        raise ConfigError(
            f"replication over {instances} instances ({shape}) needs the instances started "
            f"together, but no launcher's variables say this process is one of them and "
            f"{COORDINATOR} is not set. Fix: start the program with `popart-kit launch "
            f"--num-instances {instances} --num-replicas {replication.global_replicas} -- ...`, "
            f"poprun, mpirun, srun or torchrun; on several hosts set {COORDINATOR}=HOST:PORT of "
            f"instance 0.", rule=_RULE)
    problems = []
    if here.processes != instances:
        problems.append(
            f"{here.count_from} processes but the session's replication ({shape}) has "
            f"{instances} instance{'s' if instances > 1 else ''}"
            + (f" - each of the {here.processes} would train alone on its own data"
               if instances == 1 else ""))
    elif here.process_id != index:
        problems.append(
            f"{here.index_from} but the session's global_offset={replication.global_offset} "
            f"makes it instance {index} (offset = instance x local_factor {local}); the offset "
            f"must be {here.process_id * local}")
    if OFFSET in env or TOTAL in env:
        found = popdist_env(env).replication()
        if (found.global_replicas, found.local_factor, found.global_offset) != (
                replication.global_replicas, local, replication.global_offset):
            problems.append(
                f"the environment gives this instance replicas {found.replica_ids.start}.."
                f"{found.replica_ids.stop - 1} of {found.global_replicas} ({found.local_factor} "
                f"local, {OFFSET}={found.global_offset}) but the session's replication has "
                f"global_factor={replication.global_replicas}, local_factor={local}, "
                f"global_offset={replication.global_offset}")
    if here.processes > 1 and here.coordinator is None and not here.jax_finds_coordinator:
        problems.append(f"no coordinator: no address of process 0 from {here.source}, and "
                        f"{COORDINATOR} is not set")
    if problems:
        raise ConfigError(
            "distributed replication: " + "; ".join(problems) + ". Fix: take the replication "
            "from the environment (cfg.with_popdist_env(); under mpirun, srun or torchrun "
            f"export {TOTAL} and {IPUS} for the whole job), or start the instances with "
            f"matching settings; set {COORDINATOR}=HOST:PORT of instance 0 where no launcher "
            "gives it.", rule=_RULE)
    return World(here.processes, here.process_id, here.coordinator,
                 _seconds(env, FAULT_TIMEOUT_VARIABLE, FAULT_TIMEOUT),
                 here.index_from or "the session's replication")


def initialize(replication: Any, env: Mapping[str, str] | None = None) -> World:
    """Start the multi-process runtime for ``replication`` (once per process; a second call
    checks the running one agrees). Must run before JAX starts its devices. Raises
    :class:`InstanceFailed` naming the instances that did not come within the start timeout,
    and ConfigError when instance 0 refuses this one (another job, or not its secret). From
    then on a watchdog ends the process (status :data:`PEER_FAILED`) when another instance
    stops or hangs."""
    import jax

    # no public API says whether JAX has started its devices (checked with JAX 0.10.2)
    from jax._src import xla_bridge

    env = os.environ if env is None else env
    here = world(replication, env)
    if jax.distributed.is_initialized():  # already started (by an earlier session, the user)
        running = (jax.process_count(), jax.process_index())
        if running != (here.processes, here.process_id):
            raise ConfigError(
                f"JAX's distributed runtime already runs as process {running[1]} of "
                f"{running[0]}, but this session is instance {here.process_id} of "
                f"{here.processes}. Fix: give every session of the process the same "
                f"replication.", rule=_RULE)
        return here
    if xla_bridge.backends_are_initialized():
        raise ConfigError(
            "JAX started its devices before this distributed session, so it cannot join the "
            "other instances. Fix: create the distributed session before any other JAX work "
            "(other sessions included) in the process.", rule=_RULE)
    here = _with_job(here, env)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU; GPUs use NCCL
    marks = env.get(JOINED)
    if marks:  # tell popart-kit launch this instance came to meet the others (it names those that
        # never did)
        with contextlib.suppress(OSError):
            open(os.path.join(marks, str(here.process_id)), "w").close()
    bind = None
    if here.coordinator is not None:  # under Open MPI alone JAX finds (and waits for) the others
        local = _local_exchange(here, env)
        if local is not None and here.process_id == 0:  # before the others may look for them
            host_exchange.remove_segments(local.prefix)  # a crashed launch's, same name
        _Watchdog(here, rendezvous(here)).start()
        bind = here.coordinator if _local(here.coordinator) else None
        host_exchange.start(local)
        if local is not None:
            atexit.register(host_exchange.cleanup)
    slack = 2 * here.timeout + _JAX_SLACK  # JAX aborts at its timeouts: the kit speaks first
    try:
        jax.distributed.initialize(
            here.coordinator, here.processes, here.process_id,
            initialization_timeout=here.start_timeout + slack, heartbeat_timeout_seconds=slack,
            shutdown_timeout_seconds=slack, coordinator_bind_address=bind)
    except Exception as err:  # jax raises RuntimeError / XlaRuntimeError, text only
        raise InstanceFailed(
            f"instance {here.process_id} of {here.processes} could not join the others at "
            f"{here.coordinator or 'the Open MPI coordinator'} within {here.start_timeout} s: "
            f"{str(err).splitlines()[0][:300]}. Fix: check every instance started (the "
            f"launcher names any that stopped), that the coordinator port is free, or raise "
            f"{START_TIMEOUT_VARIABLE}.") from None
    return here


def _local_exchange(here: World, env: Mapping[str, str]) -> host_exchange.LocalJob | None:
    """The shared-memory exchange of the instances' gradients (:mod:`.host_exchange`) when
    every instance runs on this host - the coordinator is a loopback address, so none can run
    elsewhere - the job has a secret (the segments' names derive from it) and the host can,
    unless ``POPART_KIT_INSTANCE_EXCHANGE=gloo``; else None (gloo, as across hosts)."""
    choice = env.get(EXCHANGE_VARIABLE, "auto")
    if choice not in ("auto", "gloo"):
        raise ConfigError(f"{EXCHANGE_VARIABLE}={choice[:20]!r} is not 'auto' (shared memory "
                          f"between the instances of one host where possible) or 'gloo' "
                          f"(jax.distributed's collectives always). Fix: set one of them, or "
                          f"unset it.", rule=_RULE)
    if choice == "gloo" or not here.secret or not _local(here.coordinator or "") \
            or host_exchange.available():
        return None
    return host_exchange.LocalJob(
        here.processes, here.process_id,
        host_exchange.segment_prefix(here.secret, here.coordinator or ""),
        patience=here.start_timeout + 2 * here.timeout + _JAX_SLACK)


class _Peer(NamedTuple):
    """Another instance as this one sees it after the meeting."""

    conn: socket.socket  # the meeting's connection, kept as the side channel
    host: str  # its address, for messages
    proof: str  # instance 0's side: the proof of the secret its "go" carries


def rendezvous(here: World) -> dict[int, _Peer]:
    """Wait until every instance reached the coordinator, at most ``here.start_timeout``
    seconds, so that JAX (whose own wait aborts the process) starts only when all are there.
    Instance 0 listens at the coordinator's port, challenges each instance that comes to prove
    the job's secret (HMAC-SHA256 of both nonces; the secret is never sent) and answers them
    once all came, proving it too. Returns the other instances' open connections (instance 0:
    all others; the others: instance 0). Raises :class:`InstanceFailed` naming the instances
    that did not come (or instance 0, when it cannot be reached), and ConfigError when
    instance 0 cannot listen there or refuses this instance. Instance 0 refuses, names (a
    PopartKitWarning) and keeps waiting past an instance without the secret or of another
    launch, and ignores connections that do not speak the protocol. ``here`` must name the
    coordinator."""
    host, _, port = here.coordinator.rpartition(":")
    if here.process_id == 0:
        return _gather(here, host, int(port))
    return {0: _join(here, host, int(port))}


def _mac(secret: bytes, *words: str) -> str:
    return hmac.new(secret, " ".join(words).encode(), hashlib.sha256).hexdigest()


def _gather(here: World, host: str, port: int) -> dict[int, _Peer]:
    """Instance 0's side: wait for the others and tell them all to go, or who never came."""
    deadline = time.monotonic() + here.start_timeout
    try:
        server = _listen(host, port)
    except OSError as err:
        raise ConfigError(
            f"instance 0 of {here.processes} cannot listen at the coordinator {COORDINATOR}="
            f"{here.coordinator} ({err.strerror or err}). Fix: give an address of instance 0's "
            f"host and a free port, e.g. 127.0.0.1:29500 on one host.", rule=_RULE) from None
    joined: dict[int, _Peer] = {}
    try:
        with server:
            while True:
                for gone in [i for i, peer in joined.items() if _closed(peer.conn)]:
                    joined.pop(gone).conn.close()  # it stopped while waiting: it must come again
                left = deadline - time.monotonic()
                if len(joined) == here.processes - 1 or left <= 0:
                    break
                server.settimeout(min(left, _PATIENCE))
                with contextlib.suppress(TimeoutError):
                    _admit(*server.accept(), here, joined)
        missing = [i for i in range(1, here.processes) if i not in joined]
        for peer in joined.values():
            with contextlib.suppress(OSError):
                peer.conn.settimeout(_PATIENCE)
                reply = "missing " + ",".join(map(str, missing)) if missing else "go " + peer.proof
                peer.conn.sendall(reply.encode() + b"\n")
    except BaseException:
        _close(joined)
        raise
    if missing:
        _close(joined)
        raise InstanceFailed(_never_came(here, missing))
    return joined


def _close(peers: Mapping[int, _Peer]) -> None:
    for peer in peers.values():
        peer.conn.close()


def _admit(conn: socket.socket, address: Any, here: World, joined: dict[int, _Peer]) -> None:
    """Take a joining instance that proves the job's secret into ``joined``; refuse one that
    does not, or does not belong to this launch, naming its ``address``; close anything that
    does not speak the protocol."""
    try:
        hello = _line(conn, _PATIENCE).split()
        if (len(hello) != 4 or hello[0] != _HELLO or not all(w.isdigit() for w in hello[1:3])
                or len(hello[3]) != 2 * _NONCE):
            conn.close()
            return
        nonce = secrets.token_hex(_NONCE)
        conn.sendall(f"challenge {nonce}\n".encode())
        proof = _line(conn, _PATIENCE).removeprefix("proof ")
    except OSError:
        conn.close()
        return
    processes, process_id = int(hello[1]), int(hello[2])
    problem = (f"it did not prove the job's secret ({SECRET} differs, or is set on only one of "
               f"them)" if not hmac.compare_digest(proof, _mac(here.secret, "join", *hello[1:],
                                                                nonce)) else
               f"it is one of {processes} instances, instance 0 one of {here.processes}"
               if processes != here.processes else
               f"its index {process_id} is not one of 1..{here.processes - 1}"
               if not 0 < process_id < here.processes else
               f"instance {process_id} already came" if process_id in joined else None)
    if problem is None:
        joined[process_id] = _Peer(conn, address[0], _mac(here.secret, "go", hello[3], nonce))
        return
    warn(f"instance 0 of {here.processes} at the coordinator {here.coordinator} refused a "
         f"connection from {address[0]}:{address[1]} as instance {process_id} of {processes}: "
         f"{problem}; the instances wait on for the real one.")
    with contextlib.suppress(OSError), conn:
        conn.sendall(f"refused {problem}\n".encode())


def _join(here: World, host: str, port: int) -> _Peer:
    """Another instance's side: reach instance 0, prove the job's secret and wait for its
    answer, which must prove the secret too."""
    deadline = time.monotonic() + here.start_timeout
    conn = _connect(host, port, deadline)
    if conn is None:
        raise InstanceFailed(_never_came(here, [0]))
    nonce, reply = secrets.token_hex(_NONCE), ""
    words = (str(here.processes), str(here.process_id), nonce)
    try:
        conn.sendall(f"{_HELLO} {' '.join(words)}\n".encode())
        challenge = _line(conn, here.start_timeout + 1).removeprefix("challenge ")
        conn.sendall(f"proof {_mac(here.secret, 'join', *words, challenge)}\n".encode())
        reply = _line(conn, here.start_timeout + 1)  # instance 0 answers by its own deadline
    except OSError:
        pass
    if reply.startswith("go ") and hmac.compare_digest(
            reply[3:], _mac(here.secret, "go", nonce, challenge)):
        return _Peer(conn, host, "")
    conn.close()
    missing = reply[8:].split(",") if reply.startswith("missing ") else []
    if missing and all(i.isdigit() for i in missing):
        raise InstanceFailed(_never_came(here, [int(i) for i in missing]))
    if reply.startswith("refused "):
        raise ConfigError(
            f"instance {here.process_id} of {here.processes}: instance 0 at the coordinator "
            f"{here.coordinator} refused it: {reply[8:]}. Fix: start every instance of one "
            f"launch with the same replication and job secret ({SECRET}; popart-kit launch "
            f"--secret-file FILE on each host), and other launches at another coordinator "
            f"port.", rule=_RULE)
    raise InstanceFailed(
        f"instance {here.process_id} of {here.processes}: the coordinator {here.coordinator} "
        f"stopped, did not answer as popart-kit instance 0 within {here.start_timeout} s, or "
        f"did not prove the job's secret ({SECRET}) (answer {reply[:40]!r}). Fix: see instance "
        f"0's output, and check {COORDINATOR} is instance 0's address on every instance.")


def _never_came(here: World, missing: list[int]) -> str:
    who = "instance" if len(missing) == 1 else "instances"
    return (f"{who} {', '.join(map(str, missing))} of {here.processes} never came to meet "
            f"instance {here.process_id} at the coordinator {here.coordinator} within the start "
            f"timeout of {here.start_timeout} s. Fix: start every instance (popart-kit launch "
            f"--num-instances {here.processes} starts them all) with the same {COORDINATOR}="
            f"{here.coordinator}, instance 0's address, or raise {START_TIMEOUT_VARIABLE}.")


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
    """One short text line from ``conn`` (what came before end of stream, if it ended); what
    follows the line stays unread (instance 0's first heartbeat may follow its answer)."""
    conn.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n") and len(data) < 200:
        ahead = conn.recv(200 - len(data), socket.MSG_PEEK)
        if not ahead:
            break
        end = ahead.find(b"\n")
        data += conn.recv(end + 1 if end >= 0 else len(ahead))
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


class _Watchdog:
    """Heartbeats over the meeting's connections to the other instances (instance 0: all
    others; the others: instance 0), and the end of this process, with a named
    :class:`InstanceFailed` on stderr and exit status :data:`PEER_FAILED`, when one's
    connection closes without a goodbye, it sends nothing for the fault timeout, or it reports
    a failure. Instance 0 passes what it saw on to the others. At a normal exit it says
    goodbye; at an exit by an uncaught exception it reports it and ends at once, as JAX's
    shutdown would wait for (and then abort at) the instances still running."""

    current: _Watchdog | None = None

    def __init__(self, here: World, peers: dict[int, _Peer]) -> None:
        self.here, self.peers = here, peers
        self.beat = min(1.0, here.timeout / 5)
        self.ending = threading.Lock()
        self.leaving = False

    def start(self) -> None:
        for peer in self.peers.values():
            peer.conn.setblocking(False)
        _Watchdog.current = self
        atexit.register(self.leave)
        threading.Thread(target=self.watch, name="popart-kit-watchdog", daemon=True).start()

    def watch(self) -> None:
        heard = dict.fromkeys(self.peers, time.monotonic())
        pending = dict.fromkeys(self.peers, b"")
        while self.peers and not self.leaving:
            self.send(b"beat\n")
            ready, _, _ = select.select([p.conn for p in self.peers.values()], [], [], self.beat)
            for i, peer in list(self.peers.items()):
                if peer.conn in ready:
                    heard[i] = time.monotonic()
                    pending[i] = self.read(i, pending[i])
                elif time.monotonic() - heard[i] > self.here.timeout and not self.leaving:
                    self.end(f"{self.who(i)} sent no heartbeat for {self.here.timeout} s "
                             f"({FAULT_TIMEOUT_VARIABLE}): it hangs or was stopped, or its host "
                             f"or the network is down")

    def read(self, i: int, pending: bytes) -> bytes:
        """Take what instance ``i`` sent; the part of a line still to come."""
        try:
            data = self.peers[i].conn.recv(4096)
        except BlockingIOError:
            return pending
        except OSError:
            data = b""
        if not data and not self.leaving:
            self.end(f"{self.who(i)} stopped: its connection closed without a goodbye (it was "
                     f"killed or crashed)")
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            text = line.decode("utf-8", "replace")
            if text == "bye":  # it ended normally: no more heartbeats
                self.peers.pop(i).conn.close()
                return b""
            if text.startswith("failed ") and not self.leaving:
                self.end(f"{self.who(i)} reports: {text[7:]}")
        return pending[-4096:]

    def who(self, i: int) -> str:
        return f"instance {i} of {self.here.processes} (on {self.peers[i].host})"

    def send(self, message: bytes) -> None:
        for peer in list(self.peers.values()):
            with contextlib.suppress(OSError):  # a full buffer (it hangs) or closed: seen later
                peer.conn.send(message, socket.MSG_DONTWAIT)

    def end(self, seen: str) -> None:
        """Name what was seen on stderr, pass it on to the others, and end the process."""
        with self.ending:
            failure = InstanceFailed(
                f"instance {self.here.process_id} of {self.here.processes}: {seen}. This "
                f"instance ends (exit status {PEER_FAILED}). Fix: see that instance's output "
                f"(popart-kit launch names it); an instance busy for longer than "
                f"{FAULT_TIMEOUT_VARIABLE}={self.here.timeout} s without Python getting a turn "
                f"needs a larger one.")
            self.send(f"failed {seen}\n".encode("utf-8", "replace"))
            _exit(f"{type(failure).__module__}.{type(failure).__name__}: {failure}", PEER_FAILED)

    def settle(self, err: BaseException) -> None:
        """A collective failed (``err``): give the watchdog a moment to name the instance, else
        end with what the collective saw."""
        time.sleep(_GRACE)
        self.end(f"the other instances cannot be reached, so an instance stopped "
                 f"({str(err).splitlines()[0][:300]})")

    def leave(self) -> None:
        """At exit: goodbye, or, after an uncaught exception, report it and end now."""
        self.leaving = True
        error = getattr(sys, "last_value", None)
        if error is None:
            self.send(b"bye\n")
            return
        self.send(f"failed instance {self.here.process_id} ended by {type(error).__name__}: "
                  f"{str(error)[:300]}\n".encode("utf-8", "replace"))
        _exit("", 1)


def _exit(message: str, status: int) -> None:
    """Write ``message`` to stderr and end the process now, past JAX's shutdown (which waits
    for the other instances and aborts when they do not come)."""
    with contextlib.suppress(Exception):
        host_exchange.cleanup()  # os._exit runs no atexit
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        if message:
            sys.stderr.write(message + "\n")
        sys.stderr.flush()
    os._exit(status)


def peer_failure(err: BaseException, processes: int, process_id: int) -> InstanceFailed | None:
    """A collective that failed because another instance went away, as the kit's error (None
    for any other error)."""
    text = str(err)
    if not any(w in text.lower() for w in ("gloo", "coordination", "connection closed",
                                           "popart-kit exchange")):
        return None
    return InstanceFailed(
        f"instance {process_id} of {processes}: a collective with the other instances failed, "
        f"so an instance stopped ({text.splitlines()[0][:300]}). Fix: see the failing "
        f"instance's output (popart-kit launch names it).")


@contextmanager
def watching(processes: int, process_id: int) -> Iterator[None]:
    """Turn a collective failed by a stopped instance into :class:`InstanceFailed`: the end of
    the process by the watchdog (which names the instance) when one runs, else raised."""
    try:
        yield
    except Exception as err:
        failure = peer_failure(err, processes, process_id) if processes > 1 else None
        if failure is None:
            raise
        if _Watchdog.current is not None:
            _Watchdog.current.settle(err)
        raise failure from err
