"""The xla backend for training: PopART's accumulation, replication and update semantics.

One ``run`` is bps weight updates. Each update accumulates, in one gradient accumulator, the
gradient of the loss summed over chunks of its A micro-batches on every local replica (memory
flat in A), and makes the update with :func:`~.state.apply_update`: reduced once over the
replicas of every instance - a sum, divided by A x the global replica count for Mean, as
PopART's Post strategy does - then the optimizer. Hyperparameters live on the device and change
only through ``set_optimizer``, so changing them never recompiles.

A run is atomic: the executor computes a new :class:`~.state.SessionState` beside the
committed one, which it replaces only once the run has succeeded (anchors fetched, every update
finite, :func:`~.state.check_finite`); an exception or KeyboardInterrupt at any point leaves
the session as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from ..._base.names import GRADIENT_PREFIX, RESTORED_PREFIX
from ..._base.problems import Problem, raise_errors
from ..._base.shapes import AnchorReturnType
from ..._model.builder_subgraphs import node_reads
from .executors import StepFunctions
from .lowering import recomputation
from .runtime import XlaBackend
from .state import Reduction, SessionState, apply_update, finite_flags

__all__ = ["XlaTrainingBackend"]


class XlaTrainingBackend(XlaBackend):
    """Training steps of a model whose ``loss`` tensor is minimised by ``optimizer``.

    ``check_finite`` (default True) refuses a run whose loss or gradients are not finite
    (NaN or Inf) and keeps the weights as they were; False skips the check. An anchor named
    PopART's gradient prefix + a tensor (``"Gradient___w"``) returns the gradient of the
    micro-batch's (scaled) loss with respect to that tensor - an input, a weight, an activation
    or the loss - per micro-batch and replica, before any reduction, as PopART does. Dropout
    drops at random (see :mod:`.ops_random`), its gradient masked by the forward's mask."""

    training = True

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType], loss: str, optimizer: Any,
                 micro_batches_per_chunk: int | None = None, check_finite: bool = True,
                 pipeline_workers: str = "threads") -> None:
        self.loss, self.optimizer, self.check_finite = loss, optimizer, bool(check_finite)
        super().__init__(model, config, anchors, micro_batches_per_chunk, pipeline_workers)
        if config.pipeline.enabled and config.accumulation.factor == 1 and self.pipeline is None:
            raise_errors("TrainingSession", [Problem(
                ("accumulation", "factor"),
                f"pipelined training without gradient accumulation updates weights while other "
                f"micro-batches are in flight ('stale weights'), which only the xla backend's "
                f"pipeline executor reproduces, and it cannot run here: "
                f"{self.unpipelined_because}.", "set accumulation.factor >= the pipeline depth "
                "(PopART then flushes before each update), or use the popart backend.",
                "K-stale-weights")])

    def _setup_training(self) -> None:
        """Check the loss and what it trains (all at once), then put the optimizer's state and
        hyperparameters on the devices."""
        loss = self.loss
        problems = self._gradient_problems()
        als = self.config.popart_options.get("automaticLossScalingSettings") or {}
        if isinstance(als, dict) and als.get("enabled"):
            problems.append(Problem(
                ("popart_options", "automaticLossScalingSettings", "enabled"),
                "automatic loss scaling is on, which the xla backend does not implement "
                "(PopART moves the loss scale after each update from a histogram of the "
                "gradients); training without it would give other numbers.",
                "turn it off and give the optimizer a fixed loss scaling, or run on the Poplar "
                "SDK.", "K-xla-auto-loss-scaling"))
        if loss not in self.graph.tensors:
            problems.append(Problem(("loss",), f"loss {loss!r} is not a tensor of the model.",
                                    "pass the id the loss op returned.", "K-loss-unknown"))
        raise_errors("TrainingSession", problems)
        shape = self._shapes(self.io.inputs, [loss])[loss].shape
        self.trained = [w for w in self.graph.trainable if w in self._loss_inputs(loss)]
        problems = []
        if int(np.prod(shape, dtype=np.int64)) > 1:  # PopART: one element, of any rank
            problems.append(Problem(
                ("loss",), f"loss {loss!r} has shape {list(shape)}, "
                           f"{int(np.prod(shape, dtype=np.int64))} elements; PopART: 'Loss "
                           f"tensor, '{loss}', must be a scalar tensor' (one element).",
                "reduce it with Mean or Sum (not NoReduction).", "K-loss-scalar",
                popart=f"Loss tensor, '{loss}', must be a scalar tensor"))
        if not self.trained:
            problems.append(Problem(
                ("loss",), f"loss {loss!r} depends on none of the model's floating-point "
                           f"weights: there is nothing to train.",
                "pass the loss of the model, whose weights come from addInitializedInputTensor.",
                "K-no-weights"))
        raise_errors("TrainingSession", problems)
        trained = {k: self.state.weights[k] for k in self.trained}
        self.state = SessionState(self.state.weights,
                                  self.placement.put_everywhere(self.optimizer.init(trained)),
                                  self.state.updates)
        self.hyper = self._device_hyper(self.optimizer)
        self.reduction = Reduction.of(self.config, self.placement.axes
                                      if self.placement.several else (),
                                      flat=self.placement.distributed)

    def _training_facts(self) -> dict[str, Any]:
        return dict(loss=self.loss, gradients=self.gradient_anchors, trained=self.trained,
                    optimizer=self.optimizer, check_finite=self.check_finite)

    def _anchor_tensor(self, anchor: str) -> str:
        if anchor.startswith(GRADIENT_PREFIX):
            return anchor[len(GRADIENT_PREFIX):]
        if anchor.startswith(RESTORED_PREFIX) and self.config.pipeline.enabled:
            return anchor[len(RESTORED_PREFIX):]  # the stash holds the forward's values
        return anchor

    @property
    def gradient_anchors(self) -> dict[str, str]:
        """{anchor: tensor} of the gradient anchors."""
        return {a: self._anchor_tensor(a) for a in self.anchors if a.startswith(GRADIENT_PREFIX)}

    def _gradient_problems(self) -> list[Problem]:
        out = []
        for anchor, tensor in self.gradient_anchors.items():
            spec = self.io.anchors[anchor][0]
            if not np.issubdtype(spec.dtype, np.floating):
                out.append(Problem(("anchors", anchor), f"{tensor!r} is {spec.dtype}: it has no "
                                   f"gradient.", "anchor the gradient of a floating-point "
                                   "tensor.", "K-gradient-dtype"))
            elif self.graph.is_constant(tensor):
                out.append(Problem(("anchors", anchor), f"{tensor!r} is a constant of the "
                                   f"model (folded when it was lowered): nothing flows back to "
                                   f"it.", "anchor the gradient of an input, a weight or an "
                                   "activation.", "K-gradient-constant"))
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
                todo += node_reads(producer[tensor])  # what its subgraphs read too
        return seen

    def _device_hyper(self, optimizer: Any) -> dict[str, jax.Array]:
        return self.placement.put_everywhere(
            {k: np.float32(v) for k, v in optimizer.hyperparameters().items()})

    # -- chunks and updates -------------------------------------------------------------------

    def _chunk_limit(self) -> int:
        return self.shape.accumulation  # a chunk never crosses a weight update

    def _activation_bytes(self, inputs: Any) -> int:
        return 2 * super()._activation_bytes(inputs)  # the backward pass keeps as much again

    def _work(self) -> dict[str, Any]:
        """What a step carries besides the state: the anchor buffers and, per update,
        whether every micro-batch's loss was finite."""
        return {"buffers": self.buffers.init(self.placement.per_device),
                "losses_finite": jnp.ones((self.shape.batches_per_step,), bool)}

    def _step_functions(self) -> StepFunctions:
        """A training step: bps updates of A / chunk chunks each."""
        return StepFunctions(
            updates=self.shape.batches_per_step,
            chunks=self.shape.accumulation // self.chunk, work=self._work,
            chunk=self._chunk_grads,
            apply=lambda state, grads, hyper: apply_update(state, grads, hyper,
                                                           self.optimizer, self.reduction),
            flags=self._finite if self.check_finite else None, inputs=self._inputs,
            stream_axes=self._stream_axes(), buffer_axes=self.buffers.replica_axes())

    def _chunk_grads(self, state: SessionState, work: Any, hyper: Any, inputs: Any,
                     update: Any, index: Any) -> tuple[dict[str, jax.Array], Any]:
        """The gradient of chunk ``index`` of update ``update`` (summed over its micro-batches
        and this device's replicas), with its anchors written into ``work``."""
        weights = state.weights
        start = update * self.shape.accumulation + index * self.chunk
        gradients = self.gradient_anchors
        wanted = list(dict.fromkeys([self.loss, *(self._anchor_tensor(a) for a in self.anchors
                                                 if a not in gradients)]))
        lead = (self.chunk, self.placement.per_device)
        probes = {tensor: jnp.zeros(lead + self.io.anchors[anchor][0].shape,
                                    self.io.anchors[anchor][0].dtype)
                  for anchor, tensor in gradients.items()}

        def loss_of(train: Mapping[str, jax.Array],
                    probes: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, Any]]:
            values = self._evaluate_chunk({**weights, **train}, inputs, start, wanted, probes)
            # gradients leave the backward pass scaled by the loss scaling, as in PopART;
            # the optimizer divides it out
            scale = hyper.get("loss_scaling", 1.0)
            return jnp.sum(values[self.loss]) * scale, values

        with recomputation(self._recomputation()):  # what the backward recomputes
            (grads, probed), values = jax.grad(loss_of, argnums=(0, 1), has_aux=True)(
                {n: weights[n] for n in self.trained}, probes)
        values = {**values, **{a: probed[t] for a, t in gradients.items()}}
        out = {"buffers": self.buffers.write(work["buffers"], {
            n: values[n if n in gradients else self._anchor_tensor(n)] for n in self.anchors},
            start),
               "losses_finite": work["losses_finite"]}
        if self.check_finite:
            finite = jnp.isfinite(values[self.loss]).all()
            out["losses_finite"] = work["losses_finite"].at[update].set(
                work["losses_finite"][update] & finite)
        return grads, out

    def _recomputation(self) -> str | None:
        """PopART's recomputation for this step: autoRecomputation (pipeline.recomputation;
        a pipelined session recomputes per stage instead), else the nodes
        Builder.recomputeOutputInBackwardPass marks, else none."""
        mode = self.config.pipeline.recomputation
        if mode in ("standard", "recompute_all", "norm_only"):
            return mode
        return "marked" if self.graph.recomputes else None

    def _finite(self, state: SessionState, work: Any) -> Any:
        """The run's :func:`~.state.finite_flags`; over several devices, agreed on by all."""
        flags = finite_flags(work["losses_finite"], state.weights, self.trained)
        if self.placement.several:
            flags = jax.lax.pmin(flags.astype(jnp.int32), self.placement.axes).astype(bool)
        return flags

    def _memory_parts(self, temporaries: int) -> tuple[dict[str, int], dict[str, int]]:
        parts, detail = super()._memory_parts(temporaries)
        state = sum(int(np.prod(np.shape(a), dtype=np.int64)) * np.dtype(a.dtype).itemsize
                    for a in jax.tree.leaves(self.state.optimizer))
        # a run computes new weights and state beside the committed ones (atomic runs)
        parts["weights"] = 2 * parts["weights"]
        parts["optimizer state"] = 2 * state
        return parts, detail

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state as host arrays (see the optimizer's ``init``)."""
        return self.placement.fetch(self.state.optimizer)

    def set_optimizer(self, optimizer: Any) -> None:
        """New hyperparameter values (the session checked it is the same kind of optimizer):
        put on the device once, for the next runs of the same compiled program."""
        hyper = self._device_hyper(optimizer)
        with self._lock:
            self.hyper, self.optimizer = hyper, optimizer
