"""popart.getSupportedOperations and getUnsupportedOperations: what the xla runtime lowers.

PopART answers for its own op registry; here the answer is the xla backend's: an ai.onnx
operator is supported at every version of its ONNX schema history up to the newest opset the
kit's Builder offers, and an ai.graphcore one (with ``includeInternal``) at version 1. The two
lists never share an operator. getSupportedOperationsDefinition describes the same operators:
their inputs and outputs with the tensor types each takes, and their attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import defs

__all__ = ["OperatorIdentifier", "OpDefinition", "getSupportedOperations",
           "getSupportedOperationsDefinition", "getUnsupportedOperations"]

AI_ONNX = "ai.onnx"


@dataclass(frozen=True)
class OperatorIdentifier:
    """popart.OperatorIdentifier: an operator's domain, type and version."""

    domain: str
    type: str
    version: int

    def __str__(self) -> str:
        return f"{self.domain}.{self.type}:{self.version}"


@dataclass(frozen=True)
class _Port:
    """OpDefinition::Input / ::Output: a name and the tensor types (popart.DataType) it takes."""

    name: str
    supportedTensors: list  # noqa: N815 - PopART's name
    constant: bool = False


@dataclass(frozen=True)
class _Attribute:
    """OpDefinition::Attribute: the values an attribute takes, as a regular expression."""

    supportedValuesRegex: str  # noqa: N815 - PopART's name


@dataclass(frozen=True)
class OpDefinition:
    """popart.OpDefinition: an operator's inputs, outputs (each with its supported tensor types)
    and attributes (name -> the regex of the values it takes)."""

    inputs: list[_Port]
    outputs: list[_Port]
    attributes: dict[str, _Attribute]


def _lowered() -> set[tuple[str, str]]:
    from .._runtime.xla.op_table import OPS  # the xla backend's operators (imports JAX)

    return set(OPS)


def _history(newest: int) -> dict[str, list[int]]:
    """Each ai.onnx operator's schema versions up to opset ``newest``."""
    out: dict[str, list[int]] = {}
    for schema in defs.get_all_schemas_with_history():
        if schema.domain in ("", AI_ONNX) and schema.since_version <= newest:
            out.setdefault(schema.name, []).append(schema.since_version)
    return {k: sorted(set(v)) for k, v in out.items()}


def getSupportedOperations(includeInternal: bool) -> list[OperatorIdentifier]:
    """Every operator version the xla backend runs (``includeInternal``: ai.graphcore ones
    too)."""
    lowered = _lowered()
    newest = onnx.defs.onnx_opset_version()
    out = [OperatorIdentifier(AI_ONNX, name, v)
           for name, versions in sorted(_history(newest).items()) if ("", name) in lowered
           for v in versions]
    if includeInternal:
        out += [OperatorIdentifier(domain, name, 1) for domain, name in sorted(lowered)
                if domain not in ("", AI_ONNX)]
    return out


def getUnsupportedOperations(opsetVersion: int) -> list[OperatorIdentifier]:
    """The ai.onnx operators of opset ``opsetVersion`` the xla backend does not run (each at
    the version that opset has)."""
    lowered = _lowered()
    return [OperatorIdentifier(AI_ONNX, name, versions[-1])
            for name, versions in sorted(_history(opsetVersion).items())
            if ("", name) not in lowered]


def _data_types(allowed: list[str]) -> list:
    """popart.DataType members for ONNX type strings such as ``tensor(float)`` (others left
    out)."""
    from ._core import ENUMS

    members = ENUMS["DataType"].__members__
    out = []
    for text in allowed:
        name = text.removeprefix("tensor(").removesuffix(")").upper()
        if name in members:
            out.append(members[name])
    return out


def _onnx_definition(schema: defs.OpSchema) -> OpDefinition:
    constraints = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}

    def port(p: defs.OpSchema.FormalParameter) -> _Port:
        return _Port(p.name, _data_types(constraints.get(p.type_str, [p.type_str])))

    return OpDefinition([port(p) for p in schema.inputs], [port(p) for p in schema.outputs],
                        {name: _Attribute("*") for name in sorted(schema.attributes)})


def _graphcore_definitions() -> dict[str, OpDefinition]:
    """ai.graphcore definitions from the Builder's registry: attributes by parameter; the
    tensor types are the float types the xla backend computes in."""
    from .._model.graphcore import GRAPHCORE_OPS
    from ._core import ENUMS

    floats = [ENUMS["DataType"].__members__[n] for n in ("FLOAT", "FLOAT16")]
    out: dict[str, OpDefinition] = {}
    for entry in GRAPHCORE_OPS.values():
        count = entry.outputs if isinstance(entry.outputs, int) else 1
        attrs = {entry.attribute(name): _Attribute("*") for name, _, _ in entry.params
                 if name not in ("debugContext", "debugPrefix")}
        out.setdefault(entry.op_type, OpDefinition(
            [_Port("input", floats)], [_Port(f"output{i}", floats) for i in range(count)],
            attrs))
    return out


def getSupportedOperationsDefinition(includePrivate: bool) -> dict[OperatorIdentifier,
                                                                    OpDefinition]:
    """popart.getSupportedOperationsDefinition: each operator of
    :func:`getSupportedOperations` (``includePrivate``: the ai.graphcore ones too) with its
    definition - inputs and outputs with their tensor types (from the ONNX schema for ai.onnx),
    and attributes."""
    out: dict[OperatorIdentifier, OpDefinition] = {}
    graphcore = _graphcore_definitions() if includePrivate else {}
    for op in getSupportedOperations(includePrivate):
        if op.domain == AI_ONNX:
            out[op] = _onnx_definition(defs.get_schema(op.type, op.version, ""))
        else:
            out[op] = graphcore.get(op.type, OpDefinition([], [], {}))
    return out
