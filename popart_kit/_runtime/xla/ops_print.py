"""ai.graphcore PrintTensor: its input printed to stderr as the step runs, and its gradient.

PopART's PrintTensorOpx (popx/op/printtensorx.cpp) adds poplar's PrintTensor program: a line
``<title>: <values>`` on stderr, the title being the op's ``title`` or else its input's id,
the values formatted as poplar's default PrintTensorFmt does (numpy's layout: integers padded
to a common width, ``[ 6  9 12]``; floating point fixed with 7 decimals, ``[1.0000000
2.0000000]``; over 1000 elements summarised by their 3 edge items). With ``print_gradient``
(default 1) its grad op (op/printtensor.cpp, getGradOps) prints the gradient flowing back
under ``<title>_gradient``, or PopART's gradient prefix + the input's id without a title.
The output is the input, unchanged.

Printing is ``jax.debug.callback``: once per micro-batch and replica each time the step runs
(not when it is compiled), in the order the program runs them.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.names import GRADIENT_PREFIX
from .ops import GRAPHCORE, Ctx, op

__all__ = ["poplar_text"]


def poplar_text(title: str, value: Any) -> str:
    """``title: values`` as poplar's PrintTensor writes them by default."""
    a = np.asarray(value)
    if np.issubdtype(a.dtype, np.floating) or a.dtype.kind == "V" or a.dtype.name == "bfloat16":
        text = np.array2string(a.astype(np.float32), precision=7, floatmode="fixed",
                               separator=" ", threshold=1000, edgeitems=3)
    else:
        text = np.array2string(a, separator=" ", threshold=1000, edgeitems=3)
    return f"{title}: {text}"


def _print(title: str, value: Any) -> None:
    print(poplar_text(title, value), file=sys.stderr, flush=True)


def _show(title: str, value: Any) -> None:
    jax.debug.callback(functools.partial(_print, title), value)


@op("PrintTensor", domain=GRAPHCORE)
def popart_print_tensor(ctx: Ctx, x: Any) -> Any:
    """Print ``x`` (and, with print_gradient, its gradient); return it unchanged."""
    title = ctx.attr("title", "") or ""
    name = title or ctx.inputs[0]
    if not ctx.attr("print_gradient", 1) or not jnp.issubdtype(x.dtype, jnp.inexact):
        _show(name, x)
        return x
    gradient = f"{title}_gradient" if title else GRADIENT_PREFIX + ctx.inputs[0]

    @jax.custom_vjp
    def printed(v: Any) -> Any:
        _show(name, v)
        return v

    def forward(v: Any) -> tuple[Any, None]:
        _show(name, v)
        return v, None

    def backward(_: None, g: Any) -> tuple[Any]:
        _show(gradient, g)
        return (g,)

    printed.defvjp(forward, backward)
    return printed(x)
