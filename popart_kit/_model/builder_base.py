"""What the Builder's modules share: its error, its attribute scopes, the check on names, and
pybind11's choice among PopART's overloads. Below ``builder`` and ``builder_settings``, which
both import it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..errors import ModelError, ModelTypeError, PopartException, short

__all__ = ["BuilderError", "Scope", "debug_name", "overload", "signature", "is_str", "is_count"]


class BuilderError(PopartException):
    """A model-building mistake PopART's Builder also refuses (a ``popart.popart_exception``
    in the drop-in, as PopART raises it)."""


class Scope:
    """A context manager that pushes an attribute value for the nodes a builder creates inside
    it (``builder._scopes``: attribute -> stack of values)."""

    def __init__(self, builder: Any, attribute: str, value: Any) -> None:
        self._builder, self._attribute, self._value = builder, attribute, value

    def __enter__(self) -> Scope:
        self._builder._scopes.setdefault(self._attribute, []).append(self._value)
        return self

    def __exit__(self, *exc: object) -> None:
        self._builder._scopes[self._attribute].pop()


def debug_name(value: Any, what: str) -> str:
    """``value`` as a debug context or name scope: text that encodes as UTF-8, as ONNX names
    must; anything else is refused here, at the call, not when the model is serialised."""
    if not isinstance(value, str):
        raise ModelTypeError(f"{what} must be text, got {type(value).__name__} {short(value)}. "
                             f"Fix: pass a name such as 'layer0'.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ModelError(f"{what} {short(value)} cannot name ONNX tensors or nodes: a lone "
                         f"surrogate at position {err.start} is not UTF-8. Fix: pass text "
                         f"without surrogates (decode bytes with errors='replace').") from None
    return value


def overload(method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             *overloads: tuple[inspect.Signature, dict[str, Callable[[Any], bool]]]
             ) -> dict[str, Any]:
    """The arguments of the first overload that binds and whose argument checks pass, as
    pybind11 picks among PopART's overloads; TypeError listing them when none does."""
    for sig, checks in overloads:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        if all(check(bound.arguments[name]) for name, check in checks.items()):
            return dict(bound.arguments)
    shown = "; ".join(f"{method}{sig}" for sig, _ in overloads)
    raise TypeError(f"{method}(): no overload takes these arguments. PopART's: {shown}")


def signature(*names: str, **defaults: Any) -> inspect.Signature:
    """A signature of positional-or-keyword parameters ``names``, with ``defaults``."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(n, kind, default=defaults[n]) if n in defaults
                              else inspect.Parameter(n, kind) for n in names])


def is_str(v: Any) -> bool:
    return isinstance(v, str)


def is_count(v: Any) -> bool:
    """An integer argument (not a bool), as pybind11 takes one."""
    return not isinstance(v, bool) and hasattr(v, "__index__")
