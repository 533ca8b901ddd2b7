"""The xla backend: one compiled program per session runs a whole step on every local replica.

A ``run`` is bps × A micro-batches on each of R replicas. The program evaluates them all on the
device (no host round trip per micro-batch, the analogue of device iterations); replicas
are a mesh axis (``shard_map``) over as many devices as divide R, vectorised within a device.
Anchors come back as PopART returns them: All every micro-batch, EveryN micro-batches N-1,
2N-1, ..., Final the last one, Sum their sum - per replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..._problems import Problem, raise_errors
from ...builder import broadcast_inputs
from ...shapes import AnchorReturnType
from ...stepio import StepIOFactory, TensorSpec
from ..base import check_weights
from .devices import HOST_DEVICES, ensure_host_devices, replica_devices
from .lowering import LoweredGraph, lower

__all__ = ["XlaBackend"]

_REPLICA = "replica"


def vmap(fn: Any, size: int, in_axes: tuple[int | None, ...], out_axes: Any = 0) -> Any:
    """``jax.vmap`` over an axis of ``size``, except that a size of 1 is squeezed away: XLA on
    CPU runs a matrix product with a batch dimension of 1 markedly slower than the plain one
    (the benchmark's training step at bps 16: 1.47x the hand-written program with the batch
    dimension, 1.10x without), and a replica block or accumulation of 1 is common."""
    if size != 1:
        return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_size=size)

    def call(*args: Any) -> Any:
        squeezed = [arg if axis is None else jax.tree.map(lambda a, ax=axis: jnp.squeeze(a, ax),
                                                            arg)
                    for arg, axis in zip(args, in_axes, strict=True)]
        out = fn(*squeezed)
        if isinstance(out_axes, int):
            return jax.tree.map(lambda o: jnp.expand_dims(o, out_axes), out)
        return {k: jax.tree.map(lambda o, ax=out_axes[k]: jnp.expand_dims(o, ax), v)
                for k, v in out.items()}

    return call


def returned(every: jax.Array, art: AnchorReturnType) -> jax.Array:
    """What PopART returns of a tensor's values at the M micro-batches of a run (axis 0):
    All all of them, EveryN micro-batches N-1, 2N-1, ..., Final the last, Sum their sum."""
    if art.name == "Sum":
        return every.sum(axis=0, dtype=every.dtype)
    if art.name == "Final":
        return every[-1]
    return every if art.period is None else every[art.period - 1::art.period]


class XlaBackend:
    """Runs a session's model on JAX devices with PopART's step, replica and anchor semantics."""

    name = "xla"

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType]) -> None:
        replicas = config.replication.local_factor
        ensure_host_devices(max(replicas, HOST_DEVICES))  # before the lowering starts JAX
        self.model, self.config = model, config
        self.graph: LoweredGraph = lower(model)  # refuses unsupported operators, all at once
        raise_errors("XlaBackend", self._problems(anchors))
        self.anchors = dict(anchors)
        broadcast = broadcast_inputs(model)
        inputs = {name: TensorSpec(shape, dtype, name in broadcast)
                  for name, (shape, dtype) in self.graph.inputs.items()}
        found = jax.eval_shape(
            lambda w, x: self.graph.evaluate(w, x, list(self.anchors)),
            {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self.graph.weights.items()},
            {k: jax.ShapeDtypeStruct(s.shape, s.dtype) for k, s in inputs.items()})
        self.io = StepIOFactory(config, inputs=inputs, anchors={
            name: (TensorSpec(found[name].shape, found[name].dtype), art)
            for name, art in self.anchors.items()})
        self.devices = replica_devices(replicas)
        self.mesh = Mesh(np.array(self.devices), (_REPLICA,))
        self._weights = {k: jax.device_put(jnp.asarray(v), self._everywhere())
                         for k, v in self.graph.weights.items()}
        self._program: Any = None

    def _problems(self, anchors: Mapping[str, AnchorReturnType]) -> list[Problem]:
        """What this backend cannot run, all at once, before anything compiles."""
        out = [Problem(("anchors", a), f"anchor {a!r} is not a tensor of the model.",
                       "anchor an input, a weight or a node output.", "K-anchor-unknown")
               for a in anchors if a not in self.graph.tensors]
        for name, (shape, _) in self.graph.inputs.items():
            if any(not isinstance(d, int) for d in shape):
                out.append(Problem(("inputs", name), f"input {name!r} has shape {shape}: a "
                                   f"dimension is symbolic or unknown.",
                                   "give the input a fixed shape (PopART compiles static "
                                   "shapes too).", "K-static-shape"))
        doubles = [n for n, (_, d) in self.graph.inputs.items() if np.dtype(d) == np.float64]
        doubles += [n for n, w in self.graph.weights.items() if w.dtype == np.float64]
        out += [Problem(("tensors", n), f"tensor {n!r} is DOUBLE, which PopART does not run "
                        f"on IPUs.", "use FLOAT (or FLOAT16).", "K-double") for n in doubles]
        return out

    # -- the program --------------------------------------------------------------------------

    def _everywhere(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def _replica_program(self, weights: Mapping[str, jax.Array],
                         streams: Mapping[str, jax.Array],
                         fixed: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """One replica's run: ``streams`` are [M, *S] (M = bps × A), ``fixed`` Broadcast
        inputs [M, *S] shared by all replicas. Returns each anchor as PopART returns it.

        Inference micro-batches do not depend on each other, so the M of them are evaluated as
        one vectorised computation: XLA on CPU runs the body of a loop (lax.scan) several
        times slower than the same operations outside one (the benchmark's convnet: 11-17 ms
        per micro-batch in a scan, 1.5 ms vectorised), and this keeps the run one program."""
        steps = self.config.batches_per_step * self.config.accumulation.factor
        values = vmap(lambda xs: self.graph.evaluate(weights, xs, list(self.anchors)), steps,
                      (0,))({**streams, **fixed})
        return {name: returned(values[name], art) for name, art in self.anchors.items()}

    def _build(self) -> Any:
        streamed = [n for n, spec in self.io.inputs.items() if not spec.broadcast]
        stacked_out = {n: (1 if art.name in ("All", "EveryN") else 0)
                       for n, art in self.anchors.items()}
        per_device = self.config.replication.local_factor // len(self.devices)

        def block(weights: Any, streams: Any, fixed: Any) -> Any:
            # the replicas of one device, vectorised; axis 1 of a stream is the replica
            return vmap(self._replica_program, per_device, (None, 1, None),
                        stacked_out)(weights, streams, fixed)

        if len(self.devices) == 1:
            return jax.jit(block)
        return jax.jit(jax.shard_map(
            block, mesh=self.mesh,
            in_specs=(P(), {n: P(None, _REPLICA) for n in streamed}, P()),
            out_specs={n: P(None, _REPLICA) if a else P(_REPLICA)
                       for n, a in stacked_out.items()},
            check_vma=False))  # replicas are independent: nothing to check across them

    def prepare(self) -> None:
        """Compile the step program for this session's shapes (run does it when needed)."""
        if self._program is not None:
            return
        streams, fixed = self._device_inputs(self.io.allocate_inputs(), as_shapes=True)
        self._program = self._build().lower(self._weights, streams, fixed).compile()

    # -- a run ----------------------------------------------------------------------------------

    def _device_inputs(self, inputs: Mapping[str, np.ndarray], as_shapes: bool = False,
                       steps: tuple[int, ...] | None = None
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Canonical host arrays -> [*steps, R, *S] streams and [*steps, *S] Broadcast inputs
        (``steps`` defaults to (bps × A,)), placed on the replicas' devices (on one device the
        compiled program takes the host arrays); ``as_shapes`` gives their shapes and
        placements only, for compiling."""
        cfg = self.config
        steps = steps or (cfg.batches_per_step * cfg.accumulation.factor,)
        replicas = cfg.replication.local_factor
        several = len(self.devices) > 1
        streams, fixed = {}, {}
        for name, spec in self.io.inputs.items():
            array = np.asarray(inputs[name], dtype=spec.dtype)  # PopART's int64 -> int32
            if spec.broadcast:
                array, placement = array.reshape(steps + spec.shape), self._everywhere()
            else:
                array = array.reshape(steps + (replicas,) + spec.shape)
                placement = NamedSharding(self.mesh, P(*(None,) * len(steps), _REPLICA))
            if as_shapes:
                array = jax.ShapeDtypeStruct(array.shape, jnp.dtype(array.dtype),
                                             sharding=placement if several else None)
            elif several:
                array = jax.device_put(array, placement)
            (fixed if spec.broadcast else streams)[name] = array
        return streams, fixed

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.io.check_inputs(inputs)
        self.prepare()
        streams, fixed = self._device_inputs(inputs)
        out = self._program(self._weights, streams, fixed)
        return {name: np.array(value).reshape(self.io.anchor_shape(name))  # writable copies
                for name, value in out.items()}

    # -- weights ----------------------------------------------------------------------------------

    def weights(self) -> dict[str, np.ndarray]:
        """Current weights in the model's own dtypes (JAX computes INT64 as INT32, as PopART
        casts it on the device)."""
        return {name: np.array(value).astype(self.graph.weights[name].dtype)
                for name, value in self._weights.items()}

    def write_weights(self, mapping: Mapping[str, np.ndarray]) -> None:
        check_weights(self.graph.weights, mapping)
        for name, value in mapping.items():
            self._weights[name] = jax.device_put(jnp.asarray(value), self._everywhere())

    def model_proto(self) -> onnx.ModelProto:
        proto = onnx.ModelProto()
        proto.CopyFrom(self.model)
        current = self.weights()
        for tensor in proto.graph.initializer:
            if tensor.name in current:
                tensor.CopyFrom(onnx.numpy_helper.from_array(current[tensor.name], tensor.name))
        return proto
