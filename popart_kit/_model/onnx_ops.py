"""PopART's Python signatures of the ai.onnx operators, derived from ONNX's own schemas.

PopART generates ``builder.aiOnnx.<op>`` from ``onnx.defs`` (its scripts/gen_operators.py); this
module applies the same rule, so every operator of a chosen opset gets PopART's method name,
parameter names, order and defaults:

* the method is the op name in lower case (And, Or, Not, Xor, If: ``logical_and`` ...);
* ``args`` (input tensor ids), then ``num_outputs`` when the op's output count varies, then the
  attributes under their ONNX names, required ones first, each group alphabetical, ``auto_pad``
  left out; then ``debugContext``;
* an optional attribute defaults to ``[]`` for lists, else the schema's default, else ``""``
  for strings and ``None`` for numbers; ``None``, ``[]`` and ``""`` are not written, so ONNX's
  own defaults apply;
* one output returns a tensor id, several a list of ids.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import defs

__all__ = ["OpSignature", "signatures", "method_name"]

_RENAMED = {"And": "logical_and", "Or": "logical_or", "Not": "logical_not",
            "Xor": "logical_xor", "If": "logical_if"}
_LIST_TYPES = {onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS, onnx.AttributeProto.STRINGS,
               onnx.AttributeProto.TENSORS, onnx.AttributeProto.GRAPHS}
# Attributes holding subgraphs need a sub-builder, which popart_kit's Builder does not offer
# (If, Loop, Scan); Constant's sparse form is the one exception, left unused.
_UNSUPPORTED = {onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS,
                onnx.AttributeProto.SPARSE_TENSOR}


def method_name(op_type: str) -> str:
    return _RENAMED.get(op_type, op_type.lower())


@dataclass(frozen=True)
class OpSignature:
    """One ai.onnx operator as PopART's Builder exposes it."""

    op_type: str
    since_version: int
    has_args: bool
    variable_outputs: bool
    fixed_outputs: int
    attributes: tuple[tuple[str, int, bool, Any], ...]  # (name, AttributeProto type, required,
    #                                                      default)

    @property
    def returns_list(self) -> bool:
        return self.variable_outputs or self.fixed_outputs > 1

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params = []
        if self.op_type == "Constant":
            params.append(inspect.Parameter("value", kind))
            if self.since_version >= 11:
                params.append(inspect.Parameter("is_value_sparse", kind, default=False))
        else:
            if self.has_args:
                params.append(inspect.Parameter("args", kind))
            names = {a[0] for a in self.attributes}
            if self.variable_outputs and "num_outputs" not in names:  # Split-18 has it as an
                params.append(inspect.Parameter("num_outputs", kind))  # attribute already
            for name, attr_type, required, default in self.attributes:
                # PopART asks for ConstantOfShape's value tensor (a numpy array) explicitly
                required = required or attr_type == onnx.AttributeProto.TENSOR
                params.append(inspect.Parameter(name, kind) if required
                              else inspect.Parameter(name, kind, default=default))
        params.append(inspect.Parameter("debugContext", kind, default=""))
        return inspect.Signature(params)


def _default(schema: defs.OpSchema, attr: defs.OpSchema.Attribute) -> Any:
    if attr.name == "axes" and schema.name.startswith("Reduce"):
        return None  # None: reduce over all axes
    if attr.type in _LIST_TYPES:
        return []  # PopART's default for every list attribute; unwritten, ONNX's applies
    if attr.type == onnx.AttributeProto.STRING and not _has_default(attr):
        return ""
    proto = attr.default_value
    if proto is not None and proto.type != onnx.AttributeProto.UNDEFINED:
        value = onnx.helper.get_attribute_value(proto)
        if isinstance(value, bytes):
            return value.decode()
        if isinstance(value, float):
            return round(value, 5) if abs(value) < 1e30 else value
        return value
    return None


def _has_default(attr: defs.OpSchema.Attribute) -> bool:
    proto = attr.default_value
    return proto is not None and proto.type != onnx.AttributeProto.UNDEFINED


@functools.cache
def signatures(version: int) -> dict[str, OpSignature]:
    """Every ai.onnx operator at ``version``, by PopART method name."""
    latest: dict[str, defs.OpSchema] = {}
    for schema in defs.get_all_schemas_with_history():
        if schema.domain not in ("", "ai.onnx") or schema.since_version > version:
            continue
        if schema.name not in latest or schema.since_version > latest[schema.name].since_version:
            latest[schema.name] = schema
    out = {}
    for name, schema in latest.items():
        if name != "Constant" and any(a.type in _UNSUPPORTED
                                      for a in schema.attributes.values()):
            continue
        attrs = sorted((a for a in schema.attributes.values() if a.name != "auto_pad"),
                       key=lambda a: (not a.required, a.name))
        out[method_name(name)] = OpSignature(
            op_type=name, since_version=schema.since_version, has_args=bool(schema.inputs),
            variable_outputs=schema.min_output != schema.max_output,
            fixed_outputs=schema.max_output if schema.min_output == schema.max_output else 1,
            attributes=tuple((a.name, int(a.type), bool(a.required), _default(schema, a))
                             for a in attrs))
    return out
