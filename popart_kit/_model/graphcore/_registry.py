"""The registry of ``builder.aiGraphcore`` operators: each method's PopART signature, the op it
adds and how its outputs are typed.

An entry (:class:`GraphcoreOp`) gives the method's parameters after ``args`` as
``(name, kind, default)`` - kind ``float``, ``int``, ``ints``, ``str``, ``bool``, ``optional
ints`` or a converter function; a default of :data:`REQUIRED` means the caller must give it -
and ``infer``, which maps the input types and the converted attributes to the output types
(PopART's ``Op::setup``). Families of operators register in their own modules of this package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GRAPHCORE_OPS", "REQUIRED", "GraphcoreOp", "TensorType", "register", "same"]

REQUIRED = object()

TensorType = tuple[int, "list[int] | None"]   # (ONNX elem type, shape or None when unknown)
Infer = Callable[[Sequence[TensorType], Mapping[str, Any]], list[TensorType]]


def same(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    """One output typed as the first input."""
    dtype, shape = inputs[0]
    return [(dtype, None if shape is None else list(shape))]


def _ints(value: Any) -> list[int]:
    return [int(v) for v in value]


CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "float": float, "int": int, "str": str, "bool": lambda v: int(bool(v)), "ints": _ints,
    "optional ints": lambda v: None if v is None else _ints(v),
}


@dataclass(frozen=True)
class GraphcoreOp:
    """One ``aiGraphcore`` method: the op type it adds (domain ai.graphcore, version 1), its
    parameters after ``args``, how many outputs it has (a count, or the name of the parameter
    that gives it), whether PopART returns them as a list, and the attribute names that are not
    the parameter's own (``renamed``: (parameter, attribute) pairs)."""

    op_type: str
    params: tuple[tuple[str, str | Callable[[Any], Any], object], ...] = ()
    infer: Infer = same
    outputs: int | str = 1
    returns_list: bool = False
    renamed: tuple[tuple[str, str], ...] = ()
    # PopART signatures the generic binding does not fit (init: a shape and no inputs, two
    # overloads; tensorremap: debugPrefix): bind(builder, args, *rest, **kwargs) gives the
    # inputs, the parameters' values by name (debugContext too) and attributes of its own.
    bind: Callable[..., tuple[list[str], dict[str, Any], dict[str, Any]]] | None = None

    def attribute(self, name: str) -> str:
        """The ONNX attribute that parameter ``name`` sets."""
        return dict(self.renamed).get(name, name)

    @staticmethod
    def convert(kind: str | Callable[[Any], Any], value: Any) -> Any:
        """A parameter's attribute value by its ``kind`` (None leaves the attribute out)."""
        convert = CONVERTERS[kind] if isinstance(kind, str) else kind
        return convert(value)


GRAPHCORE_OPS: dict[str, GraphcoreOp] = {}


def register(method: str, entry: GraphcoreOp) -> None:
    """Add ``builder.aiGraphcore.<method>``; a method registered twice is a programming error."""
    if method in GRAPHCORE_OPS:
        raise RuntimeError(f"aiGraphcore.{method} is registered twice")
    GRAPHCORE_OPS[method] = entry
