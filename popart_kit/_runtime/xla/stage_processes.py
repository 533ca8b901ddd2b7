"""Pipeline stages in worker processes of their own: stages that really run side by side on CPU.

XLA:CPU gives every virtual CPU device of a process one shared pool of intra-op threads, and a
program spreads its operations over the whole pool: two stages on two virtual devices of one
process share the same threads, and an unpipelined run already uses every core. A stage can
only have threads of its own in a process of its own. With ``pipeline_workers="processes"``
each stage runs in a worker process with one CPU device and :attr:`StageProcesses.threads`
threads (``PJRT_NPROC``; default: the cores divided among the stages, at least 1), as an IPU
runs its stage with its own tiles.

**Protocol.** The session's process starts the K workers once (``python -P -m`` this module:
nothing of the user's script is imported again, and neither the working directory nor a
script's is on their ``sys.path``; they import this package from where the session's process
did) with socket pairs to it and between neighbouring stages. Each worker is sent the model and
its stage's :class:`~.stages.StageSpec`, builds its stage's part of the graph and its programs
from them (nothing else of the session) and keeps them. A run sends each worker its stage's
stream inputs and hyperparameters, and its part of the committed state when it holds another;
the workers run the schedule's actions of their stage (a :class:`~.stages.StageRunner`),
sending activations forward and gradients backward (a sender thread per link, so a send never
blocks a stage), and return what they kept, their new state and their trace. The session's
process checks and commits as for threads, so a run stays atomic.

**Failure.** A worker that fails reports its error; a worker that dies or falls silent past
the deadline is named. Either way every worker is stopped (the next run starts new ones) and
the run raises without changing the session, so a failed stage never leaves the others
waiting. Workers ignore SIGINT: a terminal's Ctrl-C reaches the session's process, whose
KeyboardInterrupt, in a run or while the workers start, stops them the same way.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import PopartKitError
from .stages import Board

__all__ = ["StageProcesses", "WorkerDevice", "default_threads"]

#: Seconds a worker may take to start (import JAX, build its stage) before it is named.
START_SECONDS = 120.0
#: Socket buffer asked for each link between processes.
LINK_BUFFER_BYTES = 8 << 20
#: Seconds a run may go without any worker answering before the workers are stopped.
SILENCE_SECONDS = 600.0
#: A worker that reports a broken link is given this long to see its dead neighbour reaped,
#: so the error names the stage that died rather than the one that noticed.
LINK_DEATH_SECONDS = 2.0


class StageWorkerError(PopartKitError, RuntimeError):
    """A pipeline stage's worker process failed, died or fell silent; nothing was applied
    (also a RuntimeError: the input was fine, the run was not)."""

    rule = "K-stage-worker"


class WorkerDevice(NamedTuple):
    """Where a stage runs with ``pipeline_workers="processes"``."""

    stage: int
    pid: int
    device: str
    threads: int

    def __str__(self) -> str:
        return f"stage {self.stage}: process {self.pid}, {self.device}, {self.threads} thread(s)"


def default_threads(stages: int) -> int:
    """The cores divided among the stages, at least one each."""
    return max(1, len(os.sched_getaffinity(0)) // stages)


class _Link:
    """One end of a socket pair carrying pickled messages whose arrays travel out of band
    (pickle protocol 5): each array crosses as its raw bytes, received straight into the
    buffer the unpickled array then uses. ``threaded``: sends go through a thread of their
    own, so a stage never waits for its neighbour to read."""

    def __init__(self, sock: socket.socket, threaded: bool = False) -> None:
        self.sock = sock
        self._out: queue.Queue[Any] | None = None
        self._sender: threading.Thread | None = None
        if threaded:
            self._out = queue.Queue()
            self._sender = threading.Thread(target=self._send_all, daemon=True)
            self._sender.start()

    def _send_all(self) -> None:
        assert self._out is not None
        while (message := self._out.get()) is not _CLOSE:
            try:
                self._send_now(message)
            except OSError:
                return

    def _send_now(self, message: Any) -> None:
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        self.sock.sendall(struct.pack(f"<QQ{len(raws)}Q", len(head), len(raws),
                                      *(r.nbytes for r in raws)) + head)
        for raw in raws:
            self.sock.sendall(raw)

    def send(self, message: Any) -> None:
        if self._out is not None:
            self._out.put(message)
        else:
            self._send_now(message)

    def recv(self) -> Any:
        size, count = struct.unpack("<QQ", self._read(16))
        sizes = struct.unpack(f"<{count}Q", self._read(8 * count)) if count else ()
        head = self._read(size)
        return pickle.loads(head, buffers=[self._read(n) for n in sizes])

    def _read(self, n: int) -> bytearray:
        out = bytearray(n)
        view, got = memoryview(out), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise EOFError("the other end closed its link")
            got += k
        return out

    def poll(self, seconds: float) -> bool:
        return bool(select.select([self.sock], [], [], seconds)[0])

    def close(self) -> None:
        if self._out is not None:
            self._out.put(_CLOSE)
            self._sender.join(5)  # type: ignore[union-attr]
        self.sock.close()


_CLOSE = object()


class StageProcesses:
    """K worker processes, one per stage, started once and reused by every run. ``threads``:
    XLA threads per worker; ``pin``: keep each worker to cores of its own where the cores
    suffice (set both before the workers start)."""

    def __init__(self, spec: Callable[[], dict[str, Any]], stages: int,
                 threads: int | None = None,
                 serve: Callable[[int, Any], Any] | None = None) -> None:
        self.spec, self.stages, self.serve = spec, stages, serve
        self._closing = threading.Lock()
        self.threads = threads if threads is not None else default_threads(stages)
        self.pin = False
        self._procs: list[subprocess.Popen[bytes]] = []
        self._links: list[_Link] = []
        self.devices: list[WorkerDevice] = []
        self._closer = weakref.finalize(self, _stop, self._procs, self._links)

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> bool:
        """Start the workers, unless they run; whether it started them (new workers hold no
        weights yet). An exception (KeyboardInterrupt included) while they start stops them,
        so the next start begins afresh."""
        if self._procs:
            return False
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return True

    def _start(self) -> None:
        pairs = [_socket_pair() for _ in range(self.stages)]  # session <-> stage
        chain = [_socket_pair() for _ in range(self.stages - 1)]  # stage s <-> s + 1
        # the workers import this very package, wherever it was imported from; an empty
        # PYTHONPATH entry would mean the working directory, which -P keeps off their path
        home = str(Path(sys.modules[__package__.partition(".")[0]].__file__).resolve().parents[1])
        user = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        path = os.pathsep.join([home, *filter(None, user)])
        env = dict(os.environ, PJRT_NPROC=str(self.threads), JAX_PLATFORMS="cpu",
                   PYTHONPATH=path)
        env.pop("JAX_NUM_CPU_DEVICES", None)
        try:
            for s in range(self.stages):
                fds = [pairs[s][1].fileno(),
                       chain[s - 1][1].fileno() if s else -1,
                       chain[s][0].fileno() if s < self.stages - 1 else -1]
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-P", "-m", __name__, *map(str, fds)], env=env,
                    pass_fds=[f for f in fds if f >= 0], stdin=subprocess.DEVNULL))
        finally:
            for sock in [p[1] for p in pairs] + [end for c in chain for end in c]:
                sock.close()
        self._links.extend(_Link(p[0]) for p in pairs)
        init = self.spec()
        for s, link in enumerate(self._links):
            link.send(("init", dict(init, stage=s, cores=self._cores(s))))
        self.devices = [WorkerDevice(s, p.pid, *self._answer(s, START_SECONDS, "start"))
                        for s, p in enumerate(self._procs)]

    def _cores(self, s: int) -> list[int] | None:
        """The cores stage ``s``'s worker keeps to, when every stage can have cores of its
        own (else None: the system places them)."""
        cores = sorted(os.sched_getaffinity(0))
        if not self.pin or self.threads * self.stages > len(cores):
            return None
        return cores[s * self.threads:(s + 1) * self.threads]

    def close(self) -> None:
        """Stop the workers (the next run starts new ones)."""
        with self._closing:
            _stop(self._procs, self._links)
            self.devices = []

    # -- a run ------------------------------------------------------------------------------

    def run(self, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each stage's run; any failure stops every worker and raises StageWorkerError."""
        self.start()
        try:
            for s, (link, payload) in enumerate(zip(self._links, payloads, strict=True)):
                try:
                    link.send(("run", payload))
                except OSError:  # its end is gone: name the worker that died
                    self._name_the_dead("run", LINK_DEATH_SECONDS)
                    raise StageWorkerError(
                        f"pipeline stage {s}'s worker process closed its link before its run; "
                        f"nothing was applied.") from None
            if self.serve is None:
                return [self._answer(s, SILENCE_SECONDS, "run") for s in range(self.stages)]
            return self._answers_serving()
        except BaseException:
            self.close()
            raise

    def _answers_serving(self) -> list[Any]:
        """Each stage's answer, waited for by a thread per stage that also answers its
        worker's requests (``serve``) on the way: the stages' requests are served at once,
        whatever order they come in. The first failure stops every worker and is raised."""
        results: list[Any] = [None] * self.stages
        errors: list[BaseException] = []

        def answer(s: int) -> None:
            try:
                results[s] = self._answer(s, SILENCE_SECONDS, "run")
            except BaseException as error:  # noqa: BLE001 - raised by the calling thread
                errors.append(error)
                self.close()

        threads = [threading.Thread(target=answer, args=(s,), daemon=True,
                                    name=f"stage {s}'s answers") for s in range(self.stages)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except BaseException:
            self.close()
            for t in threads:
                if t.ident is not None:
                    t.join()
            raise
        if errors:
            raise errors[0]
        return results

    def _name_the_dead(self, what: str, within: float = 0.0) -> None:
        """Raise for the first worker that has exited, if any, looking for up to ``within``
        seconds."""
        deadline = time.monotonic() + within
        while True:
            for s, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    self.close()
                    raise StageWorkerError(
                        f"pipeline stage {s}'s worker process (pid {proc.pid}) exited with code "
                        f"{proc.returncode} during its {what}; nothing was applied. Fix: see "
                        f"its output above, or use pipeline_workers='threads'.")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)

    def _answer(self, s: int, seconds: float, what: str) -> Any:
        """Stage ``s``'s answer, its worker's requests served on the way (``serve``)."""
        while True:
            kind, value = self._message(s, seconds, what)
            if kind != "request" or self.serve is None:
                break
            self._links[s].send(("answer", self.serve(s, value)))
        if kind == "error":
            error, text = value
            # a neighbour's death shows here as a broken link, a moment before it can be reaped
            self._name_the_dead(what, LINK_DEATH_SECONDS
                                if isinstance(error, ConnectionError | EOFError) else 0.0)
            self.close()
            if isinstance(error, BaseException):
                raise error from StageWorkerError(f"in pipeline stage {s}'s worker:\n{text}")
            raise StageWorkerError(f"pipeline stage {s}'s worker failed:\n{text}")
        return value

    def _message(self, s: int, seconds: float, what: str) -> tuple[str, Any]:
        """Stage ``s``'s worker's next message; one that died, or fell silent for ``seconds``,
        is named."""
        link, proc = self._links[s], self._procs[s]
        deadline = time.monotonic() + seconds
        while not link.poll(0.2):
            self._name_the_dead(what)
            if time.monotonic() > deadline:
                self.close()
                raise StageWorkerError(
                    f"pipeline stage {s}'s worker process gave no answer in {seconds:.0f} s "
                    f"during its {what}; the workers were stopped and nothing was applied. "
                    f"Fix: use pipeline_workers='threads', or fewer micro-batches per step.")
        try:
            return link.recv()
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            self.close()
            raise StageWorkerError(
                f"pipeline stage {s}'s worker process (pid {proc.pid}) closed its link during "
                f"its {what} (exit code {proc.returncode}); nothing was applied.") from None


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair whose buffers hold a few activations, so a send rarely waits for the
    reader (the kernel may grant less)."""
    pair = socket.socketpair()
    for end in pair:
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LINK_BUFFER_BYTES)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, LINK_BUFFER_BYTES)
    return pair


def _stop(procs: list[subprocess.Popen[bytes]], links: list[_Link]) -> None:
    for link in links:
        with contextlib.suppress(OSError):
            link.close()
    deadline = time.monotonic() + 2.0  # a worker whose link closed exits by itself
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    procs.clear()
    links.clear()


# -- the worker side ----------------------------------------------------------------------------

class _PipeBoard(Board):
    """The threaded executor's board across processes: activations go to the next stage and
    gradients to the one before, and what arrives is received, unpickled and put on the device
    by a thread per link while the stage computes; stashes stay here."""

    def __init__(self, before: _Link | None, after: _Link | None) -> None:
        super().__init__()
        self._before, self._after = before, after

    def listen(self, link: _Link | None, count: int) -> None:
        """Receive ``count`` values from ``link`` in a thread of its own."""
        if link is not None and count:
            threading.Thread(target=self._receive, args=(link, count), daemon=True).start()

    def _receive(self, link: _Link, count: int) -> None:
        import jax

        try:
            for _ in range(count):
                key, value = link.recv()
                super().put(key, jax.device_put(value))
        except BaseException as error:  # noqa: BLE001 - the stage's take raises it
            self.fail(error)

    def put(self, key: Any, value: Any) -> None:
        import jax

        if key[0] == "F":
            self._after.send((key, jax.device_get(value)))  # type: ignore[union-attr]
        elif key[0] == "B":
            self._before.send((key, jax.device_get(value)))  # type: ignore[union-attr]
        else:
            super().put(key, value)


def _runner(init: dict[str, Any], main: _Link) -> Any:
    """Stage ``init["stage"]``'s runner, built from the model and its spec alone, on this
    process's one CPU device; where its gradients are summed over instances, the session's
    process (at the other end of ``main``) sums them."""
    import dataclasses

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    device = jax.devices()[0]
    import onnx

    from .host_memory import keep_freed_memory
    from .lowering import lower
    from .stages import StagePrograms, StageRunner

    keep_freed_memory()  # as the session's own process does
    spec = init["stages"][init["stage"]]
    whole = lower(onnx.load_from_string(init["model"]))
    spec = dataclasses.replace(spec, stage=spec.stage.built(whole))
    def exchange(gradient: Any) -> Any:
        main.send(("request", jax.device_get(gradient)))
        kind, value = main.recv()
        return jax.device_put(value, device)

    return StageRunner(spec, StagePrograms(spec), lambda axis: device,
                       exchange if spec.exchange else None)


def _serve(main: _Link, before: _Link | None, after: _Link | None) -> None:
    import warnings

    import jax

    from .stages import RunContext

    warnings.simplefilter("ignore")  # the session's process has said it all already
    kind, init = main.recv()
    s = init["stage"]
    if init.get("cores"):
        os.sched_setaffinity(0, init["cores"])
    try:
        runner = _runner(init, main)
        del init  # the model's bytes
        device = jax.devices()[0]
        main.send(("ok", (str(device), int(os.environ.get("PJRT_NPROC", "0")))))
    except BaseException as error:  # noqa: BLE001 - reported to the session's process
        main.send(("error", (_portable(error), traceback.format_exc())))
        return
    spec = runner.spec
    actions = spec.schedule.for_stage(s)
    state = None  # that of the last run (the session sends another when it has one: after a
    while True:   # refused run, write_weights, a new session)
        try:
            kind, p = main.recv()
        except (EOFError, OSError):
            return
        try:
            put = jax.device_put
            if p["state"] is not None:
                state = put(p["state"], device)
            board = _PipeBoard(before, after)
            at = [None] * s
            ctx = RunContext(streams=[*at, put(p["streams"], device)], states=[*at, state],
                             hyper=[*at, put(p["hyper"], device)],
                             accs=[*at, {k: jax.numpy.zeros_like(state.weights[k])
                                         for k in spec.trained} if spec.training else None],
                             board=board)
            board.listen(before, sum(a.kind == "F" for a in actions) if s else 0)
            board.listen(after, sum(a.kind == "B" for a in actions) if not spec.last else 0)
            runner.run(ctx)
            if board.failed is not None:
                raise board.failed
            state = ctx.states[s]
            main.send(("ok", dict(outputs=jax.device_get(ctx.outputs),
                                  sums=jax.device_get(ctx.sums),
                                  state=jax.device_get(state) if spec.training else None,
                                  trace=ctx.trace)))
        except BaseException as error:  # noqa: BLE001 - reported to the session's process
            main.send(("error", (_portable(error), traceback.format_exc())))


def _portable(error: BaseException) -> BaseException | None:
    """The error itself if it survives pickling, else None (its text is sent anyway)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure means "send the text"
        return None


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the session's process stops this one
    fds = [int(a) for a in argv]
    links = [_Link(socket.socket(fileno=fd), threaded=True) if fd >= 0 else None
             for fd in fds]
    _serve(links[0], links[1], links[2])  # type: ignore[arg-type]
    for link in links:
        if link is not None:
            link.close()


if __name__ == "__main__":
    main(sys.argv[1:])
