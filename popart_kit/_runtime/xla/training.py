"""The xla backend for training: PopART's accumulation, replication and update semantics.

One ``run`` is bps weight updates. Each update accumulates, in one gradient accumulator, the
gradient of the loss summed over chunks of its A micro-batches on every local replica, and
makes the update with :func:`~.state.apply_update`: reduced once over the replicas of every
instance - a sum, divided by A x the global replica count for Mean, as PopART's Post strategy
does; a grouped weight's (VariableSettings) within each of its groups, see :mod:`.grouped` -
then the optimizer. Hyperparameters live on the device and change only through
``set_optimizer``, so changing them never recompiles.

A run is atomic: the executor computes a new :class:`~.state.SessionState` beside the
committed one, which it replaces only once the run has succeeded (anchors fetched, every update
finite, :func:`~.state.check_finite`); an exception or KeyboardInterrupt at any point leaves
the session as it was.

Memory is flat in A: beyond an unaccumulated step (A=1), an update of several chunks holds one
chunk's activations and one weight's gradient beside the accumulator (the accumulator itself
sits where the new weights are written; XLA:CPU's matrix products cannot add into their
output). Both are set by the chunk, not by A: a smaller ``micro_batches_per_chunk`` trades
the speed of larger matrix products for memory (``benchmarks/runtime_bench.py``, accumulation).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from ..._base.names import GRADIENT_PREFIX, RESTORED_PREFIX
from ..._base.problems import Problem, raise_errors, warn
from ..._base.shapes import AnchorReturnType
from ..._model.builder_subgraphs import node_reads
from ...errors import ConfigError
from . import loss_scaling as als
from .executors import Executor, HostDrivenExecutor, LoopedExecutor, StepFunctions, StepResult
from .grouped import RULE as GROUPED_RULE
from .grouped import group_divisors, optimizer_problems, replica_rows
from .host_exchange import min_over_instances
from .lowering import recomputation
from .ops import UnsupportedModel
from .ops_random import draws_random
from .pipeline import PipelineExecutor
from .placement import PROCESS
from .runtime import XlaBackend
from .state import Reduction, SessionState, apply_update, finite_flags, reduce_gradients

__all__ = ["XlaTrainingBackend"]

COPIED = "copied"  # the gradients' entry of the copy updates' new values (see copy_updates)

#: PopART's compound scalars of an SGD weight (compoundscalarhelper.hpp/.cpp), anchorable by
#: name, by the weight's update (SGD::getOptimizerInputs): SGD0 without a velocity, SGD1 with one
#: (accumulator and momentum Combined), SGD2 (Separate). Each stem: its value from the atoms
#: ``a`` (lr, dm, wd, mm, vs, ls) and the factors ``f`` (af, rf: the accumulation and
#: replication factors where the Post mean strategy divides by them; rf1: the replicas with
#: gradient accumulation; dp1: dampeningScaleFactor1's af / rf).
_STEMS: dict[str, dict[str, Callable[[Any, Any], Any]]] = {
    "SGD0": {"scaledLearningRate0": lambda a, f: a.lr * (1 - a.dm) / (a.ls * f.af * f.rf),
             "weightDecayScaleFactor0": lambda a, f: 1 - a.lr * (1 - a.dm) * a.wd},
    "SGD1": {"scaledLearningRate1": lambda a, f: a.lr / (a.vs * f.rf1),
             "dampeningScaleFactor1": lambda a, f: (1 - a.dm) * a.vs / (a.ls * f.dp1),
             "scaledMomentum1": lambda a, f: a.mm / f.rf1,
             "scaledWeightDecay1": lambda a, f: (1 - a.dm) * a.wd * a.vs},
    "SGD2": {"scaledLearningRate2": lambda a, f: a.lr / a.vs,
             "dampeningScaleFactor2": lambda a, f: (1 - a.dm) * a.vs / (a.ls * f.af * f.rf),
             "scaledMomentum2": lambda a, f: a.mm,
             "scaledWeightDecay1": lambda a, f: (1 - a.dm) * a.wd * a.vs},
}
_FORMULAS = {stem: formula for stems in _STEMS.values() for stem, formula in stems.items()}


class XlaTrainingBackend(XlaBackend):
    """Training steps of a model whose ``loss`` tensor is minimised by ``optimizer``.

    ``check_finite`` (default True) refuses a run whose loss or gradients are not finite
    (NaN or Inf) and keeps the weights as they were; False skips the check. An anchor named
    PopART's gradient prefix + a tensor (``"Gradient___w"``) returns the gradient of the
    micro-batch's (scaled) loss with respect to that tensor - an input, a weight, an activation
    or the loss - per micro-batch and replica, before any reduction, as PopART does. Dropout
    drops at random (see :mod:`.ops_random`), its gradient masked by the forward's mask.
    A trained weight's anchor is the weight as PopART copies it (:meth:`_post_update_anchors`):
    Final after the step's last update, All and Sum after each update without gradient
    accumulation, else the value the micro-batch used. PopART's compound optimizer scalars
    (``"scaledLearningRate0___default___FLOAT"``, ...: :meth:`_compound_scalars`) can be
    anchored, as can the loss scale.

    PopART's automatic loss scaling (``automaticLossScalingSettings.enabled``) is
    :mod:`.loss_scaling`: the factor lives in the :class:`~.state.SessionState`, and
    ``"finalLossScale"`` (the loss scale each micro-batch used), ``"lossScaling_<DTYPE>"`` and,
    accumulating, ``"Accum___autoLossScaleStats"`` can be anchored; a pipelined session runs
    its stages one after the other."""

    training = True

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType], loss: str, optimizer: Any,
                 micro_batches_per_chunk: int | None = None, check_finite: bool = True,
                 pipeline_workers: str = "threads") -> None:
        self.loss, self.optimizer, self.check_finite = loss, optimizer, bool(check_finite)
        self.als = als.Settings.of(config.popart_options)
        self.tracking: als.Tracking | None = None
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
        if loss not in self.graph.tensors:
            problems.append(Problem(("loss",), f"loss {loss!r} is not a tensor of the model.",
                                    "pass the id the loss op returned.", "K-loss-unknown"))
        raise_errors("TrainingSession", problems)
        self._refuse_inference_batch_norms(loss)
        found = self._shapes(self.io.inputs, [loss])[loss]
        shape, self.loss_dtype = found.shape, np.dtype(found.dtype)
        reads = self._loss_inputs(loss)
        self.trained = [w for w in self.graph.trainable if w in reads
                        and w not in self.copy_updates]
        if self.als is not None:
            self._setup_loss_scaling()
        problems = [Problem(("anchors", a), f"anchor {a!r}: the loss scale is "
                            f"{als.onnx_name(self.loss_dtype)} (the loss's type).",
                            f"anchor 'lossScaling_{als.onnx_name(self.loss_dtype)}'.",
                            "K-anchor-unknown")
                    for a in self.anchors if a.startswith(als.LOSS_SCALING)
                    and a != als.LOSS_SCALING + als.onnx_name(self.loss_dtype)]
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
        grouped = optimizer_problems(self.groupings, self.trained, self.optimizer)
        if grouped:
            raise ConfigError(grouped[0], rule=GROUPED_RULE)
        trained = {k: self.state.weights[k] for k in self.trained}
        self.state = SessionState(self.state.weights,
                                  self.placement.put_everywhere(self.optimizer.init(trained)),
                                  self.state.updates,
                                  () if self.als is None else self.placement.put_everywhere(
                                      np.ones((), np.float32)))
        self.hyper = self._device_hyper(self.optimizer)
        self.reduction = replace(
            Reduction.of(self.config, self.placement.axes if self.placement.several else (),
                         flat=self.placement.distributed),
            divisors=tuple(group_divisors(self.groupings, self.config).items()))

    # -- automatic loss scaling (see loss_scaling) -------------------------------------------

    def _setup_loss_scaling(self) -> None:
        """PopART's refusals of automatic loss scaling, the first in PopART's order, and the
        gradients it tracks."""
        settings, pipelined = self.als, self.config.pipeline.enabled
        problems = settings.problems(pipelined=pipelined,
                                     accumulating=self.config.accumulation.factor > 1)
        if not problems:
            nodes = self.graph.nodes
            onnx_nodes = {o: n for n in self.model.graph.node for o in n.output if o}
            names = sorted({i for n in nodes for i in n.inputs if i} | self.graph.tensors
                           - set(self.graph.known))
            dtypes = {k: np.dtype(v.dtype) for k, v in self._shapes(
                self.io.inputs, [n for n in names if n in self.graph.tensors]).items()}
            self.tracking, problems = als.track(
                settings, nodes, {o: n.domain for o, n in onnx_nodes.items()},
                self.graph.known, self.graph.weights, self.trained,
                self._loss_inputs(self.loss), onnx_nodes.get(self.loss),
                lambda name: dtypes.get(name, np.dtype(np.float32)), self.graph.tensors,
                {n.output[0] for n in self.model.graph.node if n.output and draws_random(n)})
            problems = problems or settings.range_problems()
            if not problems:
                probed = [*self.tracking.outputs, *self.tracking.tensors]
                self._als_probes = {k: (v.shape, np.dtype(v.dtype)) for k, v in
                                    self._shapes(self.io.inputs, probed).items()}
        raise_errors("TrainingSession", problems[:1])  # PopART stops at the first

    def _compound_scalars(self, anchors: Mapping[str, Any] | None = None
                          ) -> dict[str, tuple[str, str | None, np.dtype]]:
        """The anchors that are PopART's compound optimizer scalars (compoundscalarhelper):
        {anchor: (stem, weight with specific values or None, dtype)} for an SGD's
        ``<stem>___default___<TYPE>`` (TYPE a trainable weight's) and
        ``<stem>___specific___<weight>``; SGD0's stems without a velocity, SGD1's with one
        (Combined), SGD2's with one kept Separate (``anchors``: the session's unless given)."""
        opt = self.optimizer
        if type(opt).__name__ != "SGD":
            return {}
        separate = getattr(opt, "accumulator_and_momentum", "combined") == "separate"
        types = {als.onnx_name(np.dtype(w.dtype)): np.dtype(w.dtype)
                 for n, w in self.graph.weights.items() if n in self.graph.trainable
                 and np.issubdtype(np.dtype(w.dtype), np.floating)}
        out = {}
        for anchor in self.anchors if anchors is None else anchors:
            stem, _, rest = anchor.partition("___")
            kind, _, key = rest.partition("___")
            weight = key if kind == "specific" else None
            if kind == "default" and key in types:
                velocity, dtype = opt.has_velocity, types[key]
            elif weight is not None and weight in opt.specific and weight in self.graph.weights:
                velocity = opt._has_velocity(opt._weight(weight))
                dtype = np.dtype(self.graph.weights[weight].dtype)
            else:
                continue
            if stem in _STEMS["SGD2" if separate else "SGD1"] if velocity else \
                    stem in _STEMS["SGD0"]:
                out[anchor] = (stem, weight, dtype)
        return out

    def _compound_value(self, stem: str, weight: str | None, hyper: Any) -> Any:
        """Compound scalar ``stem`` of ``weight`` (None: the defaults) from the device
        hyperparameters, by PopART's formulas (:data:`_STEMS`)."""
        def atom(name: str, default: float) -> Any:
            return hyper.get(f"{name}@{weight}", hyper.get(name, default))

        acc, replicas = self.shape.accumulation, self.shape.global_replicas
        mean = self.config.accumulation.reduction == "mean"
        post = mean and self.config.accumulation.mean_strategy == "post"
        atoms = SimpleNamespace(
            lr=atom("learning_rate", 0.0), dm=atom("dampening", 0.0),
            wd=atom("weight_decay", 0.0), mm=atom("momentum", 0.0),
            vs=atom("velocity_scaling", 1.0), ls=hyper.get("loss_scaling", 1.0))
        dp1 = (acc if mean else 1) / (  # dampeningScaleFactor1's af / rf
            replicas if acc > 1 and not mean else 1 / replicas if acc == 1 and mean else 1)
        factors = SimpleNamespace(af=acc if post else 1, rf=replicas if post else 1,
                                  rf1=replicas if acc > 1 else 1, dp1=dp1)
        return _FORMULAS[stem](atoms, factors)

    def _extra_anchors(self, anchors: Mapping[str, Any] | None = None) -> set[str]:
        """The anchors that are no tensors of the model: the loss scale's (any training
        session), automatic loss scaling's and the optimizer's compound scalars."""
        out = {als.LOSS_SCALING + "FLOAT16", als.LOSS_SCALING + "FLOAT"}
        out.update(self._compound_scalars(anchors))
        if self.als is not None:
            out.add(als.FINAL_LOSS_SCALE)
            if self.config.accumulation.factor > 1:
                out.add(als.STATISTICS)
        return out

    def _problems(self, anchors: Mapping[str, AnchorReturnType], chunk: int | None,
                  workers: str = "threads") -> list[Problem]:
        extra = self._extra_anchors(anchors)
        return [p for p in super()._problems(anchors, chunk, workers)
                if not (p.rule == "K-anchor-unknown" and p.loc[-1] in extra)]

    def _shapes(self, inputs: Mapping[str, Any], wanted: list[str]) -> dict[str, Any]:
        extra = self._extra_anchors()
        if not any(w in extra for w in wanted):
            return super()._shapes(inputs, wanted)
        rest = [w for w in wanted if w not in extra]
        loss = [self.loss] if self.loss in self.graph.tensors else []
        out = super()._shapes(inputs, rest + loss)
        dtype = self._scale_dtype_of(out[self.loss].dtype if loss else np.float32)
        compound = self._compound_scalars()
        for w in wanted:
            if w in compound:
                out[w] = jax.ShapeDtypeStruct((), compound[w][2])
            elif w in extra:
                out[w] = jax.ShapeDtypeStruct((2,) if w == als.STATISTICS else (),
                                              np.float32 if w == als.STATISTICS else dtype)
        return out

    def _scale_dtype_of(self, loss_dtype: Any) -> np.dtype:
        """The loss scale's dtype: the loss's, or float32 with automatic loss scaling
        (PopART's EnsureFp32LossScale runs with it: ir.cpp, ensurefp32lossscale.cpp), which
        is also the factor's and finalLossScale's."""
        return np.dtype(np.float32) if self.als is not None else np.dtype(loss_dtype)

    @property
    def _scale_dtype(self) -> np.dtype:
        return self._scale_dtype_of(self.loss_dtype)

    def _scaled(self, hyper: Any, state: SessionState) -> Any:
        """The hyperparameters with the loss scaling the step uses: lossScaling x the factor
        (a power of two, so the optimizer divides it out exactly)."""
        if self.als is None:
            return hyper
        return {**hyper, "loss_scaling": hyper.get("loss_scaling", 1.0)
                * state.scaling.astype(jnp.float32)}

    def _counts(self, state: SessionState, values: Mapping[str, Any],
                probed: Mapping[str, Any]) -> Any:
        """[c, Rb, 2]: each micro-batch's and replica's [lower, upper] counts of the tracked
        gradients (zeros in a step that takes no histogram)."""
        tracking, known, edge = self.tracking, self.graph.known, self.als.edge

        def one(v: Mapping[str, Any], p: Mapping[str, Any]) -> Any:
            grads = [p[t] for t in tracking.tensors]
            for node, indices in tracking.nodes:
                args = [known[i] if i in known else v[i] if i else None for i in node.inputs]
                grads += als.node_gradients(node, args, p[node.outputs[0]], indices)
            return als.histogram(grads, edge)

        v = {i: values[i] for i in tracking.inputs if i not in known}
        p = {t: probed[t] for t in [*tracking.outputs, *tracking.tensors]}
        counts = jax.vmap(jax.vmap(one))(v, p)
        return counts * als.counted(state.updates, self.als.period).astype(jnp.float32)

    def _apply(self, state: SessionState, grads: Any, hyper: Any) -> SessionState:
        """A weight update; with automatic loss scaling, the optimizer divides the step's
        loss scale out and the factor moves (on the steps that count) by the step's counts,
        summed over every replica."""
        grads = dict(grads)
        copied = grads.pop(COPIED, None)
        if copied:  # replica 0's values (zeros elsewhere): summed over the replicas
            copied = reduce_gradients(copied, Reduction(self.reduction.axes,
                                                        self.reduction.flat))
            new = self._apply(state, grads, hyper)
            return replace(new, weights={**new.weights, **{
                n: v.astype(new.weights[n].dtype) for n, v in copied.items()}})
        if self.als is None:
            return apply_update(state, grads, hyper, self.optimizer, self.reduction)
        counts = grads.pop(als.STATISTICS)
        new = apply_update(state, grads, self._scaled(hyper, state), self.optimizer,
                           self.reduction)
        counts = reduce_gradients({als.STATISTICS: counts},
                                  Reduction(self.reduction.axes, self.reduction.flat))
        factor = state.scaling
        moved = als.next_factor(factor, counts[als.STATISTICS], self.als.ratio)
        return replace(new, scaling=jnp.where(als.counted(state.updates, self.als.period),
                                              moved, factor))

    def _make_executor(self, workers: str) -> Executor:
        """With automatic loss scaling or :attr:`copy_updates`, a pipelined session runs its
        stages one after the other (PopART takes it only with gradient accumulation, which
        flushes the pipeline before each update: the same numbers); the pipeline executor does
        not count gradients, agree on the factor between its stages nor copy weights."""
        if (self.als is None and not self.copy_updates) or not self.config.pipeline.enabled:
            executor = super()._make_executor(workers)
            if isinstance(executor, PipelineExecutor) and self._run_constants(None):
                executor.run = self._with_run_constants(executor.run)  # type: ignore[method-assign]
            return executor
        self.unpipelined_because = (
            "automatic loss scaling is on, which the pipeline executor does not implement"
            if self.als is not None else "the model copies tensors over weights after each "
            "micro-batch (a training BatchNormalization's running statistics), which the "
            "pipeline executor does not implement")
        warn(f"pipelining on the xla backend: {self.unpipelined_because}; running the stages "
             f"one after the other on one device (same numerics).")
        return (HostDrivenExecutor if self.on_host else LoopedExecutor)(
            self._step_functions(), self.placement)

    def _run_constants(self, hyper: Any) -> dict[str, Any]:
        """The anchors whose value a run's hyperparameters fix (the loss scale's and the
        compound scalars'), as {anchor: value} (``hyper`` None: {anchor: None})."""
        names = [a for a in self.anchors if a.startswith(als.LOSS_SCALING)] \
            if self.als is None else []
        out: dict[str, Any] = {n: None if hyper is None else np.asarray(
            hyper.get("loss_scaling", 1.0)).astype(self._scale_dtype) for n in names}
        for name, (stem, weight, dtype) in self._compound_scalars().items():
            out[name] = None if hyper is None else np.asarray(
                self._compound_value(stem, weight, hyper)).astype(dtype)
        return out

    def _pipeline_facts(self) -> Any:
        """The pipeline is not told of the :meth:`_run_constants` anchors (no stage computes
        them): :meth:`_with_run_constants` adds them to its runs' anchors."""
        facts = super()._pipeline_facts()
        constants = self._run_constants(None)
        if not constants:
            return facts
        return replace(facts, **{k: {a: v for a, v in getattr(facts, k).items()
                                     if a not in constants}
                                 for k in ("anchors", "tensors", "anchor_shapes")})

    def _with_run_constants(self, run: Any) -> Any:
        """``run`` (the pipeline's) with the :meth:`_run_constants` anchors added, each in
        its host shape, from the run's hyperparameters."""
        def with_constants(inputs: Any, state: Any, hyper: Any) -> StepResult:
            result = run(inputs, state, hyper)
            host = {k: np.asarray(v) for k, v in self.placement.fetch(hyper).items()}
            values = {name: np.full(self._anchor_shapes[name], value) for name, value in
                      self._run_constants(host).items()}
            return replace(result, anchors={**result.anchors, **values})

        return with_constants

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
            if np.issubdtype(spec.dtype, np.integer) and self._integer_loss():
                continue  # PopART backpropagates an integer loss in integers
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

    def _refuse_inference_batch_norms(self, loss: str) -> None:
        """PopART refuses to differentiate a BatchNormalization with one output (inference
        mode) on the loss's path (batchnorm.cpp, BatchNormGradOp): it must be detached (a
        Detach on its output stops the path) or given its five training outputs."""
        producer = self._producers
        seen, todo, found = set(), [loss], []
        while todo:
            tensor = todo.pop()
            node = producer.get(tensor)
            if tensor in seen or node is None or node.op_type == "Detach":
                continue
            seen.add(tensor)
            if node.op_type == "BatchNormalization" and node.domain in (
                    "", "ai.onnx", "ai.graphcore") and len([o for o in node.output if o]) == 1:
                found.append(node)
            todo += node_reads(node)
        if found:
            node = found[0]
            text = (f"BatchNorm Op \"{node.name or node.output[0]}\" has 1 output(s) which "
                    f"means it is in inference mode, but its gradient Op is being created. To "
                    f"use the BatchNorm Op in inference mode during training, it has to be "
                    f"detached first.")
            failed = UnsupportedModel([
                f"{n.name or n.output[0]} (BatchNormalization): one output (inference mode) on "
                f"the path to loss {loss!r}: PopART refuses its gradient. Fix: give it its five "
                f"training outputs (GraphTransformer.prepareNodesForTraining), or detach its "
                f"output (aiGraphcore.detach)." for n in found])
            failed.popart_text = text
            raise failed

    def _integer_loss(self) -> bool:
        """Whether the loss is an integer tensor (the whole backward pass then is too)."""
        loss = self.loss
        return loss in self.graph.tensors and np.issubdtype(
            self._shapes(self.io.inputs, [loss])[loss].dtype, np.integer)

    @functools.cached_property
    def _producers(self) -> dict[str, onnx.NodeProto]:
        """The node that makes each tensor of the model's graph."""
        return {o: n for n in self.model.graph.node for o in n.output}

    def _loss_inputs(self, loss: str) -> set[str]:
        """Every tensor the loss depends on, read back through the graph."""
        producer = self._producers
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
        # a chunk never crosses a weight update; with copy updates (written after each
        # micro-batch, read by the next), a chunk is one micro-batch
        return 1 if self.copy_updates else self.shape.accumulation

    @functools.cached_property
    def copy_updates(self) -> dict[str, str]:
        """{weight: tensor}: the weights PopART updates by copying a tensor over them after
        each micro-batch (a CopyVarUpdate, in the accumulation loop: mainloops.cpp): the
        updater of an ai.graphcore CopyVarUpdate, and a training BatchNormalization's (one
        with more than one output) running mean and var, inputs 3 and 4 (through a Detach),
        from its outputs 1 and 2 (batchnorm.cpp's setup).
        Such a weight gets no gradient update; with replication, replica 0's copy is kept
        (PopART's replicas each keep their own; the host reads replica 0's)."""
        producer = self._producers
        out: dict[str, str] = {}
        for node in self.model.graph.node:
            if node.op_type == "CopyVarUpdate" and node.domain == "ai.graphcore" \
                    and node.input[0] in self.graph.weights:
                out[node.input[0]] = node.input[1]
            if node.op_type != "BatchNormalization" or node.domain not in (
                    "", "ai.onnx", "ai.graphcore") or len(node.output) < 2:
                continue
            for i in (3, 4):
                source = node.input[i] if len(node.input) > i else ""
                if source in producer and producer[source].op_type == "Detach":
                    source = producer[source].input[0]
                if source in self.graph.weights and len(node.output) > i - 2 \
                        and node.output[i - 2]:
                    out[source] = node.output[i - 2]
        return out

    def _activation_bytes(self, inputs: Any) -> int:
        return 2 * super()._activation_bytes(inputs)  # the backward pass keeps as much again

    def _work(self) -> dict[str, Any]:
        """What a step carries besides the state: the anchor buffers and, per update,
        whether every micro-batch's loss was finite."""
        work = {"buffers": self.buffers.init(self.placement.per_device),
                "losses_finite": jnp.ones((self.shape.batches_per_step,), bool)}
        if als.STATISTICS in self.anchors:  # the update's counts so far, per replica
            work["statistics"] = jnp.zeros((self.placement.per_device, 2), jnp.float32)
        if self.copy_updates and self.shape.accumulation > 1:  # copied since the update
            work[COPIED] = {n: jnp.zeros(np.shape(self.graph.weights[n]),
                                         self.graph.weights[n].dtype) for n in self.copy_updates}
        return work

    def _step_functions(self) -> StepFunctions:
        """A training step: bps updates of A / chunk chunks each."""
        return StepFunctions(
            updates=self.shape.batches_per_step,
            chunks=self.shape.accumulation // self.chunk, work=self._work,
            chunk=self._chunk_grads,
            apply=self._apply,
            flags=self._finite if self.check_finite else None, inputs=self._inputs,
            stream_axes=self._stream_axes(), buffer_axes=self.buffers.replica_axes(),
            after=self._after_update if self._post_update_anchors() else None)

    def _post_update_anchors(self) -> list[str]:
        """The anchors of trained weights that return the weight after an update, as PopART
        copies a weight's anchor once its VarUpdate has run (irlowering.cpp, toHostTask's
        final populator): Final (the end of the step's copy, after its last update) and,
        without gradient accumulation, All and Sum (copied in the backward pass, after the
        update). With accumulation All and Sum are copied in the inner loop and EveryN as soon
        as the weight exists: the weight the micro-batch used."""
        unaccumulated = self.shape.accumulation == 1
        return [a for a, art in self.anchors.items() if a in self.trained and (
            art.name == "Final" or (unaccumulated and art.name in ("All", "Sum")))]

    def _after_update(self, state: SessionState, work: Any, update: Any) -> Any:
        """Write the :meth:`_post_update_anchors` of update ``update`` from its new weights:
        as the value of its last micro-batch, each replica its group's row."""
        names = self._post_update_anchors()
        per_device = self.placement.per_device
        rows = replica_rows({n: state.weights[n] for n in names if n in self.groupings},
                            {n: g for n, g in self.groupings.items() if n in names}, per_device,
                            self.placement.axes if self.placement.several else None)
        values = {n: (rows[n] if n in rows else jnp.broadcast_to(
            state.weights[n], (per_device, *jnp.shape(state.weights[n]))))[None] for n in names}
        start = update * self.shape.accumulation + self.shape.accumulation - 1
        return {**work, "buffers": self.buffers.write(work["buffers"], values, start)}

    def _chunk_grads(self, state: SessionState, work: Any, hyper: Any, inputs: Any,
                     update: Any, index: Any) -> tuple[dict[str, jax.Array], Any]:
        """The gradient of chunk ``index`` of update ``update`` (summed over its micro-batches
        and this device's replicas), with its anchors written into ``work``."""
        weights, copies = state.weights, self.copy_updates
        if COPIED in work:  # a later micro-batch of the update reads the earlier one's copy
            weights = {**weights, **{n: jnp.where(index == 0, weights[n], work[COPIED][n])
                                     for n in copies}}
        start = update * self.shape.accumulation + index * self.chunk
        gradients, extra, tracking = self.gradient_anchors, self._extra_anchors(), self.tracking
        wanted = list(dict.fromkeys([self.loss, *(self._anchor_tensor(a) for a in self.anchors
                                                 if a not in gradients and a not in extra),
                                     *(i for i in (tracking.inputs if tracking else ())
                                       if i not in self.graph.known), *copies.values()]))
        lead = (self.chunk, self.placement.per_device)
        # an integer tensor's probe is float32: what it feeds is then computed in float32,
        # its gradient cast back to the integer anchor (PopART backpropagates integers)
        specs = {tensor: self.io.anchors[anchor][0] for anchor, tensor in gradients.items()}
        probes = {tensor: jnp.zeros(lead + spec.shape, spec.dtype if np.issubdtype(
                      spec.dtype, np.inexact) else np.float32) for tensor, spec in specs.items()}
        if tracking:
            probes.update({t: jnp.zeros(lead + tuple(shape), dtype) for t, (shape, dtype)
                           in self._als_probes.items() if t not in probes})
        unscaled, hyper = hyper, self._scaled(hyper, state)

        def loss_of(train: Mapping[str, jax.Array],
                    probes: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, Any]]:
            values = self._evaluate_chunk({**weights, **train}, inputs, start, wanted, probes)
            # gradients leave the backward pass scaled by the loss scaling, as in PopART;
            # the optimizer divides it out
            scale = hyper.get("loss_scaling", 1.0)
            total = jnp.sum(values[self.loss])
            if not jnp.issubdtype(total.dtype, jnp.inexact):  # an integer loss (PopART's)
                total = total.astype(jnp.float32)
            return total * scale, values

        with recomputation(self._recomputation()):  # what the backward recomputes
            (grads, probed), values = jax.grad(loss_of, argnums=(0, 1), has_aux=True)(
                {n: weights[n] for n in self.trained}, probes)
        values = {**values, **{a: probed[t] for a, t in gradients.items()}}
        out = dict(work)
        # the loss scale as PopART holds it: a tensor of the loss's dtype
        scale = jnp.asarray(unscaled.get("loss_scaling", 1.0)).astype(self._scale_dtype)
        values[als.LOSS_SCALING + als.onnx_name(self.loss_dtype)] = jnp.broadcast_to(scale, lead)
        for name, (stem, weight, dtype) in self._compound_scalars().items():
            values[name] = jnp.broadcast_to(jnp.asarray(
                self._compound_value(stem, weight, unscaled)).astype(dtype), lead)
        if tracking:
            counts = self._counts(state, values, probed)
            grads[als.STATISTICS] = counts.sum(axis=(0, 1))
            values[als.FINAL_LOSS_SCALE] = jnp.broadcast_to(scale * state.scaling, lead)
            if "statistics" in work:  # PopART's accumulator: the update's counts so far
                so_far = jnp.where(index == 0, 0, work["statistics"]) + jnp.cumsum(counts, 0)
                values[als.STATISTICS], out["statistics"] = so_far, so_far[-1]
        if copies:  # replica 0's (the device's first, on the first device), as a gradient:
            # zeros but in the update's last chunk, so that summing the chunks keeps it
            first = (index == self.shape.accumulation // self.chunk - 1) & (
                jax.lax.axis_index(self.placement.axes) == 0 if self.placement.several
                else True)
            new = {n: jax.lax.stop_gradient(values[t][-1, 0]) for n, t in copies.items()}
            grads[COPIED] = {n: jnp.where(first, v, jnp.zeros_like(v)) for n, v in new.items()}
            if COPIED in out:
                out[COPIED] = {n: v.astype(weights[n].dtype) for n, v in new.items()}
        after = self._post_update_anchors()  # written by _after_update
        out["buffers"] = self.buffers.write(work["buffers"], {
            n: values[n if n in gradients else self._anchor_tensor(n)] for n in self.anchors
            if n not in after}, start)
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
            flags = min_over_instances(flags.astype(jnp.int32), self.placement.axes,
                                       PROCESS).astype(bool)
        return flags

    def _memory_parts(self, temporaries: int) -> tuple[dict[str, int], dict[str, int]]:
        parts, detail = super()._memory_parts(temporaries)
        state = sum(int(np.prod(np.shape(a), dtype=np.int64)) * np.dtype(a.dtype).itemsize
                    for a in jax.tree.leaves(self.state.optimizer))
        # a run computes new weights and state beside the committed ones (atomic runs)
        parts["weights"] = 2 * parts["weights"]
        parts["optimizer state"] = 2 * state
        if self.on_host:  # the accumulator is carried between the chunk programs' calls, one
            # of their arguments (a looped step's is among XLA's own figures)
            parts["gradient accumulator"] = sum(
                int(np.prod(np.shape(self.state.weights[n]), dtype=np.int64))
                * np.dtype(self.state.weights[n].dtype).itemsize for n in self.trained)
        return parts, detail

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state as host arrays (see the optimizer's ``init``)."""
        return self.placement.fetch(self.state.optimizer)

    def set_optimizer_state(self, values: Mapping[str, Any]) -> None:
        """Replace part of the optimizer's state (a checkpoint's): ``values`` shaped as
        :meth:`optimizer_state` gives it (``{key: {weight: array}}`` or ``{key: array}``), a
        subset, each array cast to the state's dtype there. Refused, before anything changes:
        a key or weight the state lacks, an array of another shape."""
        with self._lock:
            new = self.placement.fetch(self.state.optimizer)
            for key, part in values.items():
                have = new.get(key) if isinstance(new, dict) else None
                if have is None:
                    kind = type(self.optimizer).__name__
                    raise ConfigError(f"optimizer state {key!r}: the {kind} state has "
                                      f"{sorted(new or {})}. Fix: give the state this "
                                      f"optimizer keeps.", rule="K-optimizer-state")
                pairs = part.items() if isinstance(part, Mapping) else [(None, part)]
                for weight, value in pairs:
                    old = have if weight is None else have.get(weight)
                    if old is None:
                        raise ConfigError(f"optimizer state {key!r} has no weight {weight!r} "
                                          f"(it has {sorted(have)}). Fix: give the state of "
                                          f"the weights the optimizer trains.",
                                          rule="K-optimizer-state")
                    value = np.asarray(value)
                    if value.shape != np.shape(old):
                        raise ConfigError(f"optimizer state {key!r} of {weight!r}: shape "
                                          f"{list(value.shape)}, the state's is "
                                          f"{list(np.shape(old))}. Fix: give an array of the "
                                          f"state's shape.", rule="K-optimizer-state")
                    cast = value.astype(np.asarray(old).dtype)
                    if weight is None:
                        new[key] = cast
                    else:
                        have[weight] = cast
            self.state = replace(self.state, optimizer=self.placement.put_everywhere(new))

    def loss_scaling_state(self) -> dict[str, Any]:
        """Automatic loss scaling's state on the host: ``{"factor": float32 scalar (the loss
        scale update factor), "updates": weight updates counted so far (an int: the period's
        phase), "tracked": how many gradients the histograms count}``; ``{}`` without it."""
        if self.als is None:
            return {}
        tracked = len(self.tracking.tensors) + sum(len(i) for _, i in self.tracking.nodes)
        return {"factor": np.asarray(self.placement.fetch(self.state.scaling), np.float32),
                "updates": int(np.asarray(self.placement.fetch(self.state.updates))),
                "tracked": tracked}

    def set_loss_scaling_state(self, factor: Any = None, updates: int | None = None) -> None:
        """Replace automatic loss scaling's state (a checkpoint's): the loss scale update
        ``factor`` (a scalar, or None: kept) and the ``updates`` counted so far (None: kept).
        Refused: a session without automatic loss scaling, a factor that is not one finite
        positive number, negative updates."""
        if self.als is None:
            raise ConfigError("set_loss_scaling_state: automatic loss scaling is off in this "
                              "session. Fix: enable automaticLossScalingSettings.",
                              rule="K-optimizer-state")
        new: dict[str, Any] = {}
        if factor is not None:
            value = np.asarray(factor, np.float32)
            if value.size != 1 or not np.isfinite(value).all() or value.reshape(-1)[0] <= 0:
                raise ConfigError(f"loss scale update factor {value.tolist()}: give one finite "
                                  f"positive number (the factor starts at 1).",
                                  rule="K-optimizer-state")
            new["scaling"] = self.placement.put_everywhere(value.reshape(()))
        if updates is not None:
            if int(updates) < 0:
                raise ConfigError(f"loss scaling updates={updates}: give a count of 0 or more.",
                                  rule="K-optimizer-state")
            new["updates"] = self.placement.put_everywhere(np.int32(updates))
        with self._lock:
            self.state = replace(self.state, **new)

    def set_optimizer(self, optimizer: Any) -> None:
        """New hyperparameter values (the session checked it is the same kind of optimizer):
        put on the device once, for the next runs of the same compiled program."""
        hyper = self._device_hyper(optimizer)
        with self._lock:
            self.hyper, self.optimizer = hyper, optimizer
