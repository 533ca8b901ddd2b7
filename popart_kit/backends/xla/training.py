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
from .runtime import _REPLICA, XlaBackend, vmap

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
        if loss not in self.graph.tensors:
            problems.append(Problem(("loss",), f"loss {loss!r} is not a tensor of the model.",
                                    "pass the id the loss op returned.", "K-loss-unknown"))
        if not self.graph.trainable:
            problems.append(Problem(("model",), "the model has no floating-point weights to "
                                    "train.", "add weights with addInitializedInputTensor.",
                                    "K-no-weights"))
        raise_errors("TrainingSession", problems)
        self.loss = loss
        self.optimizer = optimizer
        trainable = {k: self._weights[k] for k in self.graph.trainable}
        self._opt_state = jax.device_put(optimizer.init(trainable), self._everywhere())

    # -- the program --------------------------------------------------------------------------

    def _update_step(self, hyper: Any, carry: Any, xs: Any, replicas_here: int,
                     collective: bool) -> tuple[Any, dict[str, jax.Array]]:
        """One weight update: xs are the A micro-batches of this device's replicas."""
        weights, opt_state = carry
        names = list(self.graph.trainable)
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
        trainable = {n: weights[n] for n in names}
        new_trainable, opt_state = self.optimizer.apply(hyper, trainable, total, opt_state)
        return ({**weights, **new_trainable}, opt_state), values

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
            return weights, opt_state, self._anchor_values(values)

        if devices == 1:
            return jax.jit(block, donate_argnums=(0, 1))
        anchor_specs = {n: P(None, None, _REPLICA) if art.name in ("All", "EveryN")
                        else P(_REPLICA) for n, art in self.anchors.items()}
        return jax.jit(jax.shard_map(
            block, mesh=self.mesh,
            in_specs=(P(), P(), P(), {n: P(None, None, _REPLICA) for n in streamed}, P()),
            out_specs=(P(), P(), anchor_specs), check_vma=False), donate_argnums=(0, 1))

    def _anchor_values(self, values: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """values [bps, Rb, A, *S] -> PopART's anchors, counted over the bps × A micro-batches:
        All/EveryN [bps(/N), A, Rb, *S] (EveryN keeps micro-batches N-1, 2N-1, ...),
        Final/Sum [Rb, *S]."""
        cfg = self.config
        out = {}
        for name, art in self.anchors.items():
            v = jnp.swapaxes(values[name], 1, 2)  # [bps, A, Rb, *S]
            if art.name == "Sum":
                out[name] = v.sum(axis=(0, 1), dtype=v.dtype)
            elif art.name == "Final":
                out[name] = v[-1, -1]
            elif art.name == "EveryN":
                flat = v.reshape((-1,) + v.shape[2:])[art.period - 1::art.period]
                out[name] = flat.reshape((cfg.batches_per_step // art.period,
                                          cfg.accumulation.factor) + v.shape[2:])
            else:
                out[name] = v
        return out

    def prepare(self) -> None:
        if self._program is None:
            self._program = self._build()

    # -- a run ----------------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.io.check_inputs(inputs)
        self.prepare()
        cfg = self.config
        streams, fixed = self._device_inputs(
            inputs, steps=(cfg.batches_per_step, cfg.accumulation.factor))
        hyper = {k: jnp.asarray(v, jnp.float32)
                 for k, v in self.optimizer.hyperparameters().items()}
        weights, self._opt_state, out = self._program(self._weights, self._opt_state, hyper,
                                                      streams, fixed)
        self._weights = dict(weights)
        return {name: np.array(value).reshape(self.io.anchor_shape(name))
                for name, value in out.items()}

    def set_random_seed(self, seed: int) -> None:
        """The xla backend runs no random operators (Dropout in training is refused when the
        model is lowered), so every run is already deterministic; the seed is recorded."""
        self.seed = int(seed)

    def set_optimizer(self, optimizer: Any) -> None:
        """New hyperparameter values (the session checked it is the same kind of optimizer):
        the next run passes them to the same compiled program."""
        self.optimizer = optimizer
