"""Pipelined execution on the xla backend: each stage its own programs on its own devices, run
by the :class:`~popart_kit._base.schedule.PipelineSchedule`.

**Split.** The lowered graph is cut at the model's stage annotations (read by
:attr:`PipelineLayout.tensor_stages`: ``__pipeline_stage``, else ``__ipu_number`` as PopART
infers stages) into one :class:`~.stages.Stage` each. Stage s receives from stage s - 1 every
tensor a later stage needs (PopART's chain of IPU copies), reads its own stream inputs and owns
the weights its nodes read. Where stages run is the :class:`~.placement.Placement`'s: as many
devices each as the unpipelined placement gives the R local replicas (so R x K devices for R
replicas of K stages where the host has them), else one, its programs running the replicas
vectorised. On CPU that is one device per stage, and the stages of one process share its threads
(XLA:CPU has one intra-op pool per process): ``pipeline_workers="processes"`` puts each stage in
a worker process of its own (``stage_processes.py``). Fewer devices than stages: the backend
says so once and runs unpipelined.

**Executor.** :class:`PipelineExecutor` implements the executors' protocol
(:mod:`.executors`). Each stage has a :class:`~.stages.StageRunner` (in a thread here, or in its
worker process) that does its stage's actions in the schedule's order, waiting for the
activations (forward) or gradients (backward) it needs from its neighbours; stages run at once,
and each action's start (once its inputs are there) and end are recorded
(:attr:`PipelineExecutor.trace`), from which the measured bubble follows. Gradients accumulate
per stage on its devices; the replicas' gradients are summed inside each stage's vectorised
backward, and each update goes through :func:`~.state.apply_update` - over several instances
as one program across the instances' stage devices, whose reduction sums every instance's
gradient. A run keeps only the micro-batches its anchors return (Sum anchors are summed on the
stage).

**Atomic runs.** A run's new state is returned, not kept: the backend commits it once the run
has succeeded. No program donates the committed state (a stage's first update of a run reads
it; later ones donate the state the run made), and a failure or KeyboardInterrupt stops every
stage before the run raises, so a failed, refused or interrupted run leaves the session as it
was.

**Stashing and recomputation.** Without recomputation a forward keeps its stage's
linearisation (JAX's residuals: PopART's stashed activations) for the backward. With
``pipeline.recomputation`` standard, recompute_all or pipeline, a forward keeps only its
stage's inputs and the backward recomputes the stage forward (PopART's recompute of a stage
from its stashed inputs); :meth:`PipelineExecutor.stash_bytes` measures both. ``norm_only``
recomputes normalisations inside a stage, which XLA fuses anyway: it is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from ..._base.names import GRADIENT_PREFIX
from ..._base.schedule import Action, PipelineSchedule, chrome_trace, measured_bubble
from ..._base.shapes import AnchorReturnType, StepShape
from ..._model.builder_subgraphs import node_reads
from ..._model.layout import PipelineLayout
from ...errors import ConfigError
from .executors import StepResult
from .lowering import LoweredGraph
from .memory import check_fits
from .ops import partials
from .ops_graphcore_nn import group_norm_channels
from .ops_random import RANDOM_STREAM
from .placement import PROCESS, Placement
from .stages import Board, RunContext, Stage, StagePrograms, StageRunner, StageSpec
from .state import Reduction, SessionState, reduce_gradients

__all__ = ["PipelineFacts", "PipelineExecutor", "split", "pipeline_for", "RECOMPUTE",
           "WORKERS"]

#: pipeline.recomputation values that mean "recompute a stage's forward in its backward".
RECOMPUTE = frozenset({"standard", "recompute_all", "pipeline"})
#: Where stages run: threads of this process (one virtual device each), or worker processes.
WORKERS = ("threads", "processes")


@dataclass(frozen=True)
class PipelineFacts:
    """What the pipeline is told of a session: its model and lowered graph, config, host
    layout (``io``), anchors (``tensors``: the tensor whose values each returns), their host
    shapes, placement, ``shapes(wanted)`` (one micro-batch's shapes of tensors), the
    program's canonical inputs and the run's shape; for training the loss, gradient anchors
    (anchor -> tensor), trained weights, optimizer and whether runs are checked for NaN/Inf."""

    model: onnx.ModelProto
    graph: LoweredGraph
    config: Any
    io: Any
    anchors: dict[str, AnchorReturnType]
    tensors: dict[str, str]
    anchor_shapes: dict[str, tuple[int, ...]]
    placement: Placement
    shapes: Callable[[list[str]], dict[str, Any]]
    program_inputs: dict[str, jax.ShapeDtypeStruct]
    shape: StepShape
    loss: str | None = None
    gradients: dict[str, str] = field(default_factory=dict)
    trained: list[str] = field(default_factory=list)
    optimizer: Any = None
    check_finite: bool = True

    @property
    def training(self) -> bool:
        return self.loss is not None

    def key(self, anchor: str) -> str:
        """The value a run keeps for ``anchor``: its tensor's, or (a gradient anchor) the
        gradient under the anchor's own name."""
        return anchor if anchor in self.gradients else self.tensors[anchor]


def split(facts: PipelineFacts, wanted: list[str], gradients: list[str] = ()
          ) -> list[Stage] | str:
    """The graph as one stage each, or why it cannot be split. ``wanted``: tensors whose
    values are anchored; ``gradients``: those whose gradients are."""
    model, graph = facts.model, facts.graph
    stage_of = PipelineLayout.from_model(model).tensor_stages
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
        for i in node_reads(node):
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
    shapes = facts.shapes(list(producer_stage))
    io = facts.io.inputs
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
        inputs.update((i, (tuple(io[i].shape),
                           np.dtype(jax.dtypes.canonicalize_dtype(io[i].dtype))))
                      for i in streams)
        part = graph.part(made, inputs)
        if RANDOM_STREAM in facts.program_inputs:  # every stage gets its micro-batches' seeds
            streams += (RANDOM_STREAM,)
        stages.append(Stage(
            s, frozenset(made), inputs, carried, streams, tuple(sorted(part.weights)), sends,
            tuple(t for t in wanted if t in made or owner.get(t) == s and t in graph.weights),
            tuple(t for t in gradients if t in made or owner.get(t) == s), part))
        carried = sends
    unplaced = [t for t in wanted if t not in producer_stage and t not in graph.inputs
                and t not in owner]
    unplaced += [t for t in gradients if t not in producer_stage and t not in owner]
    if unplaced:
        return f"anchor(s) on {unplaced} are constants or unread, not computed by a stage"
    return stages


def pipeline_for(facts: PipelineFacts, workers: str = "threads"
                 ) -> tuple[PipelineExecutor | None, str]:
    """The executor a pipelined session runs with, or None and why not (``workers``: see
    :data:`WORKERS`)."""
    config = facts.config
    if config.pipeline.recomputation == "norm_only":
        raise ConfigError("pipeline.recomputation='norm_only' recomputes normalisations "
                          "inside a stage, which has no meaning on the xla backend (XLA fuses "
                          "them already). Fix: use 'none', or 'standard' to recompute each "
                          "stage's forward in its backward.", rule="K-xla-recompute")
    if facts.training and getattr(facts.optimizer, "clip_norm", ()):
        return None, ("gradient clipping (ClipNormSettings) scales each weight's gradient by a "
                      "norm of several weights, which the stages' separate updates cannot see")
    wanted = list(dict.fromkeys([*(facts.tensors[a] for a in facts.anchors
                                   if a not in facts.gradients),
                                 *([facts.loss] if facts.training else [])]))
    stages = split(facts, wanted, list(dict.fromkeys(facts.gradients.values())))
    if isinstance(stages, str):
        return None, stages
    if facts.training and facts.loss not in stages[-1].anchors:
        return None, f"the loss {facts.loss!r} is not computed on the last stage"
    if workers == "processes":
        return PipelineExecutor(facts, stages, None), ""
    return PipelineExecutor(facts, stages, facts.placement.stage_devices(len(stages))), ""


def _nbytes(array: Any) -> int:
    """Bytes of an array, or of anything with its shape and dtype."""
    return int(np.prod(array.shape, dtype=np.int64)) * np.dtype(array.dtype).itemsize


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

    ``devices``: each stage's devices (None: the stages run in worker processes, see
    ``stage_processes.py``). ``record``: keep :attr:`trace` (action, stage, start, end in
    seconds) of the last run; ``threads``: one thread per stage (else every action is
    dispatched from one thread in schedule order and JAX's asynchronous dispatch overlaps
    them; no trace then)."""

    def __init__(self, facts: PipelineFacts, stages: list[Stage],
                 devices: list[list[jax.Device]] | None) -> None:
        self.facts, self.stages, self.devices = facts, stages, devices
        config = facts.config
        self.training = facts.training
        self.schedule = PipelineSchedule.for_config(config, len(stages))
        self.replicas = facts.shape.replicas
        self.recompute = config.pipeline.recomputation in RECOMPUTE
        self.record, self.threads = True, True
        self.trace: list[tuple[Action, int, float, float]] = []
        self.programs: list[Any] = []  # stage programs compile as they first run
        self.memory: dict[str, int] = {}
        self.specs = self._specs()
        self._updates_per_run = sum(a.kind == "U" for a in self.schedule.for_stage(0))
        self._runners: dict[int, StageRunner] = {}
        self.processes: Any = None  # StageProcesses, with pipeline_workers="processes"
        self._sums: dict[int, Callable] = {}  # stage -> its gradients' sum over instances
        if devices is None:
            from .stage_processes import StageProcesses

            self.processes = StageProcesses(
                self._worker_init, len(stages),
                serve=self._sum_over_instances if self.specs[0].exchange else None)
        self._held: SessionState | None = None  # the state the workers hold
        self._checked = False  # the memory check

    # -- the stages' descriptions ----------------------------------------------------------

    def _kept(self) -> tuple[dict[str, frozenset[int]], frozenset[str]]:
        """For each value the stages compute for the anchors (a tensor, or a gradient anchor):
        the micro-batches a run keeps (those its anchors return, and every loss for the
        finiteness check), and which are summed instead (Sum anchors), so a run holds no more
        than it returns."""
        f = self.facts
        computed = {t for st in self.stages for t in st.anchors} | {
            GRADIENT_PREFIX + t for st in self.stages for t in st.probes}
        kept: dict[str, set[int]] = {t: set() for t in computed}
        summed: set[str] = set()
        for name, art in f.anchors.items():
            t = f.key(name)
            if t not in computed:
                continue
            if art.name == "Sum":
                summed.add(t)
            else:
                kept[t].update(f.shape.returned(art))
        if self.training:
            kept[f.loss].update(range(f.shape.micro_batches))
        return {t: frozenset(v) for t, v in kept.items()}, frozenset(summed)

    def _specs(self) -> list[StageSpec]:
        f = self.facts
        kept, summed = self._kept()
        broadcast = frozenset(k for k, s in f.io.inputs.items() if s.broadcast)
        # over instances the update sums every instance's gradient: inside its program with
        # stage threads, or in the session's process, asked by each worker (``exchange``)
        across = f.placement.distributed and self.devices is not None
        reduction = Reduction.of(f.config, (PROCESS,) if across else (), flat=across)
        exchange = f.placement.distributed and self.devices is None
        out = []
        for st in self.stages:
            probes = {t: (tuple(f.io.anchors[GRADIENT_PREFIX + t][0].shape),
                          np.dtype(f.io.anchors[GRADIENT_PREFIX + t][0].dtype))
                      for t in st.probes}
            out.append(StageSpec(
                st, len(self.stages), self.replicas, self.schedule, broadcast, kept, summed,
                self.recompute, f.loss, tuple(w for w in st.weights if w in f.trained),
                f.optimizer, reduction, exchange, probes))
        return out

    def _worker_init(self) -> dict[str, Any]:
        """What a stage worker process is sent when it starts: the model (each builds its
        own stage's part) and every stage's spec (it takes its own)."""
        return dict(model=self.facts.model.SerializeToString(),
                    stages=[spec.portable() for spec in self.specs])

    def _sum_over_instances(self, s: int, gradient: Any) -> Any:
        """Stage ``s``'s gradient (host arrays, from its worker) summed over every instance: one
        all-reduce between this stage's counterparts in the instances' processes, each stage
        on a device of its own so the stages' sums never wait for one another."""
        if s not in self._sums:
            placement = self.facts.placement
            devices = jax.local_devices(backend=placement.platform)
            self._sums[s] = placement.across_instances(
                lambda g: reduce_gradients(g, Reduction((PROCESS,), flat=True)), (),
                devices[s % len(devices)])
        return jax.device_get(self._sums[s](gradient))

    # -- where stages run -----------------------------------------------------------------

    @property
    def placement(self) -> dict[tuple[int, int], Any]:
        """(replica, stage) -> device (a :class:`~.stage_processes.WorkerDevice` when the
        stages run in worker processes, once the backend has prepared and started them)."""
        if self.processes is not None:
            self.start()
            return {(r, s): d for s, d in enumerate(self.processes.devices)
                    for r in range(self.replicas)}
        assert self.devices is not None
        return {(r, s): group[r * len(group) // self.replicas]
                for s, group in enumerate(self.devices) for r in range(self.replicas)}

    def _where(self, s: int, replica_axis: int | None = None) -> Any:
        assert self.devices is not None
        return self.facts.placement.on_stage(self.devices[s], replica_axis)

    def runner(self, s: int) -> StageRunner:
        """Stage ``s``'s runner in this process (its programs are also what the memory
        estimate traces, with worker processes)."""
        if s not in self._runners:
            spec = self.specs[s]
            if self.devices is None:
                programs = StagePrograms(spec)
                where: Callable[[int | None], Any] = lambda axis: jax.devices()[0]  # noqa: E731
            else:
                device = self.devices[s][0]
                programs = StagePrograms(spec, lambda fn, donate: self.facts.placement
                                         .across_instances(fn, donate, device))
                where = lambda axis, s=s: self._where(s, axis)  # noqa: E731
            self._runners[s] = StageRunner(spec, programs, where)
            self._runners[s].record = self.record
        return self._runners[s]

    @property
    def measured_bubble(self) -> float:
        """The idle share of the devices over the last recorded run."""
        return measured_bubble([(d, a, b) for _, d, a, b in self.trace])

    def chrome_trace(self) -> dict[str, Any]:
        """The last run's :attr:`trace` as Chrome trace events: ``json.dump`` it and open the
        file in Perfetto (ui.perfetto.dev) or chrome://tracing to see the stages overlap."""
        return chrome_trace(self.trace)

    # -- the executor protocol ------------------------------------------------------------

    def prepare(self, state: SessionState, hyper: Any) -> None:
        """Check the step fits, then start the stages' worker processes if they run in
        processes (the stage programs compile as they first run)."""
        if not self._checked:
            self.check_memory(state)
        self.start()

    def start(self) -> None:
        if not self._checked:
            raise RuntimeError("the pipeline is started by its backend's prepare()")
        if self.processes is not None and self.processes.start():
            self._held = None  # new workers: the next run sends them the committed state

    def close(self) -> None:
        """Stop the stage worker processes, if any (a later run starts new ones)."""
        if self.processes is not None:
            self.processes.close()

    def run(self, inputs: Mapping[str, np.ndarray], state: SessionState,
            hyper: Any) -> StepResult:
        self.start()
        config = self.facts.config
        with jax.default_matmul_precision("float32"), partials(config.precision.partials_type), \
                group_norm_channels(config.popart_options.get("groupNormStridedChannelGrouping")):
            if self.processes is not None:
                ctx = self._in_processes(inputs, state, hyper)
            else:
                ctx = self._here(inputs, state, hyper)
        self.trace = sorted(ctx.trace, key=lambda e: e[2])
        result = self._finish(inputs, state, ctx)
        if self.processes is not None:  # what the workers hold, should the run be committed
            self._held = result.state if result.state is not None else state
        return result

    def _stage_states(self, state: SessionState) -> list[SessionState]:
        """The committed state split over the stages."""
        every = set(self.facts.trained)
        return [SessionState({k: state.weights[k] for k in st.weights},
                             _select(state.optimizer, set(spec.trained), every)
                             if self.training else (), state.updates)
                for st, spec in zip(self.stages, self.specs, strict=True)]

    def _in_processes(self, host: Mapping[str, np.ndarray], state: SessionState,
                      hyper: Any) -> RunContext:
        """A run by the stages' worker processes: each gets its stage's inputs and, when it
        holds another, the committed state; each hands back what it kept, its new state and
        its trace."""
        held = self._held is state
        self._held = None  # until this run is done
        states = None if held else jax.device_get(self._stage_states(state))
        hyper = jax.device_get(hyper)
        payloads = [dict(streams={k: host[k] for k in st.streams},
                         state=None if states is None else states[s], hyper=hyper)
                    for s, st in enumerate(self.stages)]
        results = self.processes.run(payloads)
        put = self.facts.placement.put_everywhere
        ctx = RunContext(streams=[], states=[put(r["state"]) if self.training else None
                                             for r in results], hyper=[], accs=[],
                         board=Board())
        for r in results:
            ctx.outputs.update(r["outputs"])
            ctx.sums.update(r["sums"])
            ctx.trace.extend(r["trace"])
        return ctx

    def _here(self, host: Mapping[str, np.ndarray], state: SessionState,
              hyper: Any) -> RunContext:
        """A run by this process: one thread per stage, or one dispatching thread."""
        io = self.facts.io.inputs
        placement = self.facts.placement
        streams = [placement.stage_put({k: host[k] for k in st.streams}, self.devices[s],
                                       {k: None if k in io and io[k].broadcast else 1
                                        for k in st.streams})
                   for s, st in enumerate(self.stages)]
        local = placement.local_copy((state, hyper))
        states = [placement.to_stage(st, self.devices[s])
                  for s, st in enumerate(self._stage_states(local[0]))]
        hypers = [placement.to_stage(local[1], group) for group in self.devices]
        accs = [{k: jnp.zeros_like(st.weights[k]) for k in spec.trained}
                if self.training else None
                for st, spec in zip(states, self.specs, strict=True)]
        ctx = RunContext(streams, list(states), hypers, accs, Board())
        runners = [self.runner(s) for s in range(len(self.stages))]
        for r in runners:
            r.record = self.record
        if self.threads:
            self._in_threads(runners, ctx)
        else:
            for group in self.schedule.by_slot():
                for action in group:
                    runner = runners[action.stage]
                    runner.act(action, ctx, runner.receive(action, ctx))
        return ctx

    @staticmethod
    def _in_threads(runners: list[StageRunner], ctx: RunContext) -> None:
        """The stages' actions by a thread per stage. A failure in a stage, or an exception
        (KeyboardInterrupt included) in this thread while it waits, stops every stage at its
        next action, and this returns only once they have all stopped, then raises it: no
        stage runs on after its run has ended.

        A stage's end is its own event, set once its frames (and the arrays they held) are
        gone, not ``Thread.join``: on Python before 3.13 a join interrupted by Ctrl-C marks a
        thread that is still running as stopped (``_wait_for_tstate_lock`` releases the lock
        the live thread holds), so a later join returns at once and the stage could free its
        arrays while the interpreter finalizes - jaxlib's ``~PyArray_Storage`` then takes the
        GIL back, the thread is unwound by ``pthread_exit`` through that destructor, and the
        process aborts instead of ending by SIGINT. A thread that had not begun when the run
        failed does nothing but see the failure."""
        ended = [threading.Event() for _ in runners]

        def stage(runner: StageRunner, end: threading.Event) -> None:
            try:
                runner.run(ctx)
            finally:
                end.set()  # run's frame, and every array it held, is gone by now

        workers = [threading.Thread(target=stage, args=(r, e), daemon=True,
                                    name=f"pipeline stage {r.index}")
                   for r, e in zip(runners, ended, strict=True)]
        try:
            for t in workers:
                t.start()
            for e in ended:
                e.wait()
        except BaseException as error:
            ctx.board.fail(error)
            for t, e in zip(workers, ended, strict=True):
                if t.ident is not None:  # begun before the failure: it may be mid-action
                    e.wait()
            raise
        finally:
            for t in workers:
                if t.ident is not None:
                    t.join()  # past its last array: only the thread's own teardown is left
        if ctx.board.failed is not None:
            raise ctx.board.failed

    def _finish(self, host: Mapping[str, np.ndarray], state: SessionState,
                ctx: RunContext) -> StepResult:
        """The anchors, the new state (stages' states merged) and the finiteness flags."""
        f = self.facts
        values = f.placement.fetch({"kept": ctx.outputs, "sums": ctx.sums})
        kept, sums = values["kept"], values["sums"]
        for t in {f.key(a) for a in f.anchors} - set(self.specs[0].kept):
            v = host[t]  # a stream input anchored: [micro-batches, (replicas,) ...]
            v = v if v.ndim > len(f.io.inputs[t].shape) + 1 else np.repeat(
                v[:, None], self.replicas, axis=1)
            kept.update(((t, m), v[m]) for m in range(f.shape.micro_batches))
            sums[t] = v.sum(axis=0, dtype=v.dtype)
        anchors = {}
        for name, art in f.anchors.items():
            t = f.key(name)
            if art.name == "Sum":
                anchors[name] = np.asarray(sums[t])
            else:
                anchors[name] = np.stack([kept[(t, m)] for m in f.shape.returned(art)])
        if not self.training:
            return StepResult(anchors)
        stage_states = [s for s in ctx.states if s is not None]
        every = set(f.trained)
        new = SessionState(
            {**state.weights, **{k: v for s in stage_states for k, v in s.weights.items()}},
            _merge([s.optimizer for s in stage_states], every),
            state.updates + self._updates_per_run)  # counted, not fetched from the stages
        # a trained weight's Final anchor is PopART's end-of-step copy: after the last update
        final = [n for n, art in f.anchors.items() if art.name == "Final" and n in f.trained]
        for name, value in f.placement.fetch({n: new.weights[n] for n in final}).items():
            anchors[name] = np.broadcast_to(value, anchors[name].shape).astype(
                anchors[name].dtype)
        flags = None
        if f.check_finite:
            losses = np.stack([kept[(f.loss, m)] for m in range(f.shape.micro_batches)]
                              ).reshape(f.shape.batches_per_step, -1)
            ends = f.placement.fetch({k: jnp.isfinite(v).all() for s in stage_states
                                      for k, v in s.weights.items() if k in every})
            flags = np.array([bool(np.isfinite(row).all()) for row in losses]
                             + [bool(ends[k]) for k in f.trained])
        return StepResult(anchors, new, flags)

    # -- memory ---------------------------------------------------------------------------

    def stash_bytes(self) -> dict[str, list[int]]:
        """Bytes one micro-batch keeps on each stage (but the last) between its forward and
        backward: the linearisation (no recomputation) or the stage's inputs (recomputation)."""
        out: dict[str, list[int]] = {"stashed": [], "recomputed": []}
        host = self.facts.program_inputs
        for st in self.stages[:-1]:
            w = {k: jax.ShapeDtypeStruct(self.facts.graph.weights[k].shape,
                                         jax.dtypes.canonicalize_dtype(
                                             self.facts.graph.weights[k].dtype))
                 for k in st.weights}
            r = {k: jax.ShapeDtypeStruct((self.replicas, *st.inputs[k][0]), st.inputs[k][1])
                 for k in st.receives}
            x = {k: host[k] for k in st.streams}
            m = jax.ShapeDtypeStruct((), jnp.int32)
            _, _, vjp = jax.eval_shape(self.runner(st.index).programs.stash, w, r, x, m)
            out["stashed"].append(sum(_nbytes(a) for a in jax.tree.leaves(vjp)))
            # recomputation keeps the stage's inputs: what it received and its stream slices
            kept = [*jax.tree.leaves(r), *(jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
                                          for v in x.values())]
            out["recomputed"].append(sum(_nbytes(a) for a in kept))
        return out

    def in_flight(self, s: int) -> int:
        """The most micro-batches stage ``s`` holds between their forward and backward."""
        held = most = 0
        for a in self.schedule.for_stage(s):
            held += (a.kind == "F") - (a.kind == "B")
            most = max(most, held)
        return most if self.training and s < len(self.stages) - 1 else 0

    def memory_parts(self, state: SessionState | None = None) -> list[dict[str, int]]:
        """Each stage's memory by part, from shapes alone: weights (training: the committed
        and the new ones, the gradient accumulator and the optimizer state, committed and new),
        its stream inputs, its stashed activations (in-flight micro-batches x what one keeps)
        and the anchors it keeps; with worker processes, also each worker's copy of the
        model."""
        f = self.facts
        kept, summed = self.specs[0].kept, self.specs[0].summed
        stash = (self.stash_bytes()["recomputed" if self.recompute else "stashed"] + [0]
                 if self.training else [0] * len(self.stages))
        shapes = f.program_inputs
        every = set(f.trained)
        found = {f.key(a): f.io.anchors[a][0] for a in f.anchors}
        if self.training:
            found[f.loss] = f.shapes([f.loss])[f.loss]
        optimizer = state.optimizer if state is not None else ()
        out = []
        for s, st in enumerate(self.stages):
            weights = sum(int(f.graph.weights[k].nbytes) for k in st.weights)
            parts = {"weights": weights * (2 if self.training else 1),
                     "stream inputs": sum(_nbytes(shapes[k]) for k in st.streams),
                     "stashed activations": self.in_flight(s) * stash[s],
                     "anchors kept": sum(
                         (len(kept[t]) + (t in summed)) * self.replicas * _nbytes(found[t])
                         for t in [*st.anchors, *(GRADIENT_PREFIX + p for p in st.probes)])}
            if self.training:
                trained = self.specs[s].trained
                opt = _select(optimizer, set(trained), every)
                parts["optimizer state and gradients"] = sum(
                    int(f.graph.weights[k].nbytes) for k in trained) + 2 * sum(
                    _nbytes(a) for a in jax.tree.leaves(opt))
            if self.processes is not None:  # while it starts; then only its stage's part
                parts["the worker's copy of the model"] = 3 * sum(
                    int(w.nbytes) for w in f.graph.weights.values())
            out.append(parts)
        return out

    def check_memory(self, state: SessionState | None = None) -> None:
        """Refuse (K-memory) a step whose stages cannot fit their devices, before anything is
        allocated for it; on CPU every stage counts against the host's RAM."""
        per_stage = self.memory_parts(state)
        fix = (f"run fewer micro-batches per step (batches_per_step="
               f"{self.facts.config.batches_per_step}), keep fewer anchors (Final or Sum "
               f"instead of All)" + ("" if self.recompute or not self.training else
                                     ", or recompute each stage's forward in its backward "
                                     "(pipeline.recomputation='standard')") + ".")
        on_host = self.devices is None or self.devices[0][0].platform == "cpu"
        if on_host:
            total: dict[str, int] = {}
            for parts in per_stage:
                for k, v in parts.items():
                    total[k] = total.get(k, 0) + v
            detail = {f"stage {s} {k}": v for s, parts in enumerate(per_stage)
                      for k, v in parts.items()}
            check_fits("pipelined step", total, jax.devices("cpu")[0], fix, detail)
            self.memory = total
        else:
            assert self.devices is not None
            for s, parts in enumerate(per_stage):
                check_fits(f"pipeline stage {s}", parts, self.devices[s][0], fix)
            self.memory = {f"stage {s} {k}": v for s, parts in enumerate(per_stage)
                           for k, v in parts.items()}
        self._checked = True
