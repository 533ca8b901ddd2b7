"""How a step runs: executors behind one protocol.

Every way of running a session's step implements :class:`Executor`: ``prepare`` compiles for a
state, and ``run`` takes the run's canonical host inputs, the committed :class:`~.state.
SessionState` and the hyperparameters, and returns a :class:`StepResult` - the anchors (device
arrays the backend copies to the host once, or host arrays: a CPU run's large anchors, see
:mod:`.anchor_memory`), the new state (training) and the
finiteness flags (training, on the host) - without changing anything: the backend checks and
commits. The backend wraps every executor's run in the same
lock, profiling and peer-watching.

* :class:`LoopedExecutor`: the whole step one compiled program, its chunks looped inside it.
* :class:`HostDrivenExecutor`: a chunk program (and an update program) called from the host per
  chunk, results staying on the device (convolutions on CPU; see :mod:`.steps`).
* ``PipelineExecutor`` (:mod:`.pipeline`): each stage its own programs on its own devices.

The first two run the same math, a :class:`StepFunctions`: the per-chunk work, the update and
the flags a backend defines once. Randomness needs nothing of an executor: a model with random
operators takes each micro-batch's and replica's seed as one more stream input
(:data:`~.ops_random.RANDOM_STREAM`, made by the session's :class:`~.state.RandomSeed`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from .anchor_memory import RecycledAnchors
from .hlo_text import callback_only_parameters, has_host_callbacks
from .placement import Placement
from .state import SessionState
from .steps import loop

__all__ = ["Executor", "StepResult", "StepFunctions", "LoopedExecutor", "HostDrivenExecutor"]


@dataclass(frozen=True)
class StepResult:
    """What a run produced: ``anchors`` (each anchor's values in order: host arrays, or this
    process's device arrays, which the backend brings to the host once, in their host
    shapes), the ``state`` after the run's updates (None for inference) and ``flags``
    (training: :func:`~.state.finite_flags` on the host; None when unchecked)."""

    anchors: dict[str, Any]
    state: SessionState | None = None
    flags: np.ndarray | None = None


def _results(placement: Placement, buffers: Any, flags: Any) -> tuple[Any, Any]:
    """A run's anchor buffers, left where they are for the backend to bring to the host (the
    only copy they get), and its flags on the host (None stays None). Over several processes,
    this process's parts on the host; off the CPU, every transfer starts before the first is
    waited for."""
    if placement.distributed:
        return placement.fetch((buffers, flags))
    if placement.platform != "cpu":
        for leaf in jax.tree.leaves((buffers, flags)):
            leaf.copy_to_host_async()
    return buffers, None if flags is None else np.asarray(flags)


class Executor(Protocol):
    """Runs a session's steps; see the module docs."""

    #: The compiled programs (empty until prepared; a pipeline compiles as it first runs).
    programs: list[Any]

    def prepare(self, state: SessionState, hyper: Any) -> None: ...

    def run(self, inputs: Mapping[str, np.ndarray], state: SessionState,
            hyper: Any) -> StepResult: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StepFunctions:
    """The math of one step, traced per device (its block of replicas) inside a program.

    A run is ``updates`` weight updates (1 for inference, whose chunks need no update between
    them), each of ``chunks`` chunks. ``work()`` is a run's fresh carry (a dict with the anchor
    ``"buffers"``); ``chunk(state, work, hyper, inputs, update, index)`` returns the chunk's
    gradient (``{}`` for inference) and the work with its anchors written; ``apply(state,
    grads, hyper)`` makes an update (None: inference); ``flags(state, work)`` says whether
    the run stayed finite (None: unchecked). ``after(state, work, update)`` (training, None:
    nothing) writes into the work what is read after update ``update`` made ``state`` (a
    weight's anchor, as PopART copies it after its VarUpdate). ``stream_axes``/
    ``buffer_axes``: the replica axis of each input and anchor buffer."""

    updates: int
    chunks: int
    work: Callable[[], dict[str, Any]]
    chunk: Callable[..., tuple[dict[str, Any], dict[str, Any]]]
    apply: Callable[[SessionState, Any, Any], SessionState] | None
    flags: Callable[[SessionState, Any], Any] | None
    inputs: dict[str, jax.ShapeDtypeStruct]
    stream_axes: dict[str, int | None]
    buffer_axes: dict[str, int]
    after: Callable[[SessionState, Any, Any], Any] | None = None

    @property
    def training(self) -> bool:
        return self.apply is not None


def _runnable(jitted: Any, compiled: Any, training: bool) -> Any:
    """What a run calls: the compiled program, or for an inference program holding host
    callbacks (onnxruntime's calls: :mod:`.conv_mlas`, :mod:`.delegated`) the jitted
    function. JAX dispatches a compiled program holding callbacks in Python, and the callback
    waits for the interpreter lock that dispatch holds: 40-150 microseconds more per call
    (an MLP run by onnxruntime: 420 against 250 microseconds). The jitted function traces and
    compiles the program once more on its first call (the callbacks are new objects):
    tens of milliseconds for an inference program, whose heavy work is in the callbacks, too
    long for a training one, whose backward XLA compiles."""
    return jitted if not training and has_host_callbacks(compiled.as_text()) else compiled


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _indices(placement: Placement, count: int) -> list[Any]:
    """Loop indices as device scalars, put once (a Python int would be a new transfer per
    call)."""
    return [placement.put_everywhere(np.int32(i)) for i in range(count)]


def _recycled(step: StepFunctions, placement: Placement) -> RecycledAnchors:
    return RecycledAnchors(placement, jax.eval_shape(step.work)["buffers"])


class LoopedExecutor:
    """The whole step as one compiled program: its updates and chunks looped inside it. The
    program's last argument is the donated memory of the large anchors (see
    :mod:`.anchor_memory`), which it writes them into."""

    def __init__(self, step: StepFunctions, placement: Placement) -> None:
        self.step, self.placement = step, placement
        self.programs: list[Any] = []
        self.recycled = _recycled(step, placement)

    def _whole(self, state: SessionState, hyper: Any, inputs: Any) -> Any:
        """The step; inference gives back no state (returning the weights would copy them
        every run)."""
        f = self.step

        if not f.training:  # the chunks straight through, no gradient to carry
            work = loop(f.chunks, lambda k, w: f.chunk(state, w, hyper, inputs, jnp.int32(0),
                                                        k)[1], f.work())
            flags = f.flags(state, work) if f.flags is not None else None
            return None, work["buffers"], flags

        def update(u: Any, carry: Any) -> Any:
            state, work = carry
            # the first chunk's gradient starts the accumulator: no zeroed buffer when one
            # chunk is the whole update
            grads, work = f.chunk(state, work, hyper, inputs, u, jnp.int32(0))

            def more(k: Any, c: Any) -> Any:
                g, w = f.chunk(state, c[1], hyper, inputs, u, k)
                return _add(c[0], g), w

            if f.chunks > 1:
                grads, work = jax.lax.fori_loop(1, f.chunks, more, (grads, work))
            state = f.apply(state, grads, hyper)
            return state, (work if f.after is None else f.after(state, work, u))

        state, work = loop(f.updates, update, (state, f.work()))
        flags = f.flags(state, work) if f.flags is not None else None
        return state, work["buffers"], flags

    def prepare(self, state: SessionState, hyper: Any) -> None:
        f = self.step
        inputs = self.placement.abstract(f.inputs, f.stream_axes)
        slots = self.recycled.abstract()  # empty off one CPU device: spmd never sees any
        if f.training:
            program = jax.jit(self.placement.spmd(
                lambda s, h, x, _: self._whole(s, h, x), (None, None, f.stream_axes, None),
                (None, f.buffer_axes, None)), donate_argnums=3, keep_unused=True)
            self.programs = [program.lower(state, hyper, inputs, slots).compile()]
        else:  # inference takes the weights alone: each argument is a cost of every call
            program = jax.jit(self.placement.spmd(
                lambda w, x, _: self._whole(SessionState(w), None, x)[1],
                (None, f.stream_axes, None), f.buffer_axes), donate_argnums=2, keep_unused=True)
            self.programs = [program.lower(state.weights, inputs, slots).compile()]
        self._call = _runnable(program, self.programs[0], f.training)

    def parameters(self, state: SessionState) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(kind, name, shape)`` of each parameter of the compiled inference program, in
        order: the weights, the inputs, the donated anchor memory ("slots")."""
        inputs = self.placement.abstract(self.step.inputs, self.step.stream_axes)
        paths = jax.tree_util.tree_flatten_with_path(
            {"0": state.weights, "1": inputs, "2": self.recycled.abstract()})[0]
        kinds = {"0": "weights", "1": "inputs", "2": "slots"}
        return [(kinds[path[0].key], path[1].key, tuple(np.shape(leaf))) for path, leaf in paths]

    def callback_only_inputs(self, state: SessionState, hlo: str) -> set[str]:
        """The inputs the compiled inference program (``hlo``: its text) reads only in
        onnxruntime segments (:func:`~.hlo_text.callback_only_parameters`; none for
        training)."""
        if self.step.training:
            return set()
        numbers = callback_only_parameters(hlo)
        return {name for i, (kind, name, _) in enumerate(self.parameters(state))
                if kind == "inputs" and i in numbers}

    def run(self, inputs: Mapping[str, np.ndarray], state: SessionState,
            hyper: Any) -> StepResult:
        device = self.placement.put(inputs, self.step.stream_axes)
        slots = self.recycled.slots()
        if not self.step.training:
            buffers = self._call(state.weights, device, slots)
            return StepResult(self.recycled.hand_out(_results(self.placement, buffers,
                                                              None)[0]))
        new, buffers, flags = self._call(state, hyper, device, slots)
        anchors, flags = _results(self.placement, buffers, flags)
        return StepResult(self.recycled.hand_out(anchors), new, flags)

    def close(self) -> None:
        self.recycled.clear()


class HostDrivenExecutor:
    """The step's chunks (and updates) each a program call from the host, the run's work
    staying on the device between calls (see :mod:`.steps`). The committed state is never
    donated, so a failed or interrupted run leaves it intact."""

    def __init__(self, step: StepFunctions, placement: Placement) -> None:
        self.step, self.placement = step, placement
        self.programs: list[Any] = []
        self._indices: list[Any] = []
        self.recycled = _recycled(step, placement)

    def _init(self, state: SessionState, slots: Any) -> Any:
        """A run's fresh work, its large anchors in the donated ``slots``."""
        work = self.step.work()
        if self.step.training:
            work["grads"] = jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), self._grads)
        return work

    def _chunk(self, state: SessionState, work: Any, hyper: Any, inputs: Any, update: Any,
               index: Any) -> Any:
        grads, out = self.step.chunk(state, work, hyper, inputs, update, index)
        if self.step.training:
            out["grads"] = _add(work["grads"], grads)
        return out

    def _update(self, state: SessionState, work: Any, hyper: Any, update: Any) -> Any:
        state = self.step.apply(state, work["grads"], hyper)  # type: ignore[misc]
        work = {**work, "grads": jax.tree.map(jnp.zeros_like, work["grads"])}
        return state, work if self.step.after is None else self.step.after(state, work, update)

    def _flags(self, state: SessionState, work: Any) -> Any:
        return self.step.flags(state, work)  # type: ignore[misc]

    def prepare(self, state: SessionState, hyper: Any) -> None:
        f = self.step
        inputs = self.placement.abstract(f.inputs, f.stream_axes)
        index = jax.ShapeDtypeStruct((), jnp.int32)
        if f.training:  # what a chunk's gradient has (its weights', and what else it sums)
            self._grads = dict(jax.eval_shape(
                lambda s, w, h, x: f.chunk(s, w, h, x, jnp.int32(0), jnp.int32(0))[0],
                state, f.work(), hyper, inputs))
        slots = self.recycled.abstract()
        jitted = [jax.jit(self._init, donate_argnums=1, keep_unused=True),
                  jax.jit(self._chunk, donate_argnums=(1,))]
        work = jax.eval_shape(self._init, state, slots)
        programs = [jitted[0].lower(state, slots).compile(),
                    jitted[1].lower(state, work, hyper, inputs, index, index).compile()]
        if f.training:
            jitted.append(jax.jit(self._update, donate_argnums=(1,)))
            programs.append(jitted[-1].lower(state, work, hyper, index).compile())
        if f.flags is not None:
            jitted.append(jax.jit(self._flags))
            programs.append(jitted[-1].lower(state, work).compile())
        self.programs = programs
        self._calls = [_runnable(j, p, f.training) for j, p in zip(jitted, programs, strict=True)]
        self._indices = _indices(self.placement, max(f.updates, f.chunks))

    def run(self, inputs: Mapping[str, np.ndarray], state: SessionState,
            hyper: Any) -> StepResult:
        f = self.step
        device = self.placement.put(inputs, f.stream_axes, resident=True)
        init, chunk, *rest = self._calls
        work = init(state, self.recycled.slots())
        for u in self._indices[:f.updates]:
            for k in self._indices[:f.chunks]:
                work = chunk(state, work, hyper, device, u, k)
            if f.training:
                state, work = rest[0](state, work, hyper, u)
        flags = rest[-1](state, work) if f.flags is not None else None
        anchors, flags = _results(self.placement, work["buffers"], flags)
        return StepResult(self.recycled.hand_out(anchors), state if f.training else None,
                          flags)

    def close(self) -> None:
        self.recycled.clear()
