"""Problems found in a configuration, and how they reach the user.

A rule returns :class:`Problem` objects instead of raising, so that every violated rule can be
reported in one error. Errors become one pydantic ``ValidationError`` (a ``ValueError``) whose
entries carry the field location; warnings become :class:`PopartKitWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = ["Problem", "PopartKitWarning", "raise_errors", "emit_warnings"]


class PopartKitWarning(UserWarning):
    """A configuration PopART accepts but that rarely does what its author wants."""


@dataclass(frozen=True)
class Problem:
    """One violated rule: where (a dotted field path), what (with the numbers) and the fix.

    ``involved`` maps every field the rule read to its value, so the error shows the numbers.
    ``rule`` is a short id: ``V<n>`` for a PopART rule (see shared/reference), ``K-...`` for a
    rule popart_kit adds.
    """

    loc: str | tuple[str, ...]  # a dotted field path, or parts that may contain dots
    message: str
    fix: str
    rule: str
    severity: Literal["error", "warning"] = "error"
    involved: dict[str, Any] = field(default_factory=dict)

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
        return self.loc if isinstance(self.loc, str) else ".".join(self.loc)

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.loc.split(".")) if isinstance(self.loc, str) else self.loc

    def text(self) -> str:
        return f"{self.message} Fix: {self.fix}"

    def __str__(self) -> str:
        return f"{self.dotted}: {self.text()} [{self.rule}]"


def raise_errors(title: str, problems: Iterable[Problem],
                 also: ValidationError | None = None) -> None:
    """Raise one ValidationError listing every error in ``problems`` after those of ``also``
    (an error pydantic raised); with no error in ``problems``, do nothing."""
    details = [
        InitErrorDetails(
            type=PydanticCustomError("popart_kit." + p.rule, "{text}", {"text": p.text()}),
            loc=p.parts,
            input=p.value,
        )
        for p in problems
        if p.severity == "error"
    ]
    if details and also is not None:
        details = [InitErrorDetails(type=PydanticCustomError(e["type"], "{text}",
                                                             {"text": e["msg"]}),
                                    loc=e["loc"], input=e.get("input"))
                   for e in also.errors()] + details
    if details:
        raise ValidationError.from_exception_data(title, details)


def emit_warnings(problems: Iterable[Problem], stacklevel: int = 2) -> None:
    for p in problems:
        if p.severity == "warning":
            warnings.warn(str(p), PopartKitWarning, stacklevel=stacklevel + 1)
