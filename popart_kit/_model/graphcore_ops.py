"""The ai.graphcore operators the Builder offers beyond the losses: PopART's Python signatures
(popart.cpp builder bindings, builder.hpp) and the shape of each output.

Each entry: method name -> (op type, parameters after ``args`` as (name, kind, default), shape
rule). Kinds: ``float``, ``int``, ``ints``, ``str``; a default of ``REQUIRED`` means none. Shape
rules: ``same`` (the first input's), ``reshape`` (the ``shape`` attribute), ``subsample``
(ceil(dim / stride)), ``slice`` (``axes`` dims become ``sizes``).
"""

from __future__ import annotations

REQUIRED = object()

_UNARY = ("same", ())
GRAPHCORE_OPS: dict[str, tuple[str, tuple[tuple[str, str, object], ...], str]] = {
    "scale": ("Scale", (("scale", "float", REQUIRED),), "same"),
    "scaledadd": ("ScaledAdd", (("scale0", "float", 1.0), ("scale1", "float", 1.0)), "same"),
    "detach": ("Detach", (), "same"),
    "nop": ("Nop", (), "same"),
    "printtensor": ("PrintTensor", (("print_gradient", "int", 1), ("title", "str", "")),
                    "same"),
    "geluerf": ("GeluErf", (), "same"),
    "swish": ("Swish", (), "same"),
    "atan2": ("Atan2", (), "same"),
    "expm1": ("Expm1", (), "same"),
    "log1p": ("Log1p", (), "same"),
    "fmod": ("Fmod", (), "same"),
    "remainder": ("Remainder", (), "same"),
    "round": ("Round", (), "same"),
    "nearbyint": ("NearbyInt", (), "same"),
    "bitwisenot": ("BitwiseNot", (), "same"),
    "bitwiseand": ("BitwiseAnd", (), "same"),
    "bitwiseor": ("BitwiseOr", (), "same"),
    "bitwisexor": ("BitwiseXor", (), "same"),
    "bitwisexnor": ("BitwiseXnor", (), "same"),
    "incrementmod": ("IncrementMod", (("increment", "float", REQUIRED),
                                      ("modulus", "float", REQUIRED)), "same"),
    "reshape": ("Reshape", (("shape", "ints", REQUIRED),), "reshape"),
    "subsample": ("Subsample", (("strides", "ints", REQUIRED),), "subsample"),
    "reverse": ("Reverse", (("dimensions", "ints", REQUIRED),), "same"),
    "dynamicslice": ("DynamicSlice", (("axes", "ints", REQUIRED), ("sizes", "ints", REQUIRED),
                                      ("noOverlap", "int", 0)), "slice"),
    "dynamicupdate": ("DynamicUpdate", (("axes", "ints", REQUIRED),
                                        ("sizes", "ints", REQUIRED), ("noOverlap", "int", 0)),
                      "same"),
    "dynamiczero": ("DynamicZero", (("axes", "ints", REQUIRED), ("sizes", "ints", REQUIRED)),
                    "same"),
    "dynamicadd": ("DynamicAdd", (("axes", "ints", REQUIRED), ("sizes", "ints", REQUIRED)),
                   "same"),
}

__all__ = ["GRAPHCORE_OPS", "REQUIRED"]
