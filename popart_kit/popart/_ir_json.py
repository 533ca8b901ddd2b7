"""``session._serializeIr(IrSerializationFormat.JSON)``: the graph a session runs, in the JSON
shape PopART writes its IR (Ir::serialise, OpJsonSerialiser): ``{"maingraph": [op, ...]}``, each
op ``{"type", "name", "inputs": [{"name", "shape", "type", "index"}], "outputs": [...],
"attributes": {name: value as text}}``.

The ops are the model's ONNX nodes as the xla backend lowers them (forward only, the model's
own annotations such as ``__ipu_number`` included), not PopART's IR after its patterns: there
are no gradient, optimizer or inplace ops to list.
"""

from __future__ import annotations

import json
import math
from typing import Any

import onnx
from onnx import helper

from .._base.problems import popart_vector

__all__ = ["ir_json"]


def _types(model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - lenient, as PopART's own inference
        graph = model.graph
    out = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        dims = [str(d.dim_value) if d.HasField("dim_value") else "?"
                for d in tensor.shape.dim] if tensor.HasField("shape") else []
        name = onnx.TensorProto.DataType.Name(tensor.elem_type) if tensor.elem_type else \
            "UNDEFINED"
        out[value.name] = (popart_vector(dims), name)
    for init in graph.initializer:
        out[init.name] = (popart_vector(init.dims),
                          onnx.TensorProto.DataType.Name(init.data_type))
    return out


def _attribute_text(attr: onnx.AttributeProto) -> str:
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return popart_vector(v.decode() if isinstance(v, bytes) else v for v in value)
    if isinstance(value, onnx.TensorProto):
        return f"tensor {list(value.dims)} ({math.prod(value.dims)} elements)"
    return str(value)


def ir_json(model: onnx.ModelProto) -> str:
    """The model's graph as PopART's JSON IR serialisation (see the module docstring)."""
    types = _types(model)

    def tensors(names: Any) -> list[dict[str, str]]:
        return [{"name": n, "shape": types.get(n, ("[]", "UNDEFINED"))[0],
                 "type": types.get(n, ("[]", "UNDEFINED"))[1], "index": str(i)}
                for i, n in enumerate(names) if n]

    def ops(graph: onnx.GraphProto) -> list[dict[str, Any]]:
        return [{"type": node.op_type, "name": node.name,
                 "inputs": tensors(node.input), "outputs": tensors(node.output),
                 "attributes": {a.name: _attribute_text(a) for a in node.attribute}}
                for node in graph.node if node.op_type != "Constant"]

    name = model.graph.name
    key = name if name and not name.startswith("BuilderGraph") else "maingraph"
    out = {key: ops(model.graph)}
    todo = [model.graph]
    while todo:  # the graphs of Call, If, Loop and Scan nodes, by name, as PopART's IR has them
        for node in todo.pop().node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    out.setdefault(attr.g.name or f"{node.name or node.op_type}/{attr.name}",
                                   ops(attr.g))
                    todo.append(attr.g)
    return json.dumps(out)
