"""The elementwise, shape and dynamic-slice ``aiGraphcore`` operators (PopART's popart.cpp builder
bindings, builder.hpp)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._registry import REQUIRED, GraphcoreOp, TensorType, register


def _reshaped(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    """PopART's ReshapeOp shape: a 0 takes the input's size there, one -1 is inferred."""
    dtype, given = inputs[0]
    shape = list(attrs["shape"])
    if given is None or any(not isinstance(d, int) or d < 0 for d in given):
        return [(dtype, shape)]
    shape = [given[i] if d == 0 and i < len(given) else d for i, d in enumerate(shape)]
    if shape.count(-1) == 1:
        known = -math.prod(shape)
        total = math.prod(given)
        if known and total % known == 0:
            shape[shape.index(-1)] = total // known
    return [(dtype, shape)]


def _subsampled(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    dtype, shape = inputs[0]
    if shape is None:
        return [(dtype, None)]
    strides = list(attrs["strides"]) + [1] * (len(shape) - len(attrs["strides"]))
    zero = next((i for i, s in enumerate(strides) if s == 0), None)
    if zero is not None:  # PopART's text (subsample.cpp)
        raise ValueError(f"Strides invalid. 0 stride at index {zero} (strides {strides}): "
                         f"every stride must be at least 1.")
    return [(dtype, [-(-d // s) for d, s in zip(shape, strides, strict=False)])]


def _sliced(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    dtype, shape = inputs[0]
    if len(inputs) > 2:  # DynamicSlice's slice input: the output takes its shape (PopART)
        return [(dtype, inputs[2][1])]
    if shape is None:
        return [(dtype, None)]
    shape = list(shape)
    for axis, size in zip(attrs["axes"], attrs["sizes"], strict=True):
        shape[axis] = size
    return [(dtype, shape)]


for _method, _op_type in {
        "detach": "Detach", "nop": "Nop", "geluerf": "GeluErf", "swish": "Swish",
        "atan2": "Atan2", "expm1": "Expm1", "log1p": "Log1p", "fmod": "Fmod",
        "remainder": "Remainder", "round": "Round", "nearbyint": "NearbyInt",
        "bitwisenot": "BitwiseNot", "bitwiseand": "BitwiseAnd", "bitwiseor": "BitwiseOr",
        "bitwisexor": "BitwiseXor", "bitwisexnor": "BitwiseXnor"}.items():
    register(_method, GraphcoreOp(_op_type))

register("scale", GraphcoreOp("Scale", (("scale", "float", REQUIRED),)))
register("scaledadd", GraphcoreOp("ScaledAdd", (("scale0", "float", 1.0),
                                                 ("scale1", "float", 1.0))))
register("printtensor", GraphcoreOp("PrintTensor", (("print_gradient", "int", 1),
                                                     ("title", "str", ""))))
register("incrementmod", GraphcoreOp("IncrementMod", (("increment", "float", REQUIRED),
                                                       ("modulus", "float", REQUIRED))))
register("reshape", GraphcoreOp("Reshape", (("shape", "ints", REQUIRED),), _reshaped))
register("subsample", GraphcoreOp("Subsample", (("strides", "ints", REQUIRED),), _subsampled))
register("reverse", GraphcoreOp("Reverse", (("dimensions", "ints", REQUIRED),)))
register("dynamicslice", GraphcoreOp("DynamicSlice", (("axes", "ints", REQUIRED),
                                                       ("sizes", "ints", REQUIRED),
                                                       ("noOverlap", "int", 0)), _sliced))
for _method, _op_type, _extra in (("dynamicupdate", "DynamicUpdate", (("noOverlap", "int", 0),)),
                                  ("dynamiczero", "DynamicZero", ()),
                                  ("dynamicadd", "DynamicAdd", ())):
    register(_method, GraphcoreOp(_op_type, (("axes", "ints", REQUIRED),
                                             ("sizes", "ints", REQUIRED), *_extra)))
