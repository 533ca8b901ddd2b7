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
from .devices import replica_devices
from .lowering import LoweredGraph, lower

__all__ = ["XlaBackend"]

_REPLICA = "replica"


class XlaBackend:
    """Runs a session's model on JAX devices with PopART's step, replica and anchor semantics."""

    name = "xla"

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType]) -> None:
        self.model, self.config = model, config
        self.graph: LoweredGraph = lower(model)  # refuses unsupported operators, all at once
        unknown = [a for a in anchors if a not in self.graph.tensors]
        raise_errors("XlaBackend", [Problem(
            ("anchors", a), f"anchor {a!r} is not a tensor of the model.",
            "anchor an input, a weight or a node output.", "K-anchor-unknown") for a in unknown])
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
        replicas = config.replication.local_factor
        self.devices = replica_devices(replicas)
        self.mesh = Mesh(np.array(self.devices), (_REPLICA,))
        self._weights = {k: jax.device_put(jnp.asarray(v), self._everywhere())
                         for k, v in self.graph.weights.items()}
        self._program: Any = None

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
        times slower than the same operations outside one (measured in
        benchmarks/runtime_bench.py), and this keeps the run one program all the same."""
        values = jax.vmap(lambda xs: self.graph.evaluate(weights, xs, list(self.anchors)))(
            {**streams, **fixed})
        out = {}
        for name, art in self.anchors.items():
            every = values[name]  # [M, *S]
            if art.name == "Sum":
                out[name] = every.sum(axis=0)
            elif art.name == "Final":
                out[name] = every[-1]
            else:
                out[name] = every if art.period is None else every[art.period - 1::art.period]
        return out

    def _build(self) -> Any:
        replica_axis = {n: 1 for n in self.io.inputs if not self.io.inputs[n].broadcast}
        stacked_out = {n: (1 if art.name in ("All", "EveryN") else 0)
                       for n, art in self.anchors.items()}

        def block(weights: Any, streams: Any, fixed: Any) -> Any:
            # the replicas of one device, vectorised; axis 1 of a stream is the replica
            return jax.vmap(self._replica_program, in_axes=(None, 1, None),
                            out_axes=stacked_out)(weights, streams, fixed)

        if len(self.devices) == 1:
            return jax.jit(block)
        return jax.jit(jax.shard_map(
            block, mesh=self.mesh,
            in_specs=(P(), {n: P(None, _REPLICA) for n in replica_axis}, P()),
            out_specs={n: P(None, _REPLICA) if a else P(_REPLICA)
                       for n, a in stacked_out.items()},
            check_vma=False))  # replicas are independent: nothing to check across them

    def prepare(self) -> None:
        if self._program is None:
            self._program = self._build()

    # -- a run ----------------------------------------------------------------------------------

    def _device_inputs(self, inputs: Mapping[str, np.ndarray]
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Canonical host arrays -> [M, R, *S] streams and [M, *S] Broadcast inputs, placed on
        the replicas' devices (on one device the compiled program takes the host arrays)."""
        cfg = self.config
        steps = cfg.batches_per_step * cfg.accumulation.factor
        replicas = cfg.replication.local_factor
        several = len(self.devices) > 1
        streams, fixed = {}, {}
        for name, spec in self.io.inputs.items():
            array = np.asarray(inputs[name], dtype=spec.dtype)  # PopART's int64 -> int32
            if spec.broadcast:
                array = array.reshape((steps,) + spec.shape)
                fixed[name] = jax.device_put(array, self._everywhere()) if several else array
            else:
                array = array.reshape((steps, replicas) + spec.shape)
                streams[name] = jax.device_put(array, NamedSharding(
                    self.mesh, P(None, _REPLICA))) if several else array
        return streams, fixed

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.io.check_inputs(inputs)
        self.prepare()
        streams, fixed = self._device_inputs(inputs)
        out = self._program(self._weights, streams, fixed)
        return {name: np.asarray(value).reshape(self.io.anchor_shape(name))
                for name, value in out.items()}

    # -- weights ----------------------------------------------------------------------------------

    def weights(self) -> dict[str, np.ndarray]:
        return {name: np.array(value) for name, value in self._weights.items()}

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
