"""The elementwise, shape and dynamic-slice ``aiGraphcore`` operators (PopART's popart.cpp builder
bindings, builder.hpp)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._registry import REQUIRED, GraphcoreOp, TensorType, register


def _reshaped(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    return [(inputs[0][0], list(attrs["shape"]))]


def _subsampled(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    dtype, shape = inputs[0]
    if shape is None:
        return [(dtype, None)]
    strides = list(attrs["strides"]) + [1] * (len(shape) - len(attrs["strides"]))
    return [(dtype, [-(-d // s) for d, s in zip(shape, strides, strict=False)])]


def _sliced(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    dtype, shape = inputs[0]
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
