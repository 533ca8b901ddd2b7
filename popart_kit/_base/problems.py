"""Problems found in a configuration, and how they reach the user.

A rule returns :class:`Problem` objects instead of raising, so that every violated rule can be
reported in one error. Errors become one :class:`~popart_kit.errors.Invalid` (a ``ValueError``
and a pydantic ``ValidationError``) whose entries carry the field location and the rule id;
warnings become :class:`PopartKitWarning`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import pydantic
import pydantic_core
from pydantic import ValidationError

from ..errors import Invalid, InvalidConfig, InvalidData, InvalidModel

__all__ = ["Problem", "PopartKitWarning", "raise_errors", "emit_warnings", "warn",
           "popart_vector",
           "popart_rules", "under_popart_rules", "user_stacklevel"]


class PopartKitWarning(UserWarning):
    """A configuration PopART accepts but that rarely does what its author wants."""


@dataclass(frozen=True)
class Problem:
    """One violated rule: where (a dotted field path), what (with the numbers) and the fix.

    ``involved`` maps every field the rule read to its value, so the error shows the numbers.
    ``rule`` is a short id: ``V<n>`` for a check PopART itself makes, ``K-...`` for a rule
    popart_kit adds.
    """

    loc: str | tuple[str, ...]  # a dotted field path, or parts that may contain dots
    message: str
    fix: str
    rule: str
    severity: Literal["error", "warning"] = "error"
    involved: dict[str, Any] = field(default_factory=dict)
    #: PopART's own message for this refusal, where the rule mirrors a PopART check whose
    #: text programs (and PopART's tests) match on: ``popart_kit.popart`` raises it verbatim.
    popart: str = ""

    @property
    def value(self) -> Any:
        """The value at ``loc`` when the rule recorded it, else everything it read."""
        loc = self.dotted
        for name, value in self.involved.items():
            if name == loc or name.endswith("." + loc):
                return value
        return self.involved

    @property
    def dotted(self) -> str:
        return self.loc if isinstance(self.loc, str) else ".".join(map(str, self.loc))

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.loc.split(".")) if isinstance(self.loc, str) else self.loc

    def text(self) -> str:
        return f"{self.message} Fix: {self.fix}"

    @property
    def docs(self) -> str:
        """Where the rule is explained: its entry in the repository's rules reference."""
        return f"docs/rules.md#{self.rule}"

    def __str__(self) -> str:
        return f"{self.dotted}: {self.text()} [{self.rule}] (see {self.docs})"


# Which error class a title's problems raise when the caller does not say.
_KIND_OF_TITLE: tuple[tuple[str, type[Invalid]], ...] = (
    ("StepIOFactory", InvalidData), ("write_weights", InvalidData), ("run", InvalidData),
    ("PipelineLayout", InvalidModel), ("model", InvalidModel), ("XlaBackend", InvalidModel),
    ("PopartBackend", InvalidModel), ("TrainingSession", InvalidModel),
)


def _kind(title: str) -> type[Invalid]:
    return next((k for prefix, k in _KIND_OF_TITLE if title.startswith(prefix)), InvalidConfig)


_POPART_RULES: contextvars.ContextVar[bool] = contextvars.ContextVar("popart_rules",
                                                                    default=False)


@contextlib.contextmanager
def popart_rules() -> Iterator[None]:
    """Within this block only PopART's refusals are errors: a problem of a kit rule that
    refuses what PopART runs (``rule_docs.POPART_RUNS``) is a warning (what
    ``popart_kit.popart`` gives a PopART program)."""
    token = _POPART_RULES.set(True)
    try:
        yield
    finally:
        _POPART_RULES.reset(token)


def under_popart_rules() -> bool:
    """Whether the caller runs within :func:`popart_rules`."""
    return _POPART_RULES.get()


def raise_errors(title: str, problems: Iterable[Problem],
                 also: ValidationError | None = None,
                 error: type[Invalid] | None = None) -> None:
    """Raise one :class:`~popart_kit.errors.Invalid` (of class ``error``, by default chosen from
    ``title``) listing every error in ``problems`` after those of ``also`` (an error pydantic
    raised); with no error in ``problems``, do nothing. Under :func:`popart_rules` the errors
    of rules PopART does not have are warned instead."""
    problems = list(problems)
    if _POPART_RULES.get():
        from .rule_docs import POPART_RUNS

        relaxed = [p for p in problems if p.severity == "error" and p.rule in POPART_RUNS]
        emit_warnings([replace(p, severity="warning") for p in relaxed])
        problems = [p for p in problems if p not in relaxed]
    entries = [("popart_kit." + p.rule, p.parts, f"{p.text()} (see {p.docs})", p.value,
                p.popart) for p in problems if p.severity == "error"]
    if entries and also is not None:
        entries = [(e["type"], e["loc"], e["msg"], e.get("input"))
                   for e in also.errors(include_url=False)] + entries
    if entries:
        raise (error or _kind(title)).of(title, entries)  # PopART's texts when all have one


def emit_warnings(problems: Iterable[Problem], stacklevel: int | None = None) -> None:
    """Warn once per warning problem, attributed to the user's line (see :func:`warn`)."""
    for p in problems:
        if p.severity == "warning":
            warn(str(p), stacklevel=stacklevel)


_INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (pydantic, pydantic_core))
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # popart_kit/


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside popart_kit (and pydantic, which runs the
    kit's validators), counted from the function that calls :func:`warnings.warn`."""
    frame, level = sys._getframe(2), 2  # the caller of warn(): stacklevel 2
    while frame is not None and (frame.f_code.co_filename.startswith((_PACKAGE, *_INTERNAL))
                                 or frame.f_code.co_filename.startswith("<frozen")):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, category: type[Warning] = PopartKitWarning,
         stacklevel: int | None = None) -> None:
    """``warnings.warn`` attributed to the first frame outside popart_kit (the user's code),
    whatever the depth of the kit's call stack; ``stacklevel`` overrides it."""
    warnings.warn(message, category, stacklevel=stacklevel or user_stacklevel())


def popart_vector(items: Iterable[Any]) -> str:
    """A vector or set as PopART's messages print it (util.hpp appendSequence): ``[a b c]``."""
    return "[" + " ".join(str(i) for i in items) + "]"
