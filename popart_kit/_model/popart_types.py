"""PopART's typing of ai.onnx nodes, where it differs from ONNX's strict inference.

PopART's Builder runs ONNX's inference leniently (``InferShapes`` with its default options, in
willow/src/builder_impl.cpp ``runShapeInference``): no check of the schema's type constraints,
and a node ONNX cannot infer is left untyped instead of refused. Its ops then type their outputs
in their own ``setup()`` (willow/src/op/*.cpp) when a session is made, and refuse there.
:func:`node_types` types one node as PopART does, in this order:

1. PopART's own Builder inference functions, which replace ONNX's (:data:`BUILDER_RULES`:
   willow/src/shapeinference.cpp, BatchNormalization 6/7/9);
2. ONNX's strict inference;
3. where it refuses, the op's ``setup()`` rule (:data:`SETUP_RULES`), which gives PopART's
   output types or raises :class:`PopartRefusal` with PopART's words;
4. else ONNX's inference without the type-constraint check (PopART's Builder's answer).

A node none of these types raises ONNX's ``InferenceError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .._base.problems import popart_vector

__all__ = ["PopartRefusal", "ALWAYS_CHECKED", "BUILDER_RULES", "SETUP_RULES", "first_refusal",
           "popart_opid",
           "first_setup_refusal", "node_types", "onnx_types", "tensor_data_text"]

Shape = tuple[int, ...]
Typed = tuple[int, Shape]  # (ONNX elem type, shape)


class PopartRefusal(ValueError):
    """PopART's op refuses these inputs when a session is made (its setup's message)."""


def popart_opid(op_type: str, opset: int, domain: str = "") -> str:
    """An operator's identifier as PopART prints it (opmanager.cpp:70), domain.type:version:
    ONNX's operators at the version of their schema ``opset`` selects (``opset`` itself where
    no schema has it: an unknown operator, an opset beyond a C int), ai.graphcore's at 1."""
    domain = domain or "ai.onnx"
    if domain == "ai.graphcore":
        return f"{domain}.{op_type}:1"
    try:
        version = onnx.defs.get_schema(op_type, opset, "").since_version
    except (onnx.defs.SchemaError, TypeError):
        version = opset
    return f"{domain}.{op_type}:{version}"


@dataclass(frozen=True)
class Node:
    """What a rule reads: the node, its inputs' (elem type, shape) (None when unknown or
    omitted) and the values of its constant inputs."""

    proto: onnx.NodeProto
    version: int
    inputs: Sequence[Typed | None]
    values: Mapping[int, np.ndarray]

    @property
    def attrs(self) -> dict[str, Any]:
        return {a.name: helper.get_attribute_value(a) for a in self.proto.attribute}

    def op(self) -> str:
        """The op as PopART's ``Op::str`` names it: ``Op <name> (ai.onnx.Add:9)``."""
        name = self.proto.name or (self.proto.output[0] if self.proto.output else "")
        return f"Op {name} (ai.onnx.{self.proto.op_type}:{self.version})"

    def opid(self) -> str:
        """The op's identifier as PopART prints it: ``ai.onnx.Slice:10`` (the version of the
        op's schema at the model's opset)."""
        return popart_opid(self.proto.op_type, self.version)

    def debug_name(self) -> str:
        """The op as PopART's ``Op::debugName`` names it:
        ``Op(ai.onnx.MatMul:9, inputs=[a, b], outputs=[MatMul:0])`` (a named op:
        ``Op(name (ai.onnx.MatMul:9), ...)``)."""
        ident = f"{self.proto.name} ({self.opid()})" if self.proto.name else self.opid()
        return (f"Op({ident}, inputs=[{', '.join(self.proto.input)}], "
                f"outputs=[{', '.join(self.proto.output)}])")

    def known(self, *indices: int) -> list[Typed]:
        found = [self.inputs[i] if i < len(self.inputs) else None for i in indices]
        if any(t is None for t in found):
            raise _Unknown
        return found  # type: ignore[return-value]


class _Unknown(Exception):
    """An input's type or shape is not known: the rule cannot type the node."""


class _NoValue(PopartRefusal):
    """PopART's refusal of a shape input with no constant value (the xla lowering may still
    compute the value from shapes)."""


def _type_name(elem: int) -> str:
    return TensorProto.DataType.Name(elem)



def np_out(node: Node, s0: Shape, s1: Shape) -> Shape:
    """numpy broadcasting of two shapes, refused in PopART's words (tensorinfo.cpp npOut)."""
    out = []
    for i in range(1, max(len(s0), len(s1)) + 1):
        a = s0[-i] if i <= len(s0) else 1
        b = s1[-i] if i <= len(s1) else 1
        if a != b and a != 1 and b != 1:
            raise PopartRefusal(f"np broadcasting failed on '{node.op()}', frames "
                                f"[{', '.join(map(str, s0))}] and [{', '.join(map(str, s1))}] "
                                f"are not aligned")
        out.append(b if a == 1 else a)
    return tuple(reversed(out))


def _same_type(node: Node, t0: Typed, t1: Typed) -> None:
    if t0[0] != t1[0]:
        raise PopartRefusal(f"np broadcasting failed on {node.op()}, incompatible types "
                            f"{_type_name(t0[0])} and {_type_name(t1[0])} (shapes "
                            f"{popart_vector(t0[1])} and {popart_vector(t1[1])})")


def _binary(node: Node) -> list[Typed]:
    """ElementWiseBinaryBaseOp::setup: one data type, numpy broadcasting; input 0's type."""
    t0, t1 = node.known(0, 1)
    _same_type(node, t0, t1)
    return [(t0[0], np_out(node, t0[1], t1[1]))]


def _fp32_scalar(t: Typed) -> bool:
    return t[0] == TensorProto.FLOAT and int(np.prod(t[1], dtype=np.int64)) == 1


def _mul(node: Node) -> list[Typed]:
    """MulOp::setup: as :func:`_binary`, except that a FLOAT16 tensor times a FLOAT scalar (one
    element), either way round, is FLOAT16 (mul.cpp getOutputDataType)."""
    t0, t1 = node.known(0, 1)
    shape = np_out(node, t0[1], t1[1])
    if t0[0] != t1[0] and all(_fp32_scalar(t) or t[0] == TensorProto.FLOAT16 for t in (t0, t1)):
        return [(TensorProto.FLOAT16, shape)]
    _same_type(node, t0, t1)
    return [(t0[0], shape)]


def _comparison(node: Node) -> list[Typed]:
    """BinaryComparisonOp::setup (Equal, Greater, Less, And, Or, Xor ...): BOOL, numpy
    broadcasting of the shapes; any input types."""
    t0, t1 = node.known(0, 1)
    return [(TensorProto.BOOL, np_out(node, t0[1], t1[1]))]


def _variadic(node: Node) -> list[Typed]:
    """VariadicOp::setup (Max, Min, Sum, Mean): input 0's type, broadcast with each other
    input, one data type."""
    out = node.known(0)[0]
    for i in range(1, len(node.inputs)):
        (t,) = node.known(i)
        _same_type(node, out, t)
        out = (out[0], np_out(node, out[1], t[1]))
    return [out]


def tensor_data_text(op: str, what: str, tensor: str) -> str:
    """PopART's refusal when an op needs the value of input ``what`` (``tensor``) to type its
    output and the tensor has none (Op::getInTensorData, e.g. slice.cpp connectInTensor)."""
    return (f"Need the value of the {op} input '{what}' to determine the output shape, but was "
            f"unable because [Tensor::getDataViaGraphTraversal] Could not work out tensor data "
            f"for {tensor}.")


def _shape_value(node: Node, index: int, what: str) -> Shape:
    """The value of a constant INT32 or INT64 shape input (PopART's getInTensorData)."""
    value = node.values.get(index)
    tensor = node.proto.input[index]
    if value is None:
        raise _NoValue(tensor_data_text(node.opid(), what, tensor))
    if value.dtype not in (np.int32, np.int64):
        kind = _type_name(helper.np_dtype_to_tensor_dtype(value.dtype))
        raise PopartRefusal(f"Need the value of the {node.opid()} input '{what}' to determine "
                            f"the output shape, but was unable because the tensor `{tensor}` "
                            f"is not the correct type, it is {kind}")
    return tuple(int(v) for v in value.reshape(-1))


def _tile(node: Node) -> list[Typed]:
    """TileOp (tile.cpp connectInTensor): the constant INT64 ``repeats`` has one element per
    input dimension; the output is the input's shape times them (negative repeats give the
    negative sizes PopART's Builder refuses)."""
    (t0,) = node.known(0)
    repeats = node.values.get(1)
    if repeats is None:
        raise _Unknown
    tensor = node.proto.input[1]
    if repeats.size != len(t0[1]):
        raise PopartRefusal(f"'Repeats' tensor `{tensor}' should have one element for each "
                            f"dimension of the data tensor")
    return [(t0[0], tuple(int(d) * int(r) for d, r in zip(t0[1], repeats.reshape(-1),
                                                          strict=True)))]


def _reshape(node: Node) -> list[Typed]:
    """ReshapeOp (reshape.cpp finaliseShape and setup): no size under -1, zeros take the input's
    size, one -1 inferred, the element count kept."""
    (t0,) = node.known(0)
    shape = list(_shape_value(node, 1, "shape"))

    def refuse(reason: str) -> PopartRefusal:
        return PopartRefusal(f"Need the value of the {node.opid()} input 'shape' to determine "
                             f"the output shape, but was unable because {reason}")

    bad = [d for d in shape if d < -1]
    if bad:
        raise refuse(f"Dimension, {bad[0]}, of new shape for Reshape cannot be smaller than -1.")
    if not node.attrs.get("allowzero", 0):
        shape = [t0[1][i] if d == 0 and i < len(t0[1]) else d for i, d in enumerate(shape)]
    if -1 in shape:
        size, rest = int(np.prod(t0[1], dtype=np.int64)), -int(np.prod(shape, dtype=np.int64))
        if rest == 0 or size % abs(rest):
            raise refuse("Incompatible inferred dimension, not whole number.")
        if shape.count(-1) > 1:
            raise refuse("shape input to ReshapeOp can only use -1 to specify one unknown "
                         "dimension")
        shape[shape.index(-1)] = size // rest
    n_in, n_out = int(np.prod(t0[1], dtype=np.int64)), int(np.prod(shape, dtype=np.int64))
    if n_in != n_out:
        raise PopartRefusal(f"Failure in ReshapeOp::setup() for {node.debug_name()}. Trying to "
                            f"reshape from {popart_vector(t0[1])} to {popart_vector(shape)}. The "
                            f"number of elements of the input is {n_in}, while the number of "
                            f"elements of the output is {n_out}. The number of elements cannot "
                            f"change for a ReshapeOp")
    return [(t0[0], tuple(shape))]


def _matmul(node: Node) -> list[Typed]:
    """MatMulOp::npMatMulOut (matmul.cpp): no scalar input, numpy's matmul shapes, equal
    contracting dimensions; input 0's type."""
    t0, t1 = node.known(0, 1)
    for side, t, name in (("lhs", t0, node.proto.input[0]), ("rhs", t1, node.proto.input[1])):
        if not t[1]:
            raise PopartRefusal(f"{node.debug_name()} doesn't support scalar tensor {name} as "
                                f"the {side} input")
    lhs = ([1] if len(t0[1]) == 1 else []) + list(t0[1])
    rhs = list(t1[1]) + ([1] if len(t1[1]) == 1 else [])
    if lhs[-1] != rhs[-2]:
        raise PopartRefusal(f"{node.debug_name()} contracting dimensions unequal: lhs "
                            f"'{node.proto.input[0]}' {popart_vector(lhs)}, rhs "
                            f"'{node.proto.input[1]}' {popart_vector(rhs)}")
    out = list(np_out(node, tuple(lhs[:-2]), tuple(rhs[:-2])))
    out += ([lhs[-2]] if len(t0[1]) > 1 else []) + ([rhs[-1]] if len(t1[1]) > 1 else [])
    return [(t0[0], tuple(out))]


def _transpose(node: Node) -> list[Typed]:
    """TransposeBaseOp::setup: ``perm`` (default: reversed) has one entry per input
    dimension."""
    (t0,) = node.known(0)
    perm = list(node.attrs.get("perm", [])) or list(range(len(t0[1])))[::-1]
    if len(perm) != len(t0[1]):
        raise PopartRefusal(f"Rank of permutation tensor {popart_vector(perm)}, rank "
                            f"{len(perm)} must be equal to rank of input tensor, shape "
                            f"{popart_vector(t0[1])}, rank {len(t0[1])}.")
    return [(t0[0], tuple(t0[1][p] for p in perm))]


def _concat(node: Node) -> list[Typed]:
    """ConcatOp::getOutputShape (concat.cpp): ``axis`` may be negative at every version (ONNX
    takes one only from Concat-11); the inputs agree but along it."""
    typed = node.known(*range(max(1, len(node.inputs))))  # none: ONNX's checker refuses it
    rank = len(typed[0][1])
    axis = int(node.attrs.get("axis", 0))
    axis += rank if axis < 0 else 0
    if not 0 <= axis < rank:
        raise _Unknown  # ONNX's own refusal stands
    out = list(typed[0][1])
    out[axis] = 0
    for i, (_, shape) in enumerate(typed):
        if len(shape) != rank:
            raise PopartRefusal(f"Input {i} of {len(typed)} to concat does not have matching "
                                f"output rank. Input {i} has rank {len(shape)} "
                                f"({popart_vector(shape)}) while the output has rank {rank} "
                                f"({popart_vector(out)}).Concat axis {axis}.")
        if shape[:axis] != tuple(out[:axis]) or shape[axis + 1:] != tuple(out[axis + 1:]):
            shapes = "".join("\n" + popart_vector(t[1]) for t in typed)
            raise PopartRefusal(f"Input {i} to concat does not have matching shape. In "
                                f"ConcatOp::getOutputShape, axis = {axis} and shapes : {shapes}")
        out[axis] += shape[axis]
    return [(typed[0][0], tuple(out))]


def _flatten(node: Node) -> list[Typed]:
    """flattenOpFactory (reshape.cpp): ``axis`` in [-rank, rank] at every version (ONNX takes a
    negative one only from Flatten-11); the 2D shape either side of it."""
    (t0,) = node.known(0)
    rank = len(t0[1])
    axis = int(node.attrs.get("axis", 1))
    axis += rank if axis < 0 else 0
    if not 0 <= axis <= rank:
        raise PopartRefusal(f"invalid axis {axis} in flattenOpFactory")
    return [(t0[0], (int(np.prod(t0[1][:axis], dtype=np.int64)),
                     int(np.prod(t0[1][axis:], dtype=np.int64))))]


def _expand(node: Node) -> list[Typed]:
    """ExpandOp: the constant ``shape`` (INT32 or INT64) broadcast with the input's shape
    (expand.cpp finaliseShape); the input's type."""
    shape = _shape_value(node, 1, "shape")
    (t0,) = node.known(0)
    out = []
    for i in range(1, max(len(shape), len(t0[1])) + 1):
        a = t0[1][-i] if i <= len(t0[1]) else 1
        b = shape[-i] if i <= len(shape) else 1
        if a != 1 and b != 1 and a != b:
            raise PopartRefusal("Expand shape constraint: corresponding dimensions must have "
                                "the same value or one of them must be 1")
        out.append(max(a, b))
    return [(t0[0], tuple(reversed(out)))]


def _constant_of_shape(node: Node) -> list[Typed]:
    """ConstantOfShape: the constant ``input`` (INT32 or INT64) is the shape; the value
    attribute's type (FLOAT when absent)."""
    shape = _shape_value(node, 0, "input")
    value = node.attrs.get("value")
    return [(value.data_type if value is not None else TensorProto.FLOAT, shape)]


def _conv_transpose(node: Node) -> list[Typed]:
    """ConvTransposeOp::setup: [N, weights[1] * group, spatial...]; ``output_shape`` either
    the spatial sizes or, as PopART also takes, the whole output shape."""
    x, w = node.known(0, 1)
    attrs = node.attrs
    spatial = len(x[1]) - 2
    given = list(attrs.get("output_shape", []))
    if given and len(given) != spatial:
        return [(x[0], tuple(given))]
    out = [x[1][0], w[1][1] * int(attrs.get("group", 1))]
    if given:
        return [(x[0], tuple(out + given))]
    strides = list(attrs.get("strides", [])) or [1] * spatial
    padding = list(attrs.get("output_padding", [])) or [0] * spatial
    pads = list(attrs.get("pads", [])) or [0] * (2 * spatial)
    out += [strides[i] * (x[1][i + 2] - 1) + padding[i] + w[1][i + 2] - pads[i]
            - pads[spatial + i] for i in range(spatial)]
    return [(x[0], tuple(out))]


def _batch_norm(node: Node) -> list[Typed | None]:
    """PopART's Builder inference of BatchNormalization 6, 7 and 9 (shapeinference.cpp): Y as
    X; with 5 outputs, mean and saved mean as the mean input, var and saved var as var."""
    out: list[Typed | None] = [node.inputs[0]]
    if len(node.proto.output) == 5:
        mean, var = (node.inputs[i] if i < len(node.inputs) else None for i in (3, 4))
        out += [mean, var, mean, var]
    return out


Rule = Callable[[Node], list[Any]]

#: PopART's own Builder inference, used instead of ONNX's: op type -> (ai.onnx versions, rule).
BUILDER_RULES: dict[str, tuple[frozenset[int], Rule]] = {
    "BatchNormalization": (frozenset({6, 7, 9}), _batch_norm),
}

#: The ops' setup() rules, used where ONNX's strict inference refuses a node.
SETUP_RULES: dict[str, Rule] = {
    **dict.fromkeys(("Add", "Sub", "Div", "Pow"), _binary),
    "Mul": _mul,
    **dict.fromkeys(("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or",
                     "Xor"), _comparison),
    **dict.fromkeys(("Max", "Min", "Sum", "Mean"), _variadic),
    "Expand": _expand,
    "ConstantOfShape": _constant_of_shape,
    "ConvTranspose": _conv_transpose,
    "Tile": _tile,
    "Reshape": _reshape,
    "MatMul": _matmul,
    "Transpose": _transpose,
    "Flatten": _flatten,
    "Concat": _concat,
}


def _typed(t: onnx.TypeProto | None) -> Typed | None:
    if t is None or not t.HasField("tensor_type"):
        return None
    tensor = t.tensor_type
    if not tensor.elem_type or not tensor.HasField("shape") or any(
            not d.HasField("dim_value") for d in tensor.shape.dim):
        return None
    return tensor.elem_type, tuple(d.dim_value for d in tensor.shape.dim)


def _as_protos(node: onnx.NodeProto, typed: Sequence[Typed | None]) -> dict[str, onnx.TypeProto]:
    return {name: helper.make_tensor_type_proto(t[0], list(t[1]))
            for name, t in zip(node.output, typed, strict=False) if name and t is not None}


def onnx_types(node: onnx.NodeProto, version: int, types: Mapping[str, onnx.TypeProto],
               data: Mapping[str, TensorProto], domain: str = "", check_type: bool = True
               ) -> dict[str, onnx.TypeProto]:
    """ONNX's inference of one node: strict (the schema's type constraints checked), or, with
    ``check_type=False``, as PopART's Builder runs it. Raises ValidationError or
    InferenceError."""
    schema = onnx.defs.get_schema(node.op_type, version, domain)
    if check_type:
        return dict(onnx.shape_inference.infer_node_outputs(
            schema, node, dict(types), dict(data) or None,
            opset_imports=[helper.make_opsetid("", version)]))
    inputs = [helper.make_value_info(name, types[name]) for name in dict.fromkeys(node.input)
              if name and name not in data and name in types]
    initializers = []
    for name, tensor in data.items():
        if name in node.input:
            copy = TensorProto()
            copy.CopyFrom(tensor)
            copy.name = name
            initializers.append(copy)
    opsets = [helper.make_opsetid("", version)]
    if domain:
        opsets.append(helper.make_opsetid(domain, schema.since_version))
    graph = helper.make_graph([node], "node", inputs, [], initializer=initializers)
    model = helper.make_model(graph, opset_imports=opsets)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=True)
    return {v.name: v.type for v in inferred.graph.value_info if v.name in node.output}


def node_types(node: onnx.NodeProto, version: int, types: Mapping[str, onnx.TypeProto],
               data: Mapping[str, TensorProto], domain: str = "",
               refine: Callable[[dict[str, onnx.TypeProto]], dict[str, onnx.TypeProto] | None]
               | None = None) -> dict[str, onnx.TypeProto]:
    """``node``'s output types as PopART gives them (see the module docstring). ``refine``
    may offer other input types for a second strict try (nearest listed types). Raises
    :class:`PopartRefusal` where PopART's op refuses the inputs, ONNX's InferenceError where
    nothing types the node."""
    def rule_node() -> Node:
        values = {i: numpy_helper.to_array(data[name]) for i, name in enumerate(node.input)
                  if name in data}
        return Node(node, version, [_typed(types.get(name)) if name else None
                                    for name in node.input], values)

    if not domain and node.op_type in BUILDER_RULES:
        versions, rule = BUILDER_RULES[node.op_type]
        schema = onnx.defs.get_schema(node.op_type, version, domain)
        if schema.since_version in versions:
            return _as_protos(node, rule(rule_node()))
    inputs = dict(types)
    rule = SETUP_RULES.get(node.op_type) if not domain else None
    try:
        found = onnx_types(node, version, inputs, data, domain)
        if rule is None or all(_typed(found.get(name)) is not None
                               for name in node.output if name):
            return found
        try:  # ONNX gave no shape (Concat-4's negative axis): the op's setup gives it
            return _as_protos(node, rule(rule_node()))
        except (_Unknown, _NoValue):
            return found
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        refused = err
    relaxed = refine(inputs) if refine is not None else None
    if relaxed is not None:
        try:
            return onnx_types(node, version, relaxed, data, domain)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
            pass
    if rule is not None:
        try:
            return _as_protos(node, rule(rule_node()))
        except _Unknown:
            pass
    try:
        found = onnx_types(node, version, inputs, data, domain, check_type=False)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
        found = {}
    if found and all(_typed(found.get(name)) is not None for name in node.output if name):
        return found
    raise onnx.shape_inference.InferenceError(str(refused)) from None


def _batch_norm_setup(node: Node) -> list[Typed | None]:
    """BatchNormOp::setup (batchnorm.cpp): X of rank 3 or more; scale, B, mean and var of shape
    [C] (``spatial=0``: X's shape but the first dimension)."""
    (x,) = node.known(0)
    if len(x[1]) < 3:
        raise PopartRefusal(f"batch norm requires X to have a rank >= 3.  x has rank "
                            f"{len(x[1])}")
    spatial = int(node.attrs.get("spatial", 1))
    expected = x[1][1:2] if spatial else x[1][1:]
    match = "dimension 1" if spatial else "all but the first dimension"
    for index, name in ((1, "scale"), (2, "B"), (3, "mean"), (4, "var")):
        (t,) = node.known(index)
        if tuple(t[1]) != tuple(expected):
            raise PopartRefusal(f"expected shape of batch norm input tensor {name} "
                                f"({popart_vector(t[1])}) to be {popart_vector(expected)} to "
                                f"match {match} of X ({popart_vector(x[1])})")
    return _batch_norm(node)


#: Ops whose setup() refuses inputs ONNX's (or PopART's Builder's) inference types, checked
#: even where that inference accepts the node: op type -> the setup rule.
ALWAYS_CHECKED: dict[str, Rule] = {"Transpose": _transpose,
                                   "BatchNormalization": _batch_norm_setup}


def first_setup_refusal(model: onnx.ModelProto) -> str | None:
    """The first refusal of an op of :data:`ALWAYS_CHECKED` in ``model``'s main graph, its
    inputs typed by the model's recorded types (a model ONNX's inference accepts); None when
    none refuses."""
    graph = model.graph
    if not any(n.op_type in ALWAYS_CHECKED and n.domain in ("", "ai.onnx") for n in graph.node):
        return None
    version = next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")),
                   onnx.defs.onnx_opset_version())
    types = {v.name: _typed(v.type) for v in (*graph.input, *graph.value_info)}
    types.update({t.name: (t.data_type, tuple(t.dims)) for t in graph.initializer})
    for node in graph.node:
        if node.op_type not in ALWAYS_CHECKED or node.domain not in ("", "ai.onnx"):
            continue
        rule = Node(node, version, [types.get(t) if t else None for t in node.input], {})
        try:
            ALWAYS_CHECKED[node.op_type](rule)
        except PopartRefusal as refusal:
            return str(refusal)
        except _Unknown:
            pass
    return None


def first_refusal(model: onnx.ModelProto) -> str | None:
    """The first refusal of PopART's ops in ``model``'s main graph (its setup's message,
    naming the node), typing node by node as :func:`node_types` does; None when none refuses.
    A node nothing types keeps the types the model records for its outputs."""
    version = next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")),
                   onnx.defs.onnx_opset_version())
    graph = model.graph
    types: dict[str, onnx.TypeProto] = {v.name: v.type for v in (*graph.input,
                                                                 *graph.value_info)}
    data: dict[str, TensorProto] = {}
    for tensor in graph.initializer:
        data[tensor.name] = tensor
        types[tensor.name] = helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
    for node in graph.node:
        found: dict[str, onnx.TypeProto] = {}
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                data[node.output[0]] = value
                found = {node.output[0]: helper.make_tensor_type_proto(value.data_type,
                                                                       list(value.dims))}
        elif (node.domain in ("", "ai.onnx") and not any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                for a in node.attribute)
                and all(not t or _typed(types.get(t)) is not None for t in node.input)):
            try:
                found = node_types(node, version, {t: types[t] for t in node.input if t},
                                   {t: data[t] for t in node.input if t in data})
            except PopartRefusal as refusal:
                return str(refusal)
            except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError,
                    onnx.defs.SchemaError):
                found = {}
        types.update(found)
    return None
