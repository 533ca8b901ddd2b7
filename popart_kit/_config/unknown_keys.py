"""Unknown keys of a typed section, reported with every other problem and a "did you mean".

pydantic alone reports an unknown key as a bare "Extra inputs are not permitted", and a model that
has one never runs its rules, so one typo hides every other mistake. :func:`split_unknown` takes
the unknown keys out of the data (in nested sections too) before validation, and returns them as
:class:`Problem` objects whose fix names the closest field (or PopART option) when one is close.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from .._base.problems import Problem
from ..errors import short
from . import catalog

__all__ = ["split_unknown", "did_you_mean", "unknown_keyword_message", "RULE"]

RULE = "K-unknown-key"


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


# Names users bring from other frameworks, which no spelling distance finds.
_SYNONYMS = {"lr": "learning_rate", "eps": "epsilon", "beta1": "beta1", "betas": "beta1",
             "batch_size": "micro_batch_size", "replication_factor": "replication",
             "gradient_accumulation": "accumulation", "ipus": "ipus_per_replica"}


def did_you_mean(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The candidates closest to ``name`` (ignoring case, ``_`` and ``-``), best first."""
    candidates = list(candidates)
    if len(name) > 100:  # no field is that long; matching would only cost time
        return []
    synonym = _SYNONYMS.get(name.lower())
    if synonym in candidates:
        return [synonym]
    by_norm = {}
    for c in candidates:
        by_norm.setdefault(_norm(c), c)
    exact = by_norm.get(_norm(name))
    if exact is not None:
        return [exact]
    close = difflib.get_close_matches(_norm(name), list(by_norm), n=n, cutoff=0.6)
    return [by_norm[c] for c in close]


def _fields(model: type) -> dict[str, Any]:
    return dict(model.model_fields)


def _accepted(model: type) -> set[str]:
    names = set(model.model_fields)
    names |= set(getattr(model, "_ACCEPTED_ALIASES", ()))
    return names


def _section_type(annotation: Any) -> type | None:
    """The pydantic model class of a section field (``Replication``, ...), else None."""
    from pydantic import BaseModel

    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _unknown_problem(model: type, prefix: str, key: Any, value: Any) -> Problem:
    name = key if isinstance(key, str) else repr(key)
    fields = sorted(_accepted(model))
    close = did_you_mean(name, fields) if isinstance(key, str) else []
    where = f"{prefix}{name}"
    owner = prefix.rstrip(".") or model.__name__
    popart = _popart_hint(name) if not prefix and isinstance(key, str) else ""
    if popart and (popart[1] or not close):
        fix = popart[0]
    elif close:
        fix = f"did you mean {' or '.join(f'{prefix}{c}' for c in close)}?"
    else:
        fix = f"remove it, or use one of the fields of {owner}: {', '.join(fields)}."
    return Problem(where, f"{short(name)} is not a field of {owner}.", fix, RULE,
                   involved={where: value})


def _popart_hint(name: str) -> tuple[str, bool] | tuple[()]:
    """For a top-level key that is (close to) a PopART SessionOptions name: where it goes, and
    whether the name is exactly PopART's."""
    if name in catalog.CONTROLLED_OPTIONS:
        field = catalog.CONTROLLED_OPTIONS[name]
        return f"PopART's {name} is set by the typed field {field}.", True
    if name in catalog.ELSEWHERE:
        return f"PopART's {name} is set by {catalog.ELSEWHERE[name]}.", True
    close = did_you_mean(name, catalog.OPTIONS, n=2)
    if close:
        return (f"a PopART SessionOptions attribute goes in popart_options: did you mean "
                f"{' or '.join(f'popart_options.{c}' for c in close)}?", close[0] == name)
    return ()


def split_unknown(model: type, data: Mapping[str, Any], prefix: str = "",
                  nested: bool = True) -> tuple[dict[str, Any], list[Problem]]:
    """``data`` without the keys ``model`` does not accept (recursively into section fields
    when ``nested``), and one :class:`Problem` per key taken out."""
    accepted, fields = _accepted(model), _fields(model)
    clean: dict[str, Any] = {}
    problems: list[Problem] = []
    for key, value in data.items():
        if key not in accepted:
            problems.append(_unknown_problem(model, prefix, key, value))
            continue
        section = _section_type(fields[key].annotation) if key in fields and nested else None
        if section is not None and isinstance(value, Mapping) and (
                section.model_config.get("extra") == "forbid"):
            value, inner = split_unknown(section, value, f"{prefix}{key}.", nested)
            problems += inner
        clean[key] = value
    return clean, problems


def unknown_keyword_message(owner: str, unknown: list[str], accepted: list[str]) -> str:
    """``owner() got unexpected keyword argument(s)`` with a suggestion for each."""
    parts = []
    for name in unknown:
        close = did_you_mean(name, accepted)
        parts.append(f"{short(name)}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    return (f"{owner}: unknown keyword argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(parts)}. Fix: use the keywords {owner} accepts: {', '.join(accepted)}. "
            f"See docs/rules.md#{RULE}.")


def checked_keywords(init: Any) -> Any:
    """Wrap ``__init__`` so that unknown keyword arguments raise the kit's
    :class:`~popart_kit.errors.ConfigTypeError` (a ``TypeError``) with a "did you mean" for each,
    instead of Python's bare TypeError. ``inspect.signature`` and ``help`` keep showing the
    original signature (``__wrapped__``)."""
    import functools

    params = list(inspect.signature(init).parameters.values())[1:]
    accepted = [p.name for p in params
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in accepted]
        if unknown:
            from ..errors import ConfigTypeError

            raise ConfigTypeError(unknown_keyword_message(type(self).__name__, unknown, accepted),
                                  rule=RULE)
        init(self, *args, **kwargs)

    return wrapper
