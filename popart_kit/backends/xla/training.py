"""The xla backend for training: PopART's accumulation, replication and update semantics.

One ``run`` is bps weight updates. Each update takes the gradient of the loss for A micro-batches
on every local replica (evaluated vectorised), reduces them over accumulation and replicas - a
sum, divided by A × R for Mean, as PopART's Post strategy does -, the replica part as a
collective over the mesh axis, and applies the optimizer once. The bps updates are a loop inside
the one compiled program; hyperparameters are arguments, so changing them never recompiles.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from jax.sharding import PartitionSpec as P

from ..._problems import Problem, raise_errors
from ...shapes import AnchorReturnType
from .runtime import _REPLICA, XlaBackend, returned, vmap

__all__ = ["XlaTrainingBackend"]


class XlaTrainingBackend(XlaBackend):
    """Training steps of a model whose ``loss`` tensor is minimised by ``optimizer``."""

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType], loss: str, optimizer: Any) -> None:
        super().__init__(model, config, anchors)
        problems = []
        if config.pipeline.enabled and config.accumulation.factor == 1:
            problems.append(Problem(
                ("accumulation", "factor"),
                "pipelined training without gradient accumulation updates weights while other "
                "micro-batches are in flight ('stale weights'), which the xla backend does not "
                "reproduce.", "set accumulation.factor >= the pipeline depth (PopART then "
                "flushes before each update), or use the popart backend.", "K-stale-weights"))
        if config.replication.is_distributed:
            problems.append(Problem(
                ("replication", "global_factor"),
                f"training over {config.replication.instances} instances needs gradients "
                f"reduced across processes, which the xla backend does not do yet.",
                "train one instance (no global_factor), or use the popart backend under "
                "poprun.", "K-xla-distributed"))
        problems += self._dropout_problems()
        if loss not in self.graph.tensors:
            problems.append(Problem(("loss",), f"loss {loss!r} is not a tensor of the model.",
                                    "pass the id the loss op returned.", "K-loss-unknown"))
        raise_errors("TrainingSession", problems)
        shape = jax.eval_shape(lambda w, x: self.graph.evaluate(w, x, [loss])[loss], {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self.graph.weights.items()}, {
            k: jax.ShapeDtypeStruct(s.shape, s.dtype) for k, s in self.io.inputs.items()}).shape
        self.trained = [w for w in self.graph.trainable if w in self._loss_inputs(loss)]
        problems = []
        if shape:
            problems.append(Problem(
                ("loss",), f"loss {loss!r} has shape {list(shape)}; PopART: 'Loss tensor must "
                           f"be a scalar tensor'.", "reduce it with Mean or Sum (not "
                                                    "NoReduction).", "K-loss-scalar"))
        if not self.trained:
            problems.append(Problem(
                ("loss",), f"loss {loss!r} depends on none of the model's floating-point "
                           f"weights: there is nothing to train.",
                "pass the loss of the model, whose weights come from addInitializedInputTensor.",
                "K-no-weights"))
        raise_errors("TrainingSession", problems)
        self.loss = loss
        self.optimizer = optimizer
        trained = {k: self._weights[k] for k in self.trained}
        self._opt_state = jax.device_put(optimizer.init(trained), self._everywhere())

    def _dropout_problems(self) -> list[Problem]:
        """PopART drops out at random when training; the xla backend has no random operators."""
        out = []
        for node in self.model.graph.node:
            if node.op_type != "Dropout":
                continue
            ratio = next((onnx.helper.get_attribute_value(a) for a in node.attribute
                          if a.name == "ratio"), None)
            if ratio != 0.0:
                out.append(Problem(("model", node.name or node.output[0]),
                                   f"Dropout {node.name or node.output[0]!r} drops at random "
                                   f"when training (ratio {ratio if ratio is not None else 0.5})"
                                   f"; the xla backend has no random operators.",
                                   "remove the Dropout (or give it ratio 0), or train with the "
                                   "popart backend.", "K-xla-dropout"))
        return out

    def _loss_inputs(self, loss: str) -> set[str]:
        """Every tensor the loss depends on, read back through the graph."""
        producer = {o: n for n in self.model.graph.node for o in n.output}
        seen, todo = set(), [loss]
        while todo:
            tensor = todo.pop()
            if tensor in seen:
                continue
            seen.add(tensor)
            if tensor in producer:
                todo += [t for t in producer[tensor].input if t]
        return seen

    # -- the program --------------------------------------------------------------------------

    def _update_step(self, hyper: Any, carry: Any, xs: Any, replicas_here: int,
                     collective: bool) -> tuple[Any, dict[str, jax.Array]]:
        """One weight update: xs are the A micro-batches of this device's replicas."""
        weights, opt_state = carry
        names = self.trained  # weights off the loss's path get no update, as in PopART
        wanted = list(dict.fromkeys([self.loss, *self.anchors]))

        def one(x: Mapping[str, jax.Array]) -> tuple[dict[str, jax.Array], dict[str, Any]]:
            def loss_of(train: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, Any]]:
                values = self.graph.evaluate({**weights, **train}, x, wanted)
                # gradients leave the backward pass scaled by the loss scaling, as in PopART;
                # the optimizer divides it out
                scale = hyper.get("loss_scaling", 1.0)
                return jnp.sum(values[self.loss]) * scale, values
            grads, values = jax.grad(loss_of, has_aux=True)({n: weights[n] for n in names})
            return grads, {n: values[n] for n in self.anchors}

        streams, fixed = xs
        accumulation = self.config.accumulation.factor
        # streams [A, Rb, *S]: vmap over the device's replicas, then over accumulation steps
        per_replica = vmap(lambda s: vmap(lambda a, f: one({**a, **f}), accumulation,
                                          (0, 0))(s, fixed), replicas_here, (1,))
        grads, values = per_replica(streams)  # grads [Rb, A, ...], values [Rb, A, *S]
        total = {n: g.sum(axis=(0, 1)) for n, g in grads.items()}
        if collective:
            total = jax.lax.psum(total, _REPLICA)
        if self.config.accumulation.reduction == "mean":
            scale = accumulation * self.config.replication.local_factor
            total = {n: g / scale for n, g in total.items()}
        trained = {n: weights[n] for n in names}
        new_trained, opt_state = self.optimizer.apply(hyper, trained, total, opt_state)
        return ({**weights, **new_trained}, opt_state), values

    def _build(self) -> Any:
        cfg = self.config
        devices = len(self.devices)
        per_device = cfg.replication.local_factor // devices
        streamed = [n for n, spec in self.io.inputs.items() if not spec.broadcast]

        def block(weights: Any, opt_state: Any, hyper: Any, streams: Any, fixed: Any) -> Any:
            # streams [bps, A, Rb, *S], fixed [bps, A, *S]: a loop over the bps updates
            def step(carry: Any, xs: Any) -> Any:
                return self._update_step(hyper, carry, xs, per_device, devices > 1)
            (weights, opt_state), values = jax.lax.scan(step, (weights, opt_state),
                                                         (streams, fixed))
            # values [bps, Rb, A, *S] -> [bps × A, Rb, *S]: the run's micro-batches in order
            every = {n: jnp.swapaxes(v, 1, 2).reshape((-1,) + v.shape[1:2] + v.shape[3:])
                     for n, v in values.items()}
            return weights, opt_state, {n: returned(every[n], art)
                                        for n, art in self.anchors.items()}

        if devices == 1:
            return jax.jit(block, donate_argnums=(0, 1))
        anchor_specs = {n: P(None, _REPLICA) if art.name in ("All", "EveryN")
                        else P(_REPLICA) for n, art in self.anchors.items()}
        return jax.jit(jax.shard_map(
            block, mesh=self.mesh,
            in_specs=(P(), P(), P(), {n: P(None, None, _REPLICA) for n in streamed}, P()),
            out_specs=(P(), P(), anchor_specs), check_vma=False), donate_argnums=(0, 1))

    def _arguments(self, inputs: Mapping[str, np.ndarray], as_shapes: bool = False) -> tuple:
        cfg = self.config
        streams, fixed = self._device_inputs(
            inputs, as_shapes, steps=(cfg.batches_per_step, cfg.accumulation.factor))
        hyper = {k: jnp.asarray(v, jnp.float32)
                 for k, v in self.optimizer.hyperparameters().items()}
        return self._weights, self._opt_state, hyper, streams, fixed

    def prepare(self) -> None:
        """Compile the training step for this session's shapes (run does it when needed)."""
        if self._program is None:
            self._program = self._build().lower(
                *self._arguments(self.io.allocate_inputs(), as_shapes=True)).compile()

    # -- a run ----------------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.io.check_inputs(inputs)
        self.prepare()
        weights, self._opt_state, out = self._program(*self._arguments(inputs))
        self._weights = dict(weights)
        return {name: np.array(value).reshape(self.io.anchor_shape(name))
                for name, value in out.items()}

    def set_random_seed(self, seed: int) -> None:
        """The xla backend runs no random operators (Dropout in training is refused when the
        session is made), so every run is already deterministic; the seed is recorded."""
        self.seed = int(seed)

    def set_optimizer(self, optimizer: Any) -> None:
        """New hyperparameter values (the session checked it is the same kind of optimizer):
        the next run passes them to the same compiled program."""
        self.optimizer = optimizer
