"""One pipeline stage: its description, its programs, and the handlers of its actions.

A :class:`StageSpec` describes a stage completely: what it receives, reads, owns and sends on
(:class:`Stage`), the replicas it runs vectorised, its optimizer and gradient
:class:`~.state.Reduction`, the schedule and what a run keeps of its values. It is all a stage
needs: :class:`StagePrograms` builds the stage's programs from it, in the session's process
(threads) or in a stage worker process (``stage_processes.py``), which is sent the spec and the
model and builds nothing else. A :class:`StageRunner` does the stage's actions of the schedule
in order, one handler per kind of action (forward, backward, update), on a typed
:class:`RunContext`.

**Stale weights (no accumulation: continuous pipelining).** From PopART's implicit pipeline
transform:

* a backward op is put on pipeline stage ``maxStage - stage`` of its forward op
  (``willow/src/transforms/autodiff/gradgrowerop.cpp:85-87``, maxStage = 2F - 2), and the
  weight update inherits the placement of the gradient it consumes
  (``willow/src/ir.cpp:3127-3139``, ``growVarUpdateOpInternal``: ``inheritPlacementAttributes``):
  stage s updates its weights in its backward stage, right after each backward;
* in cycle ``t`` pipeline stage ``p`` runs micro-batch ``t - p``
  (``willow/src/transforms/pipeline.cpp:2324-2335``, ``PipelineInfo::doStage``) and a cycle
  runs its stages in stage order, forward before backward
  (``willow/src/popx/popprograms.cpp:503-525``);
* variables are never stashed - only activations are (``willow/src/transforms/pipeline.cpp:
  637-641``, ``getStashCandidateTensors``: "the tensor being a Variable").

So on stage s of F, with D = 2(F - 1 - s): micro-batch m's **forward** sees the weights after
``max(0, m - D)`` updates (those of micro-batches whose backward ran in an earlier cycle), and
its **backward** uses the stashed activations of that forward but reads the weights as they
are then, after m updates, both for the gradient it sends back and for its weight gradient's
own inputs. The last stage (D = 0) sees no staleness. Here every op that reads a weight is
differentiated at the current weight while its value stays the forward's
(``LoweredGraph.evaluate(fresh=...)``); the backward recomputes its stage's forward from the
stashed inputs and weight version to do so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.names import GRADIENT_PREFIX
from ..._base.schedule import Action, PipelineSchedule
from .lowering import LoweredGraph
from .ops_random import RANDOM_STREAM, random_scope
from .state import Reduction, SessionState, apply_update
from .steps import LOCAL_REPLICA, vmap

__all__ = ["Stage", "StageSpec", "StagePrograms", "StageRunner", "RunContext", "Board"]


@dataclass(frozen=True)
class Stage:
    """One stage's part of the graph: what it receives, reads, owns and sends on. ``graph``
    is built from the model by ``produces`` and ``inputs`` (:meth:`LoweredGraph.part`), and is
    left out when the stage is sent to a worker process, which builds it again."""

    index: int
    produces: frozenset[str]
    inputs: dict[str, tuple[tuple[int, ...], np.dtype]]
    receives: tuple[str, ...]   # from the stage before (its ``sends``)
    streams: tuple[str, ...]    # graph inputs it reads (and the seeds, RANDOM_STREAM)
    weights: tuple[str, ...]
    sends: tuple[str, ...]      # to the stage after
    anchors: tuple[str, ...]    # anchored tensors it computes (or weights it owns)
    probes: tuple[str, ...] = ()  # tensors whose gradients its backward returns (anchors)
    graph: LoweredGraph | None = field(default=None, compare=False)

    def built(self, whole: LoweredGraph) -> Stage:
        """The stage with its graph: its part of the model's ``whole`` graph."""
        return replace(self, graph=whole.part(set(self.produces), self.inputs))


@dataclass(frozen=True)
class StageSpec:
    """Everything a stage's programs and runner need (see the module docs)."""

    stage: Stage
    count: int                  # stages in the pipeline
    replicas: int               # run vectorised on the stage's device(s)
    schedule: PipelineSchedule
    broadcast: frozenset[str]   # stream inputs given once for every replica
    kept: dict[str, frozenset[int]]  # value -> the micro-batches a run keeps of it
    summed: frozenset[str]      # values a run sums (Sum anchors)
    recompute: bool = False     # the backward recomputes the forward from the stage's inputs
    loss: str | None = None     # training: the loss (on the last stage)
    trained: tuple[str, ...] = ()
    optimizer: Any = None
    reduction: Reduction = Reduction()
    #: the stage's gradients are summed over the instances by the session's process (stage
    #: worker processes over several instances) before each update
    exchange: bool = False
    probe_specs: dict[str, tuple[tuple[int, ...], np.dtype]] = field(default_factory=dict)

    @property
    def training(self) -> bool:
        return self.loss is not None

    @property
    def last(self) -> bool:
        return self.stage.index == self.count - 1

    @property
    def accumulate(self) -> bool:
        return self.schedule.accumulate

    def portable(self) -> StageSpec:
        """The spec as a worker process is sent it: without the stage's graph."""
        return replace(self, stage=replace(self.stage, graph=None))


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _gradients(probed: Mapping[str, Any]) -> dict[str, Any]:
    """Gradients by their anchors' names."""
    return {GRADIENT_PREFIX + t: g for t, g in probed.items()}


class StagePrograms:
    """A stage's jitted programs, from its spec alone. ``spmd(fn, donate)`` makes the update
    program (one over every instance where the session has several: its reduction sums the
    instances' gradients); by default a plain ``jax.jit``."""

    def __init__(self, spec: StageSpec,
                 spmd: Callable[[Callable, tuple[int, ...]], Callable] | None = None) -> None:
        self.spec = spec
        self._spmd = spmd or (lambda fn, donate: jax.jit(fn, donate_argnums=donate))
        self.forward = jax.jit(lambda w, r, x, m: self._forward(w, r, x, m))
        if not spec.training:
            return
        if spec.last:
            self.loss = jax.jit(self._loss, donate_argnums=(5,))
        else:
            self.stash = jax.jit(self._stash)
            self.back = jax.jit(self._back, donate_argnums=(2,))
            self.again = jax.jit(self._back_again, donate_argnums=(6,))
        # the first update of a run reads the committed state (maybe the very arrays: a
        # device_put to their own device does not copy), which a failed, refused or interrupted
        # run must leave intact; later updates donate the optimizer state the run made (never
        # the weights: a stash may hold the version a backward still needs)
        self.apply = self._spmd(self._apply, (2,))
        self.apply_again = self._spmd(self._apply, (1, 2))

    # -- the stage's math --------------------------------------------------------------------

    def _forward(self, w: Any, recv: Any, streams: Any, m: Any, fresh: Any = None,
                 probes: Any = None) -> tuple[dict, dict]:
        """The stage on micro-batch ``m`` for every replica: what it sends on, and its anchors.
        ``probes``: zero offsets, per replica, whose gradients are gradient anchors."""
        spec, st = self.spec, self.spec.stage
        x = {k: jax.lax.dynamic_index_in_dim(v, m, 0, keepdims=False) for k, v in streams.items()}
        per = {k: v for k, v in x.items() if k not in spec.broadcast}
        fixed = {k: v for k, v in x.items() if k in spec.broadcast}
        owned = [t for t in st.anchors if t in st.weights]  # anchored weights
        wanted = [*st.sends, *(t for t in st.anchors if t not in owned)]
        graph = st.graph
        assert graph is not None

        def one(r: Any, xr: Any, pr: Any) -> Any:
            xr = dict(xr)
            seed = xr.pop(RANDOM_STREAM, None)  # this micro-batch's and replica's seed
            with random_scope(seed, spec.training) if seed is not None else nullcontext():
                return graph.evaluate(w, {**r, **xr, **fixed}, wanted, offsets=pr or None,
                                      fresh=fresh)

        out = vmap(one, spec.replicas, (0, 0, 0), LOCAL_REPLICA)(recv, per, probes or {})
        out.update((t, jnp.broadcast_to(jnp.asarray(w[t]), (spec.replicas, *np.shape(w[t]))))
                   for t in owned)
        return {k: out[k] for k in st.sends}, {k: out[k] for k in st.anchors}

    def _probes(self) -> dict[str, jax.Array]:
        """Zeros shaped as the stage's gradient anchors, one per replica."""
        return {t: jnp.zeros((self.spec.replicas, *shape), dtype)
                for t, (shape, dtype) in self.spec.probe_specs.items()}

    def _split(self, w: Any) -> tuple[dict, dict]:
        trained = self.spec.trained
        return ({k: v for k, v in w.items() if k in trained},
                {k: v for k, v in w.items() if k not in trained})

    def _stash(self, w: Any, r: Any, x: Any, m: Any) -> Any:
        t, rest = self._split(w)
        carry, vjp, aux = jax.vjp(
            lambda tw, rr, pr: self._forward({**rest, **tw}, rr, x, m, probes=pr),
            t, r, self._probes(), has_aux=True)
        return carry, aux, vjp

    def _back(self, vjp: Any, g: Any, acc: Any) -> Any:
        gw, gr, gp = vjp(g)
        return _add(acc, gw), gr, gp

    def _back_again(self, w_then: Any, w_now: Any, r: Any, x: Any, m: Any, g: Any,
                    acc: Any) -> Any:
        """The backward from the stashed inputs and weight version: with accumulation a
        recomputation; without, differentiated at the current weights (module docs)."""
        t_then, rest = self._split(w_then)
        if self.spec.accumulate:
            def f(tw: Any, rr: Any, pr: Any) -> Any:
                return self._forward({**rest, **tw}, rr, x, m, probes=pr)[0]
            primal = t_then
        else:
            def f(tw: Any, rr: Any, pr: Any) -> Any:
                return self._forward(w_then, rr, x, m, fresh=tw, probes=pr)[0]
            primal = self._split(w_now)[0]
        _, vjp = jax.vjp(f, primal, r, self._probes())
        gw, gr, gp = vjp(g)
        return _add(acc, gw), gr, gp

    def _loss(self, w: Any, r: Any, x: Any, m: Any, hyper: Any, acc: Any) -> Any:
        t, rest = self._split(w)
        loss_name = self.spec.loss

        def loss(tw: Any, rr: Any, pr: Any) -> Any:
            _, aux = self._forward({**rest, **tw}, rr, x, m, probes=pr)
            return jnp.sum(aux[loss_name]) * hyper.get("loss_scaling", 1.0), aux

        (gw, gr, gp), aux = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(
            t, r, self._probes())
        return _add(acc, gw), gr, {**aux, **_gradients(gp)}

    def _apply(self, weights: Any, rest: Any, acc: Any, hyper: Any) -> Any:
        """The stage's weight update (:func:`~.state.apply_update`) of a state given as its
        weights and ``rest`` (optimizer state, update count); the accumulator zeroed."""
        new = apply_update(SessionState(weights, *rest), acc, hyper, self.spec.optimizer,
                           self.spec.reduction)
        return new.weights, (new.optimizer, new.updates), jax.tree.map(jnp.zeros_like, acc)


class Board:
    """Values passed between the stages of a run: put once, taken once."""

    def __init__(self) -> None:
        self._values: dict[Any, Any] = {}
        self._ready = threading.Condition()
        self.failed: BaseException | None = None

    def put(self, key: Any, value: Any) -> None:
        with self._ready:
            self._values[key] = value
            self._ready.notify_all()

    def take(self, key: Any) -> Any:
        with self._ready:
            while key not in self._values:
                if self.failed is not None:
                    raise RuntimeError("another stage failed") from self.failed
                self._ready.wait(0.5)
            return self._values.pop(key)

    def fail(self, error: BaseException) -> None:
        """Stop the run: every take raises from now on. The first failure is the one kept."""
        with self._ready:
            if self.failed is None:
                self.failed = error
            self._ready.notify_all()


@dataclass
class RunContext:
    """One run's values, by stage: its stream inputs, state, hyperparameters and gradient
    accumulator on the stage's devices; the board the stages pass values on; what the run
    keeps (``outputs``: (value, micro-batch) -> array; ``sums``) and its ``trace``."""

    streams: list[Any]
    states: list[SessionState | None]
    hyper: list[Any]
    accs: list[Any]
    board: Board
    outputs: dict[tuple[str, int], Any] = field(default_factory=dict)
    sums: dict[str, Any] = field(default_factory=dict)
    trace: list[tuple[Action, int, float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class StageRunner:
    """Does one stage's actions of the schedule in order: :meth:`act` hands each to the
    handler of its kind. ``where(replica_axis)``: the stage's device, or its sharding over
    the stage's devices (None: a copy on each); ``exchange(gradient)``: the gradient summed
    over every instance, where the session's process does that sum (worker processes)."""

    def __init__(self, spec: StageSpec, programs: StagePrograms,
                 where: Callable[[int | None], Any],
                 exchange: Callable[[Any], Any] | None = None) -> None:
        self.spec, self.programs, self.where = spec, programs, where
        self.exchange = exchange  # sums a gradient over the instances (``spec.exchange``)
        self.record = True
        #: anchored weights returned after each micro-batch's update (no accumulation), as
        #: PopART copies a weight's anchor after its VarUpdate
        self.after_update = tuple(t for t in spec.stage.anchors if t in spec.trained) \
            if spec.training and not spec.accumulate else ()
        self.handlers: dict[str, Callable[[Action, RunContext, Any], Any]] = {
            "F": self.forward, "B": self.backward, "U": self.update}

    @property
    def index(self) -> int:
        return self.spec.stage.index

    def run(self, ctx: RunContext) -> None:
        """The stage's actions in order, until they are done or the run has failed (the
        failure is put on the board)."""
        try:
            for action in self.spec.schedule.for_stage(self.index):
                if ctx.board.failed is not None:
                    return
                got = self.receive(action, ctx)  # waiting for a neighbour is idle time
                start = time.perf_counter()
                done = self.act(action, ctx, got)
                jax.block_until_ready(done)
                end = time.perf_counter()
                if self.record and action.kind != "U":
                    with ctx.lock:
                        ctx.trace.append((action, self.index, start, end))
        except BaseException as error:  # noqa: BLE001 - handed to whoever runs the stages
            ctx.board.fail(error)

    def micro_batch(self, a: Action) -> int:
        return a.update * self.spec.schedule.micro_batches + (a.micro_batch or 0)

    def receive(self, a: Action, ctx: RunContext) -> Any:
        """What action ``a`` waits for: the activations from the stage before (F), or the
        gradient from the stage after and its own stash (B), on its device."""
        s, board, dev = a.stage, ctx.board, self.where(0)
        m = self.micro_batch(a)
        if a.kind == "F":
            return jax.device_put(board.take(("F", s - 1, m)), dev) if s else {}
        if a.kind == "B" and not self.spec.last:
            return jax.device_put(board.take(("B", s + 1, m)), dev), board.take(("stash", s, m))
        return None

    def act(self, a: Action, ctx: RunContext, got: Any) -> Any:
        """Action ``a`` given what it received; returns what to wait for to see it done."""
        return self.handlers[a.kind](a, ctx, got)

    def forward(self, a: Action, ctx: RunContext, recv: Any) -> Any:
        s, spec, p = self.index, self.spec, self.programs
        m = self.micro_batch(a)
        x, state = ctx.streams[s], ctx.states[s]
        assert state is not None
        w = state.weights
        if not spec.training:
            carry, aux = p.forward(w, recv, x, np.int32(m))
        elif spec.last:  # its aux has the stage's gradient anchors too
            ctx.accs[s], grad, aux = p.loss(w, recv, x, np.int32(m), ctx.hyper[s], ctx.accs[s])
            carry = {}
            ctx.board.put(("B", s, m), grad)
        elif spec.recompute or not spec.accumulate:
            carry, aux = p.forward(w, recv, x, np.int32(m))
            ctx.board.put(("stash", s, m), (w, recv))
        else:
            carry, aux, vjp = p.stash(w, recv, x, np.int32(m))
            ctx.board.put(("stash", s, m), vjp)
        if not spec.last:
            ctx.board.put(("F", s, m), carry)
        self.keep(ctx, m, {k: v for k, v in aux.items() if k not in self.after_update})
        return (carry, aux)

    def backward(self, a: Action, ctx: RunContext, got: Any) -> Any:
        s, p = self.index, self.programs
        if self.spec.last:
            return None  # done with the forward, in the same slot
        m = self.micro_batch(a)
        g, stashed = got
        state = ctx.states[s]
        assert state is not None
        if isinstance(stashed, tuple):
            w_then, recv = stashed
            ctx.accs[s], grad, probed = p.again(w_then, state.weights, recv, ctx.streams[s],
                                                np.int32(m), g, ctx.accs[s])
        else:
            ctx.accs[s], grad, probed = p.back(stashed, g, ctx.accs[s])
        self.keep(ctx, m, _gradients(probed))
        if s:
            ctx.board.put(("B", s, m), grad)
        return grad

    def update(self, a: Action, ctx: RunContext, got: Any) -> Any:
        s = self.index
        if not self.spec.trained:
            return None
        if self.exchange is not None:
            ctx.accs[s] = self.exchange(ctx.accs[s])
        # the stage's first update of a run reads the committed state
        apply = self.programs.apply if self.micro_batch(a) == 0 else self.programs.apply_again
        state = ctx.states[s]
        assert state is not None
        weights, (optimizer, updates), ctx.accs[s] = apply(
            state.weights, (state.optimizer, state.updates), ctx.accs[s], ctx.hyper[s])
        ctx.states[s] = SessionState(weights, optimizer, updates)
        if self.after_update:
            self.keep(ctx, self.micro_batch(a), {t: jnp.broadcast_to(
                weights[t], (self.spec.replicas, *np.shape(weights[t])))
                for t in self.after_update})
        return weights

    def keep(self, ctx: RunContext, m: int, aux: Mapping[str, Any]) -> None:
        """Keep of a micro-batch's values what the run returns (and sum the summed)."""
        kept, summed = self.spec.kept, self.spec.summed
        for t, v in aux.items():
            if m in kept.get(t, ()):
                ctx.outputs[(t, m)] = v
            if t in summed:
                ctx.sums[t] = v if t not in ctx.sums else ctx.sums[t] + v
