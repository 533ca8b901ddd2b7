"""PopART's ai.graphcore tensor operators: reducemedian, bucketize, sort, sequenceslice, slice,
depthtospace, groupedgather, scatterreduce, groupedscatterreduce, init, tensorremap,
copyvarupdate and abort (popart.cpp's builder bindings, willow/src/builder.cpp, the ops' setup in
willow/src/op/*.cpp and their ONNX shape inference in willow/src/defs.cpp).

The shape rules the xla lowering shares (:func:`reduce_axes`, :func:`scatter_shapes`,
:data:`POPART_DATA_TYPES`) live here: they raise ``ValueError`` with PopART's reasons.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from onnx import TensorProto

from ..builder_base import BuilderError
from ._registry import REQUIRED, GraphcoreOp, TensorType, register

__all__ = ["POPART_DATA_TYPES", "SCATTER_REDUCTIONS", "reduce_axes", "scatter_shapes"]

INT32 = TensorProto.INT32

#: PopART's C++ ``DataType`` values (willow/include/popart/datatype.hpp; what ``int()`` of a
#: ``popart.DataType`` gives in PopART, and init's ``data_type`` attribute) -> (name, ONNX type).
POPART_DATA_TYPES: dict[int, tuple[str, int]] = {
    0: ("UINT8", TensorProto.UINT8), 1: ("INT8", TensorProto.INT8),
    4: ("UINT16", TensorProto.UINT16), 5: ("INT16", TensorProto.INT16),
    6: ("INT32", TensorProto.INT32), 7: ("INT64", TensorProto.INT64),
    8: ("UINT32", TensorProto.UINT32), 9: ("UINT64", TensorProto.UINT64),
    10: ("BOOL", TensorProto.BOOL), 11: ("FLOAT", TensorProto.FLOAT),
    12: ("FLOAT16", TensorProto.FLOAT16), 13: ("BFLOAT16", TensorProto.BFLOAT16),
    14: ("DOUBLE", TensorProto.DOUBLE),
}
_DATA_TYPE_VALUES = {name: value for value, (name, _) in POPART_DATA_TYPES.items()}

#: ScatterReduction members (PopART's order) -> the ``reduction`` attribute string.
SCATTER_REDUCTIONS = {"Sum": "sum", "Max": "max", "Min": "min", "Mul": "mul",
                      "NoReduction": "none"}


# -- converters ---------------------------------------------------------------------------------

def _ints(value: Any) -> list[int]:
    return [int(v) for v in value]


def _data_type(value: Any) -> int:
    """A ``popart.DataType`` member, its name or PopART's C++ value -> the C++ value."""
    name = getattr(value, "name", value)
    if isinstance(name, str):
        if name.split(".")[-1] not in _DATA_TYPE_VALUES:
            raise ValueError(f"data_type {value!r} is not one of "
                             f"{', '.join(_DATA_TYPE_VALUES)}")
        return _DATA_TYPE_VALUES[name.split(".")[-1]]
    if int(value) not in POPART_DATA_TYPES:
        raise ValueError(f"data_type {value!r} is not a PopART DataType value with an ONNX "
                         f"type (one of {sorted(POPART_DATA_TYPES)})")
    return int(value)


def _scatter_reduction(value: Any) -> str:
    """A ``popart.ScatterReduction`` member, its name, its index or the attribute string."""
    if isinstance(value, int) and not hasattr(value, "name"):
        names = list(SCATTER_REDUCTIONS)
        if not 0 <= value < len(names):
            raise ValueError(f"reduction {value} is not a ScatterReduction (0..{len(names) - 1})")
        return SCATTER_REDUCTIONS[names[value]]
    name = str(getattr(value, "name", value)).split(".")[-1]
    if name in SCATTER_REDUCTIONS:
        return SCATTER_REDUCTIONS[name]
    if name.lower() in SCATTER_REDUCTIONS.values():
        return name.lower()
    raise ValueError(f"reduction {value!r} is not a popart.ScatterReduction "
                     f"({', '.join(SCATTER_REDUCTIONS)})")


def _inputs(args: Any) -> list[str]:
    return [args] if isinstance(args, str) else list(args)


# -- shape rules --------------------------------------------------------------------------------

def reduce_axes(axes: Sequence[int] | None, rank: int) -> list[int]:
    """ReduceOp::setup's axes: every axis when None, else made non-negative and sorted;
    ValueError for an axis out of [-rank, rank - 1] or given twice."""
    if axes is None:
        return list(range(rank))
    if rank == 0 and axes:
        raise ValueError("Reduce input rank must be greater than 0.")
    for axis in axes:
        if not -rank <= axis <= rank - 1:
            raise ValueError(f"Axis {axis} is out of acceptable range [{-rank}, {rank - 1}]")
    out = sorted(a + rank if a < 0 else a for a in axes)
    if len(set(out)) != len(out):
        raise ValueError(f"axes {list(axes)} name an axis twice")
    return out


def _reduced_shape(shape: Sequence[int], axes: Sequence[int], keepdims: int) -> list[int]:
    return [1 if i in axes else d for i, d in enumerate(shape)
            if keepdims or i not in axes]


def _expand_indices(indices: Sequence[int], data: Sequence[int], axis: int,
                    grouped: bool) -> list[int]:
    """expandIndicesBcastNdShape: a vector of indices (after the group dimension) is placed
    at ``axis``, and trailing singleton dimensions are added up to the data's rank."""
    if len(indices) > len(data):
        raise ValueError(f"Invalid rank for indices input. Indices rank {len(indices)} must be "
                         f"<= data input rank {len(data)}.")
    out = list(indices)
    if len(indices) - int(grouped) == 1:
        out[int(grouped):int(grouped)] = [1] * (axis - int(grouped))
    out += [1] * (len(data) - len(out))
    if any(i > d for i, d in zip(out, data, strict=True)):
        raise ValueError(f"Failed to expand 'indices' shape {list(indices)} to match 'src' "
                         f"shape {list(data)} using reduction axis = {axis}.")
    return out


def scatter_shapes(data: Sequence[int], indices: Sequence[int], axis: int, axis_size: int,
                   group_size: int, broadcast: bool) -> tuple[int, list[int], list[int]]:
    """ScatterReduceOp::setup: (the axis made non-negative, the shape of the data region the
    indices address - the index shape after expanding - and the output shape when no
    initial values are given). Indices of the data's shape address it element by element;
    with ``broadcast`` a vector of indices (plus singleton dimensions) applies to every slice
    along ``axis``; without it the indices address the leading region of their own shape."""
    rank = len(data)
    if not -rank <= axis <= rank - 1:
        raise ValueError(f"ScatterReduceOp::setup axis = {axis} is outside the acceptable "
                         f"range [{-rank}, {rank - 1}]")
    axis = axis + rank if axis < 0 else axis
    grouped = group_size > 1
    if grouped and axis == 0:
        raise ValueError(f"axis 0 is the group dimension (group_size={group_size}): scatter "
                         f"along an axis after it")
    if grouped and (data[0] != group_size or indices[0] != group_size):
        raise ValueError(f"the first dimension of the data {list(data)} and indices "
                         f"{list(indices)} must be the group size {group_size}")
    region = list(data)
    if list(indices) != list(data):
        expanded = _expand_indices(indices, data, axis, grouped)
        wide = [i for i, d in enumerate(expanded) if d != 1]
        partial = len(wide) != 1 + int(grouped) or wide[int(grouped)] != axis
        if broadcast and partial or not broadcast and len(indices) != rank:
            raise ValueError(f"Partial broadcasting of indices is not currently supported "
                             f"(indices {list(indices)}, data {list(data)}, axis {axis}): give "
                             f"indices of the data's shape, or a vector along the axis.")
        if broadcast and expanded[axis] != data[axis]:
            raise ValueError(f"the vector of {expanded[axis]} indices must have the size of "
                             f"the data's axis {axis} ({data[axis]})")
        if not broadcast:
            region = expanded
    out = list(region)
    out[axis] = axis_size
    return axis, region, out


# -- output types (PopART's setup) --------------------------------------------------------------

def _median_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    dtype, shape = inputs[0]
    if shape is None:
        return [(dtype, None), (INT32, None)]
    out = _reduced_shape(shape, reduce_axes(attrs.get("axes"), len(shape)),
                         attrs.get("keepdims", 1))
    return [(dtype, out), (INT32, list(out))]


def _bucketize_types(inputs: Sequence[TensorType],
                     attrs: Mapping[str, Any]) -> list[TensorType]:
    (dtype, shape), (bdtype, bshape) = inputs[0], inputs[1]
    if bshape is not None and len(bshape) != 1:
        raise ValueError(f"BucketizeOp::setup The boundaries tensor is not a 1-D tensor. The "
                         f"boundaries tensor rank = {len(bshape)}.")
    if dtype != bdtype:
        raise ValueError(f"BucketizeOp::setup The input and boundaries tensors have different "
                         f"data types. The input tensor data type = "
                         f"{TensorProto.DataType.Name(dtype).lower()}. The boundaries tensor "
                         f"data type = {TensorProto.DataType.Name(bdtype).lower()}.")
    return [(INT32, shape)]


def _sort_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    dtype, shape = inputs[0]
    if shape is not None:
        axis = attrs.get("axis", -1)
        if not shape:
            raise ValueError("Sort input rank must be greater than 0.")
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"Cannot sort on axis {axis} when input rank is {len(shape)}.")
    return [(dtype, shape), (INT32, shape)]


def _sequence_slice_types(inputs: Sequence[TensorType],
                          attrs: Mapping[str, Any]) -> list[TensorType]:
    return [inputs[1]]


def slice_bounds(shape: Sequence[int], starts: Sequence[int], ends: Sequence[int],
                 axes: Sequence[int] | None) -> list[tuple[int, int, int]]:
    """BaseSliceOp::getSlices for steps of 1: (axis, start, end) with indices clamped to
    [-dim, dim] and counted from the end when negative; ValueError for an axis out of range,
    lists of different lengths or a start after its end."""
    axes = list(range(len(starts))) if not axes else list(axes)
    if not len(axes) == len(starts) == len(ends):
        raise ValueError(f"axes {axes}, starts {list(starts)} and ends {list(ends)} must have "
                         f"the same length")
    out = []
    for axis, start, end in zip(axes, starts, ends, strict=True):
        if not 0 <= axis < len(shape):
            raise ValueError(f"Invalid input shape in BaseSliceOp::getSlices. The input shape "
                             f"has rank {len(shape)}, but axis = {axis}. axis must be less "
                             f"than the input shape's rank (and not negative).")
        dim = shape[axis]
        first, last = (max(min(i, dim), -dim) for i in (start, end))
        first, last = (i + dim if i < 0 else i for i in (first, last))
        if first > last:
            raise ValueError(f"slice on axis {axis}: start {start} comes after end {end} on a "
                             f"dimension of size {dim}")
        out.append((axis, first, last))
    return out


def _slice_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    dtype, shape = inputs[0]
    if shape is None:
        return [(dtype, None)]
    out = list(shape)
    for axis, start, end in slice_bounds(shape, attrs["starts"], attrs["ends"],
                                         attrs.get("axes")):
        out[axis] = end - start
    return [(dtype, out)]


def _depth_to_space_types(inputs: Sequence[TensorType],
                          attrs: Mapping[str, Any]) -> list[TensorType]:
    dtype, shape = inputs[0]
    block = attrs["blocksize"]
    if block <= 0:
        raise ValueError(f"Blocksize must be positive (got {block})")
    if attrs.get("mode", "DCR") not in ("DCR", "CRD"):
        raise ValueError(f"Unrecognised DepthToSpaceMode {attrs['mode']} (DCR or CRD)")
    if shape is None:
        return [(dtype, None)]
    if len(shape) != 4:
        raise ValueError(f"Input tensor must be 4-dimensional (got shape {list(shape)})")
    n, c, h, w = shape
    if c % (block * block):
        raise ValueError(f"the channels ({c}) must be a multiple of blocksize^2 "
                         f"({block * block})")
    return [(dtype, [n, c // (block * block), h * block, w * block])]


def gather_axis(shape: Sequence[int], axis: int, group_size: int) -> int:
    """GatherOp::setup's axis, made non-negative; ValueError out of range or on the group
    dimension."""
    rank = len(shape)
    if not -rank <= axis <= rank - 1:
        raise ValueError(f"GatherOp::setup axis = {axis} is outside the acceptable range "
                         f"[{-rank}, {rank - 1}]")
    axis = axis % rank
    if axis == 0 and group_size > 1:
        raise ValueError(f"GatherOp::setup axis = {axis} indicates the dimension of the group")
    return axis


def _grouped_gather_types(inputs: Sequence[TensorType],
                          attrs: Mapping[str, Any]) -> list[TensorType]:
    (dtype, shape), (_, indices) = inputs[0], inputs[1]
    if shape is None or indices is None:
        return [(dtype, None)]
    group = attrs.get("group_size", 1)
    axis = gather_axis(shape, attrs.get("axis", 0), group)
    index = list(indices[1:] if group > 1 else indices)
    return [(dtype, [*shape[:axis], *index, *shape[axis + 1:]])]


def _scatter_reduce_types(inputs: Sequence[TensorType],
                          attrs: Mapping[str, Any]) -> list[TensorType]:
    (dtype, shape), (_, indices) = inputs[0], inputs[1]
    if attrs["axis_size"] < 1:
        raise ValueError(f"ScatterReduceOp axis_size = {attrs['axis_size']} is not valid: must "
                         f"be > 0.")
    if attrs.get("group_size", 1) < 1:
        raise ValueError(f"ScatterReduceOp group_size = {attrs['group_size']} is not valid: "
                         f"must be > 0.")
    if attrs.get("enable_index_broadcast", 1) not in (0, 1):
        raise ValueError(f"ScatterReduceOp enable_index_broadcast = "
                         f"{attrs['enable_index_broadcast']} is not valid: must be either 0 "
                         f"or 1.")
    if shape is None or indices is None:
        return [(dtype, None)]
    _, _, out = scatter_shapes(shape, indices, attrs.get("axis", -1), attrs["axis_size"],
                               attrs.get("group_size", 1), bool(attrs.get("enable_index_"
                                                                          "broadcast", 1)))
    if len(inputs) > 2:  # the initial values give the output's type
        return [inputs[2]]
    return [(dtype, out)]


def _init_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    if attrs["init_type"] not in (0, 1):
        raise ValueError(f"init_type {attrs['init_type']} is not a popart.InitType (NoInit=0, "
                         f"Zero=1)")
    return [(POPART_DATA_TYPES[attrs["data_type"]][1], list(attrs["shape"]))]


def _remap_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    if attrs["remap_type"] not in (0, 1, 2):
        raise ValueError(f"remap_type {attrs['remap_type']} is not a popart.TensorRemapType "
                         f"(FwdBwdReverse=0, FwdBwd=1, Fwd=2)")
    return [inputs[0]]


def _abort_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    if inputs and inputs[0][1] is not None and _product(inputs[0][1]) > 1:
        raise ValueError("Conditional abort op can only test a scalar tensor")
    return []


def _product(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


# -- PopART signatures the generic binding does not fit -----------------------------------------

def _bind_init(builder: Any, shape: Any, data_type: Any = REQUIRED, init_type: Any = REQUIRED,
               batch_axis: Any = -1, debugContext: Any = ""  # noqa: N803 - PopART's name
               ) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """init(shape, data_type, init_type, batch_axis, debugContext="") and its overload
    init(shape, data_type, init_type, debugContext="") (batch_axis -1); no inputs."""
    if isinstance(batch_axis, str):  # the overload without batch_axis, given positionally
        batch_axis, debugContext = -1, batch_axis
    given = {"data_type": data_type, "init_type": init_type, "batch_axis": batch_axis,
             "debugContext": debugContext}
    # PopART's builder adds tensor_type = TensorType::ActGrad (0), which its InitOp requires
    return [], given, {"shape": _ints(shape), "tensor_type": 0}


def _bind_remap(builder: Any, args: Any, remap_type: Any = 0,
                debugPrefix: Any = ""  # noqa: N803 - PopART's name
                ) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """tensorremap(args, remap_type=0, debugPrefix="")."""
    return _inputs(args), {"remap_type": remap_type, "debugContext": debugPrefix}, {}


def _bind_copy_var_update(builder: Any, args: Any,
                          debugContext: Any = ""  # noqa: N803 - PopART's name
                          ) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """copyvarupdate([variable, updater]): PopART's Builder refuses other arguments."""
    inputs = _inputs(args)
    if len(inputs) != 2:
        raise BuilderError(f"copyvarupdate should have two args (the variable and its new "
                           f"value); got {inputs}.")
    if not builder.isInitializer(inputs[0]):
        raise BuilderError(f"The first arg of copyvarupdate ({inputs[0]!r}) should be an "
                           f"initialised tensor: give a tensor of addInitializedInputTensor.")
    return inputs, {"debugContext": debugContext}, {}


register("reducemedian", GraphcoreOp("ReduceMedian", (("axes", "optional ints", None),
                                                      ("keepdims", "int", 1)),
                                     _median_types, outputs=2, returns_list=True))
register("bucketize", GraphcoreOp("Bucketize", (("right", "int", 0),), _bucketize_types))
register("sort", GraphcoreOp("Sort", (("axis", "int", -1), ("descending", "int", 0),
                                      ("stable", "int", 0)),
                             _sort_types, outputs=2, returns_list=True))
register("sequenceslice", GraphcoreOp("SequenceSlice", (("zeroUnused", "int", 0),),
                                      _sequence_slice_types))
# PopART's builder leaves axes out when empty (every axis from 0, in order)
register("slice", GraphcoreOp("Slice", (("ends", "ints", REQUIRED), ("starts", "ints", REQUIRED),
                                        ("axes", lambda v: _ints(v) or None, REQUIRED)),
                              _slice_types))
# ... and depthtospace's mode when it is the default "DCR"
register("depthtospace", GraphcoreOp("DepthToSpace", (
    ("blocksize", "int", REQUIRED), ("mode", lambda v: None if v == "DCR" else str(v), REQUIRED)),
    _depth_to_space_types))
register("groupedgather", GraphcoreOp("GroupedGather", (("axis", "int", 0),
                                                        ("group_size", "int", 1)),
                                      _grouped_gather_types))
_SCATTER = (("axis_size", "int", REQUIRED), ("axis", "int", -1),
            ("reduction", _scatter_reduction, "ScatterReduction.Sum"))
register("scatterreduce", GraphcoreOp("ScatterReduce", (*_SCATTER,
                                                        ("enable_index_broadcast", "int", 1)),
                                      _scatter_reduce_types))
register("groupedscatterreduce", GraphcoreOp("ScatterReduce", (
    *_SCATTER, ("group_size", "int", 1), ("enable_index_broadcast", "int", 1)),
    _scatter_reduce_types))
register("init", GraphcoreOp("Init", (("data_type", _data_type, REQUIRED),
                                      ("init_type", "int", REQUIRED),
                                      ("batch_axis", "int", -1)),
                             _init_types, bind=_bind_init))
register("tensorremap", GraphcoreOp("TensorRemap", (("remap_type", "int", 0),), _remap_types,
                                    bind=_bind_remap))
register("copyvarupdate", GraphcoreOp("CopyVarUpdate", (), bind=_bind_copy_var_update))
register("abort", GraphcoreOp("Abort", (), _abort_types, outputs=0))
