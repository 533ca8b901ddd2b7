"""The xla backend for training: PopART's accumulation, replication and update semantics.

One ``run`` is bps weight updates. Each update accumulates, in one gradient accumulator, the
gradient of the loss summed over chunks of its A micro-batches on every local replica (memory
flat in A), reduces it once over the replicas - a sum, divided by A x R for Mean, as PopART's
Post strategy does - and applies the optimizer. Hyperparameters live on the device and change
only through ``set_optimizer``, so changing them never recompiles.

A run is atomic: the program computes new weights and optimizer state beside the committed
ones, and they replace them only once the run has succeeded (anchors fetched, every update
finite); an exception or KeyboardInterrupt at any point leaves the session as it was. A run
whose loss or gradients are not finite is refused the same way, naming the update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from ..._problems import Problem, raise_errors
from ...shapes import AnchorReturnType
from .placement import REPLICA
from .runtime import XlaBackend
from .steps import loop

__all__ = ["XlaTrainingBackend", "NonFiniteUpdate"]


class NonFiniteUpdate(ValueError):
    """A training run met a non-finite loss or gradient; its updates were not applied."""


class XlaTrainingBackend(XlaBackend):
    """Training steps of a model whose ``loss`` tensor is minimised by ``optimizer``.

    ``check_finite`` (default True) refuses a run whose loss or gradients are not finite
    (NaN or Inf) and keeps the weights as they were; False skips the check."""

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType], loss: str, optimizer: Any,
                 micro_batches_per_chunk: int | None = None, check_finite: bool = True) -> None:
        self.loss = loss
        super().__init__(model, config, anchors, micro_batches_per_chunk)
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
        shape = self._shapes(self.io.inputs, [loss])[loss].shape
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
        self.optimizer = optimizer
        self.check_finite = bool(check_finite)
        trained = {k: self._weights[k] for k in self.trained}
        self._opt_state = self.placement.put_everywhere(optimizer.init(trained))
        self._hyper = self._device_hyper(optimizer)

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

    def _device_hyper(self, optimizer: Any) -> dict[str, jax.Array]:
        return self.placement.put_everywhere(
            {k: np.float32(v) for k, v in optimizer.hyperparameters().items()})

    # -- chunks and updates -------------------------------------------------------------------

    def _chunk_limit(self) -> int:
        return self.config.accumulation.factor  # a chunk never crosses a weight update

    def _activation_bytes(self, inputs: Any) -> int:
        return 2 * super()._activation_bytes(inputs)  # the backward pass keeps as much again

    def _work(self) -> dict[str, Any]:
        """What a step carries besides the weights: the gradient accumulator, the anchor
        buffers and the finiteness flags (one row per update: loss, then each gradient)."""
        trained = {k: jnp.zeros(self.graph.weights[k].shape,
                                jax.dtypes.canonicalize_dtype(self.graph.weights[k].dtype))
                   for k in self.trained}
        return {"grads": trained, "loss_finite": jnp.bool_(True),
                "buffers": self.buffers.init(self.placement.per_device),
                "flags": jnp.ones((self.config.batches_per_step, 1 + len(self.trained)), bool)}

    def _work_shapes(self) -> Any:
        return jax.eval_shape(self._work)

    def _chunk_step(self, state: Any, work: Any, hyper: Any, inputs: Any, update: Any,
                    index: Any) -> Any:
        """Accumulate the gradient of chunk ``index`` of update ``update``."""
        weights, _ = state
        start = update * self.config.accumulation.factor + index * self.chunk
        wanted = list(dict.fromkeys([self.loss, *self.anchors]))

        def loss_of(train: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, Any]]:
            values = self._evaluate_chunk({**weights, **train}, inputs, start, wanted)
            # gradients leave the backward pass scaled by the loss scaling, as in PopART;
            # the optimizer divides it out
            scale = hyper.get("loss_scaling", 1.0)
            return jnp.sum(values[self.loss]) * scale, values

        grads, values = jax.grad(loss_of, has_aux=True)({n: weights[n] for n in self.trained})
        out = dict(work)
        out["grads"] = {n: work["grads"][n] + grads[n] for n in self.trained}
        if self.check_finite:
            out["loss_finite"] = work["loss_finite"] & jnp.isfinite(values[self.loss]).all()
        out["buffers"] = self.buffers.write(work["buffers"],
                                            {n: values[n] for n in self.anchors}, start)
        return out

    def _update_step(self, state: Any, work: Any, hyper: Any, update: Any) -> Any:
        """Reduce the accumulated gradient over the replicas and apply the optimizer."""
        weights, opt_state = state
        grads = work["grads"]
        loss_finite = work["loss_finite"]
        if self.placement.several:
            grads = jax.lax.psum(grads, REPLICA)
            loss_finite = jax.lax.psum((~loss_finite).astype(jnp.int32), REPLICA) == 0
        if self.config.accumulation.reduction == "mean":
            scale = self.config.accumulation.factor * self.config.replication.local_factor
            grads = {n: g / scale for n, g in grads.items()}
        out = dict(work)
        if self.check_finite:
            row = jnp.stack([loss_finite] + [jnp.isfinite(grads[n]).all()
                                             for n in self.trained])
            out["flags"] = work["flags"].at[update].set(row)
        trained = {n: weights[n] for n in self.trained}
        new_trained, opt_state = self.optimizer.apply(hyper, trained, grads, opt_state)
        out["grads"] = jax.tree.map(jnp.zeros_like, work["grads"])
        out["loss_finite"] = jnp.bool_(True)
        return ({**weights, **new_trained}, opt_state), out

    def _update(self, state: Any, work: Any, hyper: Any, inputs: Any, update: Any) -> Any:
        accumulation = self.config.accumulation.factor
        work = loop(accumulation // self.chunk,
                    lambda k, w: self._chunk_step(state, w, hyper, inputs, update, k), work)
        return self._update_step(state, work, hyper, update)

    def _whole_step(self, state: Any, hyper: Any, inputs: Any) -> Any:
        state, work = loop(self.config.batches_per_step,
                           lambda u, c: self._update(c[0], c[1], hyper, inputs, u),
                           (state, self._work()))
        return state, work["buffers"], work["flags"]

    def _compile(self) -> list[Any]:
        state = (self._weights, self._opt_state)
        inputs = self._abstract_inputs()
        if not self.on_host:
            program = jax.jit(self.placement.spmd(
                self._whole_step, (None, None, self._stream_axes()),
                (None, self.buffers.replica_axes(), None)))
            return [program.lower(state, self._hyper, inputs).compile()]
        index = jax.ShapeDtypeStruct((), jnp.int32)
        work = self._work_shapes()
        init = jax.jit(self._work).lower().compile()
        chunk = jax.jit(self._chunk_step, donate_argnums=(1,)).lower(
            state, work, self._hyper, inputs, index, index).compile()
        update = jax.jit(self._update_step, donate_argnums=(1,)).lower(
            state, work, self._hyper, index).compile()
        return [init, chunk, update]

    def _execute(self, inputs: Mapping[str, jax.Array]) -> Any:
        state = (self._weights, self._opt_state)
        if not self.on_host:
            return self._program[0](state, self._hyper, inputs)
        init, chunk, update = self._program
        work = init()
        chunks = self._indices[:self.config.accumulation.factor // self.chunk]
        for u in self._indices[:self.config.batches_per_step]:
            for k in chunks:
                work = chunk(state, work, self._hyper, inputs, u, k)
            state, work = update(state, work, self._hyper, u)
        return state, work["buffers"], work["flags"]

    def _memory_parts(self, temporaries: int) -> tuple[dict[str, int], dict[str, int]]:
        parts, detail = super()._memory_parts(temporaries)
        state = sum(int(np.prod(np.shape(a), dtype=np.int64)) * np.dtype(a.dtype).itemsize
                    for a in jax.tree.leaves(self._opt_state))
        # a run computes new weights and state beside the committed ones (atomic runs)
        parts["weights"] = 2 * parts["weights"]
        parts["optimizer state"] = 2 * state
        return parts, detail

    # -- a run ----------------------------------------------------------------------------------

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.io.check_inputs(inputs)
        with self._lock:
            self.prepare()
            device_inputs = self.placement.put(self._host_inputs(inputs), self._stream_axes())
            state, buffers, flags = self._execute(device_inputs)
            out, flags = self.placement.fetch((buffers, flags))
            if self.check_finite and not flags.all():
                self._refuse_non_finite(flags)
            anchors = {name: value.reshape(self.io.anchor_shape(name))
                       for name, value in out.items()}
            # the commit: one assignment, after everything that can fail
            self._weights, self._opt_state = state
        return anchors

    def _refuse_non_finite(self, flags: np.ndarray) -> None:
        update = int(np.argmin(flags.all(axis=1)))
        names = ["the loss"] + [f"the gradient of {n!r}" for n in self.trained]
        bad = [names[i] for i in np.flatnonzero(~flags[update])]
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise NonFiniteUpdate(
            f"weight update {update} of this run (of {len(flags)}) met NaN or Inf in {shown}; "
            f"no update of the run was applied: the weights and optimizer state are as before "
            f"the run. Fix: look for NaN/Inf or extreme values in this run's inputs, lower the "
            f"learning rate or the loss scaling; check_finite=False skips this check.")

    def set_random_seed(self, seed: int) -> None:
        """The xla backend runs no random operators (Dropout in training is refused when the
        session is made), so every run is already deterministic; the seed is recorded."""
        self.seed = int(seed)

    def set_optimizer(self, optimizer: Any) -> None:
        """New hyperparameter values (the session checked it is the same kind of optimizer):
        put on the device once, for the next runs of the same compiled program."""
        hyper = self._device_hyper(optimizer)
        with self._lock:
            self._hyper, self.optimizer = hyper, optimizer
