"""The random ``aiGraphcore`` operators (PopART's popart.cpp builder bindings, builder.hpp):
``shapeddropout``, typed as its input (ShapedDropoutOp::setup). As in PopART, the mask's
``shape`` and the ratio are checked when a session is made, not here. ai.onnx's Dropout and
RandomNormal/Uniform(Like) come with ``aiOnnx``."""

from __future__ import annotations

from ._registry import REQUIRED, GraphcoreOp, register, same

register("shapeddropout", GraphcoreOp("ShapedDropout", (("shape", "ints", REQUIRED),
                                                         ("ratio", "float", 0.5)), same))
