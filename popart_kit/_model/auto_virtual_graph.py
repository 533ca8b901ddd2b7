"""PopART's automatic virtual graphs (``VirtualGraphMode.Auto``): place every op of a model on an
IPU by balancing a cost, as PopART's AutoVirtualGraph transform does
(willow/src/transforms/auto_virtual_graph.cpp).

The rule, step by step:

1. **Subgraphs.** Each consumer of a streamed input starts a subgraph; in schedule order every op
   joins the subgraph of its producer; an op fed by two subgraphs starts a new one (unless the
   other is a single op that costs nothing, which moves over).
2. **Costs.** An op costs the bytes of the weights and constants it reads (twice that with
   gradient accumulation, for the accumulators) plus, when training, the bytes of the forward
   tensors its gradient keeps alive (see :data:`GRAD_READS`).
3. **Split points.** Within a subgraph, an op where every path from the subgraph's earlier ops
   meets (no other op is waiting on them) is a candidate split, recorded at the subgraph's
   cumulative cost there.
4. **Placement.** IPU ``i`` takes subgraphs in order until the cost reaches ``i / n`` of the total
   (or the running sum of ``virtualGraphSplitRatios``), splitting a subgraph at the candidate
   whose cost is nearest that budget. Too few candidates: PopART's refusal "Couldn't find enough
   splits".

What differs from PopART, by construction: PopART runs this on its IR after its patterns (the
ops are PopART's, the schedule its scheduler's); here it runs on the ONNX nodes in graph order,
and the gradient's live tensors come from a table per op type instead of each op's grad op.
Pure arithmetic on the model: no JAX.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .._base.problems import Problem, raise_errors
from ..errors import InvalidModel
from .layout import VIRTUAL_GRAPH

__all__ = ["AutoSplitError", "GRAD_READS", "auto_ipus", "auto_placed", "tensor_bytes",
           "with_auto_ipus"]

#: For each op type, what its gradient reads of the forward op: ``"in"`` its inputs, ``"out"``
#: its outputs, ``"both"``; op types not listed need only the incoming gradient (cost 0).
GRAD_READS: dict[str, str] = {
    **dict.fromkeys(("MatMul", "Gemm", "Conv", "ConvTranspose", "Mul", "Div", "Pow", "Log",
                     "Sin", "Cos", "Atan", "Asin", "Acos", "Erf", "Gelu", "BatchNormalization",
                     "LayerNormalization", "GroupNormalization", "InstanceNormalization",
                     "Max", "Min", "Abs", "Sign", "Clip", "LeakyRelu", "Elu", "Selu",
                     "PRelu", "Softplus", "Where", "Gather", "GatherElements", "Nll", "L1",
                     "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", "ReduceMax",
                     "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "AveragePool",
                     "GeluErf", "Swish", "Atan2", "Reciprocal"), "in"),
    **dict.fromkeys(("Relu", "Sigmoid", "Tanh", "Softmax", "LogSoftmax", "Exp", "Sqrt"), "out"),
    **dict.fromkeys(("MaxPool", "ReduceLogSumExp"), "both"),
}


class AutoSplitError(ValueError):
    """The model cannot be split over the IPUs asked for; the message is PopART's."""


@dataclass
class _Subgraph:
    candidates: set[int]
    cost: float = 0.0
    splits: dict[int, float] = field(default_factory=dict)   # op -> cumulative cost there
    final_splits: set[int] = field(default_factory=set)
    ipu: int = 0
    has_been_split: bool = False

    def best_split(self, budget: float) -> int | None:
        """The candidate whose cost is nearest ``budget`` among the first at or above it and
        the one before (PopART's lower_bound rule); removed from the candidates."""
        ordered = sorted(self.splits.items(), key=lambda item: item[1])
        costs = [c for _, c in ordered]
        at = bisect.bisect_left(costs, budget)
        if at == len(ordered):
            return None
        if at > 0 and budget - costs[at - 1] < costs[at] - budget:
            at -= 1
        op = ordered[at][0]
        del self.splits[op]
        return op


def tensor_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Bytes of every tensor whose type and shape ONNX can infer (0 where it cannot)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - lenient, as PopART's own inference
        inferred = model
    graph = inferred.graph
    out: dict[str, int] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type") or not tensor.HasField("shape") or \
                any(not d.HasField("dim_value") for d in tensor.shape.dim):
            continue
        try:
            itemsize = helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
        except (KeyError, TypeError):
            continue
        out[value.name] = math.prod(d.dim_value for d in tensor.shape.dim) * itemsize
    for init in graph.initializer:
        out[init.name] = math.prod(init.dims) * np.dtype(
            helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    out[node.output[0]] = math.prod(attr.t.dims) * np.dtype(
                        helper.tensor_dtype_to_np_dtype(attr.t.data_type)).itemsize
    return out


def auto_ipus(model: onnx.ModelProto, num_ipus: int, training: bool,
              accumulation: bool = False, split_ratios: Sequence[float] = ()) -> list[int]:
    """The IPU of each node of ``model`` (in graph order; Constant nodes, which PopART folds
    into constants, get the IPU of their first consumer, else 0). Raises
    :class:`AutoSplitError` when there are fewer split points than IPUs."""
    graph = model.graph
    nodes = list(graph.node)
    if num_ipus <= 1:
        return [0] * len(nodes)
    sizes = tensor_bytes(model)
    weights = {t.name for t in graph.initializer}
    weights |= {o for n in nodes if n.op_type == "Constant" for o in n.output}
    streamed = [v.name for v in graph.input if v.name not in weights]
    ops = [i for i, n in enumerate(nodes) if n.op_type != "Constant"]
    consumers: dict[str, list[int]] = {}
    for i in ops:
        for name in dict.fromkeys(nodes[i].input):
            if name:
                consumers.setdefault(name, []).append(i)

    w_weights = 2.0 if accumulation else 1.0

    def cost(i: int) -> float:
        node, seen, total = nodes[i], set(), 0.0
        for index, name in enumerate(node.input):
            if name in weights:
                total += w_weights * sizes.get(name, 0)
                seen.add(index)
        reads = GRAD_READS.get(node.op_type) if training else None
        if reads in ("in", "both"):
            total += sum(sizes.get(n, 0) for k, n in enumerate(node.input)
                         if n and k not in seen)
        if reads in ("out", "both"):
            total += sum(sizes.get(n, 0) for n in dict.fromkeys(node.output) if n)
        return total

    subgraphs: list[_Subgraph] = []
    owner: dict[int, int] = {}

    def start(i: int) -> None:
        owner[i] = len(subgraphs)
        subgraphs.append(_Subgraph({i}))

    for name in streamed:
        for i in consumers.get(name, []):
            start(i)

    total = 0.0
    for i in ops:
        op_cost = cost(i)
        total += op_cost
        if i not in owner:
            start(i)
        sub_id = owner[i]
        sub = subgraphs[sub_id]
        sub.cost += op_cost
        if i in sub.candidates:
            sub.candidates.discard(i)
            if not sub.candidates:
                sub.splits[i] = sub.cost
        for name in nodes[i].output:
            for consumer in consumers.get(name, []) if name else []:
                current = owner.setdefault(consumer, sub_id)
                if current == sub_id:
                    sub.candidates.add(consumer)
                    continue
                other = subgraphs[current]
                if len(other.candidates) == 1 and other.cost == 0.0:
                    other.candidates.discard(consumer)
                    sub.candidates.add(consumer)
                    owner[consumer] = sub_id
                else:
                    owner[consumer] = len(subgraphs)
                    subgraphs.append(_Subgraph({consumer}))

    ipu, sub_index, spent, ratio_sum = 0, 0, 0.0, 0.0
    for k in range(1, num_ipus + 1):
        ratio = k / num_ipus
        if split_ratios and k - 1 < len(split_ratios):
            ratio = ratio_sum + split_ratios[k - 1]
        ratio_sum = ratio
        budget = ratio * total
        while sub_index < len(subgraphs):
            sub = subgraphs[sub_index]
            above = sub.cost + spent > budget and sub.cost > 0
            split_at_end = sub.cost + spent - budget == 0.0
            if above and k != num_ipus:
                op = sub.best_split(budget - spent)
                if op is not None:
                    sub.final_splits.add(op)
                    if not sub.has_been_split:
                        sub.ipu = ipu
                    sub.has_been_split = True
                    ipu += 1
                    break
                split_at_end = True
            spent += sub.cost
            sub_index += 1
            if not sub.has_been_split:
                sub.ipu = ipu
            if split_at_end and k != num_ipus and sub_index != len(subgraphs):
                ipu += 1
                break
    if ipu != num_ipus - 1:
        raise AutoSplitError(f"[AutoVirtualGraph] Couldn't find enough splits for {num_ipus} "
                             f"IPUs. Only found {ipu}")

    placed: dict[int, int] = {}
    for i in ops:
        sub = subgraphs[owner[i]]
        placed[i] = sub.ipu
        if i in sub.final_splits:
            sub.final_splits.discard(i)
            sub.ipu += 1   # the split op stays on the earlier IPU, as PopART places it
    return [placed.get(i, next((placed[c] for o in n.output for c in consumers.get(o, [])
                                if c in placed), 0))
            for i, n in enumerate(nodes)]


def with_auto_ipus(model: onnx.ModelProto, num_ipus: int, training: bool,
                   accumulation: bool = False,
                   split_ratios: Sequence[float] = ()) -> onnx.ModelProto:
    """A copy of ``model`` whose nodes carry the IPU :func:`auto_ipus` gives them
    (``__ipu_number``, replacing any the model had)."""
    ipus = auto_ipus(model, num_ipus, training, accumulation, split_ratios)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node, ipu in zip(out.graph.node, ipus, strict=True):
        kept = [a for a in node.attribute if a.name != VIRTUAL_GRAPH]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.append(helper.make_attribute(VIRTUAL_GRAPH, ipu))
    return out


def auto_placed(model: onnx.ModelProto, config: Any) -> onnx.ModelProto:
    """``model`` placed by :func:`with_auto_ipus` for a session ``config`` with
    ``virtual_graph_mode='auto'`` (its IPUs per replica, mode, accumulation and PopART's
    ``virtualGraphSplitRatios``); InvalidModel (rule V49, PopART's text) when it cannot be."""
    ratios = config.popart_options.get("virtualGraphSplitRatios") or ()
    try:
        return with_auto_ipus(model, config.ipus_per_replica, config.is_training,
                              config.accumulation.factor > 1, ratios)
    except AutoSplitError as err:
        text = str(err)
        raise_errors("model", [Problem(
            ("model", "virtual_graph_mode"), text,
            f"use fewer IPUs than ipus_per_replica={config.ipus_per_replica} for this model, "
            f"or place its ops yourself (virtual_graph_mode='manual').", "V49",
            popart=text)], error=InvalidModel)
        raise  # raise_errors raised
