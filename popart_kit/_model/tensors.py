"""ONNX tensors as PopART stores them: its Builder and modelToHost keep FLOAT values in
``float_data`` and pack FLOAT16 values two to an int32 in ``int32_data`` (builder_impl.cpp
addInitializedInputTensor), where ONNX keeps one FLOAT16 value per int32. :func:`to_array`
reads either; :func:`as_popart_stores` writes PopART's form; :func:`in_onnx_form` turns a
model's packed initializers into ONNX's form (what onnx.checker and onnxruntime read)."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["as_popart_stores", "in_onnx_form", "to_array"]


def to_array(tensor: onnx.TensorProto) -> np.ndarray:
    """``tensor``'s values, FLOAT16 in ``int32_data`` read as PopART packs them when there are
    half as many int32s as values (one value per int32, ONNX's form, otherwise)."""
    if not _packed(tensor):
        return numpy_helper.to_array(tensor)
    words = np.asarray(tensor.int32_data, np.int32)
    return words.view(np.float16)[:math.prod(tensor.dims)].reshape(tuple(tensor.dims))


def as_popart_stores(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """``tensor`` in PopART's form (FLOAT in ``float_data``, FLOAT16 packed in ``int32_data``);
    other types unchanged."""
    if tensor.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        return tensor
    values = to_array(tensor).reshape(-1)
    out = onnx.TensorProto(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type)
    if tensor.data_type == onnx.TensorProto.FLOAT:
        out.float_data.extend(values.tolist())
    else:
        halves = np.ascontiguousarray(values, np.float16)
        if halves.size % 2:
            halves = np.append(halves, np.float16(0))
        out.int32_data.extend(halves.view(np.int32).tolist())
    return out


def _packed(tensor: onnx.TensorProto) -> bool:
    count = math.prod(tensor.dims)
    return (tensor.data_type == onnx.TensorProto.FLOAT16 and count > 1
            and not tensor.HasField("raw_data")
            and len(tensor.int32_data) == (count + 1) // 2)


def in_onnx_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself, or a copy whose PopART-packed FLOAT16 initializers are in ONNX's
    form."""
    if not any(_packed(t) for t in model.graph.initializer):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in out.graph.initializer:
        if _packed(tensor):
            tensor.CopyFrom(numpy_helper.from_array(to_array(tensor), tensor.name))
    return out
