"""popart.getSupportedOperations and getUnsupportedOperations: what the xla runtime lowers.

PopART answers for its own op registry; here the answer is the xla backend's: an ai.onnx
operator is supported at every version of its ONNX schema history up to the newest opset the
kit's Builder offers, and an ai.graphcore one (with ``includeInternal``) at version 1. The two
lists never share an operator.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import defs

__all__ = ["OperatorIdentifier", "getSupportedOperations", "getUnsupportedOperations"]

AI_ONNX = "ai.onnx"


@dataclass(frozen=True)
class OperatorIdentifier:
    """popart.OperatorIdentifier: an operator's domain, type and version."""

    domain: str
    type: str
    version: int

    def __str__(self) -> str:
        return f"{self.domain}.{self.type}:{self.version}"


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
