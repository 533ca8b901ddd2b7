"""A float16 segment as an onnxruntime graph with the XLA lowering's roundings.

onnxruntime's CPU kernels compute in float32, and XLA:CPU computes half precision the same
way: each operator of a float16 model in float32 on the half values, its result rounded to
half once (a convolution, a matrix product whatever its partials type, a mean; an elementwise
sum, product or quotient, whose float32 result rounded to half is the correctly rounded half
one, float32 having more than twice half's precision plus two bits). :func:`half_graph`
rewrites a segment's nodes so onnxruntime computes exactly that: the half operands converted
to float32 (exactly), every operator of :data:`ARITHMETIC` fed half values (its float32
operands rounded to half: a cast to float16 and back, which onnxruntime's optimizer keeps,
being lossy), and the results rounded to half where they leave the segment. The operators of
:data:`EXACT` commute with that rounding (they move, compare or clip values: rounding is
monotone and keeps zero), so they run on the unrounded values and what they give is rounded
once where an arithmetic operator or the segment's end reads it; a Conv and the Relu after it
stay adjacent, one MLAS call. Where the lowering rounds within an operator, so does the
graph: a Conv's bias is added to its rounded sum (as PopART's AddBias adds it), a Gemm's
product is rounded, then scaled by alpha (a half value), rounded, then C (scaled by beta,
rounded) added.

The values are the lowering's up to the order of each float32 sum (onnxruntime's kernels
against XLA's; the same holds for float32 segments), so a half result may differ from it by
a unit in its last place where the float32 sum lies next to a rounding boundary, and what is
computed from it may carry that on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["ARITHMETIC", "EXACT", "OPS", "half_graph"]

#: Operators computed in float32 on half operands and rounded to half once.
ARITHMETIC = frozenset({"Conv", "MatMul", "Gemm", "Add", "Sub", "Mul", "Div",
                        "GlobalAveragePool"})
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
    (a Conv's kernel's says how to broadcast its bias); every other tensor keeps its name
    with a suffix (``/f32`` converted, ``/raw`` unrounded, ``/half`` and ``/round`` rounded,
    ``/biased`` a Conv's sum plus its bias)."""
    from onnx import NodeProto, TensorProto, helper, numpy_helper

    out: list[Any] = []
    value: dict[str, str] = {}  # tensor -> the name of its float32 value
    rounded: set[str] = set(floats)  # tensors whose float32 value is a half value
    value.update((name, name) for name in floats)
    for name in fed:
        value[name] = f"{name}/f32"
        rounded.add(name)
        out.append(helper.make_node("Cast", [name], [value[name]], to=TensorProto.FLOAT))

    taken: set[str] = set()

    def fresh(name: str) -> str:
        """``name``, numbered where an earlier rounding of the same tensor took it."""
        count, made = 1, name
        while made in taken:
            count += 1
            made = f"{name}{count}"
        taken.add(made)
        return made

    def as_half(tensor: str) -> str:
        """The float32 name of ``tensor``'s value rounded to half (rounding it once)."""
        if tensor not in rounded:
            half, back = fresh(f"{tensor}/half"), fresh(f"{tensor}/round")
            out.append(helper.make_node("Cast", [value[tensor]], [half],
                                        to=TensorProto.FLOAT16))
            out.append(helper.make_node("Cast", [half], [back], to=TensorProto.FLOAT))
            value[tensor] = back
            rounded.add(tensor)
        return value[tensor]

    def emit(op_type: str, inputs: Sequence[str], output: str, **attributes: Any) -> str:
        out.append(helper.make_node(op_type, list(inputs), [output], **attributes))
        return output

    def constant(name: str, array: np.ndarray) -> str:
        return emit("Constant", [], name, value=numpy_helper.from_array(array))

    def then(tensor: str, op_type: str, operand: str, suffix: str) -> None:
        """``tensor`` becomes its rounded value combined with ``operand`` (in float32)."""
        value[tensor] = emit(op_type, [as_half(tensor), operand], f"{tensor}/{suffix}")
        rounded.discard(tensor)

    for node in nodes:
        op = node.op_type
        arithmetic = op in ARITHMETIC
        inputs = [i if not i or i not in value else as_half(i) if arithmetic else value[i]
                  for i in node.input]
        if op == "Gemm":
            _gemm(node, inputs, emit, constant, then, value, rounded, as_half)
            continue
        bias = None
        if op == "Conv" and len(inputs) > 2 and inputs[2]:
            bias, inputs = inputs[2], inputs[:2]
        made = NodeProto()
        made.CopyFrom(node)
        del made.input[:]
        made.input.extend(inputs)
        del made.output[:]
        made.output.extend(f"{o}/raw" if o else "" for o in node.output)
        out.append(made)
        exact = not arithmetic and all(i in rounded for i in node.input if i in value)
        for o in node.output:
            if o:
                value[o] = f"{o}/raw"
                if exact:
                    rounded.add(o)
        if bias is not None:  # added in half to the rounded sum, over the channel axis
            total = node.output[0]
            shape = constant(f"{total}/bias_shape",
                             np.array([-1] + [1] * (ranks[node.input[1]] - 2), np.int64))
            then(total, "Add", emit("Reshape", [bias, shape], f"{total}/bias"), "biased")
    for name in outputs:
        out.append(helper.make_node("Cast", [value[name]], [name], to=TensorProto.FLOAT16))
    return out


def _gemm(node: Any, inputs: Sequence[str], emit: Any, constant: Any, then: Any,
          value: dict[str, str], rounded: set[str], as_half: Any) -> None:
    """A Gemm as the lowering computes it in half: the product of the (transposed) operands
    rounded, times alpha (as a half value) rounded, plus C (times beta, rounded) rounded."""
    from onnx import helper

    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    y = node.output[0]
    a, b = inputs[0], inputs[1]
    if attributes.get("transA", 0):
        a = emit("Transpose", [a], f"{y}/a")
    if attributes.get("transB", 0):
        b = emit("Transpose", [b], f"{y}/b")
    value[y] = emit("MatMul", [a, b], f"{y}/raw")
    alpha = float(attributes.get("alpha", 1.0))
    if alpha != 1.0:
        then(y, "Mul", constant(f"{y}/alpha", np.array(np.float16(alpha), np.float32)),
             "scaled")
    if len(inputs) > 2 and inputs[2]:
        c, beta = inputs[2], float(attributes.get("beta", 1.0))
        if beta != 1.0:
            scaled = f"{y}/c"
            value[scaled] = emit("Mul", [c, constant(f"{y}/beta", np.array(
                np.float16(beta), np.float32))], f"{y}/c_raw")
            c = as_half(scaled)
        then(y, "Add", c, "biased")


def float_initializers(held: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``held`` (a half segment's constants and baked weights) as its graph holds them:
    float16 arrays converted to float32 (exactly), integer ones as int64."""
    return {name: a.astype(np.float32) if a.dtype == np.float16 else
            a.astype(np.int64) if np.issubdtype(a.dtype, np.integer) else a
            for name, a in held.items()}
