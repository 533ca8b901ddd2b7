"""The kit's exceptions: one tree, so ``except pk.PopartKitError`` catches every refusal but
the Builder's, which are PopART's own ``popart_exception`` (``PopartException``).

::

    ValueError
    ├── PopartException           PopART's popart_exception (the drop-in's errors, and the
    │                             Builder's BuilderError)
    └── PopartKitError            anything the kit refuses; ``.rules`` holds the rule ids
        ├── ConfigError           a configuration: SessionConfig, its sections, config files,
        │   │                     POPDIST_* variables, optimizer settings, session arguments
        │   └── ConfigTypeError   an argument of the wrong type (also a TypeError)
        ├── ModelError            an ONNX model: checker and graph problems, stage annotations,
        │   │                     what a backend cannot lower
        │   └── ModelTypeError    not a model at all (also a TypeError)
        ├── DataError             host data: arrays, samples, index ranges, values a cast changes
        │   ├── DataTypeError     data of the wrong type (also a TypeError)
        │   └── NonFiniteUpdate   a training run met NaN or Inf; none of its updates applied
        ├── FileWriteError        a file the kit could not write (also an OSError); the old
        │                         file is left as it was
        ├── SessionClosedError    a session used after close()
        └── Invalid               a list of violated rules, pydantic-style (also a pydantic
            │                     ``ValidationError``: ``.errors()``, ``type=popart_kit.<rule>``)
            ├── InvalidConfig     (also a ConfigError)
            ├── InvalidModel      (also a ModelError)
            └── InvalidData       (also a DataError)

Two errors come while a run goes rather than from checking its input, and leave the session as
it was: ``NonFiniteUpdate`` (a loss or update was NaN or Inf) and ``StageWorkerError`` (also a
RuntimeError: a pipeline stage's worker process failed, died or fell silent).

Messages quote values through :func:`short`, so an error about a huge or deeply nested value stays
small and quick to print.
"""

from __future__ import annotations

import reprlib
from typing import Any

from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

__all__ = ["PopartKitError", "ConfigError", "ModelError", "DataError", "ConfigTypeError",
           "ModelTypeError", "DataTypeError", "Invalid", "InvalidConfig", "InvalidModel",
           "InvalidData", "FileWriteError", "SessionClosedError", "NonFiniteUpdate",
           "PopartException", "short", "clip"]


class PopartException(ValueError):
    """PopART's own exception, ``popart.popart_exception`` in ``popart_kit.popart``: what the
    drop-in raises, and what the Builder's refusals are (its ``BuilderError``), as PopART's
    Builder raises popart_exception. A ValueError. It shows itself by PopART's name."""


PopartException.__name__ = PopartException.__qualname__ = "popart_exception"


class PopartKitError(ValueError):
    """Something the kit refused. ``rule`` (when known) is the id of the violated rule."""

    rule: str | None = None

    def __init__(self, *args: Any, rule: str | None = None) -> None:
        super().__init__(*args)
        if rule is not None:
            self.rule = rule

    @property
    def rules(self) -> tuple[str, ...]:
        """Ids of every violated rule this error reports."""
        return (self.rule,) if self.rule else ()


class ConfigError(PopartKitError):
    """A configuration the kit refuses (SessionConfig, files, POPDIST_*, optimizer settings)."""


class ModelError(PopartKitError):
    """An ONNX model the kit refuses (invalid graph, annotations, ops a backend cannot run)."""


class DataError(PopartKitError):
    """Host data the kit refuses (wrong type, shape, dtype, range, or a value a cast changes)."""


class NonFiniteUpdate(DataError):
    """A training run met a non-finite loss or gradient; none of its updates were applied
    (the weights and optimizer state are as before the run)."""

    rule = "K-nonfinite-update"


class ConfigTypeError(ConfigError, TypeError):
    """A configuration argument of the wrong type (a dict where a SessionConfig belongs, ...)."""


class ModelTypeError(ModelError, TypeError):
    """Something given as a model that is not one (not a ModelProto, bytes or a path)."""


class DataTypeError(DataError, TypeError):
    """Host data of the wrong type (a list where an array belongs, a non-string name, ...)."""


class FileWriteError(PopartKitError, OSError):
    """A file the kit could not write (full disk, no permission, a directory in the way). Files
    are replaced whole or not at all, so the previous file is still there, unchanged."""

    def __init__(self, message: str, *, rule: str | None = None, errno: int | None = None) -> None:
        super().__init__(message, rule=rule)
        self.errno = errno


class SessionClosedError(PopartKitError):
    """A session used after ``close()`` (or after its ``with`` block): it holds nothing to run
    with any more."""

    rule = "K-session-closed"


class Invalid(PopartKitError, ValidationError):
    """Every violated rule at once, as a pydantic ValidationError whose entries have the type
    ``popart_kit.<rule id>``. Make one with :meth:`of` (never directly)."""

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(e["type"].removeprefix("popart_kit.") for e in self.errors()
                     if e["type"].startswith("popart_kit."))

    #: PopART's own message for what was refused, when every entry mirrors a PopART check
    #: that has one (``popart_kit.popart`` raises it instead of the kit's text).
    popart_text: str | None = None

    @classmethod
    def of(cls, title: str, entries: list[tuple]) -> Invalid:
        """An error of this class from ``(type, loc, message, value)`` entries, each with
        PopART's own message as an optional fifth item (kept in the entry's ``ctx`` as
        ``popart``, so it survives pydantic re-raising the error from a validator); when every
        entry has one, they are the error's :attr:`popart_text`."""
        details, texts = [], []
        for kind, loc, text, value, *popart in entries:
            ctx = {"text": text, **({"popart": popart[0]} if popart and popart[0] else {})}
            texts.append(ctx.get("popart"))
            details.append(InitErrorDetails(type=PydanticCustomError(kind, "{text}", ctx),
                                            loc=tuple(loc), input=shortened(value)))
        err = cls.from_exception_data(title, details)
        if texts and all(texts):
            err.popart_text = "\n".join(texts)
        return err

    @staticmethod
    def _entries(err: ValidationError) -> list[tuple]:
        return [(e["type"], e["loc"], e["msg"], e.get("input"),
                 (e.get("ctx") or {}).get("popart", "")) for e in err.errors(include_url=False)]

    @classmethod
    def wrap(cls, err: ValidationError) -> Invalid:
        """``err`` (pydantic's) as this class, every entry, type, location and PopART text
        kept."""
        if isinstance(err, cls):
            return err
        return cls.of(err.title, cls._entries(err))

    @classmethod
    def wrap_titled(cls, err: ValidationError, title: str) -> Invalid:
        """``err`` as this class under another title (e.g. the file the values came from)."""
        return cls.of(title, cls._entries(err))


class InvalidConfig(ConfigError, Invalid):
    """Every problem of a configuration at once."""


class InvalidModel(ModelError, Invalid):
    """Every problem of a model at once."""


class InvalidData(DataError, Invalid):
    """Every problem of some host data at once."""


# -- bounded quoting -----------------------------------------------------------------------------

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 6
_REPR.maxlong = 40


def _big_int(value: int) -> str | None:
    bits = value.bit_length()
    if bits <= 128:
        return None
    return f"{'-' if value < 0 else ''}<an integer of {bits} bits, about 2**{bits - 1}>"


def short(value: Any, limit: int = 120) -> str:
    """``repr(value)`` bounded in length, depth and item count, whatever ``value`` holds
    (shared or cyclic references, huge integers, deep nesting); never raises."""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            big = _big_int(value)
            if big:
                return big
        text = _REPR.repr(value)
    except Exception:  # a broken __repr__, or an int too long to print
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _repr_int(self: reprlib.Repr, x: int, level: int) -> str:
    return _big_int(x) or reprlib.Repr.repr_int(self, x, level)


_REPR.repr_int = _repr_int.__get__(_REPR)  # type: ignore[method-assign]


def clip(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis marks the cut)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def shortened(value: Any) -> Any:
    """``value`` itself when it prints short, else its bounded repr (for error entries)."""
    if value is None or isinstance(value, bool | float) or (
            isinstance(value, int) and value.bit_length() <= 128):
        return value
    if isinstance(value, str) and len(value) <= 120:
        return value
    return short(value)
