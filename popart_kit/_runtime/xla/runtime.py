"""The xla backend: a session's model run on JAX devices with PopART's step semantics.

A ``run`` is M = bps x A micro-batches on each of R local replicas. The backend owns the
session's committed :class:`~.state.SessionState`, and runs every step through one
:class:`~.executors.Executor` (looped, host-driven or pipelined), which returns the anchors and
a new state without changing anything; every run is wrapped the same way - under the session's
lock (concurrent runs take turns), profiled, its peers watched - and its result is checked and
committed in one assignment. Micro-batches are evaluated in chunks (:mod:`.steps`), so memory
does not grow with M beyond what is anchored All; anchors are reduced or selected as the chunks
go (:mod:`.anchors`). Where replicas run and how arrays move is the
:class:`~.placement.Placement`'s; before the first run the step's memory is estimated and a
step that cannot fit is refused (:mod:`.memory`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from ..._base.names import GRADIENT_PREFIX
from ..._base.problems import Problem, emit_warnings, raise_errors, under_popart_rules, warn
from ..._base.shapes import AnchorReturnType, StepShape
from ..._host.stepio import StepIOFactory, TensorSpec
from ..._model.builder import broadcast_inputs
from ...errors import ConfigTypeError, InvalidConfig
from ..backend import check_weights
from . import delegated, profiling
from .anchors import AnchorBuffers, chunk_size
from .delegated import Delegation
from .direct import DirectStep, direct_step
from .distributed import initialize, watching, world
from .executors import Executor, HostDrivenExecutor, LoopedExecutor, StepFunctions
from .grouped import (
    check_grouped_weights,
    full_values,
    groupings_for,
    replica_model,
    replica_rows,
)
from .hlo_text import OneCallback, one_callback
from .host_memory import keep_freed_memory
from .input_memory import AlignedInputs
from .lowering import LoweredGraph, lower
from .memory import check_fits
from .ops import UnsupportedModel, partials
from .ops_graphcore_nn import group_norm_channels
from .ops_random import RANDOM_STREAM, random_scope, uses_random
from .pipeline import WORKERS, PipelineExecutor, PipelineFacts, pipeline_for
from .placement import Placement, ensure_host_devices
from .state import RandomSeed, SessionState, check_finite
from .steps import LOCAL_REPLICA, chunk_bytes, loops_on_host, vmap

__all__ = ["XlaBackend"]


class XlaBackend:
    """Runs a session's model on JAX devices with PopART's step, replica and anchor semantics.

    Public attributes (``session.runtime``): ``executor`` (the :class:`~.executors.Executor`
    every run goes through; ``pipeline`` is it when pipelined), ``programs`` (its compiled
    programs), ``placement``, ``memory`` (the step's bytes by part, once prepared),
    ``chunk`` (micro-batches evaluated at once), ``on_host`` (chunks driven from the host),
    ``state`` (the committed :class:`~.state.SessionState`).

    ``micro_batches_per_chunk`` overrides how many micro-batches are evaluated at once (by
    default as many as keep a chunk's activations under ``steps.chunk_bytes``).
    ``pipeline_workers`` says where a pipelined model's stages run: ``"threads"`` (default:
    one virtual device each, in this process) or ``"processes"`` (a worker process each, the
    only way stages run side by side on CPU; see ``stage_processes``)."""

    name = "xla"
    trained: list[str] = []  # the weights a training backend updates
    training = False  # whether Dropout drops (a training backend's runs)

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType],
                 micro_batches_per_chunk: int | None = None,
                 pipeline_workers: str = "threads") -> None:
        if world(config.replication).processes > 1:  # one of several: join the others (a
            # process a launcher says is one of several but the replication is not is refused)
            initialize(config.replication)
        ensure_host_devices()  # before the lowering starts JAX
        self.model, self.config = model, config
        # weights with one value per group of replicas (VariableSettings; see grouped.py):
        # lowered with their replica shape, kept [groups, *shape] in the state
        self.groupings = groupings_for(model, config)
        self.graph: LoweredGraph = lower(  # refuses unsupported operators, all at once
            replica_model(model, self.groupings),  # a gradient anchor's tensor is not folded
            unfolded={a[len(GRADIENT_PREFIX):] for a in anchors if a.startswith(GRADIENT_PREFIX)})
        check_grouped_weights(self.groupings, self.graph)
        problems = self._problems(anchors, micro_batches_per_chunk, pipeline_workers)
        options = all(p.loc[0] in ("micro_batches_per_chunk", "pipeline_workers")
                      for p in problems)  # only the session's own arguments are wrong
        raise_errors("XlaBackend", problems, error=InvalidConfig if options else None)
        _warn_meaningless(config)
        self.anchors = dict(anchors)
        broadcast = broadcast_inputs(model)
        inputs = {name: TensorSpec(shape, dtype, name in broadcast)
                  for name, (shape, dtype) in self.graph.inputs.items()}
        tensors = {name: self._anchor_tensor(name) for name in self.anchors}
        shapes = self._shapes(inputs, list(dict.fromkeys(tensors.values())))
        found = {name: shapes[tensor] for name, tensor in tensors.items()}
        self.io = StepIOFactory(config, inputs=inputs, anchors={
            name: (TensorSpec(found[name].shape, found[name].dtype), art)
            for name, art in self.anchors.items()})
        self.placement = Placement(config.replication.local_factor,
                                   processes=config.replication.instances)
        if self.placement.platform == "cpu":  # runs reuse freed memory, not fresh pages
            keep_freed_memory()
        self.shape = StepShape.of(config)  # bps x A x R x instances
        self.micro_batches = self.shape.micro_batches
        # a model with random operators takes each run's seeds as a stream input
        self.random = uses_random(model)
        self.seed = RandomSeed(time.time_ns() % 2**64)  # PopART's default: from the clock
        self.buffers = AnchorBuffers(self.anchors, {n: (s.shape, s.dtype)
                                                    for n, s in found.items()}, self.shape)
        self.chunk = self._chunk(inputs, micro_batches_per_chunk)
        self._anchor_shapes = {name: self.io.anchor_shape(name) for name in self.anchors}
        self._inputs = self._program_inputs()
        self._dtypes = {name: np.dtype(s.dtype) for name, s in self._inputs.items()}
        self.on_host = loops_on_host(model, self.placement.platform, self.placement.several,
                                     self._trips())
        self._lock = threading.RLock()
        initial = {**self.graph.weights, **full_values(model, self.groupings)}
        self.state = SessionState(self.placement.put_everywhere(
            {k: jnp.asarray(v) for k, v in initial.items()}),
            updates=self.placement.put_everywhere(np.int32(0)))
        self.hyper: Any = None  # the optimizer's hyperparameters on the device (training)
        self.prepared = False
        self.memory: dict[str, int] = {}  # the step's memory by part, once prepared
        self.unpipelined_because = ""
        self._setup_training()
        self.executor: Executor = self._make_executor(pipeline_workers)
        self.staged = AlignedInputs(self.placement.one_cpu and self.pipeline is None)
        self._segment_inputs: set[str] = set()  # inputs read only by onnxruntime, once compiled
        self._one_callback: OneCallback | None = None  # the program as one segment call
        self._direct: DirectStep | None = None  # that call, made from the host (direct.py)
        if self._delegates():
            self.graph.delegation = Delegation()  # forward segments by onnxruntime

    def _trips(self) -> int:
        """How many chunks a step evaluates."""
        return self.micro_batches // self.chunk

    def _setup_training(self) -> None:
        """What a training backend checks and sets up before its executor is chosen; an
        inference session refuses CopyVarUpdate (only a training step writes weights)."""
        copies = [n for n in self.model.graph.node
                  if n.op_type == "CopyVarUpdate" and n.domain == "ai.graphcore"]
        if copies:
            raise UnsupportedModel([
                f"{n.name or n.output[0]} (CopyVarUpdate): it overwrites its first input (a "
                f"weight) with its second after each micro-batch, which the xla backend does "
                f"only in a training session. Fix: run it in a TrainingSession, or feed the "
                f"value as an input." for n in copies])

    def _make_executor(self, workers: str) -> Executor:
        """The pipeline where the model is pipelined and can be split (else the backend says
        why once, and runs unpipelined); else the looped or host-driven executor."""
        if self.config.pipeline.enabled:
            executor, self.unpipelined_because = pipeline_for(self._pipeline_facts(), workers)
            if executor is not None:
                return executor
            warn(f"pipelining on the xla backend: {self.unpipelined_because}; running the "
                 f"stages one after the other on one device (same numerics).")
        step = self._step_functions()
        return (HostDrivenExecutor if self.on_host else LoopedExecutor)(step, self.placement)

    @property
    def programs(self) -> list[Any]:
        """The executor's compiled programs (none before ``prepare``)."""
        return self.executor.programs

    @property
    def pipeline(self) -> PipelineExecutor | None:
        """The pipeline executor, when the session runs pipelined."""
        return self.executor if isinstance(self.executor, PipelineExecutor) else None

    def _pipeline_facts(self) -> PipelineFacts:
        """What the pipeline executor is told of the session (nothing else of the backend)."""
        return PipelineFacts(
            model=self.model, graph=self.graph, config=self.config, io=self.io,
            anchors=self.anchors, tensors={a: self._anchor_tensor(a) for a in self.anchors},
            anchor_shapes=self._anchor_shapes, placement=self.placement,
            shapes=lambda wanted: self._shapes(self.io.inputs, wanted),
            program_inputs=self._inputs, shape=self.shape, **self._training_facts())

    def _training_facts(self) -> dict[str, Any]:
        return {}

    # -- what the backend refuses -----------------------------------------------------------------

    def _problems(self, anchors: Mapping[str, AnchorReturnType], chunk: int | None,
                  workers: str = "threads") -> list[Problem]:
        """What this backend cannot run, all at once, before anything compiles."""
        out = [Problem(("anchors", a), f"anchor {a!r} is not a tensor of the model.",
                       "anchor an input, a weight or a node output.", "K-anchor-unknown")
               for a in anchors if self._anchor_tensor(a) not in self.graph.tensors]
        doubles = [n for n, (_, d) in self.graph.inputs.items() if np.dtype(d) == np.float64]
        doubles += [n for n, w in self.graph.weights.items() if w.dtype == np.float64]
        out += [Problem(("tensors", n), f"tensor {n!r} is DOUBLE, which PopART does not run "
                        f"on IPUs.", "use FLOAT (or FLOAT16).", "K-double") for n in doubles]
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1):
            out.append(Problem(("micro_batches_per_chunk",),
                               f"micro_batches_per_chunk={chunk!r} is not a positive integer.",
                               "give a count of 1 or more, or None for the default.",
                               "K-chunk"))
        if workers not in WORKERS:
            out.append(Problem(("pipeline_workers",), f"pipeline_workers={workers!r} is not "
                               f"one of {', '.join(map(repr, WORKERS))}.",
                               "use 'threads' (stages on this process's devices) or "
                               "'processes' (a worker process per stage).", "K-pipeline-workers"))
        elif workers == "processes" and jax.devices()[0].platform != "cpu":
            out.append(Problem(("pipeline_workers",), f"pipeline_workers='processes' runs "
                               f"each stage in a CPU worker process, and this session runs on "
                               f"{jax.devices()[0].platform.upper()} devices.",
                               "use pipeline_workers='threads': each stage gets devices of its "
                               "own there.", "K-pipeline-workers"))
        return out

    def _anchor_tensor(self, anchor: str) -> str:
        """The tensor whose shape and dtype an anchor has (itself, for inference)."""
        return anchor

    # -- shapes and chunks -----------------------------------------------------------------------

    def _shapes(self, inputs: Mapping[str, TensorSpec], wanted: list[str]) -> dict[str, Any]:
        """Shapes and dtypes of ``wanted`` tensors for one micro-batch (nothing computed), as
        one of the session's replicas computes them (a replicated collective's output shape
        depends on their count)."""
        def one(w: Any, x: Any) -> Any:
            return self.graph.evaluate(w, x, wanted)

        replicas = StepShape.of(self.config).global_replicas
        if replicas > 1:
            each = jax.vmap(one, in_axes=None, axis_size=replicas, axis_name=LOCAL_REPLICA)
            one = lambda w, x: jax.tree.map(lambda a: a[0], each(w, x))  # noqa: E731
        return jax.eval_shape(
            one,
            {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self.graph.weights.items()},
            {k: jax.ShapeDtypeStruct(s.shape, s.dtype) for k, s in inputs.items()})

    def _activation_bytes(self, inputs: Mapping[str, TensorSpec]) -> int:
        """Bytes of every tensor one micro-batch computes on one replica (an upper bound on
        its live activations)."""
        produced = [o for node in self.model.graph.node for o in node.output
                    if o and o in self.graph.tensors]
        shapes = self._shapes(inputs, produced)
        return sum(int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize
                   for s in shapes.values())

    def _chunk_limit(self) -> int:
        """Micro-batches a chunk may hold: they must not cross a weight update."""
        return self.micro_batches

    def _chunk(self, inputs: Mapping[str, TensorSpec], requested: int | None) -> int:
        if requested is None:
            per_micro_batch = self._activation_bytes(inputs) * self.placement.per_device
            delegates = self._delegates()
            budget = delegated.CHUNK_BYTES if delegates else chunk_bytes(self.placement.platform)
            requested = max(1, budget // max(per_micro_batch, 1))
            if delegates and requested < self._chunk_limit():  # looped either way
                requested = min(requested, delegated.LOOPED_CHUNK)
        return chunk_size(self._chunk_limit(), requested, self.buffers.periods)

    def _delegates(self) -> bool:
        """Whether forward segments may run by onnxruntime (:mod:`.delegated`): inference on
        one CPU device, not pipelined, with onnxruntime installed."""
        return (not self.training and self.placement.one_cpu
                and not self.config.pipeline.enabled and delegated.available())

    # -- arguments --------------------------------------------------------------------------------

    def _stream_axes(self) -> dict[str, int | None]:
        """The replica axis of each device input: [M, R, *S] streams, [M, *S] Broadcast (and
        the seeds, [M, R, 2], of a model with random operators)."""
        axes: dict[str, int | None] = {n: None if s.broadcast else 1
                                       for n, s in self.io.inputs.items()}
        if self.random:
            axes[RANDOM_STREAM] = 1
        return axes

    def _program_inputs(self) -> dict[str, jax.ShapeDtypeStruct]:
        """What the program takes: [M, R, *S] streams and [M, *S] Broadcast inputs, in the
        dtypes JAX computes (PopART's int64 -> int32)."""
        replicas = self.shape.replicas
        shapes = {}
        for name, spec in self.io.inputs.items():
            lead = (self.micro_batches,) if spec.broadcast else (self.micro_batches, replicas)
            shapes[name] = jax.ShapeDtypeStruct(lead + spec.shape,
                                                jax.dtypes.canonicalize_dtype(spec.dtype))
        if self.random:
            shapes[RANDOM_STREAM] = jax.ShapeDtypeStruct((self.micro_batches, replicas, 2),
                                                         np.uint32)
        return shapes

    def _host_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Canonical host arrays as the program takes them (views where the dtype agrees; a
        large one in aligned memory the program reads in place, :mod:`.input_memory`), with
        the run's seeds (:class:`~.state.RandomSeed`) for a model with random operators."""
        host, lent = {}, []
        for name, s in self._inputs.items():
            if name == RANDOM_STREAM:
                continue
            buffer = (self.staged.unfilled(name, inputs[name], s.dtype, s.shape)
                      if name in self._segment_inputs else None)
            if buffer is None:
                host[name] = self.staged.place(name, inputs[name], s.dtype, s.shape)
            else:  # read by onnxruntime where it lies (its segments read nothing else)
                host[name] = buffer
                lent.append((buffer, inputs[name]))
        if lent:
            self.graph.delegation.lend(lent)  # type: ignore[union-attr]
        if self.random:
            host[RANDOM_STREAM] = self.seed.words(
                self.micro_batches, self.shape.replicas,
                self.config.replication.global_offset, self.shape.global_replicas)
        return host

    def _slice(self, inputs: Mapping[str, jax.Array], start: Any) -> dict[str, jax.Array]:
        """The chunk's micro-batches. When chunks are looped over, a barrier keeps XLA from
        moving work on the chunk (a layout change for a convolution, say) out of the loop onto
        the whole step's inputs, which would hold a second copy of them."""
        chunk = {k: jax.lax.dynamic_slice_in_dim(v, start, self.chunk, axis=0)
                 for k, v in inputs.items()}
        looped = self.chunk < self._chunk_limit() or self.micro_batches > self._chunk_limit()
        return jax.lax.optimization_barrier(chunk) if looped else chunk

    def _evaluate_chunk(self, weights: Mapping[str, jax.Array], inputs: Mapping[str, Any],
                        start: Any, wanted: list[str],
                        offsets: Mapping[str, jax.Array] | None = None) -> dict[str, jax.Array]:
        """``wanted`` tensors of the chunk of micro-batches from ``start``: [c, Rb, *S];
        ``offsets`` ([c, Rb, *S] each) are added to their tensors (see LoweredGraph.evaluate)."""
        chunk = self._slice(inputs, start)
        fixed = {k: v for k, v in chunk.items()
                 if k in self.io.inputs and self.io.inputs[k].broadcast}
        streams = {k: v for k, v in chunk.items() if k not in fixed}
        # each replica's row of the grouped weights: [per_device, *shape] each
        rows = replica_rows(weights, self.groupings, self.placement.per_device,
                            self.placement.axes if self.placement.several else None)

        def micro_batch(s: Any, f: Any, o: Any) -> Any:
            def one(x: Any, d: Any, g: Any) -> Any:  # a replica: its random operators draw
                x, w = dict(x), {**weights, **g}     # from its own seed
                if RANDOM_STREAM not in x:
                    return self.graph.evaluate(w, {**x, **f}, wanted, d)
                with random_scope(x.pop(RANDOM_STREAM), self.training):
                    return self.graph.evaluate(w, {**x, **f}, wanted, d)

            return vmap(one, self.placement.per_device, (0, 0, 0), LOCAL_REPLICA)(s, o, rows)

        return vmap(micro_batch, self.chunk, (0, 0, 0))(streams, fixed, dict(offsets or {}))

    # -- the step --------------------------------------------------------------------------------

    def _step_functions(self) -> StepFunctions:
        """An inference step: its chunks run straight through (no update between them), each
        writing its anchors."""
        chunks = self.micro_batches // self.chunk

        def chunk(state: SessionState, work: Any, hyper: Any, inputs: Any, update: Any,
                  index: Any) -> Any:
            start = (update * chunks + index) * self.chunk
            values = self._evaluate_chunk(state.weights, inputs, start, list(self.anchors))
            return {}, {"buffers": self.buffers.write(work["buffers"], values, start)}

        return StepFunctions(
            updates=1, chunks=chunks,
            work=lambda: {"buffers": self.buffers.init(self.placement.per_device)},
            chunk=chunk, apply=None, flags=None, inputs=self._inputs,
            stream_axes=self._stream_axes(), buffer_axes=self.buffers.replica_axes())

    def _memory_parts(self, temporaries: int) -> tuple[dict[str, int], dict[str, int]]:
        """The step's memory by part (and the anchors by name), for the memory check."""
        inputs = sum(int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize
                     for s in self._inputs.values())  # this process's
        anchors = self.buffers.nbytes()
        host_copies = 2 if self.placement.platform == "cpu" else 1
        weights = sum(int(v.nbytes) for v in self.graph.weights.values()) + sum(
            (g.groups - 1) * int(self.graph.weights[n].nbytes)  # a grouped weight's other
            for n, g in self.groupings.items())                 # groups
        parts = {"inputs on the device": inputs,
                 "anchors (device and host)": host_copies * sum(anchors.values()),
                 "weights": weights, "program temporaries": temporaries}
        return parts, {f"anchor {k!r}": v * host_copies for k, v in anchors.items()}

    def _check_memory(self, temporaries: int) -> None:
        parts, detail = self._memory_parts(temporaries)
        whole = [n for n, art in self.anchors.items() if art.name == "All"]
        fix = (f"run fewer micro-batches per step (batches_per_step="
               f"{self.config.batches_per_step})"
               + (f", anchor {', '.join(repr(n) for n in whole[:3])} with Final, Sum or "
                  f"EveryN instead of All" if whole else "")
               + f", or evaluate fewer micro-batches at once (micro_batches_per_chunk, now "
                 f"{self.chunk}).")
        check_fits(type(self).__name__, parts, self.placement.devices[0], fix, detail)
        self.memory = parts

    def close(self) -> None:
        """Stop what the executor runs beside this process (a pipeline's stage worker
        processes; a later run starts them again)."""
        self.executor.close()
        self.staged.clear()

    def prepare(self) -> None:
        """Check the step fits, then compile it (run does it when needed)."""
        with self._lock:
            if self.prepared:
                return
            if self.pipeline is not None:
                self.pipeline.prepare(self.state, self.hyper)  # its stages compile as they
                self.memory = self.pipeline.memory           # first run
                self.prepared = True
                return
            self._check_memory(0)  # inputs and anchors alone, before compiling anything
            started = time.perf_counter()
            # float32 products in float32, as an IPU computes them (GPUs would otherwise use
            # TF32, and results would change with the chunk size)
            with jax.default_matmul_precision("float32"), \
                    partials(self.config.precision.partials_type), group_norm_channels(
                        self.config.popart_options.get("groupNormStridedChannelGrouping")):
                self.executor.prepare(self.state, self.hyper)
            programs = self.executor.programs
            profiling.compiled(self, programs, time.perf_counter() - started)
            temporaries = max((p.memory_analysis().temp_size_in_bytes for p in programs
                               if p.memory_analysis() is not None), default=0)
            self._check_memory(temporaries)
            if self.graph.delegation is not None and isinstance(self.executor, LoopedExecutor):
                hlo = programs[0].as_text()
                self._segment_inputs = self.executor.callback_only_inputs(self.state, hlo)
                if not self.random and not self.config.profiling.auto_report_dir:
                    self._one_callback = one_callback(hlo)
            self.prepared = True

    # -- a run ----------------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, np.ndarray], *,
            copy: bool = True) -> dict[str, np.ndarray]:
        """One step by the executor, every executor's wrapped alike, of inputs the session
        checked (``StepIOFactory.check_inputs``): the session locked, the run profiled and its
        peers watched where that is asked for; its result checked, then committed in one
        assignment (an exception anywhere leaves the session as it was).

        The anchors are writable arrays of their own (no two live ones share memory): on one
        CPU device a large one is the run's own result buffer (:mod:`.anchor_memory`), the
        rest one copy of it; ``copy=False`` gives read-only views of the rest where the
        device's memory is the host's (CPU), for a caller that copies them on itself (PopART's
        PyStepIO writes into the user's arrays). A run made as one onnxruntime call from the
        host (:mod:`.direct`) gives arrays of its own either way."""
        with self._lock:
            if not self.prepared:
                self.prepare()
            delegation = self.graph.delegation
            if self._direct is not None:
                return self._direct.run(inputs, self.state.weights, self._dtypes)
            recording = self._one_callback is not None
            try:
                host = self._host_inputs(inputs)
                if delegation is not None:
                    delegation.offer(self.state.weights)
                    if recording:  # the first run: which segment call the program is
                        delegation.recording = []
                if self.placement.processes == 1 and not self.config.profiling.auto_report_dir:
                    result = self.executor.run(host, self.state, self.hyper)  # nothing to wrap
                else:
                    with self._peers(), profiling.run(self):  # timed and watched to its end
                        result = self.executor.run(host, self.state, self.hyper)
                        jax.block_until_ready((result.anchors, result.state))
                if result.flags is not None:
                    check_finite(result.flags, self.trained, self.shape.batches_per_step)
                anchors = {name: _host(result.anchors[name], copy).reshape(shape)
                           for name, shape in self._anchor_shapes.items()}
                if delegation is not None and delegation.lent:
                    jax.block_until_ready(result.anchors)  # done (above, unless no anchors)
                    if delegation.returned():  # the program copied an unfilled buffer: its
                        self._segment_inputs = set()  # segments read no values; fill them
                        self._one_callback = None
                        return self.run(inputs, copy=copy)  # from here on, and run again
                if recording:
                    self._direct = self._direct_step(delegation.recording or [])
            finally:
                if delegation is not None:
                    delegation.returned()
                    delegation.recording = None
                self._one_callback = None  # one first run only
            if result.state is not None:
                self.state = result.state  # the commit, after everything that can fail
            if self.random:
                self.seed = self.seed.advanced(self.micro_batches)
            return anchors

    def _direct_step(self, recorded: list) -> DirectStep | None:
        """The runs to come as one segment call from the host (:mod:`.direct`), where the
        program is that call (None: run the program)."""
        executor = self.executor
        assert isinstance(executor, LoopedExecutor) and self._one_callback is not None
        return direct_step(self._one_callback, recorded, executor.parameters(self.state),
                           self.state.weights, jax.eval_shape(executor.step.work)["buffers"],
                           self._anchor_shapes)

    def set_random_seed(self, seed: int) -> None:
        """Seed the model's random operators (PopART's ``setRandomSeed``): the runs from here
        on draw the same values for the same seed (see :mod:`.ops_random`)."""
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or \
                not 0 <= int(seed) < 2**64:
            raise ConfigTypeError(f"set_random_seed({seed!r}): the seed is an integer in "
                                  f"[0, 2**64) (PopART's uint64). Fix: pass a non-negative "
                                  f"integer below 2**64.", rule="K-xla-dropout")
        with self._lock:
            self.seed = RandomSeed(int(seed))

    def random_seed(self) -> int:
        """The seed the next run continues from (PopART's ``getRandomSeed``): setting it
        again repeats the runs from here."""
        with self._lock:
            return self.seed.current(self.shape.global_replicas)

    def _peers(self) -> Any:
        """Collectives failed by a stopped instance become the kit's error (:mod:`.distributed`)."""
        return watching(self.placement.processes, self.config.replication.instance_index)

    # -- weights ----------------------------------------------------------------------------------

    def weights(self) -> dict[str, np.ndarray]:
        """Current weights in the model's own dtypes (JAX computes INT64 as INT32, as PopART
        casts it on the device)."""
        current = self.state.weights  # one committed set, read once
        return {name: np.array(value).astype(self.graph.weights[name].dtype)
                for name, value in self.placement.fetch(current).items()}

    def write_weights(self, mapping: Mapping[str, np.ndarray]) -> None:
        """New values of some weights, each of its shape in the state (a grouped weight's
        [groups, *shape])."""
        check_weights({k: np.broadcast_to(np.zeros((), v.dtype), (g.groups, *g.shape))
                       if (g := self.groupings.get(k)) else v
                       for k, v in self.graph.weights.items()}, mapping)
        new = self.placement.put_everywhere({k: jnp.asarray(v) for k, v in mapping.items()})
        with self._lock:
            self.state = self.state.with_weights(new)

    def model_proto(self) -> onnx.ModelProto:
        """The model with the current weights, each stored as the model stored it (raw bytes,
        or typed fields such as float_data, which PopART's Builder writes and programs read)."""
        proto = onnx.ModelProto()
        proto.CopyFrom(self.model)
        current = self.weights()
        for tensor in proto.graph.initializer:
            value = current.get(tensor.name)
            if value is None:
                continue
            if tensor.HasField("raw_data") or not value.size:
                tensor.CopyFrom(onnx.numpy_helper.from_array(value, tensor.name))
            else:
                tensor.CopyFrom(onnx.helper.make_tensor(tensor.name, tensor.data_type,
                                                        value.shape, value.ravel().tolist()))
        return proto


def _host(array: Any, copy: bool) -> np.ndarray:
    """An anchor on the host: host arrays as they are; a device array copied once (``copy``)
    or viewed where it can be (read-only)."""
    if isinstance(array, np.ndarray):
        return array
    return np.array(array) if copy else np.asarray(array)


_WARNED: set[str] = set()


def _warn_meaningless(config: Any) -> None:
    """Settings the xla backend cannot honour are named once per process."""
    if config.precision.stochastic_rounding and "stochastic_rounding" not in _WARNED:
        _WARNED.add("stochastic_rounding")
        # a PopART program is told in its own option's name
        name = ("SessionOptions.enableStochasticRounding" if under_popart_rules() else
                "precision.stochastic_rounding")
        emit_warnings([Problem(tuple(name.split(".")),
                     "True has no meaning on the xla backend: XLA rounds to nearest, "
                     "so half-precision results can differ from an IPU's in the last bits.",
                     "leave it on for the IPU; expect round-to-nearest numerics here.",
                     "K-xla-stochastic-rounding", severity="warning")])
