"""A strict recorder of PopART's Python API, built only from ``popart_api.json``.

This is not a permissive fake: every attribute, enum member, struct field and keyword argument
must exist in the manifest (written from PopART's own sources), and every value assigned must have
the manifest's type, with pybind11's conversion rules:

* ``bool`` accepts only ``bool``; ``int`` accepts ``int`` but not ``bool``; ``float`` accepts
  ``int`` or ``float`` (and reads back a ``float``); ``str`` accepts ``str``.
* ``enum:X`` accepts only members of ``X`` (not their names, not members of another enum).
* ``struct:X`` accepts only instances of the struct class ``X``.
* ``map[str,str]`` / ``dict[str,int]`` / ``dict[str,struct:X]`` need a ``dict`` with those key and
  value types; ``list[...]`` needs a ``list``; ``set[...]`` needs a ``set``.
* ``other:...`` types are not checked.

Like pybind11, containers (maps, lists, sets) are copied on assignment and on reading, so an
in-place edit of ``opts.bufferingDepthMap`` is lost; nested structs are handed back by reference
(``def_readwrite``), so ``opts.executionPhaseSettings.phases = 2`` persists. Where PopART's
``__init__.py`` re-exposes an underscore binding as a Python property (``engineOptions`` over
``_engineOptions``, ...), the property returns a ``dict`` subclass that writes itself back on
``__setitem__``, as PopART's ``DictWrapper`` does.

Every ``setattr`` on a ``SessionOptions`` (and on every struct) is recorded, in order, in
:func:`set_log`.

``PyStepIO`` and ``PyStepIOCallback`` take exactly the manifest's constructor parameters
(positionally or by keyword, as pybind11 binds them) and check what pybind11 and PopART's
constructors check; :func:`stepio_arrays` and :func:`stepio_callbacks` read back what they hold.
:func:`first_run_check` is PopART's first ``Session.run`` check of a PyStepIO (element counts,
dtypes), and :func:`simulate_run` drives a PyStepIOCallback as PopART's StepIOSplitter does
(shared/reference/popart-stepio-builder.md §1.1, §1.5, §3).
"""

from __future__ import annotations

import json
import math
import random
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MANIFEST", "BROKEN_OPTIONS", "make_popart_module", "set_log", "to_plain",
           "check_value", "EnumMember", "DeviceCall", "stepio_arrays", "stepio_callbacks",
           "first_run_check", "simulate_run", "SimulatedRun"]

MANIFEST: dict[str, Any] = json.loads(
    (Path(__file__).with_name("popart_api.json")).read_text(encoding="utf-8"))

# Listed in the manifest but broken in PopART itself (access raises AttributeError).
BROKEN_OPTIONS = frozenset({"updatableBuffers"})


# -- enums ------------------------------------------------------------------------------------


class EnumMember:
    """One member of a PopART (pybind11) enum: compares and hashes by identity."""

    __slots__ = ("_enum", "_name", "_value")

    def __init__(self, enum: str, name: str, value: int) -> None:
        object.__setattr__(self, "_enum", enum)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_value", value)

    @property
    def name(self) -> str:
        return self._name

    @property
    def value(self) -> int:
        return self._value

    def __int__(self) -> int:
        return self._value

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{self!r} is read-only")

    def __repr__(self) -> str:
        return f"<{self._enum}.{self._name}: {self._value}>"

    def __str__(self) -> str:
        return f"{self._enum}.{self._name}"

    def __reduce__(self):  # pragma: no cover - deep copies keep identity
        raise TypeError("enum members are singletons")

    def __copy__(self) -> EnumMember:
        return self

    def __deepcopy__(self, memo: dict) -> EnumMember:
        return self


class _EnumMeta(type):
    def __setattr__(cls, key: str, value: Any) -> None:
        raise AttributeError(f"cannot set {key!r} on enum {cls.__name__}")

    def __iter__(cls):
        return iter(cls.__members__.values())

    def __len__(cls) -> int:
        return len(cls.__members__)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], int) \
                and not isinstance(args[0], bool):
            for member in cls.__members__.values():
                if member.value == args[0]:
                    return member
            raise ValueError(f"{args[0]} is not a value of {cls.__name__}")
        raise TypeError(f"{cls.__name__}() takes one int value")


def _make_enum(name: str, members: list[str]) -> type:
    values = {m: EnumMember(name, m, i) for i, m in enumerate(members)}
    namespace = dict(values)
    namespace["__members__"] = types.MappingProxyType(dict(values))
    namespace["__module__"] = "popart"
    return _EnumMeta(name, (), namespace)


# -- values -----------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _inner(type_: str) -> str:
    return type_[type_.index("[") + 1:-1]


def _dict_value_type(type_: str) -> str:
    # "dict[str,int]" -> "int", "dict[str,struct:X]" -> "struct:X", "map[str,str]" -> "str"
    return _inner(type_).split(",", 1)[1]


def check_value(popart: Any, type_: str, value: Any, where: str) -> Any:
    """The value PopART would store for ``value`` of manifest type ``type_``, or TypeError."""

    def bad(expected: str) -> TypeError:
        return TypeError(f"{where}: incompatible type {type(value).__name__} ({value!r}); "
                         f"PopART expects {expected} ({type_})")

    if type_.startswith("other:"):
        return value
    if type_ == "bool":
        if not isinstance(value, bool):
            raise bad("a bool")
        return value
    if type_ == "int":
        if not _is_int(value):
            raise bad("an int")
        return value
    if type_ == "float":
        if not (_is_int(value) or isinstance(value, float)):
            raise bad("a float")
        return float(value)
    if type_ == "str":
        if not isinstance(value, str):
            raise bad("a str")
        return value
    if type_.startswith("enum:"):
        enum = getattr(popart, type_[5:])
        if not isinstance(value, EnumMember) or enum.__members__.get(value.name) is not value:
            raise bad(f"a member of popart.{type_[5:]}")
        return value
    if type_.startswith("struct:"):
        cls = getattr(popart, type_[7:])
        if not isinstance(value, cls):
            raise bad(f"a popart.{type_[7:]}")
        return value._copy()  # pybind copies the struct into the C++ member
    if type_.startswith(("map[", "dict[")):
        if not isinstance(value, dict):
            raise bad("a dict")
        value_type = _dict_value_type(type_)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise bad("str keys")
            out[k] = check_value(popart, value_type, v, f"{where}[{k!r}]")
        return out
    if type_.startswith("list["):
        if not isinstance(value, list):
            raise bad("a list")
        return [check_value(popart, _inner(type_), v, f"{where}[{i}]")
                for i, v in enumerate(value)]
    if type_.startswith("set["):
        if not isinstance(value, (set, frozenset)):
            raise bad("a set")
        return {check_value(popart, _inner(type_), v, f"{where} item") for v in value}
    raise AssertionError(f"unknown manifest type {type_!r}")  # pragma: no cover


def _copy_out(value: Any) -> Any:
    """What reading a member gives: containers are copies (pybind11 STL casters)."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    if isinstance(value, set):
        return set(value)
    return value


def _from_default(popart: Any, type_: str, default: Any) -> Any:
    """A manifest default (plain JSON) as the PopART object it stands for."""
    if type_.startswith("other:"):
        return json.loads(json.dumps(default))
    if type_.startswith("enum:"):
        return getattr(getattr(popart, type_[5:]), default)
    if type_.startswith("struct:"):
        obj = getattr(popart, type_[7:])()
        fields = MANIFEST["structs"][type_[7:]]["fields"]
        for key, v in default.items():
            obj._values[key] = _from_default(popart, fields[key], v)
        return obj
    if type_.startswith("set["):
        return {_from_default(popart, _inner(type_), v) for v in default}
    if type_.startswith("list["):
        return [_from_default(popart, _inner(type_), v) for v in default]
    if type_.startswith(("map[", "dict[")):
        vt = _dict_value_type(type_)
        return {k: _from_default(popart, vt, v) for k, v in default.items()}
    return default


def to_plain(type_: str, value: Any) -> Any:
    """A PopART object as plain data: member names, sorted lists for sets, dicts for structs."""
    if type_.startswith("other:"):
        return value
    if type_.startswith("enum:"):
        assert isinstance(value, EnumMember), value
        return value.name
    if type_.startswith("struct:"):
        fields = MANIFEST["structs"][type_[7:]]["fields"]
        return {k: to_plain(t, getattr(value, k)) for k, t in fields.items()}
    if type_.startswith("set["):
        return sorted(to_plain(_inner(type_), v) for v in value)
    if type_.startswith("list["):
        return [to_plain(_inner(type_), v) for v in value]
    if type_.startswith(("map[", "dict[")):
        vt = _dict_value_type(type_)
        return {k: to_plain(vt, v) for k, v in value.items()}
    return value


class _DictWrapper(dict):
    """PopART's ``DictWrapper``: a dict copy that writes itself back when an item is set."""

    def __init__(self, update: Any, *args: Any) -> None:
        self._update = update
        super().__init__(*args)

    def __setitem__(self, name: str, value: Any) -> None:
        dict.__setitem__(self, name, value)
        self._update(dict(self))


# -- records ----------------------------------------------------------------------------------


class _Recorded:
    """Base of SessionOptions and structs: a fixed attribute set with typed, logged setattr."""

    __slots__ = ("_values", "_log", "_popart")
    _TYPES: dict[str, str] = {}
    _PROPERTIES: dict[str, str] = {}  # Python property name -> underlying binding
    _KIND = "object"

    def __getattr__(self, name: str) -> Any:
        # only called when normal lookup fails: slots, methods and properties come first
        if name in type(self)._PROPERTIES:
            target = type(self)._PROPERTIES[name]
            return _DictWrapper(lambda v: setattr(self, name, v), getattr(self, target))
        try:
            values = object.__getattribute__(self, "_values")
        except AttributeError:  # pragma: no cover - during construction
            raise AttributeError(name) from None
        if name not in values:
            raise AttributeError(
                f"'{type(self).__name__}' {self._KIND} has no attribute {name!r}")
        return _copy_out(values[name])

    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        target = cls._PROPERTIES.get(name, name)
        if target not in cls._TYPES or name in BROKEN_OPTIONS:
            raise AttributeError(
                f"'{cls.__name__}' {self._KIND} has no attribute {name!r}")
        stored = check_value(self._popart, cls._TYPES[target], value,
                             f"{cls.__name__}.{name}")
        self._values[target] = stored
        self._log.append((name, stored))

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete {name!r}")

    def _copy(self) -> Any:
        new = object.__new__(type(self))
        object.__setattr__(new, "_popart", self._popart)
        object.__setattr__(new, "_log", [])
        object.__setattr__(new, "_values", {
            k: (v._copy() if isinstance(v, _Recorded) else _copy_out(v))
            for k, v in self._values.items()})
        return new

    def __dir__(self) -> list[str]:
        return sorted(set(self._TYPES) | set(self._PROPERTIES) | set(dir(type(self))))

    def __repr__(self) -> str:
        return f"<strict popart.{type(self).__name__}>"


def _properties(names: dict[str, str]) -> dict[str, str]:
    """``name`` -> ``_name`` where both are listed: PopART's Python properties over bindings."""
    return {n: "_" + n for n in names if not n.startswith("_") and "_" + n in names}


def _make_struct(popart: Any, name: str, spec: dict[str, Any]) -> type:
    fields: dict[str, str] = spec["fields"]
    props = _properties(fields)
    ctors = [c for c in spec.get("ctor", [[]]) if all(a in fields for a in c)]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_popart", popart)
        object.__setattr__(self, "_log", [])
        object.__setattr__(self, "_values", {})
        for key, type_ in fields.items():
            if key not in props:
                self._values[key] = _from_default(popart, type_, spec["defaults"][key])
        if args or kwargs:
            names = next((c for c in ctors if len(c) == len(args) + len(kwargs)
                          and set(kwargs) <= set(c[len(args):])), None)
            if names is None:
                raise TypeError(f"{name}(): no constructor takes {len(args)} positional and "
                                f"keywords {sorted(kwargs)}; constructors: {spec.get('ctor')}")
            for key, v in list(zip(names, args, strict=False)) + list(kwargs.items()):
                setattr(self, key, v)
            self._log.clear()

    cls = type(name, (_Recorded,), {
        "__slots__": (), "__init__": __init__, "__module__": "popart",
        "_TYPES": {k: v for k, v in fields.items() if k not in props},
        "_PROPERTIES": props, "_KIND": "object"})
    return cls


def _make_session_options(popart: Any) -> type:
    options = {k: v for k, v in MANIFEST["session_options"].items() if k not in BROKEN_OPTIONS}
    props = _properties(options)
    types_ = {k: v["type"] for k, v in options.items() if k not in props}

    def __init__(self) -> None:
        object.__setattr__(self, "_popart", popart)
        object.__setattr__(self, "_log", [])
        object.__setattr__(self, "_values", {
            k: _from_default(popart, t, options[k]["default"]) for k, t in types_.items()})

    def enableExplicitIR(self, enable: bool) -> None:  # noqa: N802 - PopART's name
        if not isinstance(enable, bool):
            raise TypeError("enableExplicitIR(): expects a bool")
        for key in ("useHostCopyOps", "enableExplicitMainLoops", "explicitRecomputation"):
            setattr(self, key, enable)

    def getGlobalReplicationFactor(self) -> int:  # noqa: N802 - PopART's name
        v = self._values
        return v["globalReplicationFactor"] if v["enableDistributedReplicatedGraphs"] \
            else v["replicatedGraphCount"]

    methods = {"enableExplicitIR": enableExplicitIR,
               "getGlobalReplicationFactor": getGlobalReplicationFactor}
    assert set(MANIFEST["session_options_methods"]) <= set(methods)
    return type("SessionOptions", (_Recorded,), {
        "__slots__": (), "__init__": __init__, "__module__": "popart", **methods,
        "_TYPES": types_, "_PROPERTIES": props, "_KIND": "object"})


def set_log(obj: Any) -> list[tuple[str, Any]]:
    """Every ``setattr`` made on a recorded SessionOptions or struct: ``(name, stored value)``."""
    return list(object.__getattribute__(obj, "_log"))


# -- DeviceManager ----------------------------------------------------------------------------


class DeviceCall:
    """What a DeviceManager method was called with (the device it would return)."""

    def __init__(self, method: str, kwargs: dict[str, Any]) -> None:
        self.method = method
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"<DeviceCall {self.method}({self.kwargs})>"


_PARAM_TYPES = {"numIpus": "int", "tilesPerIpu": "int", "tilesPerIPU": "int", "id": "int",
                "attachTimeout": "int", "opts": "map[str,str]", "arg0": "map[str,str]"}


def _param_type(method: dict[str, Any], param: str) -> str:
    default = method["defaults"].get(param)
    if isinstance(default, str) and "." in default:
        return "enum:" + default.split(".", 1)[0]
    return _PARAM_TYPES[param]


def _make_device_manager(popart: Any) -> type:
    def make(method_name: str, spec: dict[str, Any]) -> Any:
        params: list[str] = spec["params"]
        positional_only = spec.get("positional_only", False)

        def method(self, *args: Any, **kwargs: Any) -> DeviceCall:
            if positional_only and kwargs:
                raise TypeError(f"{method_name}(): takes positional arguments only "
                                f"(got keywords {sorted(kwargs)})")
            if len(args) > len(params):
                raise TypeError(f"{method_name}(): takes at most {len(params)} arguments")
            given = dict(zip(params, args, strict=False))
            for key, value in kwargs.items():
                if key not in params:
                    raise TypeError(f"{method_name}(): unexpected keyword argument {key!r}; "
                                    f"PopART's parameters are {params}")
                if key in given:
                    raise TypeError(f"{method_name}(): got multiple values for {key!r}")
                given[key] = value
            missing = [p for p in params if p not in given and p not in spec["defaults"]]
            if missing:
                raise TypeError(f"{method_name}(): missing arguments {missing}")
            checked = {k: check_value(popart, _param_type(spec, k), v, f"{method_name}({k}=)")
                       for k, v in given.items()}
            call = DeviceCall(method_name, checked)
            self.calls.append(call)
            return call

        method.__name__ = method_name
        return method

    def __init__(self) -> None:
        self.calls = []

    namespace = {"__init__": __init__, "__module__": "popart"}
    namespace.update({name: make(name, spec) for name, spec in MANIFEST["device_manager"].items()})
    return type("DeviceManager", (), namespace)


# -- PyStepIO / PyStepIOCallback ---------------------------------------------------------------


def _bind(cls_name: str, params: list[str], args: tuple, kwargs: dict[str, Any]
          ) -> dict[str, Any]:
    """pybind11's argument matching for ``py::arg`` names without defaults."""
    if len(args) > len(params):
        raise TypeError(f"{cls_name}(): takes {len(params)} arguments ({len(args)} given); "
                        f"PopART's parameters are {params}")
    given = dict(zip(params, args, strict=False))
    for key, value in kwargs.items():
        if key not in params:
            raise TypeError(f"{cls_name}(): unexpected keyword argument {key!r}; "
                            f"PopART's parameters are {params}")
        if key in given:
            raise TypeError(f"{cls_name}(): got multiple values for {key!r}")
        given[key] = value
    missing = [p for p in params if p not in given]
    if missing:
        raise TypeError(f"{cls_name}(): missing arguments {missing}")
    return given


def _array_map(where: str, value: Any) -> dict[str, np.ndarray]:
    """pybind11's ``std::map<std::string, py::array>`` caster: a dict of str -> ndarray, copied
    (the arrays themselves are shared, not copied)."""
    if not isinstance(value, dict):
        raise TypeError(f"{where}: incompatible type {type(value).__name__}; PopART expects a "
                        f"dict of str -> numpy.ndarray")
    for k, v in value.items():
        if not isinstance(k, str):
            raise TypeError(f"{where}: key {k!r} is not a str")
        if not isinstance(v, np.ndarray):
            raise TypeError(f"{where}[{k!r}]: incompatible type {type(v).__name__}; PopART "
                            f"expects a numpy.ndarray")
    return dict(value)


def _contiguity_error(kind: str, name: str) -> RuntimeError:
    return RuntimeError(f"PyStepIO is unable to use the numpy {kind} array for tensor '{name}' "
                        f"as it is not c-contiguous (a data conversion here could have a "
                        f"significant impact on performance and hence is not allowed)")


def _make_pystepio(popart: Any) -> type:
    spec = MANIFEST["classes"]["PyStepIO"]
    params: list[str] = spec["ctor"][0]
    assert len(spec["ctor"]) == 1 and len(params) == 2, spec

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = _bind("PyStepIO", params, args, kwargs)
        inputs = _array_map(f"PyStepIO({params[0]}=)", given[params[0]])
        outputs = _array_map(f"PyStepIO({params[1]}=)", given[params[1]])
        for kind, arrays in (("input", inputs), ("output", outputs)):
            for name, array in arrays.items():
                if not array.flags.c_contiguous:
                    raise _contiguity_error(kind, name)
        object.__setattr__(self, "_inputs", inputs)
        object.__setattr__(self, "_outputs", outputs)
        object.__setattr__(self, "_runtime_asserts", True)

    def enableRuntimeAsserts(self, enable: bool) -> None:  # noqa: N802 - PopART's name
        if not isinstance(enable, bool):
            raise TypeError("enableRuntimeAsserts(): incompatible argument; PopART expects a bool")
        object.__setattr__(self, "_runtime_asserts", enable)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"'PyStepIO' object has no attribute {name!r}")

    methods = {"enableRuntimeAsserts": enableRuntimeAsserts}
    assert set(spec["methods"]) == set(methods), spec["methods"]
    return type("PyStepIO", (), {
        "__slots__": ("_inputs", "_outputs", "_runtime_asserts"), "__init__": __init__,
        "__setattr__": __setattr__, "__module__": "popart", **methods})


def _make_pystepio_callback(popart: Any) -> type:
    spec = MANIFEST["classes"]["PyStepIOCallback"]
    params: list[str] = spec["ctor"][0]
    assert len(spec["ctor"]) == 1 and len(params) == 4 and not spec["methods"], spec

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = _bind("PyStepIOCallback", params, args, kwargs)
        for key in params:
            if not callable(given[key]):
                raise TypeError(f"PyStepIOCallback({key}=): incompatible type "
                                f"{type(given[key]).__name__}; PopART expects a callable")
        object.__setattr__(self, "_callbacks", {k: given[k] for k in params})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"'PyStepIOCallback' object has no attribute {name!r}")

    return type("PyStepIOCallback", (), {
        "__slots__": ("_callbacks",), "__init__": __init__, "__setattr__": __setattr__,
        "__module__": "popart"})


def stepio_arrays(stepio: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The ``(inputs, outputs)`` dicts a recorded PyStepIO holds (the caller's array objects)."""
    return (dict(object.__getattribute__(stepio, "_inputs")),
            dict(object.__getattribute__(stepio, "_outputs")))


def stepio_callbacks(stepio: Any) -> dict[str, Any]:
    """The four callables a recorded PyStepIOCallback holds, by PopART's parameter names."""
    return dict(object.__getattribute__(stepio, "_callbacks"))


def _shape(shape: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def first_run_check(stepio: Any, inputs: dict[str, tuple], anchors: dict[str, tuple], *,
                    R: int, bps: int, A: int) -> None:  # noqa: N803 - the reference's names
    """What PopART checks of a PyStepIO on the first ``Session.run`` (reference §1.1, §1.5, §2.1).

    ``inputs``: the graph's stream inputs ``{name: (S, dtype, broadcast)}``; ``anchors``:
    ``{name: (S, dtype, fetches_per_replica)}``. Runtime error (as PopART) on an unknown or
    missing name; when ``enableRuntimeAsserts`` is on (the default), on an element count other
    than ``nelms(S)*A*bps*(1 if broadcast else R)`` (inputs) or ``nelms(S)*R*fetches`` (anchors);
    and on a dtype other than the tensor's (host int64 into an int32 input is converted).
    """
    given_in, given_out = stepio_arrays(stepio)
    asserts = object.__getattribute__(stepio, "_runtime_asserts")
    for name, array in given_in.items():
        if name not in inputs:
            raise RuntimeError(f"The tensor '{name}' has been provided as one of the inputs to "
                               f"the stepIO, but it is not registered as one of the inputs to "
                               f"the model.")
        shape, dtype, broadcast = inputs[name]
        expected = math.prod(_shape(shape)) * A * bps * (1 if broadcast else R)
        if asserts and array.size != expected:
            raise RuntimeError(
                f"Unexpected number of input elements for Tensor {name}. Expected {expected}, "
                f"but received {array.size}.\nTo disable this check at your own risk, use "
                f"IStepIO::enableRuntimeAsserts.\nreplication  factor = {R}\naccumulation "
                f"factor = {A}\nbatches per step = {bps}\nTensor nelms = "
                f"{math.prod(_shape(shape))}")
        want = np.dtype(dtype)
        if array.dtype != want and not (want == np.int32 and array.dtype == np.int64):
            raise RuntimeError(f"Type discrepancy for tensor {name}. User provided : "
                               f"{array.dtype} and expected : {want}")
    for name, array in given_out.items():
        if name not in anchors:
            raise RuntimeError(f"Testing that the buffer provided by user for output Tensor "
                               f"{name} has the correct number of elements, But there is no "
                               f"anchor named {name}.")
        shape, dtype, fetches = anchors[name]
        expected = math.prod(_shape(shape)) * R * fetches
        if asserts and array.size != expected:
            raise RuntimeError(f"Unexpected number of output elements for Tensor {name}. "
                               f"Expected {expected}, but received {array.size}.")
        if array.dtype != np.dtype(dtype):
            raise RuntimeError(f"Type discrepancy for tensor {name}. User provided : "
                               f"{array.dtype} and expected : {np.dtype(dtype)}")
    for name in inputs:
        if name not in given_in:
            raise RuntimeError(f"No tensor {name} provided in PyStepIO's inputs")
    for name in anchors:
        if name not in given_out:
            raise RuntimeError(f"No tensor {name} provided in PyStepIO's outputs")


@dataclass
class SimulatedRun:
    """One simulated run: per input, copies of the micro-batches fed (in call order); per anchor,
    the values written (in call order); and every callback call as ``(callback, name, ...)``."""

    fed: dict[str, list[np.ndarray]] = field(default_factory=dict)
    written: dict[str, list[np.ndarray]] = field(default_factory=dict)
    calls: list[tuple] = field(default_factory=list)


def _check_buffer(kind: str, name: str, array: Any, shape: tuple[int, ...], dtype: np.dtype
                  ) -> None:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{kind} callback for {name!r} returned a {type(array).__name__}, "
                        f"not a numpy array")
    if not array.flags.c_contiguous:
        raise _contiguity_error(kind, name)
    if kind == "input" and array.ndim == 0:
        # PyStepIOCallback.in(): "If a None object has been returned ndim will be 0"
        raise RuntimeError(f"[StepIOSplitter] IStepIO unexpectedly did not provide input data "
                           f"for tensor {name} (a 0-d array means no data; a scalar tensor "
                           f"must come as shape (1,))")
    nelms = math.prod(shape)
    if array.size != nelms:
        raise RuntimeError(f"{kind} callback for {name!r} returned {array.size} elements "
                           f"(shape {array.shape}); one micro-batch of one replica is "
                           f"nelms(S={shape}) = {nelms} (PopART would copy that many bytes)")
    if array.dtype != dtype:
        raise RuntimeError(f"Type discrepancy for tensor {name}. User provided : {array.dtype} "
                           f"and expected : {dtype} (the callback path copies raw bytes)")


def simulate_run(callback_stepio: Any, inputs: dict[str, tuple], anchors: dict[str, tuple], *,
                 R: int, bps: int, A: int, seed: int = 0,  # noqa: N803
                 prefetch_rate: float = 0.3) -> SimulatedRun:
    """Drive a recorded PyStepIOCallback through one run as PopART's StepIOSplitter does.

    ``inputs``: ``{name: (S, dtype, broadcast)}``; ``anchors``: ``{name: (S, dtype,
    fetches_per_replica)}``. For each of the bps*A micro-batches: every input gets R successful
    ``input_callback(name, False)`` calls in replica order (one with Broadcast), each followed by
    ``input_complete_callback(name)``; with probability ``prefetch_rate`` a call is preceded by
    ``input_callback(name, True)``, whose "no data" answer (None or a 0-d array) is allowed and
    whose data, if any, is taken as that buffer. Anchors returning ``f`` buffers per replica are
    fetched (R ``output_callback`` calls in replica order, each followed by
    ``output_complete_callback``) after micro-batches ``T/f - 1, 2T/f - 1, ...`` (T = bps*A),
    and a distinct known value, ``k*nelms(S) + arange(nelms(S)) + 1`` for the k-th call, is
    written into each returned array in place. Every returned array is checked: a C-contiguous
    numpy array of exactly nelms(S) elements of the tensor's own dtype (no conversion), and, for
    inputs, not 0-d.
    """
    cbs = stepio_callbacks(callback_stepio)
    inp, inp_done = cbs["input_callback"], cbs["input_complete_callback"]
    out, out_done = cbs["output_callback"], cbs["output_complete_callback"]
    rng = random.Random(seed)
    run = SimulatedRun({n: [] for n in inputs}, {n: [] for n in anchors})
    total = bps * A
    for name, (_, _, fetches) in anchors.items():
        if fetches < 1 or total % fetches:
            raise ValueError(f"anchor {name!r}: {fetches} fetches per replica do not divide "
                             f"bps*A = {total}")
    for step in range(total):
        for name, (shape, dtype, broadcast) in inputs.items():
            shape, dtype = _shape(shape), np.dtype(dtype)
            for _ in range(1 if broadcast else R):
                array = None
                if rng.random() < prefetch_rate:
                    array = inp(name, True)
                    run.calls.append(("input", name, True))
                    if array is None or (isinstance(array, np.ndarray) and array.ndim == 0):
                        array = None
                if array is None:
                    array = inp(name, False)
                    run.calls.append(("input", name, False))
                    if array is None:
                        raise RuntimeError(f"[StepIOSplitter] IStepIO unexpectedly did not "
                                           f"provide input data for tensor {name}")
                _check_buffer("input", name, array, shape, dtype)
                run.fed[name].append(array.copy())  # PopART copies the bytes out
                inp_done(name)
                run.calls.append(("input_complete", name))
        for name, (shape, dtype, fetches) in anchors.items():
            if (step + 1) % (total // fetches):
                continue
            shape, dtype = _shape(shape), np.dtype(dtype)
            nelms = math.prod(shape)
            for _ in range(R):
                array = out(name)
                run.calls.append(("output", name))
                _check_buffer("output", name, array, shape, dtype)
                k = len(run.written[name])
                value = (np.arange(nelms) + k * nelms + 1).astype(dtype)
                if not np.array_equal(value.astype(np.int64), np.arange(nelms) + k * nelms + 1):
                    raise ValueError(f"anchor {name!r}: {k * nelms + nelms} values are not "
                                     f"exact in {dtype}; use smaller runs")
                array.reshape(-1)[...] = value  # contiguous: reshape(-1) is a view
                run.written[name].append(value.reshape(shape))
                out_done(name)
                run.calls.append(("output_complete", name))
    return run


# -- the module -------------------------------------------------------------------------------


def make_popart_module() -> types.ModuleType:
    """A fresh module-like ``popart`` with the manifest's enums, structs, SessionOptions,
    DeviceManager, PyStepIO and PyStepIOCallback (each call builds new classes, so logs never
    leak between tests)."""
    popart = types.ModuleType("popart", "strict recorder of PopART's Python API "
                                        "(tests/contract/popart_api.json)")
    popart.__file__ = __file__
    for name, members in MANIFEST["enums"].items():
        setattr(popart, name, _make_enum(name, members))
    for name, spec in MANIFEST["structs"].items():
        setattr(popart, name, _make_struct(popart, name, spec))
    popart.SessionOptions = _make_session_options(popart)
    popart.DeviceManager = _make_device_manager(popart)
    popart.PyStepIO = _make_pystepio(popart)
    popart.PyStepIOCallback = _make_pystepio_callback(popart)
    return popart
