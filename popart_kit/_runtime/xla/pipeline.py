"""Pipelined execution on the xla backend: each stage its own program on its own device, run
by the :class:`~popart_kit._base.schedule.PipelineSchedule`.

**Split.** The lowered graph is cut at the model's ``__pipeline_stage`` annotations (else its
``__ipu_number`` ones, as PopART infers stages) into one program per stage. Stage s receives
from stage s - 1 every tensor a later stage needs (PopART's chain of IPU copies), reads its own
stream inputs and owns the weights its nodes read. Stage s runs on its own devices: as many as
the unpipelined placement gives the R local replicas (so R x K devices for R replicas of K
stages where the host has them), else one, its program running the replicas vectorised. On CPU
that is one device per stage, and the stages of one process share its threads (XLA:CPU has one
intra-op pool per process): ``pipeline_workers="processes"`` puts each stage in a worker
process of its own (``stage_processes.py``). Fewer devices than stages: the backend says so
once and runs unpipelined.

**Executor.** Each stage has a worker (a thread here, or a process) that does its stage's
actions in the schedule's order, waiting for the activations (forward) or gradients (backward)
it needs from its neighbours; stages run at once, and each action's start (once its inputs are
there) and end are recorded (:attr:`PipelineExecutor.trace`), from which the measured bubble
follows. Gradients accumulate per stage on its devices; the replicas' gradients are summed
inside each stage's vectorised backward, and the optimizer runs once per update per stage. A
run keeps only the micro-batches its anchors return (Sum anchors are summed on the stage).

**Atomic runs.** As unpipelined (``training.py``), a run's new weights and optimizer state
replace the committed ones only once it has succeeded. No program donates the committed state
(a stage's first update of a run reads it; later ones donate the state the run made), and a
failure or KeyboardInterrupt stops every stage before the run raises, so a failed, refused or
interrupted run leaves the session as it was.

**Stashing and recomputation.** Without recomputation a forward keeps its stage's
linearisation (JAX's residuals: PopART's stashed activations) for the backward. With
``pipeline.recomputation`` standard, recompute_all or pipeline, a forward keeps only its
stage's inputs and the backward recomputes the stage forward (PopART's recompute of a stage
from its stashed inputs); :meth:`PipelineExecutor.stash_bytes` measures both. ``norm_only``
recomputes normalisations inside a stage, which XLA fuses anyway: it is refused.

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..._base.names import GRADIENT_PREFIX
from ..._base.schedule import Action, PipelineSchedule, measured_bubble
from ..._model.layout import PIPELINE_STAGE, VIRTUAL_GRAPH
from ...errors import ConfigError
from . import stage_worker
from .lowering import LoweredGraph
from .memory import check_fits
from .placement import REPLICA, replica_devices
from .steps import vmap

__all__ = ["Stage", "PipelineExecutor", "split", "executor_for", "RECOMPUTE", "WORKERS"]

#: pipeline.recomputation values that mean "recompute a stage's forward in its backward".
RECOMPUTE = frozenset({"standard", "recompute_all", "pipeline"})
#: Where stages run: threads of this process (one virtual device each), or worker processes.
WORKERS = ("threads", "processes")


@dataclass(frozen=True)
class Stage:
    """One stage's program: what it receives, reads, owns and sends on."""

    index: int
    graph: LoweredGraph
    receives: tuple[str, ...]   # from the stage before (its ``sends``)
    streams: tuple[str, ...]    # graph inputs it reads
    weights: tuple[str, ...]
    sends: tuple[str, ...]      # to the stage after
    anchors: tuple[str, ...]    # anchored tensors it computes (or weights it owns)
    probes: tuple[str, ...] = ()  # tensors whose gradients its backward returns (anchors)


def _node_stage(node: onnx.NodeProto, key: str) -> int | None:
    for attr in node.attribute:
        if attr.name == key:
            return int(attr.i)
    return None


def split(backend: Any, wanted: list[str], gradients: list[str] = ()) -> list[Stage] | str:
    """The backend's graph as one program per stage, or why it cannot be split. ``wanted``:
    tensors whose values are anchored; ``gradients``: those whose gradients are."""
    model, graph = backend.model, backend.graph
    key = (PIPELINE_STAGE if any(_node_stage(n, PIPELINE_STAGE) is not None
                                 for n in model.graph.node) else VIRTUAL_GRAPH)
    stage_of: dict[str, int] = {}
    for node in model.graph.node:
        s = _node_stage(node, key)
        if s is not None:
            stage_of.update((o, s) for o in node.output if o)
    count = max(stage_of.values(), default=-1) + 1
    if count < 2:
        return "the model has fewer than two pipeline stages"
    producer_stage = {t: s for t, s in stage_of.items() if t in graph.tensors
                      and not graph.is_constant(t)}
    needed_by: dict[str, int] = {}
    reads: list[set[str]] = [set() for _ in range(count)]
    for node in model.graph.node:
        s = next((stage_of[o] for o in node.output if o in stage_of), None)
        if s is None:
            continue
        for i in node.input:
            if i and not graph.is_constant(i):
                reads[s].add(i)
                needed_by[i] = max(needed_by.get(i, -1), s)
    for t in wanted:
        if t in producer_stage:
            needed_by[t] = max(needed_by.get(t, -1), producer_stage[t])
    owner: dict[str, int] = {}  # a weight's or stream input's one reading stage
    for w in graph.weights:
        users = {s for s in range(count) if w in reads[s]}
        if len(users) > 1:
            return f"weight {w!r} is read by stages {sorted(users)}"
        owner.update((w, s) for s in users)
    for t in gradients:
        users = {s for s in range(count) if t in reads[s]}
        if t in graph.inputs and len(users) > 1:
            return (f"the gradient of input {t!r} is anchored and stages {sorted(users)} read "
                    f"it")
        owner.update((t, s) for s in users if t in graph.inputs)
    shapes = backend._shapes(backend.io.inputs, [t for t in producer_stage])
    stages, carried = [], ()
    for s in range(count):
        made = {t for t, p in producer_stage.items() if p == s}
        live = {t for t in (*carried, *made) if needed_by.get(t, -1) > s}
        sends = tuple(sorted(live))
        for t in sends:
            if not jnp.issubdtype(shapes[t].dtype, jnp.inexact):
                return (f"tensor {t!r} ({shapes[t].dtype}) crosses from stage "
                        f"{producer_stage[t]} to a later stage; only floating-point tensors "
                        f"can carry gradients between stages here")
        streams = tuple(sorted(i for i in reads[s] if i in graph.inputs))
        inputs = {t: (tuple(shapes[t].shape), np.dtype(shapes[t].dtype)) for t in carried}
        io = backend.io.inputs
        inputs.update((i, (tuple(io[i].shape),
                           np.dtype(jax.dtypes.canonicalize_dtype(io[i].dtype))))
                      for i in streams)
        part = graph.part(made, inputs)
        anchors = tuple(t for t in wanted if t in made or owner.get(t) == s and t in
                        graph.weights)
        probes = tuple(t for t in gradients if t in made or owner.get(t) == s)
        stages.append(Stage(s, part, carried, streams, tuple(sorted(part.weights)), sends,
                            anchors, probes))
        carried = sends
    unplaced = [t for t in wanted if t not in producer_stage and t not in graph.inputs
                and t not in owner]
    unplaced += [t for t in gradients if t not in producer_stage and t not in owner]
    if unplaced:
        return f"anchor(s) on {unplaced} are constants or unread, not computed by a stage"
    return stages


def executor_for(backend: Any, workers: str = "threads",
                 spec: Any = None) -> tuple[PipelineExecutor | None, str]:
    """The executor a pipelined backend runs with, or None and why not. ``workers``: see
    :data:`WORKERS`; ``spec()`` tells a worker process how to rebuild the backend
    (stage_processes.py)."""
    config = backend.config
    if not config.pipeline.enabled:
        return None, ""
    training = hasattr(backend, "loss")
    if config.pipeline.recomputation == "norm_only":
        raise ConfigError("pipeline.recomputation='norm_only' recomputes normalisations "
                          "inside a stage, which has no meaning on the xla backend (XLA fuses "
                          "them already). Fix: use 'none', or 'standard' to recompute each "
                          "stage's forward in its backward.", rule="K-xla-recompute")
    gradients = getattr(backend, "gradient_anchors", {})
    wanted = list(dict.fromkeys([*(backend._anchor_tensor(a) for a in backend.anchors
                                   if a not in gradients),
                                 *([backend.loss] if training else [])]))
    stages = split(backend, wanted, list(dict.fromkeys(gradients.values())))
    if isinstance(stages, str):
        return None, stages
    if training and backend.loss not in stages[-1].anchors:
        return None, f"the loss {backend.loss!r} is not computed on the last stage"
    devices = jax.devices()
    k = len(stages)
    if stage_worker.STAGE_WORKER:
        return PipelineExecutor(backend, stages, [devices[:1]] * k), ""
    if workers == "processes":
        from .stage_processes import StageProcesses

        executor = PipelineExecutor(backend, stages, [])
        executor.processes = StageProcesses(spec, k)
        return executor, ""
    if len(devices) < k:
        return None, (f"{k} stages need {k} devices and this host has "
                      f"{len(devices)} {devices[0].platform.upper()} device(s)")
    # a stage's replicas on as many devices as the unpipelined placement would give them
    # (on CPU one: virtual devices share the process's threads), while the host has R x K
    per = len(replica_devices(config.replication.local_factor, devices[0].platform))
    per = per if len(devices) >= per * k else 1
    return PipelineExecutor(backend, stages,
                            [devices[s * per:(s + 1) * per] for s in range(k)]), ""


def _nbytes(array: Any) -> int:
    """Bytes of an array, or of anything with its shape and dtype."""
    return int(np.prod(array.shape, dtype=np.int64)) * np.dtype(array.dtype).itemsize


def _gradients(probed: Mapping[str, Any]) -> dict[str, Any]:
    """Gradients by their anchors' names."""
    return {GRADIENT_PREFIX + t: g for t, g in probed.items()}


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _select(tree: Any, names: set[str], every: set[str]) -> Any:
    """The part of an optimizer state that concerns ``names`` (dicts keyed by weight names
    are filtered; anything else is kept)."""
    if isinstance(tree, dict):
        if tree and set(tree) <= every:
            return {k: v for k, v in tree.items() if k in names}
        return {k: _select(v, names, every) for k, v in tree.items()}
    return tree


def _merge(trees: list[Any], every: set[str]) -> Any:
    first = trees[0]
    if not isinstance(first, dict):
        return first
    keys = list(dict.fromkeys(k for t in trees for k in t))
    if keys and set(keys) <= every:
        return {k: v for t in trees for k, v in t.items()}
    return {k: _merge([t[k] for t in trees if k in t], every) for k in keys}


class PipelineExecutor:
    """Runs a pipelined session's steps stage by stage on their own devices (module docs).

    ``record``: keep :attr:`trace` (action, device index, start, end in seconds) of the last
    run; ``threads``: one worker per device (else every action is dispatched from one thread
    in schedule order and JAX's asynchronous dispatch overlaps them; no trace then)."""

    def __init__(self, backend: Any, stages: list[Stage],
                 devices: list[list[jax.Device]]) -> None:
        self.backend, self.stages, self.devices = backend, stages, devices
        config = backend.config
        self.training = hasattr(backend, "loss")
        self.accumulate = config.accumulation.factor > 1
        self.schedule = PipelineSchedule.for_config(config, len(stages))
        self.replicas = config.replication.local_factor
        self.recompute = config.pipeline.recomputation in RECOMPUTE
        self.record, self.threads = True, True
        self.trace: list[tuple[Action, int, float, float]] = []
        self._programs: dict[int, dict[str, Any]] = {}
        self._meshes: dict[int, Mesh] = {}
        self.processes: Any = None  # StageProcesses, with pipeline_workers="processes"
        self._keeping = self._kept()
        self._held: tuple[Any, Any] | None = None  # (weights, optimizer state) workers hold
        self._checked = False  # the memory check

    @property
    def placement(self) -> dict[tuple[int, int], Any]:
        """(replica, stage) -> device (a :class:`~.stage_processes.WorkerDevice` when the
        stages run in worker processes, which this starts, after the memory check)."""
        self.start()
        if self.processes is not None:
            return {(r, s): d for s, d in enumerate(self.processes.devices)
                    for r in range(self.replicas)}
        return {(r, s): group[r * len(group) // self.replicas]
                for s, group in enumerate(self.devices) for r in range(self.replicas)}

    def _where(self, s: int, replica_axis: int | None = None) -> Any:
        """Where stage ``s`` keeps an array: its device, or over its devices split along
        ``replica_axis`` (None: a copy on each)."""
        group = self.devices[s]
        if len(group) == 1:
            return group[0]
        if s not in self._meshes:
            self._meshes[s] = Mesh(np.array(group), (REPLICA,))
        spec = P() if replica_axis is None else P(*(None,) * replica_axis, REPLICA)
        return NamedSharding(self._meshes[s], spec)

    def start(self) -> None:
        """Check the step fits, then start the stages' worker processes if they run in
        processes (the stage programs compile as they first run)."""
        if not self._checked:
            self.check_memory()
        if self.processes is not None and self.processes.start():
            self._held = None  # new workers: the next run sends them the committed state

    @property
    def measured_bubble(self) -> float:
        """The idle share of the devices over the last recorded run."""
        return measured_bubble([(d, a, b) for _, d, a, b in self.trace])

    # -- one stage's programs -------------------------------------------------------------

    def _forward(self, st: Stage, w: Any, recv: Any, streams: Any, m: Any,
                 fresh: Any = None, probes: Any = None) -> tuple[dict, dict]:
        """Stage ``st`` on micro-batch ``m`` for every replica: what it sends on, and its
        anchors. ``probes``: zero offsets, per replica, whose gradients are gradient anchors."""
        io = self.backend.io.inputs
        x = {k: jax.lax.dynamic_index_in_dim(v, m, 0, keepdims=False) for k, v in streams.items()}
        per = {k: v for k, v in x.items() if not io[k].broadcast}
        fixed = {k: v for k, v in x.items() if io[k].broadcast}
        owned = [t for t in st.anchors if t in st.graph.weights]  # anchored weights
        wanted = [*st.sends, *(t for t in st.anchors if t not in owned)]

        def one(r: Any, xr: Any, pr: Any) -> Any:
            return st.graph.evaluate(w, {**r, **xr, **fixed}, wanted, offsets=pr or None,
                                     fresh=fresh)

        out = vmap(one, self.replicas, (0, 0, 0))(recv, per, probes or {})
        out.update((t, jnp.broadcast_to(jnp.asarray(w[t] if t in w else
                                                    st.graph.weights[t]),
                                        (self.replicas, *np.shape(st.graph.weights[t]))))
                   for t in owned)
        return {k: out[k] for k in st.sends}, {k: out[k] for k in st.anchors}

    def _probes(self, st: Stage) -> dict[str, jax.Array]:
        """Zeros shaped as stage ``st``'s gradient anchors, one per replica."""
        specs = {t: self.backend.io.anchors[GRADIENT_PREFIX + t][0] for t in st.probes}
        return {t: jnp.zeros((self.replicas, *spec.shape), spec.dtype)
                for t, spec in specs.items()}

    def _trained(self, st: Stage) -> list[str]:
        return [w for w in st.weights if w in self.backend.trained]

    def _make(self, st: Stage) -> dict[str, Any]:
        last = st.index == len(self.stages) - 1
        programs: dict[str, Any] = {
            "forward": jax.jit(lambda w, r, x, m: self._forward(st, w, r, x, m))}
        if not self.training:
            return programs
        trained = self._trained(st)

        def split_w(w: Any) -> tuple[dict, dict]:
            return ({k: v for k, v in w.items() if k in trained},
                    {k: v for k, v in w.items() if k not in trained})

        def stash(w: Any, r: Any, x: Any, m: Any) -> Any:
            t, rest = split_w(w)
            carry, vjp, aux = jax.vjp(
                lambda tw, rr, pr: self._forward(st, {**rest, **tw}, rr, x, m, probes=pr),
                t, r, self._probes(st), has_aux=True)
            return carry, aux, vjp

        def back(vjp: Any, g: Any, acc: Any) -> Any:
            gw, gr, gp = vjp(g)
            return _add(acc, gw), gr, gp

        def back_again(w_then: Any, w_now: Any, r: Any, x: Any, m: Any, g: Any, acc: Any) -> Any:
            """The backward from the stashed inputs and weight version: with accumulation a
            recomputation; without, differentiated at the current weights (module docs)."""
            t_then, rest = split_w(w_then)
            if self.accumulate:
                def f(tw: Any, rr: Any, pr: Any) -> Any:
                    return self._forward(st, {**rest, **tw}, rr, x, m, probes=pr)[0]
                primal = t_then
            else:
                def f(tw: Any, rr: Any, pr: Any) -> Any:
                    return self._forward(st, w_then, rr, x, m, fresh=tw, probes=pr)[0]
                primal = split_w(w_now)[0]
            _, vjp = jax.vjp(f, primal, r, self._probes(st))
            gw, gr, gp = vjp(g)
            return _add(acc, gw), gr, gp

        def loss_stage(w: Any, r: Any, x: Any, m: Any, hyper: Any, acc: Any) -> Any:
            t, rest = split_w(w)

            def loss(tw: Any, rr: Any, pr: Any) -> Any:
                _, aux = self._forward(st, {**rest, **tw}, rr, x, m, probes=pr)
                return jnp.sum(aux[self.backend.loss]) * hyper.get("loss_scaling", 1.0), aux

            (gw, gr, gp), aux = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(
                t, r, self._probes(st))
            return _add(acc, gw), gr, {**aux, **_gradients(gp)}

        def apply(w: Any, state: Any, acc: Any, hyper: Any) -> Any:
            config = self.backend.config
            if config.accumulation.reduction == "mean":
                scale = config.accumulation.factor * self.replicas
                acc = {n: g / scale for n, g in acc.items()}
            t, rest = split_w(w)
            new, state = self.backend.optimizer.apply(hyper, t, acc, state)
            return {**rest, **new}, state, jax.tree.map(jnp.zeros_like, acc)

        if last:
            programs["loss"] = jax.jit(loss_stage, donate_argnums=(5,))
        else:
            programs["stash"] = jax.jit(stash)
            programs["back"] = jax.jit(back, donate_argnums=(2,))
            programs["again"] = jax.jit(back_again, donate_argnums=(6,))
        # the first update of a run reads the committed state (maybe the very arrays: a
        # device_put to their own device does not copy), which a failed, refused or interrupted
        # run must leave intact; later updates donate the state the run made
        programs["apply"] = jax.jit(apply, donate_argnums=(2,))
        programs["apply_again"] = jax.jit(apply, donate_argnums=(1, 2))
        return programs

    def programs(self, s: int) -> dict[str, Any]:
        if s not in self._programs:
            self._programs[s] = self._make(self.stages[s])
        return self._programs[s]

    def stash_bytes(self) -> dict[str, list[int]]:
        """Bytes one micro-batch keeps on each stage (but the last) between its forward and
        backward: the linearisation (no recomputation) or the stage's inputs (recomputation)."""
        out: dict[str, list[int]] = {"stashed": [], "recomputed": []}
        host = self._host_streams_shapes()
        for st in self.stages[:-1]:
            w = {k: jax.ShapeDtypeStruct(self.backend.graph.weights[k].shape,
                                         jax.dtypes.canonicalize_dtype(
                                             self.backend.graph.weights[k].dtype))
                 for k in st.weights}
            r = self._receive_shapes(st)
            x = {k: host[k] for k in st.streams}
            m = jax.ShapeDtypeStruct((), jnp.int32)
            _, _, vjp = jax.eval_shape(self.programs(st.index)["stash"], w, r, x, m)
            size = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(vjp))
            out["stashed"].append(size)
            # recomputation keeps the stage's inputs: what it received and its stream slices
            kept = [*jax.tree.leaves(r), *(jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
                                          for v in x.values())]
            out["recomputed"].append(sum(int(np.prod(a.shape)) * a.dtype.itemsize
                                         for a in kept))
        return out

    def in_flight(self, s: int) -> int:
        """The most micro-batches stage ``s`` holds between their forward and backward."""
        held = most = 0
        for a in self.schedule.for_stage(s):
            held += (a.kind == "F") - (a.kind == "B")
            most = max(most, held)
        return most if self.training and s < len(self.stages) - 1 else 0

    def memory_parts(self) -> list[dict[str, int]]:
        """Each stage's memory by part, from shapes alone: weights (training: the committed
        and the new ones, the gradient accumulator and the optimizer state, committed and new),
        its stream inputs, its stashed activations (in-flight micro-batches x what one keeps)
        and the anchors it keeps; with worker processes, also each worker's copy of the
        model."""
        b = self.backend
        kept, summed = self._keeping
        stash = (self.stash_bytes()["recomputed" if self.recompute else "stashed"] + [0]
                 if self.training else [0] * len(self.stages))
        shapes = self._host_streams_shapes()
        every = set(b.trained) if self.training else set()
        found = {t: b.io.anchors[a][0] for a in b.anchors for t in [self._key(a)]}
        if self.training:
            found[b.loss] = b._shapes(b.io.inputs, [b.loss])[b.loss]
        out = []
        for s, st in enumerate(self.stages):
            weights = sum(int(b.graph.weights[k].nbytes) for k in st.weights)
            parts = {"weights": weights * (2 if self.training else 1),
                     "stream inputs": sum(_nbytes(shapes[k]) for k in st.streams),
                     "stashed activations": self.in_flight(s) * stash[s],
                     "anchors kept": sum(
                         (len(kept[t]) + (t in summed)) * self.replicas * _nbytes(found[t])
                         for t in [*st.anchors, *(GRADIENT_PREFIX + p for p in st.probes)])}
            if self.training:
                trained = self._trained(st)
                state = _select(b._opt_state, set(trained), every)
                parts["optimizer state and gradients"] = sum(
                    int(b.graph.weights[k].nbytes) for k in trained) + 2 * sum(
                    _nbytes(a) for a in jax.tree.leaves(state))
            if self.processes is not None:  # while it starts; then only its stage's part
                parts["the worker's copy of the model"] = 3 * sum(
                    int(w.nbytes) for w in b.graph.weights.values())
            out.append(parts)
        return out

    def check_memory(self) -> None:
        """Refuse (K-memory) a step whose stages cannot fit their devices, before anything is
        allocated for it; on CPU every stage counts against the host's RAM."""
        per_stage = self.memory_parts()
        fix = (f"run fewer micro-batches per step (batches_per_step="
               f"{self.backend.config.batches_per_step}), keep fewer anchors (Final or Sum "
               f"instead of All)" + ("" if self.recompute or not self.training else
                                     ", or recompute each stage's forward in its backward "
                                     "(pipeline.recomputation='standard')") + ".")
        on_host = self.processes is not None or self.devices[0][0].platform == "cpu"
        if on_host:
            total: dict[str, int] = {}
            for parts in per_stage:
                for k, v in parts.items():
                    total[k] = total.get(k, 0) + v
            detail = {f"stage {s} {k}": v for s, parts in enumerate(per_stage)
                      for k, v in parts.items()}
            check_fits("pipelined step", total, jax.devices("cpu")[0], fix, detail)
            self.backend.memory = total
        else:
            for s, parts in enumerate(per_stage):
                check_fits(f"pipeline stage {s}", parts, self.devices[s][0], fix)
            self.backend.memory = {f"stage {s} {k}": v for s, parts in enumerate(per_stage)
                                   for k, v in parts.items()}
        self._checked = True

    def _host_streams_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        return dict(self.backend._inputs)

    def _receive_shapes(self, st: Stage) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct((self.replicas, *st.graph.inputs[k][0]),
                                        st.graph.inputs[k][1]) for k in st.receives}

    # -- state ----------------------------------------------------------------------------

    def _stage_state(self) -> tuple[list[dict], list[Any]]:
        """The committed weights (and optimizer state) split over the stages' devices."""
        b = self.backend
        weights = [jax.device_put({k: b._weights[k] for k in st.weights}, self._where(s))
                   for s, st in enumerate(self.stages)]
        if not self.training:
            return weights, []
        every = set(b.trained)
        states = [jax.device_put(_select(b._opt_state, set(self._trained(st)), every),
                                 self._where(s)) for s, st in enumerate(self.stages)]
        return weights, states

    # -- a run ----------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.start()
        host = self.backend._host_inputs(inputs)
        ctx = self._in_processes(host) if self.processes is not None else self._here(host)
        self.trace = sorted(ctx["trace"], key=lambda e: e[2])
        out = self._finish(host, ctx)
        if self.processes is not None:  # what the workers now hold is committed
            self._held = (self.backend._weights, getattr(self.backend, "_opt_state", None))
        return out

    def _in_processes(self, host: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """A run by the stages' worker processes: each gets its stage's inputs and committed
        state, and hands back its anchors, new state and trace."""
        b = self.backend
        every = set(b.trained) if self.training else set()
        hyper = jax.device_get(b._hyper) if self.training else None
        # the workers keep the state of the last run that committed: sent only when it changed
        held = self._held is not None and self._held[0] is b._weights and (
            self._held[1] is getattr(b, "_opt_state", None))
        self._held = None  # until this run commits
        payloads = [dict(
            streams={k: host[k] for k in st.streams},
            weights=None if held else jax.device_get({k: b._weights[k] for k in st.weights}),
            states=(jax.device_get(_select(b._opt_state, set(self._trained(st)), every))
                    if self.training and not held else None),
            hyper=hyper) for st in self.stages]
        results = self.processes.run(payloads)
        put = b.placement.put_everywhere
        return dict(outputs={k: v for r in results for k, v in r["outputs"].items()},
                    sums={k: v for r in results for k, v in r["sums"].items()},
                    weights=[put(r["weights"]) for r in results] if self.training else [],
                    states=[put(r["states"]) for r in results] if self.training else [],
                    trace=[e for r in results for e in r["trace"]])

    def _here(self, host: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """A run by this process: one thread per stage device, or one dispatching thread."""
        b = self.backend
        io = b.io.inputs
        streams = [jax.device_put({k: host[k] for k in st.streams},
                                  {k: self._where(s, None if io[k].broadcast else 1)
                                   for k in st.streams})
                   for s, st in enumerate(self.stages)]
        weights, states = self._stage_state()
        hyper = [jax.device_put(b._hyper, self._where(s)) if self.training else None
                 for s in range(len(self.stages))]
        accs = [{k: jnp.zeros_like(w[k]) for k in self._trained(st)} if self.training else None
                for st, w in zip(self.stages, weights, strict=True)]
        board = stage_worker.Board()
        outputs: dict[tuple[str, int], Any] = {}  # (tensor, micro-batch) -> value kept
        trace: list[tuple[Action, int, float, float]] = []
        ctx = dict(streams=streams, weights=weights, states=states, hyper=hyper, accs=accs,
                   board=board, outputs=outputs, sums={}, trace=trace, lock=threading.Lock())
        for s in range(len(self.stages)):
            self.programs(s)
        if self.threads:
            self._in_threads(ctx)
        else:
            for group in self.schedule.by_slot():
                for action in group:
                    self._act(action, ctx, self._receive(action, ctx))
        return ctx

    def _in_threads(self, ctx: dict) -> None:
        """The stages' actions by a thread per stage. A failure in a stage, or an exception
        (KeyboardInterrupt included) in this thread while it waits, stops every stage at its
        next action, and this returns only once they have all stopped, then raises it: no
        stage runs on after its run has ended."""
        board = ctx["board"]
        workers = [threading.Thread(target=self._worker, args=(s, ctx), daemon=True,
                                    name=f"pipeline stage {s}")
                   for s in range(len(self.stages))]
        try:
            for t in workers:
                t.start()
            for t in workers:
                t.join()
        except BaseException as error:
            board.fail(error)
            for t in workers:
                if t.ident is not None:  # started
                    t.join()
            raise
        if board.failed is not None:
            raise board.failed

    def _worker(self, s: int, ctx: dict) -> None:
        """Stage ``s``'s actions in order, until they are done or the run has failed."""
        try:
            for action in self.schedule.for_stage(s):
                if ctx["board"].failed is not None:
                    return
                got = self._receive(action, ctx)  # waiting for a neighbour is idle time
                start = time.perf_counter()
                done = self._act(action, ctx, got)
                jax.block_until_ready(done)
                end = time.perf_counter()
                if self.record and action.kind != "U":
                    with ctx["lock"]:
                        ctx["trace"].append((action, s, start, end))
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            ctx["board"].fail(error)

    def _index(self, a: Action) -> int:
        return a.update * self.schedule.micro_batches + (a.micro_batch or 0)

    def _receive(self, a: Action, ctx: dict) -> Any:
        """What action ``a`` waits for: the activations from the stage before (F), or the
        gradient from the stage after and its own stash (B), on its device."""
        s, board, dev = a.stage, ctx["board"], self._where(a.stage, 0)
        m = self._index(a)
        if a.kind == "F":
            return jax.device_put(board.take(("F", s - 1, m)), dev) if s else {}
        if a.kind == "B" and s < len(self.stages) - 1:
            return jax.device_put(board.take(("B", s + 1, m)), dev), board.take(("stash", s, m))
        return None

    def _act(self, a: Action, ctx: dict, got: Any) -> Any:
        """Action ``a`` given what it received; returns what to wait for to see it done."""
        s, board = a.stage, ctx["board"]
        p = self.programs(s)
        last = s == len(self.stages) - 1
        m = self._index(a)
        x = ctx["streams"][s]
        if a.kind == "F":
            recv = got
            w = ctx["weights"][s]
            if not self.training:
                carry, aux = p["forward"](w, recv, x, np.int32(m))
            elif last:  # its aux has the stage's gradient anchors too
                ctx["accs"][s], grad, aux = p["loss"](w, recv, x, np.int32(m), ctx["hyper"][s],
                                                      ctx["accs"][s])
                carry = {}
                board.put(("B", s, m), grad)
            elif self.recompute or not self.accumulate:
                carry, aux = p["forward"](w, recv, x, np.int32(m))
                board.put(("stash", s, m), (w, recv))
            else:
                carry, aux, vjp = p["stash"](w, recv, x, np.int32(m))
                board.put(("stash", s, m), vjp)
            if not last:
                board.put(("F", s, m), carry)
            self._keep(ctx, m, aux)
            return (carry, aux)
        if a.kind == "B":
            if last:
                return None  # done with the forward, in the same slot
            g, stashed = got
            if isinstance(stashed, tuple):
                w_then, recv = stashed
                ctx["accs"][s], grad, probed = p["again"](w_then, ctx["weights"][s], recv, x,
                                                          np.int32(m), g, ctx["accs"][s])
            else:
                ctx["accs"][s], grad, probed = p["back"](stashed, g, ctx["accs"][s])
            self._keep(ctx, m, _gradients(probed))
            if s:
                board.put(("B", s, m), grad)
            return grad
        if not self._trained(self.stages[s]):
            return None
        # m == 0: the stage's first update of the run, which reads the committed state
        apply = p["apply" if m == 0 else "apply_again"]
        ctx["weights"][s], ctx["states"][s], ctx["accs"][s] = apply(
            ctx["weights"][s], ctx["states"][s], ctx["accs"][s], ctx["hyper"][s])
        return ctx["weights"][s]

    def _key(self, anchor: str) -> str:
        """What a run keeps for ``anchor``: its tensor's values, or (a gradient anchor) the
        gradients under the anchor's own name."""
        return anchor if anchor.startswith(GRADIENT_PREFIX) else self.backend._anchor_tensor(
            anchor)

    def _kept(self) -> tuple[dict[str, frozenset[int]], set[str]]:
        """For each value the stages compute for the anchors (a tensor, or a gradient anchor):
        the micro-batches a run keeps (those its anchors return, and every loss for the
        finiteness check), and which are summed instead (Sum anchors), so a run holds no more
        than it returns."""
        b, config = self.backend, self.backend.config
        computed = {t for st in self.stages for t in st.anchors} | {
            GRADIENT_PREFIX + t for st in self.stages for t in st.probes}
        kept: dict[str, set[int]] = {t: set() for t in computed}
        summed: set[str] = set()
        for name, art in b.anchors.items():
            t = self._key(name)
            if t not in computed:
                continue
            if art.name == "Sum":
                summed.add(t)
            else:
                kept[t].update(art.returned_micro_batches(config.batches_per_step,
                                                          config.accumulation.factor))
        if self.training:
            kept[b.loss].update(range(b.micro_batches))
        return {t: frozenset(v) for t, v in kept.items()}, summed

    def _keep(self, ctx: dict, m: int, aux: Mapping[str, Any]) -> None:
        kept, summed = self._keeping
        for t, v in aux.items():
            if m in kept[t]:
                ctx["outputs"][(t, m)] = v
            if t in summed:
                ctx["sums"][t] = v if t not in ctx["sums"] else ctx["sums"][t] + v

    def _finish(self, host: Mapping[str, np.ndarray], ctx: dict) -> dict[str, np.ndarray]:
        b, config = self.backend, self.backend.config
        values = b.placement.fetch({"kept": ctx["outputs"], "sums": ctx["sums"]})
        kept, sums = values["kept"], values["sums"]
        for t in {self._key(a) for a in b.anchors} - set(self._keeping[0]):
            v = host[t]  # a stream input anchored: [micro-batches, (replicas,) ...]
            v = v if v.ndim > len(b.io.inputs[t].shape) + 1 else np.repeat(
                v[:, None], self.replicas, axis=1)
            kept.update(((t, m), v[m]) for m in range(b.micro_batches))
            sums[t] = v.sum(axis=0, dtype=v.dtype)
        if self.training and b.check_finite:
            losses = np.stack([kept[(b.loss, m)] for m in range(b.micro_batches)]).reshape(
                config.batches_per_step, -1)
            ends = b.placement.fetch({k: jnp.isfinite(v).all() for w in ctx["weights"]
                                      for k, v in w.items() if k in b.trained})
            flags = np.array([bool(np.isfinite(row).all()) for row in losses]
                             + [bool(ends[k]) for k in b.trained])
            if not flags.all():
                b._refuse_non_finite(flags)
        out = {}
        for name, art in b.anchors.items():
            t = self._key(name)
            if art.name == "Sum":
                v = np.asarray(sums[t])
            else:
                v = np.stack([kept[(t, m)] for m in art.returned_micro_batches(
                    config.batches_per_step, config.accumulation.factor)])
            out[name] = np.ascontiguousarray(v).reshape(b._anchor_shapes[name])
        if self.training:  # the commit, after everything that can fail
            every = set(b.trained)
            merged = {k: v for w in ctx["weights"] for k, v in w.items()}
            b._weights = {**b._weights, **merged}
            b._opt_state = _merge(ctx["states"], every) if ctx["states"] else b._opt_state
        return out
