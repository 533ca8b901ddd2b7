"""Custom operators: the Python stand-in for a PopART program's C++ custom op.

A program built with ``builder.customOp(opName, opVersion, domain, inputs, attributes)`` runs
on PopART with a compiled op library; here it runs once the op is registered with
:func:`register_custom_op` under the same domain, name and version: ``compute`` gives the
outputs from the inputs (jax.numpy arrays) and the node's attributes, ``infer`` (optional) the
output types the Builder records, ``gradient`` (optional) PopART's grad op - without it, JAX
differentiates ``compute``. Nothing here imports JAX.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .graphcore import TensorType  # (ONNX elem type, shape or None), as the Builder types

__all__ = ["CustomOp", "CUSTOM_OPS", "custom_op", "register_custom_op"]


@dataclass(frozen=True)
class CustomOp:
    """A registered custom operator (see the module docstring)."""

    domain: str
    name: str
    version: int
    compute: Callable[..., Any]          # (*inputs, **attributes) -> output or tuple of them
    infer: Callable[..., list[TensorType]] | None = None  # (input types, attributes) -> types
    gradient: Callable[..., Any] | None = None  # (inputs, outputs, output grads, attributes)
    #                                             -> a gradient per input (None: no gradient)


CUSTOM_OPS: dict[tuple[str, str, int], CustomOp] = {}


def register_custom_op(domain: str, name: str, version: int, compute: Callable[..., Any], *,
                       infer: Callable[..., list[TensorType]] | None = None,
                       gradient: Callable[..., Any] | None = None) -> CustomOp:
    """Give the custom op ``domain``/``name`` of ``version`` its computation (jax.numpy),
    optionally its output types and its gradient (see the module docstring); a second
    registration of the same op replaces the first. Refuses the standard domains."""
    if not isinstance(domain, str) or domain in ("", "ai.onnx", "ai.graphcore"):
        raise ValueError(f"register_custom_op: domain {domain!r} is ONNX's or PopART's own; a "
                         f"custom op has a domain of its own, e.g. 'com.acme'.")
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_custom_op: name {name!r} must be the op's type, e.g. "
                         f"'LeakyRelu'.")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"register_custom_op: version {version!r} must be a positive integer "
                         f"(the opVersion the program gives customOp).")
    for what, fn in (("compute", compute), ("infer", infer), ("gradient", gradient)):
        if fn is not None and not callable(fn):
            raise ValueError(f"register_custom_op: {what} must be a function, got "
                             f"{type(fn).__name__}.")
    entry = CustomOp(domain, name, version, compute, infer, gradient)
    CUSTOM_OPS[(domain, name, version)] = entry
    return entry


def custom_op(domain: str, name: str, version: int | None) -> CustomOp | None:
    """The registered op, by exact version, else the only version registered (None: none)."""
    if version is not None and (domain, name, version) in CUSTOM_OPS:
        return CUSTOM_OPS[(domain, name, version)]
    found = [op for (d, n, _), op in CUSTOM_OPS.items() if (d, n) == (domain, name)]
    return found[0] if len(found) == 1 else None
