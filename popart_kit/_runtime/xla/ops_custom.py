"""Custom operators on the xla backend: a node of a domain of its own runs the computation
registered for it with ``popart_kit.register_custom_op`` (:mod:`popart_kit._model.custom_ops`),
differentiated by JAX or by the registered gradient (a custom_vjp)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..._model.custom_ops import CustomOp, custom_op
from .ops import Ctx, Op

__all__ = ["custom_entry"]


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _with_gradient(registered: CustomOp, attrs: Mapping[str, Any]) -> Callable[..., Any]:
    """``compute`` whose gradient is the registered one (None for an input: no gradient)."""
    grad = registered.gradient
    assert grad is not None

    @jax.custom_vjp
    def run(*inputs: Any) -> tuple[Any, ...]:
        return _as_tuple(registered.compute(*inputs, **attrs))

    def forward(*inputs: Any) -> tuple[tuple[Any, ...], Any]:
        outputs = run(*inputs)
        return outputs, (inputs, outputs)

    def backward(saved: Any, cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
        inputs, outputs = saved
        given = _as_tuple(grad(inputs, outputs, cotangents, dict(attrs)))
        if len(given) != len(inputs):
            raise ValueError(f"the gradient of custom op {registered.domain}.{registered.name} "
                             f"gave {len(given)} gradients for {len(inputs)} inputs; give one "
                             f"per input (None for none).")
        return tuple(jnp.zeros_like(x) if g is None else jnp.asarray(g, x.dtype).reshape(x.shape)
                     for x, g in zip(inputs, given, strict=True))

    run.defvjp(forward, backward)
    return run


def custom_entry(domain: str, op_type: str) -> Op | None:
    """The table entry for a registered custom op (None when none is registered)."""
    registered = custom_op(domain, op_type, None)
    if registered is None:
        return None

    def compute(ctx: Ctx, *inputs: Any) -> tuple[Any, ...]:
        attrs = dict(ctx.attrs)
        if registered.gradient is not None:
            return _with_gradient(registered, attrs)(*inputs)
        return _as_tuple(registered.compute(*inputs, **attrs))

    return Op(compute)
