"""The xla backend for training: PopART's accumulation, replication and update semantics.

One ``run`` is bps weight updates. Each update accumulates, in one gradient accumulator, the
gradient of the loss summed over chunks of its A micro-batches on every local replica (memory
flat in A), reduces it once over the replicas of every instance - a sum, divided by A x the
global replica count for Mean, as PopART's Post strategy does - and applies the optimizer.
Hyperparameters live on the device and change only through ``set_optimizer``, so changing them
never recompiles.

A run is atomic: the program computes new weights and optimizer state beside the committed
ones, and they replace them only once the run has succeeded (anchors fetched, every update
finite); an exception or KeyboardInterrupt at any point leaves the session as it was. A run
whose loss or updated weights are not finite is refused the same way, naming the first update
with a non-finite loss and the weights that ended non-finite.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import onnx

from ..._base.names import GRADIENT_PREFIX, RESTORED_PREFIX
from ..._base.problems import Problem, raise_errors
from ..._base.shapes import AnchorReturnType
from ...errors import DataError
from .runtime import XlaBackend
from .steps import loop

__all__ = ["XlaTrainingBackend", "NonFiniteUpdate"]


class NonFiniteUpdate(DataError):
    """A training run met a non-finite loss or gradient; its updates were not applied."""

    rule = "K-nonfinite-update"


class XlaTrainingBackend(XlaBackend):
    """Training steps of a model whose ``loss`` tensor is minimised by ``optimizer``.

    ``check_finite`` (default True) refuses a run whose loss or gradients are not finite
    (NaN or Inf) and keeps the weights as they were; False skips the check. An anchor named
    PopART's gradient prefix + a tensor (``"Gradient___w"``) returns the gradient of the
    micro-batch's (scaled) loss with respect to that tensor - an input, a weight, an activation
    or the loss - per micro-batch and replica, before any reduction, as PopART does."""

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType], loss: str, optimizer: Any,
                 micro_batches_per_chunk: int | None = None, check_finite: bool = True,
                 pipeline_workers: str = "threads") -> None:
        self.loss = loss
        super().__init__(model, config, anchors, micro_batches_per_chunk, pipeline_workers)
        problems = []
        if config.pipeline.enabled and config.accumulation.factor == 1 and self.pipeline is None:
            problems.append(Problem(
                ("accumulation", "factor"),
                f"pipelined training without gradient accumulation updates weights while other "
                f"micro-batches are in flight ('stale weights'), which only the xla backend's "
                f"pipeline executor reproduces, and it cannot run here: "
                f"{self.unpipelined_because}.", "set accumulation.factor >= the pipeline depth "
                "(PopART then flushes before each update), or use the popart backend.",
                "K-stale-weights"))
        problems += self._dropout_problems() + self._gradient_problems()
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
        """What a step carries besides the weights: the anchor buffers and, per update,
        whether every micro-batch's loss was finite."""
        return {"buffers": self.buffers.init(self.placement.per_device),
                "losses_finite": jnp.ones((self.config.batches_per_step,), bool)}

    def _chunk_grads(self, state: Any, work: Any, hyper: Any, inputs: Any, update: Any,
                     index: Any) -> tuple[dict[str, jax.Array], Any]:
        """The gradient of chunk ``index`` of update ``update`` (summed over its micro-batches
        and this device's replicas), with its anchors written into ``work``."""
        weights, _ = state
        start = update * self.config.accumulation.factor + index * self.chunk
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

    def _apply(self, state: Any, grads: Any, hyper: Any) -> Any:
        """Reduce an update's gradient over all replicas, of every instance (once) and apply
        the optimizer."""
        weights, opt_state = state
        if self.placement.distributed:  # one all-reduce between processes, not one per weight
            flat, unflatten = jax.flatten_util.ravel_pytree(grads)
            grads = unflatten(jax.lax.psum(flat, self.placement.axes))
        elif self.placement.several:
            grads = jax.lax.psum(grads, self.placement.axes)
        if self.config.accumulation.reduction == "mean":
            scale = self.config.accumulation.factor * self.config.replication.global_replicas
            grads = {n: g / scale for n, g in grads.items()}
        trained = {n: weights[n] for n in self.trained}
        new_trained, opt_state = self.optimizer.apply(hyper, trained, grads, opt_state)
        return {**weights, **new_trained}, opt_state

    def _update(self, state: Any, work: Any, hyper: Any, inputs: Any, update: Any) -> Any:
        """One weight update inside the program: the first chunk's gradient starts the
        accumulator (no zeroed buffer when one chunk is the whole update)."""
        grads, work = self._chunk_grads(state, work, hyper, inputs, update, 0)

        def more(k: Any, carry: Any) -> Any:
            total, w = carry
            g, w = self._chunk_grads(state, w, hyper, inputs, update, k)
            return jax.tree.map(jnp.add, total, g), w

        chunks = self.config.accumulation.factor // self.chunk
        if chunks > 1:
            grads, work = jax.lax.fori_loop(1, chunks, more, (grads, work))
        return self._apply(state, grads, hyper), work

    def _whole_step(self, state: Any, hyper: Any, inputs: Any) -> Any:
        state, work = loop(self.config.batches_per_step,
                           lambda u, c: self._update(c[0], c[1], hyper, inputs, u),
                           (state, self._work()))
        return state, work["buffers"], self._finite(state, work)

    def _finite(self, state: Any, work: Any) -> Any:
        """Whether each update's losses were finite, and each trained weight ends finite (a
        non-finite gradient or update leaves its weight non-finite for good: NaN and Inf do
        not become finite again in any optimizer's update)."""
        if not self.check_finite:
            return jnp.ones((), bool)
        weights, _ = state
        ends = jnp.stack([jnp.isfinite(weights[n]).all() for n in self.trained])
        if self.placement.several:  # every device holds the same: agree on it explicitly
            ends = jax.lax.pmin(ends.astype(jnp.int32), self.placement.axes).astype(bool)
            losses = jax.lax.pmin(work["losses_finite"].astype(jnp.int32), self.placement.axes)
            return jnp.concatenate([losses.astype(bool), ends])
        return jnp.concatenate([work["losses_finite"], ends])

    # -- the host driver (see .steps): chunk and update programs called in turn ------------------

    def _host_init(self) -> Any:
        grads = {k: jnp.zeros(self.graph.weights[k].shape,
                              jax.dtypes.canonicalize_dtype(self.graph.weights[k].dtype))
                 for k in self.trained}
        return {**self._work(), "grads": grads}

    def _host_chunk(self, state: Any, work: Any, hyper: Any, inputs: Any, update: Any,
                    index: Any) -> Any:
        grads, out = self._chunk_grads(state, work, hyper, inputs, update, index)
        return {**out, "grads": jax.tree.map(jnp.add, work["grads"], grads)}

    def _host_update(self, state: Any, work: Any, hyper: Any) -> Any:
        state = self._apply(state, work["grads"], hyper)
        return state, {**work, "grads": jax.tree.map(jnp.zeros_like, work["grads"])}

    def _compile(self) -> list[Any]:
        state = (self._weights, self._opt_state)
        inputs = self._abstract_inputs()
        if not self.on_host:
            program = jax.jit(self.placement.spmd(
                self._whole_step, (None, None, self._stream_axes()),
                (None, self.buffers.replica_axes(), None)))
            return [program.lower(state, self._hyper, inputs).compile()]
        index = jax.ShapeDtypeStruct((), jnp.int32)
        work = jax.eval_shape(self._host_init)
        init = jax.jit(self._host_init).lower().compile()
        # only the work is donated: the first update reads the committed state (atomic runs)
        chunk = jax.jit(self._host_chunk, donate_argnums=(1,)).lower(
            state, work, self._hyper, inputs, index, index).compile()
        update = jax.jit(self._host_update, donate_argnums=(1,)).lower(
            state, work, self._hyper).compile()
        finite = jax.jit(self._finite).lower(state, work).compile()
        return [init, chunk, update, finite]

    def _execute(self, inputs: Mapping[str, jax.Array]) -> Any:
        state = (self._weights, self._opt_state)
        if not self.on_host:
            return self._program[0](state, self._hyper, inputs)
        init, chunk, update, finite = self._program
        work = init()
        chunks = self._indices[:self.config.accumulation.factor // self.chunk]
        for u in self._indices[:self.config.batches_per_step]:
            for k in chunks:
                work = chunk(state, work, self._hyper, inputs, u, k)
            state, work = update(state, work, self._hyper)
        return state, work["buffers"], finite(state, work)

    def _memory_parts(self, temporaries: int) -> tuple[dict[str, int], dict[str, int]]:
        parts, detail = super()._memory_parts(temporaries)
        state = sum(int(np.prod(np.shape(a), dtype=np.int64)) * np.dtype(a.dtype).itemsize
                    for a in jax.tree.leaves(self._opt_state))
        # a run computes new weights and state beside the committed ones (atomic runs)
        parts["weights"] = 2 * parts["weights"]
        parts["optimizer state"] = 2 * state
        return parts, detail

    # -- a run ----------------------------------------------------------------------------------

    def _step(self, device_inputs: Mapping[str, Any]) -> Any:
        state, buffers, flags = self._execute(device_inputs)
        out, flags = self.placement.fetch((buffers, flags))
        return state, out, flags

    def _finish(self, fetched: Any) -> dict[str, np.ndarray]:
        state, out, flags = fetched
        if not flags.all():
            self._refuse_non_finite(flags)
        anchors = super()._finish(out)
        # the commit: one assignment, after everything that can fail
        self._weights, self._opt_state = state
        return anchors

    def _refuse_non_finite(self, flags: np.ndarray) -> None:
        updates = self.config.batches_per_step
        losses, weights = flags[:updates], flags[updates:]
        found = []
        if not losses.all():
            first = int(np.argmin(losses))
            found.append(f"the loss of weight update {first} (of {updates})")
        bad = [repr(n) for n, ok in zip(self.trained, weights, strict=True) if not ok]
        if bad:
            shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
            found.append(f"the updated weight(s) {shown} (a non-finite gradient or update)")
        raise NonFiniteUpdate(
            f"this run met NaN or Inf in {' and in '.join(found)}; no update of the run was "
            f"applied: the weights and optimizer state are as before the run. Fix: look for "
            f"NaN/Inf or extreme values in this run's inputs, lower the learning rate or the "
            f"loss scaling; check_finite=False skips this check.")

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state as host arrays (see the optimizer's ``init``)."""
        return self.placement.fetch(self._opt_state)

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
