"""PopART's automatic loss scaling (ALS) on the xla backend: the rule, and what it tracks.

PopART (willow/src/transforms/automaticlossscaling.cpp) keeps a loss-scale update factor ``F``
(a variable of the loss scale's dtype, starting at 1: float32, as PopART's EnsureFp32LossScale
transform makes the loss scale when automatic loss scaling is on): each step scales the loss
by ``finalLossScale = lossScaling x F`` and the optimizer divides the same out (its inverse
loss scale divided by ``F``), so with ``F`` a power of two the weights are those of a run
without ALS. After the step's gradients, a histogram of ``|g|`` with a single bin edge
``65504 x binEdgeLocation`` is taken of every tracked fp16 gradient tensor ``g``: the counts
below and at-or-above the edge, summed over the tracked tensors, the micro-batches of the step
and the replicas, then (LossScaleUpdate, popx/op/lossscaleupdatex.cpp) ``F`` halves if
``upper > f x lower`` with ``f = t / (1 - t)`` (``t = thresholdUpperCountProportion``), else
doubles. With ``updatePeriod = P`` both the histograms and the update run on the steps whose
index (counted over the session's life) is a multiple of ``P``; the others keep ``F``.

Tracked gradients (``gradientTensorTrackingMethod``):

* ``ConvAndMatmulGradients``: the gradients a backward MatMul/Conv produces - here each
  MatMul, Gemm, Conv or ConvTranspose node's input gradients (A and B, data and weights) as that
  node alone produces them (its vector-Jacobian product with its output's gradient), for the
  inputs PopART computes a gradient of (those depending on a trained weight);
* ``AllNonViewChangingGradientTensors`` (PopART's default): every node's input gradients, as
  above, except for view changes (Reshape, Transpose, Identity, ...), the node making the loss
  (and a Softmax feeding it: PopART's fused gradient reads the loss scale), random operators
  (here: Dropout's mask would be drawn again), nodes of several outputs (here) and gradients
  that read a weight (PopART leaves out gradient ops with a variable input; a MatMul's or
  Conv's reads a transposed or flipped copy, so theirs are kept);
* ``GradientsOfUserSpecifiedTensors``: the whole gradient of each tensor in
  ``toTrackTensors``.

Only fp16 gradients are counted (PopART's rule); none found is PopART's error. A node's own
input gradients are its vector-Jacobian product replayed beside the step's backward pass (at
worst one more backward of the tracked nodes); a tensor's whole gradient is the gradient of a
zero added where it comes into being, as for gradient anchors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.problems import Problem

__all__ = ["Settings", "Tracking", "FINAL_LOSS_SCALE", "STATISTICS", "LOSS_SCALING", "FP16_MAX",
           "histogram", "next_factor", "counted", "track", "node_gradients", "onnx_name"]

#: The anchorable tensor of the loss scale a step used (PopART's name).
FINAL_LOSS_SCALE = "finalLossScale"
#: The prefix of the loss scale's tensor (then its dtype: lossScaling_FLOAT16).
LOSS_SCALING = "lossScaling_"
#: PopART's accumulator of the step's [lower, upper] counts (with gradient accumulation).
STATISTICS = "Accum___autoLossScaleStats"
FP16_MAX = 65504.0
METHODS = ("AllNonViewChangingGradientTensors", "ConvAndMatmulGradients",
           "GradientsOfUserSpecifiedTensors")
_MATMUL_CONV = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})
_VIEW_CHANGES = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Transpose",
                           "Detach", "Nop"})
_NO_OPERAND_READ = frozenset({"Add", "Sub", "Sum"})  # their gradients read no other input
_TRANSFORM = "[AutomaticLossScale transform] "
_RULE = "K-xla-auto-loss-scaling"
_LOC = ("popart_options", "automaticLossScalingSettings")


@dataclass(frozen=True)
class Settings:
    """PopART's AutomaticLossScalingSettings, as the session gave them (defaults as in
    sessionoptions.hpp)."""

    bin_edge_location: float = 0.125
    threshold: float = 1e-7
    period: int = 1
    method: str = "AllNonViewChangingGradientTensors"
    to_track: tuple[str, ...] | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> Settings | None:
        """The settings in ``options`` (a session's popart_options), None when ALS is off."""
        als = options.get("automaticLossScalingSettings") or {}
        if not isinstance(als, Mapping) or not als.get("enabled"):
            return None
        method = als.get("gradientTensorTrackingMethod", cls.method)
        tracked = als.get("toTrackTensors")
        return cls(float(als.get("binEdgeLocation", cls.bin_edge_location)),
                   float(als.get("thresholdUpperCountProportion", cls.threshold)),
                   int(als.get("updatePeriod", cls.period)),
                   str(getattr(method, "name", method)),
                   None if tracked is None else tuple(tracked))

    @property
    def edge(self) -> np.float32:
        """The histogram's single bin edge (fp16's largest value x binEdgeLocation)."""
        return np.float32(FP16_MAX) * np.float32(self.bin_edge_location)

    @property
    def ratio(self) -> np.float32:
        """f = t / (1 - t): the factor halves when upper > f x lower (inf for t = 1)."""
        t = np.float32(self.threshold)
        with np.errstate(divide="ignore"):
            return np.float32(t / (np.float32(1) - t))

    def problems(self, *, pipelined: bool, accumulating: bool) -> list[Problem]:
        """PopART's refusals of the settings themselves, in PopART's order (the transform's
        pipelining check, then PreAutomaticLossScale's toTrackTensors checks); then come
        :func:`track`'s and :meth:`range_problems`."""
        out = []
        if pipelined and not accumulating:
            out.append(_problem(
                ("pipeline", "enabled"), "Automatic loss scaling is not currently supported "
                "when the 'enablePipelining' SessionOption is set to 'true', but the "
                "'enableGradientAccumulation' SessionOption is set to 'false'",
                "enable gradient accumulation, or turn automatic loss scaling off."))
        if self.method not in METHODS:
            out.append(_problem(("gradientTensorTrackingMethod",),
                                f"Unknown GradientTensorTrackingMethod {self.method!r}.",
                                f"use one of {', '.join(METHODS)}."))
        user = self.method == "GradientsOfUserSpecifiedTensors"
        if self.to_track is not None and not user:
            out.append(_problem(
                ("toTrackTensors",), "toTrackTensors has been set, but "
                "gradientTensorTrackingMethod has not been set to "
                "'GradientTensorTrackingMethod::GradientsOfUserSpecifiedTensors'.",
                "set gradientTensorTrackingMethod to GradientsOfUserSpecifiedTensors, or "
                "leave toTrackTensors unset."))
        elif user and self.to_track is None:
            out.append(_problem(
                ("toTrackTensors",), "gradientTensorTrackingMethod set to "
                "'GradientTensorTrackingMethod::GradientsOfUserSpecifiedTensors' but "
                "'toTrackTensors' has not been set", "give toTrackTensors."))
        elif user and not self.to_track:
            out.append(Problem(
                _LOC + ("toTrackTensors",), "toTrackTensors is an empty list.",
                "set enabled = False to disable tracking, or leave toTrackTensors unset for "
                "the default tensors.", _RULE,
                popart="[PreAutomaticLossScale] An empty list was set as the value of "
                       "'toTrackTensors'. To disable tensor tracking, please set "
                       "'automaticLossScalingSettings.enabled = False'. To track the default "
                       "tensors, please leave 'automaticLossScalingSettings.toTrackTensors' "
                       "unset."))
        return out

    def range_problems(self) -> list[Problem]:
        """PopART's refusals of the histogram's bin edge, the threshold and the period (made
        after the tracked tensors are found)."""
        out = []
        if not 0 <= self.bin_edge_location <= 1:
            out.append(_problem(
                ("binEdgeLocation",), f"Out of range value for 'binEdgeLocation'. The current "
                f"value is {self.bin_edge_location:g}, but it should be in the range [0, 1].",
                "give a value in [0, 1]."))
        if not 0 <= self.threshold <= 1:
            out.append(Problem(
                _LOC + ("thresholdUpperCountProportion",),
                f"thresholdUpperCountProportion={self.threshold:g} is outside [0, 1].",
                "give a value in [0, 1].", _RULE,
                popart=f"Out of range value for 'thresholdUpperCountProportion'. The current "
                       f"value is {self.threshold:g}, but it should be in the range [0, 1]."))
        if self.period < 1:
            out.append(_problem(("updatePeriod",), f"Arguments N and M of "
                                f"executeOpNTimesEveryMTimes are 1, {self.period} . N must not "
                                f"be larger than M.", "give an updatePeriod of 1 or more."))
        return out


def _problem(where: tuple[str, ...], text: str, fix: str) -> Problem:
    """A refusal with PopART's AutomaticLossScale transform's text."""
    return Problem(_LOC + where, text, fix, _RULE, popart=_TRANSFORM + text)


@dataclass(frozen=True)
class Tracking:
    """What a step counts: ``nodes`` - (node, input indices): those inputs' gradients as the
    node alone produces them - and ``tensors``, whose whole gradients are counted."""

    nodes: tuple[tuple[Any, tuple[int, ...]], ...] = ()
    tensors: tuple[str, ...] = ()

    @property
    def outputs(self) -> list[str]:
        """The node outputs whose gradients the step needs (each node's first)."""
        return list(dict.fromkeys(node.outputs[0] for node, _ in self.nodes))

    @property
    def inputs(self) -> list[str]:
        """The node inputs whose values the step needs (folded constants included: the
        caller takes those from the graph)."""
        return list(dict.fromkeys(i for node, _ in self.nodes for i in node.inputs if i))


def track(settings: Settings, nodes: Sequence[Any], domains: Mapping[str, str],
          known: Mapping[str, Any], weights: Iterable[str], trained: Iterable[str],
          on_loss_path: set[str], loss_node: Any, dtype_of: Callable[[str], np.dtype],
          tensors: set[str], random: set[str] = frozenset()) -> tuple[Tracking, list[Problem]]:
    """The gradients ``settings`` tracks in a lowered graph's ``nodes`` (``domains``: each
    node's first output -> its ONNX domain; ``known``: the folded constants; ``weights``: the
    model's initializers; ``trained``: the weights the loss trains; ``on_loss_path``: every
    tensor the loss depends on; ``loss_node``: the ONNX node making the loss (None: none);
    ``dtype_of``: a tensor's dtype;
    ``tensors``: every tensor of the model; ``random``: the first outputs of random nodes,
    whose gradients are not tracked: replaying one would draw again), with PopART's refusals
    when none is found."""
    fp16 = np.dtype(np.float16)
    needs = _downstream(nodes, set(trained))  # the tensors PopART computes a gradient of
    if settings.method == "GradientsOfUserSpecifiedTensors":
        names = list(dict.fromkeys(settings.to_track or ()))
        missing = [n for n in names if n not in tensors]
        if missing:
            return Tracking(), [Problem(
                _LOC + ("toTrackTensors",), f"tensors {missing} of toTrackTensors are not in "
                f"the model.", "name tensors of the model.", _RULE,
                popart="[PreAutomaticLossScale] Some of the tensors in the "
                       "'automaticLossScalingSettings.toTrackTensors' list do not exist in the "
                       "model. Please look at the error log.")]
        names = [n for n in names if n in needs and n in on_loss_path]
        wrong = [n for n in names if dtype_of(n) != fp16]
        if wrong:
            text = (f"Unsupported data type {onnx_name(dtype_of(wrong[0]))} for to-track "
                    f"tensor '{wrong[0]}'")
            return Tracking(), [_problem(("toTrackTensors",), text,
                                         "track fp16 tensors only.")]
        return Tracking(tensors=tuple(names)), []
    weights = set(weights)
    chosen = []
    for node in nodes:
        op_type = node.ctx.op_type
        domain = domains.get(node.outputs[0], "")
        if node.outputs[0] in random or not any(o in on_loss_path for o in node.outputs if o) \
                or sum(1 for o in node.outputs if o) > 1:
            continue
        if settings.method == "ConvAndMatmulGradients":
            if domain not in ("", "ai.onnx") or op_type not in _MATMUL_CONV:
                continue
            indices = (0, 1)
        else:
            made_loss = loss_node is not None and node.outputs[0] == loss_node.output[0]
            fused = (op_type in ("Softmax", "LogSoftmax") and loss_node is not None
                     and loss_node.op_type == "Nll" and node.outputs[0] in loss_node.input)
            if op_type in _VIEW_CHANGES or made_loss or fused:
                continue
            indices = tuple(range(len(node.inputs)))
        keep = []
        for i in indices:
            name = node.inputs[i] if i < len(node.inputs) else ""
            if not name or name in known or name not in needs or dtype_of(name) != fp16:
                continue
            if settings.method != "ConvAndMatmulGradients" and op_type not in _MATMUL_CONV \
                    and op_type not in _NO_OPERAND_READ and any(
                        other in weights for j, other in enumerate(node.inputs) if j != i):
                continue  # PopART's gradient op reads a variable: not tracked
            keep.append(i)
        if keep:
            chosen.append((node, tuple(keep)))
    if not chosen:
        return Tracking(), [_problem((), "No tracked gradient tensors of type fp16 were found.",
                                     "train an fp16 model (its MatMul/Conv gradients are "
                                     "tracked), or turn automatic loss scaling off.")]
    return Tracking(nodes=tuple(chosen)), []


def _downstream(nodes: Sequence[Any], start: set[str]) -> set[str]:
    """``start`` and every tensor computed from it (the nodes in graph order)."""
    out = set(start)
    for node in nodes:
        if any(i in out for i in node.inputs if i):
            out.update(o for o in node.outputs if o)
    return out


def onnx_name(dtype: np.dtype) -> str:
    return {"float32": "FLOAT", "float16": "FLOAT16", "float64": "DOUBLE"}.get(
        np.dtype(dtype).name, np.dtype(dtype).name.upper())


def node_gradients(node: Any, args: list[Any], cotangent: Any,
                   indices: Sequence[int]) -> list[Any]:
    """The gradients of ``node``'s inputs ``indices`` (one micro-batch on one replica) as the
    node alone produces them: its vector-Jacobian product with its first output's
    ``cotangent``. ``args`` are its inputs (folded constants as numpy values)."""
    def first(*picked: Any) -> Any:
        full = list(args)
        for i, value in zip(indices, picked, strict=True):
            full[i] = value
        return node.op(node.ctx.with_values(full), *full)[0]

    out, vjp = jax.vjp(first, *(args[i] for i in indices))
    return list(vjp(cotangent.astype(out.dtype)))


def histogram(values: Iterable[Any], edge: Any) -> Any:
    """[lower, upper] (float32): how many elements of ``values`` have ``|x| < edge`` and how
    many do not (PopART's single-edge histogram of absolute values, its level in the
    tensor's dtype: an edge below fp16's range is 0 and counts everything upper; Inf and NaN
    count as upper)."""
    lower = upper = jnp.float32(0)
    for x in values:
        level = jnp.float32(np.asarray(edge, np.float32).astype(x.dtype))
        below = jnp.sum(jnp.abs(x.astype(jnp.float32)) < level, dtype=jnp.float32)
        lower, upper = lower + below, upper + (jnp.float32(x.size) - below)
    return jnp.stack([lower, upper])


def next_factor(factor: Any, counts: Any, ratio: Any) -> Any:
    """PopART's LossScaleUpdate: ``factor`` halved if ``upper > ratio x lower``, else doubled
    (in ``factor``'s dtype)."""
    down = counts[1] > jnp.float32(ratio) * counts[0]
    return jnp.where(down, factor * jnp.asarray(0.5, factor.dtype),
                     factor * jnp.asarray(2, factor.dtype))


def counted(update: Any, period: int) -> Any:
    """Whether weight update ``update`` (counted over the session's life, from 0) takes
    histograms and moves the factor: every ``period``-th, from the first."""
    return update % period == 0
