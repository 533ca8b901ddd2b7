"""Host checks of integer data before a run: indices in range, 64-bit values that fit 32 bits.

Out-of-range indices do not fail on an accelerator: XLA clamps them and PopART reads whatever
lies there, so a label of 7 for 3 classes gives a finite loss and a wrong update.
:class:`IndexChecks` finds, once per model, the graph inputs used directly as indices - the
label of PopART's Nll (``ai.graphcore``) and of ONNX's NegativeLogLikelihoodLoss and
SoftmaxCrossEntropyLoss, the indices of Gather, GatherElements and
ScatterElements - and the size they index (from shape inference), and refuses a run whose
arrays hold values outside it, naming the tensor, the node and the offending values. The xla
backend computes int64 as int32 (uint64 as uint32), as PopART does on the device, so 64-bit
values outside the 32-bit range are refused too - in inputs, in a model's weights and in weights
written to a session (:func:`narrowing_problems`), where they would wrap silently.
Pure: numpy and onnx only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from .._base.problems import Problem, raise_errors
from ..errors import InvalidData, clip, short

__all__ = ["IndexChecks", "IndexRange", "narrowing_problems"]

#: What a device computes each 64-bit integer type as.
NARROWED = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32)}
_SHOW = 5  # offending values quoted
_ONNX_CLASS_LOSSES = ("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss")
_INDEXING = ("Nll", "Gather", "GatherElements", "ScatterElements", *_ONNX_CLASS_LOSSES)


@dataclass(frozen=True)
class IndexRange:
    """Input ``tensor`` indexes a dimension of ``size`` in ``node``: valid values are
    ``low .. size - 1`` (``low`` is ``-size`` where negative indices count from the end), and
    ``ignore`` (Nll's ignoreIndex) besides."""

    tensor: str
    node: str
    size: int
    low: int
    ignore: int | None = None


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """Static shapes of the model's tensors, as far as shape inference finds them."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model the checker refuses is reported elsewhere
        inferred = model
    graph, out = inferred.graph, {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        t = value.type.tensor_type
        if value.type.HasField("tensor_type") and t.HasField("shape"):
            out[value.name] = tuple(d.dim_value if d.HasField("dim_value") else None
                                    for d in t.shape.dim)
    for init in graph.initializer:
        out[init.name] = tuple(init.dims)
    return out


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


class IndexChecks:
    """The index inputs of one model and their valid ranges; :meth:`check` runs them."""

    def __init__(self, ranges: list[IndexRange], narrows: bool = True) -> None:
        self.ranges = ranges
        self.narrows = narrows  # an input may arrive as 64-bit integers (then checked)

    @property
    def needed(self) -> bool:
        """Whether a run's arrays can fail these checks: an index input, or an input that
        may be given as int64 or uint64 (an int32 input accepts int64 arrays)."""
        return bool(self.ranges) or self.narrows

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> IndexChecks:
        graph = model.graph
        inputs = {v.name for v in graph.input} - {t.name for t in graph.initializer}
        shapes = _shapes(model) if any(n.op_type in _INDEXING for n in graph.node) else {}
        ranges = []
        for i, node in enumerate(graph.node):
            label = f"{node.name or (node.output[0] if node.output else f'#{i}')} ({node.op_type})"
            if len(node.input) < 2 or node.input[1] not in inputs:
                continue
            data = shapes.get(node.input[0])
            if node.op_type == "Nll" and node.domain == "ai.graphcore":
                size = data[-1] if data else None
                if size:
                    ranges.append(IndexRange(node.input[1], label, size, 0,
                                             _attr(node, "ignoreIndex", None)))
            elif node.op_type in _ONNX_CLASS_LOSSES and node.domain in ("", "ai.onnx"):
                size = data[1] if data and len(data) > 1 else None
                if size:  # scores are [N, C, ...]: labels index C
                    ranges.append(IndexRange(node.input[1], label, size, 0,
                                             _attr(node, "ignore_index", None)))
            elif node.op_type in ("Gather", "GatherElements", "ScatterElements") and (
                    node.domain in ("", "ai.onnx")) and data:
                axis = _attr(node, "axis", 0)
                if -len(data) <= axis < len(data) and data[axis]:
                    ranges.append(IndexRange(node.input[1], label, data[axis], -data[axis]))
        wide = {onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64}
        narrows = any(v.type.tensor_type.elem_type in wide for v in graph.input
                      if v.name in inputs)
        return cls(ranges, narrows)

    def problems(self, arrays: Mapping[str, Any]) -> list[Problem]:
        """Every index out of range and every 64-bit value outside 32 bits, in ``arrays``."""
        out = narrowing_problems("inputs", arrays)
        for r in self.ranges:
            array = arrays.get(r.tensor)
            if not isinstance(array, np.ndarray) or array.dtype.kind not in "iu" or not array.size:
                continue
            if _in_range(array, r.low, r.size):
                continue  # every run's path
            bad = (array < r.low) | (array >= r.size)
            if r.ignore is not None:
                bad &= array != r.ignore
            count = int(np.count_nonzero(bad))
            if count:
                where = np.argwhere(bad)[:_SHOW]
                at = ", ".join(f"{array[tuple(w)]} at {tuple(int(i) for i in w)}" for w in where)
                allowed = f"{r.low}..{r.size - 1}" + (
                    f" or the ignoreIndex {r.ignore}" if r.ignore is not None else "")
                out.append(Problem(
                    ("inputs", r.tensor),
                    f"input {short(r.tensor)} indexes a dimension of size {r.size} in "
                    f"{clip(r.node, 80)}, but {count} value(s) are outside {allowed}: {at}"
                    + (" …" if count > _SHOW else "") + ". Unchecked, they would be clamped and "
                    "give a wrong result without an error.",
                    f"give indices in {allowed}, or pass check_indices=False to skip this check.",
                    "K-index-range"))
        return out

    def check(self, arrays: Mapping[str, Any]) -> None:
        problems = self.problems(arrays)
        if problems:
            raise_errors("run", problems, error=InvalidData)


def narrowing_problems(kind: str, arrays: Mapping[str, Any]) -> list[Problem]:
    """A problem for each int64 (uint64) array in ``arrays`` holding values outside int32's
    (uint32's) range: the device computes it in 32 bits, where they would wrap. ``kind`` is
    the location's first part and the message's noun ("inputs", "weights")."""
    out = []
    for name, array in arrays.items():
        narrow = NARROWED.get(getattr(array, "dtype", None))
        if narrow is None or not isinstance(array, np.ndarray) or not array.size:
            continue
        limits = np.iinfo(narrow)
        if array.min() >= limits.min and array.max() <= limits.max:
            continue
        bad = array[(array < limits.min) | (array > limits.max)]
        out.append(Problem(
            (kind, name),
            f"{kind.rstrip('s')} {short(name)} holds {bad.size} {array.dtype} value(s) outside "
            f"{narrow}'s range ({_some(bad)}); the tensor is computed as {narrow}, where they "
            f"would wrap.", f"keep values within {limits.min}..{limits.max}.", "K-int64-range",
            involved={f"{kind}.{name}": f"{array.dtype}{list(array.shape)}"}))
    return out


#: Index arrays up to this many values are reduced by Python's ``min`` and ``max``: right
#: after a compiled step has run, numpy's reduction machinery is out of the CPU's caches and
#: one ``array.max()`` of a 32-label batch cost about 26 microseconds a run, Python's ``max``
#: of its values about 6 (a training step at bps 1, 2 cores).
SMALL = 256


def _in_range(array: np.ndarray, low: int, size: int) -> bool:
    """Whether every value of the integer ``array`` (not empty) is in ``low .. size - 1``: by
    Python's ``min`` and ``max`` where it is small, else in one pass over it as unsigned
    values (a negative one is then huge) where ``size`` allows, else two."""
    if array.size <= SMALL:
        values = array.ravel().tolist()
        return low <= min(values) and max(values) < size
    if size <= 1 << (8 * array.itemsize - 1):
        return int(array.view(array.dtype.str.replace("i", "u")).max()) < size
    return low <= array.min() and array.max() < size


def _some(values: np.ndarray) -> str:
    shown = ", ".join(str(v) for v in values.ravel()[:_SHOW])
    return shown + (" …" if values.size > _SHOW else "")
