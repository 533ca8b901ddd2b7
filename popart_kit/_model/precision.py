"""Half precision the way PopART users build it: weights and activations FLOAT16.

PopART has no automatic mixed precision: a half-precision model is one whose inputs, weights and
activations are FLOAT16 (its Builder is given FLOAT16 tensors), trained with loss scaling (the
optimizers' ``loss_scaling``) so small gradients survive, and with ``precision.partials_type``
choosing whether matrix products and convolutions accumulate in float32 ("float") or float16.
:func:`to_half` turns a float32 model into that model.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .layout import load_model

__all__ = ["to_half"]

_FLOAT, _HALF = TensorProto.FLOAT, TensorProto.FLOAT16


def _half_type(value: onnx.ValueInfoProto) -> None:
    tensor = value.type.tensor_type
    if value.type.HasField("tensor_type") and tensor.elem_type == _FLOAT:
        tensor.elem_type = _HALF


def _half_tensor(tensor: onnx.TensorProto) -> None:
    if tensor.data_type == _FLOAT:
        tensor.CopyFrom(numpy_helper.from_array(
            numpy_helper.to_array(tensor).astype(np.float16), tensor.name))


def to_half(model: onnx.ModelProto | bytes | str | os.PathLike) -> onnx.ModelProto:
    """A copy of ``model`` with every FLOAT tensor FLOAT16: graph inputs and outputs, weights,
    constants (Constant nodes and tensor attributes), recorded intermediate types and Casts to
    FLOAT. Integer tensors (labels, indices, shapes) are left as they are; nodes of subgraphs are
    not rewritten. The result passes the ONNX checker when the original does."""
    half = onnx.ModelProto()
    half.CopyFrom(load_model(model))
    graph = half.graph
    for value in (*graph.input, *graph.output, *graph.value_info):
        _half_type(value)
    for tensor in graph.initializer:
        _half_tensor(tensor)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                _half_tensor(attribute.t)
            elif node.op_type == "Cast" and attribute.name == "to" and attribute.i == _FLOAT:
                attribute.i = _HALF
    return half
