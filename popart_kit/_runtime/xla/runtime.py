"""The xla backend: a session's model run on JAX devices with PopART's step semantics.

A ``run`` is M = bps x A micro-batches on each of R local replicas. Its micro-batches are
evaluated in chunks (:mod:`.steps`), so memory does not grow with M beyond what is anchored
All; anchors are reduced or selected as the chunks go (:mod:`.anchors`). Where replicas run and
how arrays move is the :class:`~.placement.Placement`'s; before the first run the step's memory
is estimated and a step that cannot fit is refused (:mod:`.memory`). A run does the input
check, one transfer, the program (one call, or one per chunk where :mod:`.steps` loops from the
host) and one fetch, under a lock: concurrent runs on one session take turns.
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

from ..._base.problems import Problem, emit_warnings, raise_errors, warn
from ..._base.shapes import AnchorReturnType
from ..._host.stepio import StepIOFactory, TensorSpec
from ..._model.builder import broadcast_inputs
from ...errors import InvalidConfig
from ..backend import check_weights
from . import profiling
from .anchors import AnchorBuffers, chunk_size
from .distributed import initialize, watching, world
from .lowering import LoweredGraph, lower
from .memory import check_fits
from .ops import partials
from .pipeline import WORKERS, executor_for
from .placement import Placement, ensure_host_devices
from .steps import chunk_bytes, loop, loops_on_host, vmap

__all__ = ["XlaBackend"]


class XlaBackend:
    """Runs a session's model on JAX devices with PopART's step, replica and anchor semantics.

    ``micro_batches_per_chunk`` overrides how many micro-batches are evaluated at once (by
    default as many as keep a chunk's activations under ``steps.chunk_bytes``).
    ``pipeline_workers`` says where a pipelined model's stages run: ``"threads"`` (default:
    one virtual device each, in this process) or ``"processes"`` (a worker process each, the
    only way stages run side by side on CPU; see ``stage_processes``)."""

    name = "xla"

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType],
                 micro_batches_per_chunk: int | None = None,
                 pipeline_workers: str = "threads") -> None:
        if world(config.replication).processes > 1:  # one of several: join the others (a
            # process a launcher says is one of several but the replication is not is refused)
            initialize(config.replication)
        ensure_host_devices()  # before the lowering starts JAX
        self.model, self.config = model, config
        self.graph: LoweredGraph = lower(model)  # refuses unsupported operators, all at once
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
        self.micro_batches = config.batches_per_step * config.accumulation.factor
        self.buffers = AnchorBuffers(self.anchors, {n: (s.shape, s.dtype)
                                                    for n, s in found.items()},
                                     config.batches_per_step, config.accumulation.factor,
                                     config.replication.local_factor)
        self.chunk = self._chunk(inputs, micro_batches_per_chunk)
        self._anchor_shapes = {name: self.io.anchor_shape(name) for name in self.anchors}
        self._inputs = self._program_inputs()
        self.on_host = loops_on_host(model, self.placement.platform, self.placement.several)
        self._lock = threading.RLock()
        self._weights = self.placement.put_everywhere(
            {k: jnp.asarray(v) for k, v in self.graph.weights.items()})
        self._program: Any = None
        self.memory: dict[str, int] = {}  # the step's memory by part, once prepared
        self.pipeline, self.unpipelined_because = executor_for(self, pipeline_workers,
                                                               self._worker_spec)
        if self.unpipelined_because:
            warn(f"pipelining on the xla backend: {self.unpipelined_because}; running the "
                 f"stages one after the other on one device (same numerics).")

    # -- what the backend refuses -----------------------------------------------------------------

    def _problems(self, anchors: Mapping[str, AnchorReturnType], chunk: int | None,
                  workers: str = "threads") -> list[Problem]:
        """What this backend cannot run, all at once, before anything compiles."""
        out = [Problem(("anchors", a), f"anchor {a!r} is not a tensor of the model.",
                       "anchor an input, a weight or a node output.", "K-anchor-unknown")
               for a in anchors if self._anchor_tensor(a) not in self.graph.tensors]
        for name, (shape, _) in self.graph.inputs.items():
            if shape is None or any(not isinstance(d, int) for d in shape):
                out.append(Problem(("inputs", name), f"input {name!r} has shape {shape}: a "
                                   f"dimension is symbolic or unknown.",
                                   "give the input a fixed shape (PopART compiles static "
                                   "shapes too).", "K-static-shape"))
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
        elif workers == "processes" and self.config.replication.instances > 1:
            out.append(Problem(("pipeline_workers",), f"pipeline_workers='processes' with "
                               f"{self.config.replication.instances} instances: stage workers "
                               f"run one process's stages, not instances joined over "
                               f"jax.distributed.", "use pipeline_workers='threads' across "
                               "instances.", "K-pipeline-workers"))
        return out

    def _worker_spec(self) -> dict[str, Any]:
        """What a stage worker process needs to rebuild this backend (stage_processes.py)."""
        cls = type(self)
        return dict(backend=f"{cls.__module__}:{cls.__qualname__}",
                    model=self.model.SerializeToString(), config=self.config,
                    anchors=self.anchors, loss=getattr(self, "loss", None),
                    optimizer=getattr(self, "optimizer", None))

    def _anchor_tensor(self, anchor: str) -> str:
        """The tensor whose shape and dtype an anchor has (itself, for inference)."""
        return anchor

    # -- shapes and chunks -----------------------------------------------------------------------

    def _shapes(self, inputs: Mapping[str, TensorSpec], wanted: list[str]) -> dict[str, Any]:
        """Shapes and dtypes of ``wanted`` tensors for one micro-batch (nothing computed)."""
        return jax.eval_shape(
            lambda w, x: self.graph.evaluate(w, x, wanted),
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
            requested = max(1, chunk_bytes(self.placement.platform) // max(per_micro_batch, 1))
        return chunk_size(self._chunk_limit(), requested, self.buffers.periods)

    # -- arguments --------------------------------------------------------------------------------

    def _stream_axes(self) -> dict[str, int | None]:
        """The replica axis of each device input: [M, R, *S] streams, [M, *S] Broadcast."""
        return {n: None if s.broadcast else 1 for n, s in self.io.inputs.items()}

    def _program_inputs(self) -> dict[str, jax.ShapeDtypeStruct]:
        """What the program takes: [M, R, *S] streams and [M, *S] Broadcast inputs, in the
        dtypes JAX computes (PopART's int64 -> int32)."""
        replicas = self.config.replication.local_factor
        shapes = {}
        for name, spec in self.io.inputs.items():
            lead = (self.micro_batches,) if spec.broadcast else (self.micro_batches, replicas)
            shapes[name] = jax.ShapeDtypeStruct(lead + spec.shape,
                                                jax.dtypes.canonicalize_dtype(spec.dtype))
        return shapes

    def _host_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Canonical host arrays as the program takes them (views where the dtype agrees)."""
        return {name: np.asarray(inputs[name], dtype=s.dtype).reshape(s.shape)
                for name, s in self._inputs.items()}

    def _abstract_inputs(self) -> dict[str, jax.ShapeDtypeStruct]:
        return self.placement.abstract(self._inputs, self._stream_axes())

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
        streams = {k: v for k, v in chunk.items() if not self.io.inputs[k].broadcast}
        fixed = {k: v for k, v in chunk.items() if self.io.inputs[k].broadcast}

        def micro_batch(s: Any, f: Any, o: Any) -> Any:
            return vmap(lambda x, d: self.graph.evaluate(weights, {**x, **f}, wanted, d),
                        self.placement.per_device, (0, 0))(s, o)

        return vmap(micro_batch, self.chunk, (0, 0, 0))(streams, fixed, dict(offsets or {}))

    # -- the program --------------------------------------------------------------------------

    def _chunk_step(self, weights: Any, buffers: Any, inputs: Any, index: Any) -> Any:
        start = index * self.chunk
        values = self._evaluate_chunk(weights, inputs, start, list(self.anchors))
        return self.buffers.write(buffers, values, start)

    def _whole_step(self, weights: Any, inputs: Any) -> Any:
        buffers = self.buffers.init(self.placement.per_device)
        return loop(self.micro_batches // self.chunk,
                    lambda i, b: self._chunk_step(weights, b, inputs, i), buffers)

    def _compile(self) -> list[Any]:
        weights = self._weights
        inputs = self._abstract_inputs()
        if not self.on_host:
            program = jax.jit(self.placement.spmd(
                self._whole_step, (None, self._stream_axes()), self.buffers.replica_axes()))
            return [program.lower(weights, inputs).compile()]
        index = jax.ShapeDtypeStruct((), jnp.int32)
        buffers = self.buffers.shapes()
        init = jax.jit(lambda: self.buffers.init(self.placement.per_device)).lower().compile()
        chunk = jax.jit(self._chunk_step, donate_argnums=(1,)).lower(
            weights, buffers, inputs, index).compile()
        return [init, chunk]

    def _execute(self, inputs: Mapping[str, jax.Array]) -> Any:
        if not self.on_host:
            return self._program[0](self._weights, inputs)
        init, chunk = self._program
        buffers = init()
        for index in self._indices:
            buffers = chunk(self._weights, buffers, inputs, index)
        return buffers

    def _memory_parts(self, temporaries: int) -> tuple[dict[str, int], dict[str, int]]:
        """The step's memory by part (and the anchors by name), for the memory check."""
        inputs = sum(int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize
                     for s in self._inputs.values())  # this process's
        anchors = self.buffers.nbytes()
        host_copies = 2 if self.placement.platform == "cpu" else 1
        weights = sum(int(v.nbytes) for v in self.graph.weights.values())
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
        """Stop the pipeline's stage worker processes, if any (a later run starts them)."""
        if self.pipeline is not None and self.pipeline.processes is not None:
            self.pipeline.processes.close()

    def prepare(self) -> None:
        """Check the step fits, then compile it (run does it when needed)."""
        with self._lock:
            if self.pipeline is not None:
                self.pipeline.start()  # its stage programs compile as they first run
                return
            if self._program is not None:
                return
            self._check_memory(0)  # inputs and anchors alone, before compiling anything
            started = time.perf_counter()
            # float32 products in float32, as an IPU computes them (GPUs would otherwise use
            # TF32, and results would change with the chunk size)
            with jax.default_matmul_precision("float32"), \
                    partials(self.config.precision.partials_type):
                programs = self._compile()
            profiling.compiled(self, programs, time.perf_counter() - started)
            temporaries = max((p.memory_analysis().temp_size_in_bytes for p in programs
                               if p.memory_analysis() is not None), default=0)
            self._check_memory(temporaries)
            self._indices = [self.placement.put_everywhere(np.int32(i))
                             for i in range(self.micro_batches // self.chunk)]
            self._program = programs

    # -- a run ----------------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.io.check_inputs(inputs)
        with self._lock:
            if self.pipeline is not None:
                return self.pipeline.run(inputs)
            if self._program is None:
                self.prepare()
            with self._peers(), profiling.run(self):
                device_inputs = self.placement.put(self._host_inputs(inputs),
                                                   self._stream_axes(), resident=self.on_host)
                fetched = self._step(device_inputs)
            return self._finish(fetched)

    def _step(self, device_inputs: Mapping[str, Any]) -> Any:
        """The step program on the devices, what the host needs of it fetched."""
        return self.placement.fetch(self._execute(device_inputs))

    def _finish(self, fetched: Any) -> dict[str, np.ndarray]:
        """The anchors in their host shapes (under the session's lock)."""
        return {name: value.reshape(self._anchor_shapes[name]) for name, value in fetched.items()}

    def _peers(self) -> Any:
        """Collectives failed by a stopped instance become the kit's error (:mod:`.distributed`)."""
        return watching(self.placement.processes, self.config.replication.instance_index)

    # -- weights ----------------------------------------------------------------------------------

    def weights(self) -> dict[str, np.ndarray]:
        """Current weights in the model's own dtypes (JAX computes INT64 as INT32, as PopART
        casts it on the device)."""
        current = self._weights  # one committed set, read once
        return {name: np.array(value).astype(self.graph.weights[name].dtype)
                for name, value in self.placement.fetch(current).items()}

    def write_weights(self, mapping: Mapping[str, np.ndarray]) -> None:
        check_weights(self.graph.weights, mapping)
        new = self.placement.put_everywhere({k: jnp.asarray(v) for k, v in mapping.items()})
        with self._lock:
            self._weights = {**self._weights, **new}

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


_WARNED: set[str] = set()


def _warn_meaningless(config: Any) -> None:
    """Settings the xla backend cannot honour are named once per process."""
    if config.precision.stochastic_rounding and "stochastic_rounding" not in _WARNED:
        _WARNED.add("stochastic_rounding")
        emit_warnings([Problem(("precision", "stochastic_rounding"),
                     "precision.stochastic_rounding=True has no meaning on the xla backend: XLA "
                     "rounds to nearest, so half-precision results can differ from an IPU's "
                     "in the last bits.", "leave it on for the IPU; expect round-to-nearest "
                     "numerics here.", "K-xla-stochastic-rounding", severity="warning")])
