"""A float16 segment as an onnxruntime graph with the XLA lowering's roundings.

onnxruntime's CPU kernels compute in float32, and the XLA lowering computes half precision op
by op the same way, as PopART's operators each write a half tensor: an operator in float32 on
the half values, its result rounded to half once (a convolution, a matrix product whatever
its partials type, a mean; an elementwise sum, difference or product, whose float32 result
rounded to half is the correctly rounded half one, float32 having more than twice half's
precision plus two bits). :func:`half_graph` rewrites a segment's nodes so onnxruntime
computes exactly that: the half operands converted to float32 (exactly), every operator of
:data:`ARITHMETIC` fed half values (its float32 operands rounded to half: a cast to float16
and back, which onnxruntime's optimizer keeps, being lossy), and the results rounded to half
where they leave the segment. The operators of :data:`EXACT` commute with that rounding
(they move, compare or clip values: rounding is monotone and keeps zero), so they run on the
unrounded values and what they give is rounded once where an arithmetic operator or the
segment's end reads it; a Conv and the Relu after it stay adjacent, one MLAS call. Where the
lowering rounds within an operator, so does the graph: a Conv's bias is added to its rounded
sum (as PopART's AddBias adds it), a Gemm's product is rounded, then scaled by alpha (a half
value), rounded, then C (scaled by beta, rounded) added.

The values are the lowering's op by op up to the order of each float32 sum (onnxruntime's
kernels against XLA's; the same holds for float32 segments), so a half result may differ by a
unit in its last place where the float32 sum lies next to a rounding boundary, and what is
computed from it may carry that on. Compiled, XLA may skip a rounding the lowering asks for
inside a fused elementwise chain (a Mul and the Add after it, a Gemm's alpha and its C): the
segment keeps it, as PopART's half tensors do. Div is left out: XLA divides by a broadcast
divisor as a product with its reciprocal rounded to half, which is not the quotient rounded
once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["ARITHMETIC", "EXACT", "OPS", "half_graph"]

#: Operators computed in float32 on half operands and rounded to half once.
ARITHMETIC = frozenset({"Conv", "MatMul", "Gemm", "Add", "Sub", "Mul", "GlobalAveragePool"})
#: Operators whose float32 results on unrounded values, rounded, are their results on the
#: rounded values (moves, maxima, Relu).
EXACT = frozenset({"Relu", "MaxPool", "GlobalMaxPool", "Reshape", "Flatten", "Transpose",
                   "Squeeze", "Unsqueeze", "Identity", "Concat"})
#: What a float16 segment may hold (the others, Softmax or a windowed AveragePool say, round
#: between their steps in the lowering: such a segment runs the XLA lowering).
OPS = ARITHMETIC | EXACT


def half_graph(nodes: Sequence[Any], fed: Sequence[str], floats: Sequence[str],
               outputs: Sequence[str], ranks: Mapping[str, int]) -> list[Any]:
    """The nodes of the float32 graph computing ``nodes`` (of :data:`OPS`) as the XLA
    lowering computes them in half: ``fed`` are its float16 inputs, ``floats`` the float
    tensors it holds as float32 initializers of their own names (half values, converted
    exactly), ``outputs`` its float16 outputs, ``ranks`` the ranks of the tensors it reads
    (a Conv's kernel's says how to broadcast its bias). The tensors it adds are named after
    the segment's with a suffix (``/f32`` converted, ``/raw`` unrounded, ``/half`` and
    ``/round`` rounded, ``/biased`` plus a bias), numbered where a name is taken."""
    graph = _HalfGraph(nodes, fed, floats, outputs)
    for node in nodes:
        graph.add(node, ranks)
    return graph.finish(outputs)


class _HalfGraph:
    """:func:`half_graph`'s nodes as they are made."""

    def __init__(self, nodes: Sequence[Any], fed: Sequence[str], floats: Sequence[str],
                 outputs: Sequence[str]) -> None:
        from onnx import TensorProto

        self.out: list[Any] = []
        self.taken = {*fed, *floats, *outputs, *(t for n in nodes for t in (*n.input,
                                                                            *n.output) if t)}
        self.value: dict[str, str] = {name: name for name in floats}  # its float32 value
        self.rounded: set[str] = set(floats)  # tensors whose float32 value is a half value
        for name in fed:
            self.value[name] = self.emit("Cast", [name], f"{name}/f32", to=TensorProto.FLOAT)
            self.rounded.add(name)

    def fresh(self, name: str) -> str:
        """``name``, numbered where the segment or an earlier step took it."""
        count, made = 1, name
        while made in self.taken:
            count += 1
            made = f"{name}{count}"
        self.taken.add(made)
        return made

    def emit(self, op_type: str, inputs: Sequence[str], output: str, **attributes: Any) -> str:
        """A node of ``op_type`` giving a fresh tensor named after ``output``."""
        from onnx import helper

        output = self.fresh(output)
        self.out.append(helper.make_node(op_type, list(inputs), [output], **attributes))
        return output

    def constant(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        return self.emit("Constant", [], name, value=numpy_helper.from_array(array))

    def as_half(self, tensor: str) -> str:
        """The float32 name of ``tensor``'s value rounded to half (rounding it once)."""
        from onnx import TensorProto

        if tensor not in self.rounded:
            half = self.emit("Cast", [self.value[tensor]], f"{tensor}/half",
                             to=TensorProto.FLOAT16)
            self.value[tensor] = self.emit("Cast", [half], f"{tensor}/round",
                                           to=TensorProto.FLOAT)
            self.rounded.add(tensor)
        return self.value[tensor]

    def then(self, tensor: str, op_type: str, operand: str, suffix: str) -> None:
        """``tensor`` becomes its rounded value combined with ``operand`` (in float32)."""
        self.value[tensor] = self.emit(op_type, [self.as_half(tensor), operand],
                                       f"{tensor}/{suffix}")
        self.rounded.discard(tensor)

    def add(self, node: Any, ranks: Mapping[str, int]) -> None:
        from onnx import NodeProto

        arithmetic = node.op_type in ARITHMETIC
        inputs = [i if not i or i not in self.value else
                  self.as_half(i) if arithmetic else self.value[i] for i in node.input]
        if node.op_type == "Gemm":
            self._gemm(node, inputs)
            return
        bias = None
        if node.op_type == "Conv" and len(inputs) > 2 and inputs[2]:
            bias, inputs = inputs[2], inputs[:2]
        made = NodeProto()
        made.CopyFrom(node)
        del made.input[:]
        made.input.extend(inputs)
        del made.output[:]
        made.output.extend(self.fresh(f"{o}/raw") if o else "" for o in node.output)
        self.out.append(made)
        exact = not arithmetic and all(i in self.rounded for i in node.input if i in self.value)
        for o, raw in zip(node.output, made.output, strict=True):
            if o:
                self.value[o] = raw
                if exact:
                    self.rounded.add(o)
        if bias is not None:  # added in half to the rounded sum, over the channel axis
            total = node.output[0]
            shape = self.constant(f"{total}/bias_shape", np.array(
                [-1] + [1] * (ranks[node.input[1]] - 2), np.int64))
            self.then(total, "Add", self.emit("Reshape", [bias, shape], f"{total}/bias"),
                      "biased")

    def _gemm(self, node: Any, inputs: Sequence[str]) -> None:
        """A Gemm as the lowering computes it op by op in half: the product of the
        (transposed) operands rounded, times alpha (a half value) rounded, plus C (times
        beta, rounded) rounded."""
        from onnx import helper

        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        y = node.output[0]
        a, b = inputs[0], inputs[1]
        if attributes.get("transA", 0):
            a = self.emit("Transpose", [a], f"{y}/a")
        if attributes.get("transB", 0):
            b = self.emit("Transpose", [b], f"{y}/b")
        self.value[y] = self.emit("MatMul", [a, b], f"{y}/raw")
        alpha = float(attributes.get("alpha", 1.0))
        if alpha != 1.0:
            self.then(y, "Mul", self.constant(f"{y}/alpha", np.array(np.float16(alpha),
                                                                      np.float32)), "scaled")
        if len(inputs) > 2 and inputs[2]:
            c, beta = inputs[2], float(attributes.get("beta", 1.0))
            if beta != 1.0:
                scaled = self.fresh(f"{y}/c")
                self.value[scaled] = self.emit("Mul", [c, self.constant(
                    f"{y}/beta", np.array(np.float16(beta), np.float32))], f"{y}/c_raw")
                c = self.as_half(scaled)
            self.then(y, "Add", c, "biased")

    def finish(self, outputs: Sequence[str]) -> list[Any]:
        """The nodes, each output rounded to half last."""
        from onnx import TensorProto, helper

        for name in outputs:
            self.out.append(helper.make_node("Cast", [self.value[name]], [name],
                                             to=TensorProto.FLOAT16))
        return self.out

