"""popart.SessionOptions: every attribute PopART has (from the kit's option catalog), settable
as in PopART, and its conversion to a SessionConfig."""

from __future__ import annotations

import datetime
import os
import sys
import types
import warnings
from typing import Any

from .._config import catalog
from ._core import ENUMS


def _neutral(type_: str) -> Any:
    """A field's value before PopART's defaults are laid over it."""
    if type_.startswith("enum:"):
        return next(iter(ENUMS[type_[5:]]))
    if type_.startswith("struct:"):
        return STRUCTS[type_[7:]]()
    return {"bool": False, "int": 0, "float": 0.0, "str": ""}.get(
        type_, [] if type_.startswith(("list[", "set[")) else
        {} if type_.startswith(("map[", "dict[")) else None)


class _Struct:
    """A settings struct (ExecutionPhaseSettings, TensorLocationSettings, ...): its fields
    only. Positional arguments follow one of PopART's constructor forms (``_ctors``, else the
    fields in order); a form's name that is not a field sets that field of a struct field
    (TensorLocationSettings(storage, ...) sets location.storage)."""

    _fields: dict[str, str] = {}
    _ctors: list[list[str]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name, type_ in self._fields.items():
            object.__setattr__(self, name, _neutral(type_))
        for name, value in zip(self._form(args), args, strict=False):
            self._set(name, value)
        for name, value in kwargs.items():
            setattr(self, name, value)

    @classmethod
    def _form(cls, args: tuple[Any, ...]) -> list[str]:
        """The constructor form ``args`` fit: of those as long, the first whose enum and
        struct arguments have their types (else the first, whose check names the field)."""
        forms = [f for f in cls._ctors if len(f) == len(args)] or [list(cls._fields)]
        for form in forms:
            if all(cls._fits(name, value) for name, value in zip(form, args, strict=False)):
                return form
        return forms[0]

    @classmethod
    def _fits(cls, name: str, value: Any) -> bool:
        type_ = cls._fields.get(name) or next(
            (STRUCTS[t[7:]]._fields[name] for t in cls._fields.values()
             if t.startswith("struct:") and name in STRUCTS[t[7:]]._fields), "other")
        try:
            _checked(type_, value, name)
        except TypeError:
            return False
        return True

    def _set(self, name: str, value: Any) -> None:
        if name in self._fields:
            setattr(self, name, value)
            return
        for field, type_ in self._fields.items():  # a field of one of its struct fields
            if type_.startswith("struct:") and name in STRUCTS[type_[7:]]._fields:
                setattr(getattr(self, field), name, value)
                return
        setattr(self, name, value)  # refused, naming the fields

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            raise AttributeError(f"'popart.{type(self).__name__}' has no field {name!r}; its "
                                 f"fields are {', '.join(self._fields)}.")
        object.__setattr__(self, name, _checked(self._fields[name], value,
                                                f"{type(self).__name__}.{name}"))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._fields)
        return f"{type(self).__name__}({fields})"


STRUCTS: dict[str, type[_Struct]] = {
    name: type(name, (_Struct,), {"_fields": fields,
                                  "_ctors": catalog.STRUCT_CTORS.get(name, [])})
    for name, fields in catalog.STRUCTS.items()}

# The namespace catalog conversions look enum and struct classes up in.
_NS = types.SimpleNamespace(**ENUMS, **STRUCTS)


def _checked(type_: str, value: Any, where: str) -> Any:
    """``value`` as PopART's binding would take it for ``type_``, or TypeError naming it."""
    if type_.startswith("enum:"):
        enum = ENUMS[type_[5:]]
        if not isinstance(value, enum):
            raise TypeError(f"{where} takes a popart.{type_[5:]} member "
                            f"({', '.join(m.name for m in enum)}), got {value!r}.")
        return value
    if type_.startswith("struct:"):
        struct = STRUCTS.get(type_[7:])
        if struct is not None and not isinstance(value, struct):
            raise TypeError(f"{where} takes a popart.{type_[7:]}, got {value!r}.")
        return value
    if type_.startswith("set[") and isinstance(value, set | frozenset | list | tuple):
        inner = type_[4:-1]
        return {_checked(inner, v, where) for v in value}
    if type_.startswith("list[") and isinstance(value, list | tuple):
        inner = type_[5:-1]
        return [_checked(inner, v, where) for v in value]
    if type_.startswith(("other", "dict[str,struct")):
        return value
    problem = catalog._value_problem(type_, value)
    if problem:
        raise TypeError(f"{where} = {value!r}: {problem}.")
    return float(value) if type_ == "float" else value


def _popart_value(type_: str, plain: Any) -> Any:
    """A catalog default (plain data) as this module's objects."""
    if type_.startswith("struct:") and isinstance(plain, dict):
        struct = STRUCTS[type_[7:]]()
        for key, value in plain.items():
            object.__setattr__(struct, key, _popart_value(struct._fields.get(key, "other"),
                                                          value))
        return struct
    if type_.startswith("dict[str,struct"):
        return dict(plain)
    if type_.startswith("other"):
        return plain
    return catalog._to_popart(_NS, type_, plain)


def _log_warning(message: str) -> None:
    """A line as PopART's logging::warn writes it to stderr (its default sink and level)."""
    stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    print(f"{stamp} {os.getpid()} PO:CORE     [W] {message}", file=sys.stderr, flush=True)


class SessionOptions:
    """popart.SessionOptions: every attribute of PopART's, with PopART's defaults and types
    (enum members, settings structs, dicts of strings). A session converts them through
    ``SessionConfig.from_session_options``, which reports every problem at once."""

    def __init__(self) -> None:
        for name, type_ in catalog.OPTIONS.items():
            object.__setattr__(self, name, _popart_value(type_, catalog.DEFAULTS.get(name)))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in catalog.DEPRECATED:
            # popart.cpp:1493-1522: the alias's setter logs PopART's warning (on stderr)
            _log_warning(f"The session option {name} has been deprecated and will be removed "
                         f"in a future release. Please use the alias "
                         f"{catalog.DEPRECATED[name]} instead.")
            warnings.warn(f"SessionOptions.{name} is deprecated; use "
                          f"{catalog.DEPRECATED[name]}.", DeprecationWarning, stacklevel=2)
            name = catalog.DEPRECATED[name]
        if name not in catalog.OPTIONS:
            raise AttributeError(f"'popart.SessionOptions' object has no attribute {name!r}")
        object.__setattr__(self, name, _checked(catalog.OPTIONS[name], value,
                                                f"SessionOptions.{name}"))

    def __getattr__(self, name: str) -> Any:
        if name in catalog.DEPRECATED:
            return getattr(self, catalog.DEPRECATED[name])
        raise AttributeError(f"'popart.SessionOptions' object has no attribute {name!r}")

    def enableExplicitIR(self, enable: bool) -> None:
        """PopART's switch (sessionoptions.hpp): host copy ops, explicit main loops and
        explicit recomputation together."""
        self.useHostCopyOps = enable
        self.enableExplicitMainLoops = enable
        self.explicitRecomputation = enable

    def getGlobalReplicationFactor(self) -> int:
        if self.enableDistributedReplicatedGraphs:
            return self.globalReplicationFactor
        return self.replicatedGraphCount if self.enableReplicatedGraphs else 1

    def changed(self) -> dict[str, Any]:
        """The options that differ from PopART's defaults, as plain data (member names,
        lists, dicts) - what ``SessionConfig.from_session_options`` reads."""
        out = {}
        for name in catalog.OPTIONS:
            value = getattr(self, name)
            if catalog.OPTIONS[name].startswith("dict[str,struct"):
                if value:
                    out[name] = value  # refused by the config's type check, by name
                continue
            plain = catalog.plain(name, value)
            if plain != catalog.DEFAULTS.get(name):
                out[name] = plain
        return out
