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
(PopART's stepio.cpp, stepiosplitter.cpp and session.py).

``AnchorReturnType``, ``DataFlow`` and ``PyWeightsIO`` take the manifest's constructor overloads
(resolved as pybind11 does) and raise PopART's constructor errors (willow/src/dataflow.cpp,
popart.cpp PyWeightsIO) as ``popart.popart_exception``. ``InferenceSession`` takes exactly the
manifest's constructor parameters, parses ``fnModel`` as ONNX, and models prepareDevice,
weightsFromHost/ToHost, readWeights/writeWeights (with ``constantWeights``), run (PopART's
first-run size check, then a known pattern, :func:`run_pattern`, written into every anchor) and
modelToHost on host arrays; the manifest's other methods raise NotImplementedError.
:func:`session_record` tells what a session was given and asked, in order;
:func:`created_sessions` lists the sessions a module made. DeviceManager calls are checked as
devicemanager.cpp checks them (power of two, ``Never``, host device options) and each returned
:class:`DeviceCall` records its method, its arguments and the device's type and IPU count.

``SGD``, ``ConstSGD`` (an SGD) and ``Adam`` take the manifest's constructor parameters and
PopART's values dict ``{"defaultLearningRate": (value, isConst), ...}`` with only the keys
PopART's ``getComplete`` accepts, and raise PopART's value checks; :func:`optimizer_record` tells
what one was made with and the complete ``(value, isConst)`` map PopART holds (float32 values).
``TrainingSession`` takes the manifest's constructor parameters (``loss`` a scalar tensor of the
model made by an op, ``optimizer`` one of these optimizers) and behaves as ``InferenceSession``
(weights always variables; each run leaves :func:`trained_pattern` in the device's weights),
plus ``updateOptimizerFromHost`` (PopART's ``validReplacement`` rules) and ``setRandomSeed``
(a uint64; a no-op, as in PopART, without random ops or stochastic rounding), both recorded in
:class:`SessionRecord`.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MANIFEST", "BROKEN_OPTIONS", "make_popart_module", "set_log", "to_plain",
           "option_mismatches",
           "check_value", "EnumMember", "DeviceCall", "stepio_arrays", "stepio_callbacks",
           "first_run_check", "simulate_run", "SimulatedRun", "weights_io_arrays",
           "SessionRecord", "session_record", "created_sessions", "run_pattern",
           "OptimizerRecord", "optimizer_record", "trained_pattern", "RANDOM_OPS"]

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


def _make_enum(name: str, members: list[str], cpp_values: dict[str, int] | None = None) -> type:
    """Members in binding order; ``value`` is the C++ value where ``cpp_values`` gives it (the
    enum's declaration order may differ from the binding's), else the binding position."""
    values = {m: EnumMember(name, m, (cpp_values or {}).get(m, i))
              for i, m in enumerate(members)}
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
    """What a DeviceManager method was called with (the device it would return).

    ``method``: the DeviceManager method; ``kwargs``: every argument given, by PopART's parameter
    name, as PopART stored it; ``args`` / ``keywords``: exactly as the caller passed them
    (positionally / by keyword); ``manager``: the DeviceManager that made it. ``num_ipus``,
    ``device_type`` (a ``DeviceType`` member) and ``connection_type`` (a
    ``DeviceConnectionType`` member) are what PopART's DeviceInfo would report (``num_ipus`` is
    None where only a real device could tell).
    """

    def __init__(self, method: str, kwargs: dict[str, Any], args: tuple = (),
                 keywords: dict[str, Any] | None = None, manager: Any = None,
                 num_ipus: int | None = None, device_type: Any = None,
                 connection_type: Any = None) -> None:
        self.method = method
        self.kwargs = kwargs
        self.args = tuple(args)
        self.keywords = dict(keywords or {})
        self.manager = manager
        self.num_ipus = num_ipus
        self.device_type = device_type
        self.connection_type = connection_type

    def __repr__(self) -> str:
        return f"<DeviceCall {self.method}({self.kwargs})>"


_PARAM_TYPES = {"numIpus": "int", "tilesPerIpu": "int", "tilesPerIPU": "int", "id": "int",
                "attachTimeout": "int", "opts": "map[str,str]", "arg0": "map[str,str]"}


def _param_type(method: dict[str, Any], param: str) -> str:
    default = method["defaults"].get(param)
    if isinstance(default, str) and "." in default:
        return "enum:" + default.split(".", 1)[0]
    return _PARAM_TYPES[param]


# Host devices (popart: willow/src/popx/devicexmanager.cpp, DevicexManager::createHostDevice):
# the option keys each accepts, and the syncPattern strings of devicemanager.cpp
# syncPatternFromString.
_HOST_DEVICE_OPTIONS = {
    "createIpuModelDevice": ("IpuModel", ("numIPUs", "tilesPerIPU", "compileIPUCode",
                                          "ipuVersion")),
    "createOfflineIPUDevice": ("OfflineIpu", ("numIPUs", "tilesPerIPU", "ipuVersion",
                                              "syncPattern", "gatewayMode")),
}
_SYNC_PATTERN_STRINGS = {"full": "Full", "singlePipeline": "SinglePipeline",
                         "replicaAndLadder": "ReplicaAndLadder"}


def _stoi(popart: Any, method: str, key: str, value: str) -> int:
    """``std::stoi`` of a host device option (a leading integer, else an exception)."""
    digits = value.strip()
    end = 1 if digits[:1] in "+-" else 0
    while end < len(digits) and digits[end].isdigit():
        end += 1
    if end == 0 or not digits[:end].lstrip("+-"):
        raise popart.popart_exception(f"{method}: option {key}={value!r} is not an integer "
                                      f"(std::stoi: invalid_argument)")
    return int(digits[:end])


def _device_facts(popart: Any, method: str, spec: dict[str, Any], given: dict[str, Any]
                  ) -> dict[str, Any]:
    """PopART's checks of a DeviceManager call (devicemanager.cpp, devicexmanager.cpp), and what
    the device it returns would report."""
    def default(param: str) -> Any:
        if param in given:
            return given[param]
        value = spec["defaults"][param]
        if isinstance(value, str) and "." in value:  # "SyncPattern.Full"
            enum, member = value.split(".", 1)
            return getattr(getattr(popart, enum), member)
        return value

    if method in ("acquireAvailableDevice", "tryAcquireAvailableDevice"):
        num = default("numIpus")
        if num > 0 and num & (num - 1):
            raise popart.popart_exception(
                f"You have attempted to acquire {num} IPUs. The number of IPUs requested must "
                f"be a power of two")
        if default("connectionType") is popart.DeviceConnectionType.Never:
            raise popart.popart_exception(
                "Trying to acquire a hardware device when connectionType is "
                "DeviceConnectionType::Never")
        return {"num_ipus": num, "device_type": popart.DeviceType.Ipu,
                "connection_type": default("connectionType")}
    if method in ("acquireDeviceById", "tryAcquireDeviceById"):
        if default("connectionType") is popart.DeviceConnectionType.Never:
            raise popart.popart_exception(
                "Trying to acquire a hardware device when connectionType is "
                "DeviceConnectionType::Never")
        return {"device_type": popart.DeviceType.Ipu, "connection_type": default("connectionType")}
    if method == "createCpuDevice":
        return {"num_ipus": 1, "device_type": popart.DeviceType.Cpu,
                "connection_type": popart.DeviceConnectionType.Always}
    if method in _HOST_DEVICE_OPTIONS:
        type_name, valid = _HOST_DEVICE_OPTIONS[method]
        options = next(iter(given.values()))
        for key in options:
            if key not in valid:
                raise popart.popart_exception(
                    f"Invalid option `{key}' passed to DevicexManager::createHostDevice for "
                    f"device type {type_name}. Valid options are {list(valid)}")
        num = _stoi(popart, method, "numIPUs", options["numIPUs"]) if "numIPUs" in options else 1
        if "tilesPerIPU" in options:
            _stoi(popart, method, "tilesPerIPU", options["tilesPerIPU"])
        connection = popart.DeviceConnectionType.Always
        if method == "createOfflineIPUDevice":
            pattern = options.get("syncPattern", "full")
            if pattern not in _SYNC_PATTERN_STRINGS:
                raise popart.popart_exception(f"Unknown syncPattern setting: {pattern}")
            connection = popart.DeviceConnectionType.Never  # DevicexOfflineIpuInfo
        return {"num_ipus": num, "device_type": getattr(popart.DeviceType, type_name),
                "connection_type": connection}
    return {}


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
            facts = _device_facts(popart, method_name, spec, checked)
            call = DeviceCall(method_name, checked, args, kwargs, self, **facts)
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


# -- exceptions, overloads ---------------------------------------------------------------------


def _make_exceptions(popart: Any) -> None:
    """PopART's Python exceptions (popart.cpp, ``py::exception<popart::error>(m,
    "popart_exception")`` and its two subclasses): a ``popart::error`` thrown in C++ reaches Python
    as ``popart.popart_exception``, which derives from ``Exception`` (not ``RuntimeError``)."""
    base = type("popart_exception", (Exception,), {"__module__": "popart"})
    popart.popart_exception = base
    popart.popart_internal_exception = type("popart_internal_exception", (base,),
                                            {"__module__": "popart"})
    popart.popart_runtime_error = type("popart_runtime_error", (base,), {"__module__": "popart"})


class _NoMatch(Exception):
    pass


def _resolve_overload(cls_name: str, overloads: list[list[str]], defaults: dict[str, Any],
                      checkers: dict[str, Any], args: tuple, kwargs: dict[str, Any]
                      ) -> tuple[int, dict[str, Any]]:
    """pybind11's overload resolution: the first overload whose names take ``args``/``kwargs``
    and whose converters accept every value; ``(index, {param: stored value})`` with defaults
    filled in (``defaults`` holds zero-argument factories), else TypeError."""
    reasons = []
    for index, params in enumerate(overloads):
        try:
            if len(args) > len(params):
                raise _NoMatch(f"takes at most {len(params)} positional arguments")
            given = dict(zip(params, args, strict=False))
            for key, value in kwargs.items():
                if key not in params:
                    raise _NoMatch(f"no parameter {key!r}")
                if key in given:
                    raise _NoMatch(f"multiple values for {key!r}")
                given[key] = value
            missing = [k for k in params if k not in given and k not in defaults]
            if missing:
                raise _NoMatch(f"missing {missing}")
            out = {}
            for key in params:
                if key in given:
                    try:
                        out[key] = checkers[key](given[key], f"{cls_name}({key}=)")
                    except TypeError as err:
                        raise _NoMatch(str(err)) from None
                else:
                    out[key] = defaults[key]()
            return index, out
        except _NoMatch as why:
            reasons.append(f"({', '.join(params)}): {why}")
    raise TypeError(f"{cls_name}(): incompatible arguments ({len(args)} positional, keywords "
                    f"{sorted(kwargs)}). PopART's overloads are:\n  " + "\n  ".join(reasons))


def _ctor_default(popart: Any, text: Any) -> Any:
    """A factory for a manifest ``ctor_defaults`` entry ("TileSet.Compute",
    'AnchorReturnType("All")', "SessionOptions()", None, "inference")."""
    if not isinstance(text, str):
        return lambda: text
    call = re.fullmatch(r"(\w+)\((.*)\)", text)
    if call:
        cls_name, inner = call.groups()
        values = json.loads(f"[{inner}]")
        return lambda: getattr(popart, cls_name)(*values) if hasattr(popart, cls_name) \
            else _Default(text)
    enum = re.fullmatch(r"([A-Z]\w*)\.(\w+)", text)
    if enum:
        return lambda: getattr(getattr(popart, enum.group(1)), enum.group(2))
    return lambda: text


class _Default:
    """A PopART default this recorder has no class for (``InputShapeInfo()``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _checker(popart: Any, type_: str) -> Any:
    return lambda value, where: check_value(popart, type_, value, where)


def _frozen_setattr(cls_name: str) -> Any:
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"'{cls_name}' object has no attribute {name!r}")
    return __setattr__


def _not_implemented(cls_name: str, method: str) -> Any:
    def missing(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"popart.{cls_name}.{method} exists in PopART but the strict "
                                  f"recorder does not implement it")
    missing.__name__ = method
    return missing


# -- AnchorReturnType, DataFlow, PyWeightsIO ---------------------------------------------------


def _make_anchor_return_type(popart: Any) -> type:
    """popart.cpp L721-736 over willow/src/dataflow.cpp L24-77."""
    spec = MANIFEST["classes"]["AnchorReturnType"]
    overloads: list[list[str]] = spec["ctor"]
    assert overloads == [["anchorReturnTypeString", "tileSet", "exchangeStrategy"],
                         ["anchorReturnTypeString", "returnPeriod", "tileSet",
                          "exchangeStrategy"]], overloads
    defaults = {k: _ctor_default(popart, v) for k, v in spec["ctor_defaults"].items()}
    checkers = {"anchorReturnTypeString": _checker(popart, "str"),
                "returnPeriod": _checker(popart, "int"),
                "tileSet": _checker(popart, "enum:TileSet"),
                "exchangeStrategy": _checker(popart, "enum:ExchangeStrategy")}
    ids = {"final": "Final", "everyn": "EveryN", "all": "All", "sum": "Sum"}
    error = "A return period should not be supplied for this anchor return type"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        index, given = _resolve_overload("AnchorReturnType", overloads, defaults, checkers,
                                         args, kwargs)
        string = given["anchorReturnTypeString"]
        member = ids.get(string.lower())  # getIdFromStr runs first, in the member initialiser
        if member is None:
            raise popart.popart_exception(f"Invalid anchor return type ID supplied: {string}")
        period = given.get("returnPeriod", 0)
        if index == 0 and member == "EveryN":
            raise popart.popart_exception("Must specify return period with option 'EVERYN'")
        if index == 1:
            if member != "EveryN":
                raise popart.popart_exception(error)
            if period <= 0:
                raise popart.popart_exception("Anchor return period must be greater than zero")
        object.__setattr__(self, "_string", string)
        object.__setattr__(self, "_id", getattr(popart.AnchorReturnTypeId, member))
        object.__setattr__(self, "_period", period)
        object.__setattr__(self, "_tile_set", given["tileSet"])
        object.__setattr__(self, "_exchange", given["exchangeStrategy"])
        object.__setattr__(self, "_overload", tuple(overloads[index]))
        object.__setattr__(self, "_given", (tuple(args), dict(kwargs)))

    def id(self) -> Any:  # noqa: A003 - PopART's name
        return self._id

    def rp(self) -> int:
        if self._id is not popart.AnchorReturnTypeId.EveryN:
            raise popart.popart_exception(error)
        return self._period

    def tileSet(self) -> Any:  # noqa: N802
        return self._tile_set

    def exchangeStrategy(self) -> Any:  # noqa: N802
        return self._exchange

    def _copy(self) -> Any:
        return self  # immutable from Python: a pybind copy is indistinguishable

    def __repr__(self) -> str:
        return f"<strict popart.AnchorReturnType {self._string!r}" + (
            f", {self._period}>" if self._id.name == "EveryN" else ">")

    methods = {"id": id, "rp": rp, "tileSet": tileSet, "exchangeStrategy": exchangeStrategy}
    assert set(spec["methods"]) == set(methods), spec["methods"]
    return type("AnchorReturnType", (), {
        "__slots__": ("_string", "_id", "_period", "_tile_set", "_exchange", "_overload",
                      "_given"),
        "__init__": __init__, "__setattr__": _frozen_setattr("AnchorReturnType"),
        "__module__": "popart", "_copy": _copy, "__repr__": __repr__, **methods})


def _make_dataflow(popart: Any) -> type:
    """popart.cpp L737-757 over willow/src/dataflow.cpp L133-231 (AnchorReturnTypeMap is a
    ``std::map``: ``anchors()`` lists the ids sorted)."""
    spec = MANIFEST["classes"]["DataFlow"]
    overloads: list[list[str]] = spec["ctor"]
    assert overloads == [["batchesPerStep", "anchorTensors"],
                         ["batchesPerStep", "anchorIds", "anchorReturnType"]], overloads
    defaults = {k: _ctor_default(popart, v) for k, v in spec["ctor_defaults"].items()}

    def anchor_ids(value: Any, where: str) -> list[str]:
        # pybind's std::vector caster: any sequence but str/bytes, of str
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError(f"{where}: incompatible type {type(value).__name__}; PopART "
                            f"expects a list of str")
        return [check_value(popart, "str", v, f"{where}[{i}]") for i, v in enumerate(value)]

    checkers = {"batchesPerStep": _checker(popart, "int"),
                "anchorTensors": _checker(popart, "dict[str,struct:AnchorReturnType]"),
                "anchorIds": anchor_ids,
                "anchorReturnType": _checker(popart, "struct:AnchorReturnType")}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        index, given = _resolve_overload("DataFlow", overloads, defaults, checkers, args, kwargs)
        bps = given["batchesPerStep"]
        anchors = given["anchorTensors"] if index == 0 else {
            a: given["anchorReturnType"] for a in given["anchorIds"]}
        if bps <= 0:
            raise popart.popart_exception("'Batches per step' must be greater than zero")
        for name in sorted(anchors):
            art = anchors[name]
            if art.id() is popart.AnchorReturnTypeId.EveryN:
                if art.rp() > bps:
                    raise popart.popart_exception(
                        "Return period must be <= to the number of batches per step")
                if bps % art.rp():
                    raise popart.popart_exception(
                        "Return period must be a factor of the number of batches per step")
        object.__setattr__(self, "_bps", bps)
        object.__setattr__(self, "_anchors", dict(sorted(anchors.items())))
        object.__setattr__(self, "_overload", tuple(overloads[index]))
        object.__setattr__(self, "_given", (tuple(args), dict(kwargs)))

    def isAnchored(self, id: str) -> bool:  # noqa: N802, A002
        return id in self._anchors

    def nAnchors(self) -> int:  # noqa: N802
        return len(self._anchors)

    def batchesPerStep(self) -> int:  # noqa: N802
        return self._bps

    def anchors(self) -> list[str]:
        return list(self._anchors)

    def art(self, anchorId: str) -> Any:  # noqa: N803
        if anchorId not in self._anchors:
            raise popart.popart_exception(f"Tensor {anchorId} is not an anchor")
        return self._anchors[anchorId]

    def setBatchesPerStep(self, batchesPerStep: int) -> None:  # noqa: N802, N803
        # does not re-validate EveryN periods (dataflow.hpp L325)
        object.__setattr__(self, "_bps", check_value(popart, "int", batchesPerStep,
                                                     "DataFlow.setBatchesPerStep"))

    def _copy(self) -> Any:
        new = object.__new__(type(self))
        for slot in ("_bps", "_anchors", "_overload", "_given"):
            object.__setattr__(new, slot, _copy_out(getattr(self, slot)))
        return new

    methods = {"isAnchored": isAnchored, "nAnchors": nAnchors, "batchesPerStep": batchesPerStep,
               "anchors": anchors, "art": art, "setBatchesPerStep": setBatchesPerStep}
    assert set(spec["methods"]) == set(methods), spec["methods"]
    return type("DataFlow", (), {
        "__slots__": ("_bps", "_anchors", "_overload", "_given"), "__init__": __init__,
        "__setattr__": _frozen_setattr("DataFlow"), "__module__": "popart", "_copy": _copy,
        **methods})


def _make_pyweightsio(popart: Any) -> type:
    """popart.cpp L306-347, L716-718: a map of C-contiguous arrays (shared, not copied)."""
    spec = MANIFEST["classes"]["PyWeightsIO"]
    params: list[str] = spec["ctor"][0]
    assert params == ["weights"] and not spec["methods"], spec

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = _bind("PyWeightsIO", params, args, kwargs)
        weights = _array_map("PyWeightsIO(weights=)", given["weights"])
        for name, array in weights.items():
            if not array.flags.c_contiguous:
                raise popart.popart_exception(
                    f"PyWeightsIO is unable to use the provided numpy output array for tensor "
                    f"'{name}' as it is not c-contiguous. Please use a function like "
                    f"`numpy.ascontiguousarray()` to make contiguous before passing to "
                    f"PyWeightsIO")
        object.__setattr__(self, "_weights", weights)

    return type("PyWeightsIO", (), {
        "__slots__": ("_weights",), "__init__": __init__,
        "__setattr__": _frozen_setattr("PyWeightsIO"), "__module__": "popart"})


def weights_io_arrays(weights_io: Any) -> dict[str, np.ndarray]:
    """The arrays a recorded PyWeightsIO holds (the caller's array objects)."""
    return dict(object.__getattribute__(weights_io, "_weights"))


# -- optimizers --------------------------------------------------------------------------------

# willow/include/popart/adam.hpp: enum class AdamMode { Adam = 0, AdamNoBias, AdaMax, Lamb,
# LambNoBias } (popart.cpp binds them in another order: the manifest's).
_CPP_ENUM_VALUES = {"AdamMode": {"Adam": 0, "AdamNoBias": 1, "AdaMax": 2, "Lamb": 3,
                                 "LambNoBias": 4}}

# Ops whose IR ops are RandomBaseOps (willow/include/popart/op/{dropout,randomnormal,
# randomuniform,shapeddropout}.hpp): RandomSetup::requiresRandomSeed (randomsetup.cpp L854-864).
RANDOM_OPS = frozenset({"Dropout", "ShapedDropout", "RandomNormal", "RandomNormalLike",
                        "RandomUniform", "RandomUniformLike"})


@dataclass
class OptimizerRecord:
    """What a recorded ``popart.SGD`` / ``ConstSGD`` / ``Adam`` was made with.

    ``cls``: its class name; ``type``: PopART's ``Optimizer::type_s()`` ("SGD" for SGD and
    ConstSGD, "Adam"); ``args`` / ``keywords``: the constructor call exactly as made; ``given``:
    every constructor parameter by PopART's name, defaults filled in; ``values``: the complete
    map PopART builds (``getComplete``: every key, the unset ones at the ``getUnset*`` defaults,
    the deprecated ``maxWeightNorm`` folded into ``defaultMaxWeightNorm``), each ``(value,
    isConst)`` with the value as the C++ ``float`` holds it (rounded to float32); ``settings``:
    the other things the C++ object holds that ``validReplacement`` or the Ir read
    (accumulatorAndMomentum, accumType, accl1Type; or mode, weight_decay_mode, accum_type,
    accl1_type, accl2_type, scaled_optimizer_state), as PopART members."""

    cls: str
    type: str
    args: tuple
    keywords: dict[str, Any]
    given: dict[str, Any]
    values: dict[str, tuple[float, bool]]
    settings: dict[str, Any]


def optimizer_record(optimizer: Any) -> OptimizerRecord:
    """The record of a recorded optimizer (a copy: the optimizer is immutable from Python)."""
    rec = object.__getattribute__(optimizer, "_record")
    return OptimizerRecord(rec.cls, rec.type, rec.args, dict(rec.keywords), dict(rec.given),
                           dict(rec.values), dict(rec.settings))


def _f32(value: float) -> float:
    """A Python number as the C++ ``float`` pybind11 stores (then read back as a double)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _make_optimizers(popart: Any) -> type:
    """``popart.SGD``, ``popart.ConstSGD`` (a subclass of SGD) and ``popart.Adam``, with their
    enums (popart.cpp L829-957 over willow/src/{optimizer,sgd,adam}.cpp); returns their base
    (PopART's ``Optimizer``, which the manifest does not list and this module does not expose).

    The values dict is read as ``getOptimizerValueDictionary`` reads it (popart.cpp L113-130):
    ``str`` keys (else popart_exception), ``tuple`` values (else popart_exception) cast to
    ``std::pair<float, bool>`` (else pybind11's cast error, a RuntimeError; ``isConst`` must be a
    ``bool`` here, stricter than pybind11's bool caster). Then ``getComplete`` refuses a key
    PopART does not know, ``Optimizer`` a loss scaling of 0, and ``runValueChecks`` negative
    values, a constant zero learning rate, ... as PopART does."""
    specs = {name: MANIFEST["classes"][name] for name in ("SGD", "ConstSGD", "Adam")}
    for name in ("SGD", "Adam"):
        for enum, members in specs[name]["enums"].items():
            if not hasattr(popart, enum):
                setattr(popart, enum, _make_enum(enum, members, _CPP_ENUM_VALUES.get(enum)))

    def error(message: str) -> Exception:
        return popart.popart_exception(message)

    def values_dict(value: Any, where: str) -> dict[str, tuple[float, bool]]:
        if not isinstance(value, dict):  # py::dict
            raise TypeError(f"{where}: incompatible type {type(value).__name__}; PopART expects "
                            f"a dict of str -> (float, bool)")
        out = {}
        for key, pair in value.items():
            if not isinstance(key, str):
                raise error("A key in the optimizer map input must be a py::str (in "
                            "getOptimizerValueDictionary)")
            if not isinstance(pair, tuple):
                raise error("A value in the optimizer map must be a py::tuple (in "
                            "getOptimizerValueDictionary)")
            if len(pair) != 2 or not (_is_int(pair[0]) or isinstance(pair[0], float)) \
                    or not isinstance(pair[1], bool):
                raise RuntimeError(f"Unable to cast Python instance of type "
                                   f"{type(pair).__name__} {pair!r} to C++ type "
                                   f"'std::pair<float, bool>' ({where}[{key!r}])")
            out[key] = (_f32(pair[0]), pair[1])
        return out

    def clip_norm_settings(value: Any, where: str) -> list:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError(f"{where}: incompatible type {type(value).__name__}; PopART expects "
                            f"a list of popart.ClipNormSettings")
        if value:
            raise TypeError(f"{where}: the strict recorder has no popart.ClipNormSettings; "
                            f"pass [] (PopART's default)")
        return []

    def complete(cls_name: str, given: dict[str, tuple[float, bool]]
                 ) -> dict[str, tuple[float, bool]]:
        """SGD::getComplete / Adam::getComplete over the std::map (sorted keys)."""
        spec = specs[cls_name]
        keys = spec["value_keys"]
        out = {k: (_f32(v), c) for k, (v, c) in spec["value_defaults"].items()}
        for key in sorted(given):
            if key not in keys:
                raise error(f"Invalid {cls_name} key, {key}, the allowed keys are ( "
                            + "".join(f"{k} " for k in keys) + ")")
            # Adam: "Using 'maxWeightNorm' as a key in the Adam constructor is deprecated."
            out["defaultMaxWeightNorm" if key == "maxWeightNorm" else key] = given[key]
        return out

    def fmt(value: float) -> str:
        return str(np.float32(value))

    def check_values(cls_name: str, v: dict[str, tuple[float, bool]]) -> None:
        ls = v["lossScaling"][0]
        if not (ls > 0 or ls < 0):  # Optimizer::Optimizer
            raise error("Loss scaling cannot be 0")
        lr, lr_const = v["defaultLearningRate"]
        wd = v["defaultWeightDecay"][0]
        if lr < 0:
            raise error(f"Negative learning rate ({fmt(lr)}) in {cls_name}, bailing as this "
                        f"might be a user error.")
        if lr == 0 and lr_const:
            raise error(f"Constant, zero learning rate in {cls_name}, bailing as this might be "
                        f"a user error.")
        if wd < 0:
            raise error(f"Negative weight decay ({fmt(wd)}) in {cls_name}, bailing as this "
                        f"might be a user error")
        if cls_name == "SGD":  # SGD::runValueChecks
            mm, dp = v["defaultMomentum"][0], v["defaultDampening"][0]
            vs, nt = v["defaultVelocityScaling"][0], v["nesterov"][0]
            if mm < 0:
                raise error(f"Negative momentum ({fmt(mm)}) in SGD, bailing as this might be a "
                            f"user error")
            if dp < 0:
                raise error(f"Negative dampening ({fmt(dp)}) in SGD, bailing as this might be "
                            f"a user error")
            if vs <= 0:
                raise error(f"Non-positive velocity scaling ({fmt(vs)}) in SGD is not "
                            f"supported")
            if nt != 0 and dp > 0:
                raise error(f"When enable nesterov momentum, dampening ({fmt(dp)}) in SGD "
                            f"shouled be zero")
        else:  # Adam::runValueChecks
            b1, b2, eps = (v[k][0] for k in ("defaultBeta1", "defaultBeta2", "defaultEps"))
            if b1 < 0:
                raise error(f"Negative beta1 ({fmt(b1)}) in Adam, bailing as this might be a "
                            f"user error")
            if b2 < 0:
                raise error(f"Negative beta2 ({fmt(b2)}) in Adam, bailing as this might be a "
                            f"user error")
            if eps <= 0:
                raise error(f"Non-positive eps ({fmt(eps)}) in Adam is not supported")

    def replacement_error(message: str) -> Exception:
        return popart.popart_runtime_error(message)  # optimizer_replacement_error

    def check_replacement(name: str, this: tuple[float, bool], other: tuple[float, bool],
                          is_map: bool = True) -> None:
        """Optimizer::checkReplacementValue over OptimizerValue(Map)::validReplacement."""
        if this[1] != other[1]:
            why = "Can not replace a constant value with a non constant value."
        elif this[1] and this[0] - other[0] != 0.0:
            why = "Values are constant but do not match."
        else:
            return
        prefix = "Default value is not a valid replacement. " if is_map else ""
        raise replacement_error(f"Problem with {name}. {prefix}{why}")

    class Optimizer:
        __slots__ = ("_record",)
        __module__ = "popart"
        __setattr__ = _frozen_setattr("Optimizer")

        def getLossScalingVal(self) -> float:  # noqa: N802
            return self._record.values["lossScaling"][0]

        def _clone(self) -> Any:
            """Optimizer::clone: what the Ir keeps (the Python object stays the caller's)."""
            new = object.__new__(type(self))
            object.__setattr__(new, "_record", optimizer_record(self))
            return new

        def _set_factors_from_options(self, opts: Any) -> None:
            """Adam::setFactorsFromOptions (adam.cpp L356-362)."""
            rec = self._record
            if rec.type == "Adam" and rec.settings["scaled_optimizer_state"] \
                    and opts.automaticLossScalingSettings.enabled:
                raise error("scaledOptimizerState and automaticLossScaling are not compatible.")

        def _valid_replacement(self, other: Any) -> None:
            """Optimizer::validReplacement, then SGD's (sgd.cpp L691-747) or Adam's (adam.cpp
            L589-615). SGD checks neither dampening nor, without a velocity tensor, the
            accumulator settings; Adam checks neither accumulator types nor
            scaled_optimizer_state."""
            this, new = self._record, other._record  # no clip norm settings on either
            if this.type != new.type:
                raise replacement_error(f"Can not replace optimizer of type {this.type} with "
                                        f"new optimizer of type {new.type}")
            a, b = this.values, new.values
            if this.type == "Adam":
                if this.settings["mode"] is not new.settings["mode"]:
                    raise replacement_error("Adam modes do not match")
                if this.settings["weight_decay_mode"] is not new.settings["weight_decay_mode"]:
                    raise replacement_error("Weight decay modes do not match")
                check_replacement("loss scaling", a["lossScaling"], b["lossScaling"], False)
                for key, name in (("defaultLearningRate", "learning rates"),
                                  ("defaultWeightDecay", "weight decays"),
                                  ("defaultBeta1", "beta1s"), ("defaultBeta2", "beta2s"),
                                  ("defaultEps", "eps"), ("defaultMaxWeightNorm", "mwn")):
                    check_replacement(name, a[key], b[key])
                return
            check_replacement("loss scaling", a["lossScaling"], b["lossScaling"], False)
            for key, name in (("defaultLearningRate", "learning rates"),
                              ("defaultWeightDecay", "weight decays"),
                              ("defaultMomentum", "momentums"),
                              ("defaultVelocityScaling", "velocity scalings"),
                              ("nesterov", "nesterov")):
                check_replacement(name, a[key], b[key])

            def velocity(values: dict) -> bool:
                mm, const = values["defaultMomentum"]
                return not const or mm != 0.0

            if velocity(a) != velocity(b):
                raise replacement_error("this does not require a velocity tensor, but other "
                                        "does.")
            if not velocity(a):
                return
            s, t = this.settings, new.settings
            if s["accumulatorAndMomentum"] is not t["accumulatorAndMomentum"]:
                raise replacement_error(
                    f"this has SGDAccumulatorAndMomentum {s['accumulatorAndMomentum'].name}, "
                    f"but other has {t['accumulatorAndMomentum'].name}")
            if s["accumulatorAndMomentum"] is popart.SGDAccumulatorAndMomentum.Separate:
                for key, name in (("accumType", "sgdAccumType"), ("accl1Type", "sgd2Accl1Type")):
                    if s[key] is not t[key]:
                        raise replacement_error(
                            f"this has SGDAccumulatorAndMomentum::Separate and {name} "
                            f"{s[key].name}, but other has {t[key].name}")

        def __repr__(self) -> str:
            return f"<strict popart.{self._record.cls} {self._record.values}>"

    def make(cls_name: str, base: type, checkers: dict[str, Any], build: Any) -> type:
        spec = specs[cls_name]
        params: list[str] = spec["ctor"][0]
        defaults = {k: _ctor_default(popart, v) for k, v in spec["ctor_defaults"].items()}
        assert set(checkers) == set(params), (cls_name, params)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _, given = _resolve_overload(cls_name, [params], defaults, checkers, args, kwargs)
            values, settings = build(given)
            values = complete("Adam" if cls_name == "Adam" else "SGD", values)
            check_values("Adam" if cls_name == "Adam" else "SGD", values)
            object.__setattr__(self, "_record", OptimizerRecord(
                cls_name, "Adam" if cls_name == "Adam" else "SGD", tuple(args), dict(kwargs),
                given, values, settings))

        namespace = {"__slots__": (), "__init__": __init__, "__module__": "popart"}
        for method in spec["methods"]:
            if not hasattr(base, method):
                namespace[method] = _not_implemented(cls_name, method)
        return type(cls_name, (base,), namespace)

    enum = lambda name: _checker(popart, f"enum:{name}")  # noqa: E731
    text = _checker(popart, "str")  # DebugContext: from a str
    popart.SGD = make("SGD", Optimizer, {
        "pyd": values_dict, "clip_norm_settings": clip_norm_settings,
        "accumulatorAndMomentum": enum("SGDAccumulatorAndMomentum"),
        "accumType": enum("DataType"), "accl1Type": enum("DataType"), "debugContext": text,
    }, lambda g: (g["pyd"], {k: g[k] for k in ("accumulatorAndMomentum", "accumType",
                                               "accl1Type")}))
    popart.ConstSGD = make("ConstSGD", popart.SGD, {
        "learning_rate": _checker(popart, "float"), "weight_decay": _checker(popart, "float"),
        "loss_scaling": _checker(popart, "float"), "clip_norm_settings": clip_norm_settings,
    }, lambda g: ({"defaultLearningRate": (_f32(g["learning_rate"]), True),
                   "defaultWeightDecay": (_f32(g["weight_decay"]), True),
                   "lossScaling": (_f32(g["loss_scaling"]), True)},
                  {"accumulatorAndMomentum": popart.SGDAccumulatorAndMomentum.Combined,
                   "accumType": popart.DataType.UNDEFINED,
                   "accl1Type": popart.DataType.UNDEFINED}))
    popart.Adam = make("Adam", Optimizer, {
        "values": values_dict, "mode": enum("AdamMode"),
        "weight_decay_mode": enum("WeightDecayMode"), "accum_type": enum("DataType"),
        "accl1_type": enum("DataType"), "accl2_type": enum("DataType"),
        "clip_norm_settings": clip_norm_settings,
        "scaled_optimizer_state": _checker(popart, "bool"), "debugContext": text,
    }, lambda g: (g["values"], {k: g[k] for k in ("mode", "weight_decay_mode", "accum_type",
                                                  "accl1_type", "accl2_type",
                                                  "scaled_optimizer_state")}))
    return Optimizer


# -- InferenceSession ----------------------------------------------------------------------------

# willow/include/popart/replicatedstreammode.hpp: enum class ReplicatedStreamMode { Broadcast,
# Replicate } -- the integer builder_impl.cpp writes to "__replicated_stream_mode/<id>" metadata
# and ir.cpp L2409-2419 reads back (the pybind member order differs; the C++ values count here).
_STREAM_MODE_KEY = "__replicated_stream_mode/"
_CPP_STREAM_MODES = {0: "Broadcast", 1: "Replicate"}


def _bytes_view(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


@dataclass
class SessionRecord:
    """What a recorded InferenceSession was given and asked, in order.

    ``args`` / ``keywords``: the constructor call exactly as made; ``given``: every constructor
    parameter by PopART's name (defaults filled in); ``calls``: ``(method, args, kwargs)`` of every
    method called, in order; ``runs``: the stepio of each ``run``; ``read`` / ``written``: the
    names each readWeights filled / each writeWeights stored (``runs`` holds the runs PopART's
    checks let through; ``calls`` every attempt); ``popdist_init``: whether PopART's
    Python constructor would have called ``_popdist_backend_manager.init``; ``optimizers``:
    the optimizer each ``updateOptimizerFromHost`` PopART accepted installed (PopART's clone:
    read it with :func:`optimizer_record`); ``seeds``: ``(seed, applied)`` of each
    ``setRandomSeed`` PopART accepted (``applied`` False where the session has no random
    behaviour and PopART only warns)."""

    args: tuple = ()
    keywords: dict[str, Any] = field(default_factory=dict)
    given: dict[str, Any] = field(default_factory=dict)
    calls: list[tuple[str, tuple, dict]] = field(default_factory=list)
    runs: list[Any] = field(default_factory=list)
    read: list[list[str]] = field(default_factory=list)
    written: list[list[str]] = field(default_factory=list)
    popdist_init: bool = False
    optimizers: list[Any] = field(default_factory=list)
    seeds: list[tuple[int, bool]] = field(default_factory=list)

    @property
    def methods(self) -> list[str]:
        return [name for name, _, _ in self.calls]


def session_record(session: Any) -> SessionRecord:
    """The record of a recorded InferenceSession or TrainingSession."""
    return object.__getattribute__(session, "_record")


def created_sessions(popart: Any) -> list[Any]:
    """Every InferenceSession and TrainingSession the recorder module ``popart`` constructed,
    in order."""
    return list(popart.InferenceSession._created)


def _load_model(popart: Any, fn_model: Any) -> Any:
    """``onnxutil::getModelProto``: a path to a regular file, else a serialised ModelProto."""
    import onnx

    if isinstance(fn_model, str) and os.path.isfile(fn_model):
        data = Path(fn_model).read_bytes()
    else:
        data = fn_model.encode("utf-8") if isinstance(fn_model, str) else fn_model
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as err:  # google.protobuf.message.DecodeError
        raise popart.popart_exception(
            f"Failed to load a ModelProto from the string '{data[:100]!r}'.\nCheck that it is "
            f"either a valid path to an existing onnx model file, or is a valid onnx ModelProto "
            f"string.") from err
    try:
        onnx.checker.check_model(model)
    except Exception as err:  # onnx.checker.ValidationError
        raise popart.popart_exception(f"invalid ONNX model: {err}") from err
    return model


def _tensor_types(model: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every tensor ONNX shape inference can fully type (PopART's IR infers
    them itself; this stands in for its TensorInfo)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    out = {}
    for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tensor = value.type.tensor_type
        if tensor.elem_type and tensor.HasField("shape") and all(
                d.HasField("dim_value") for d in tensor.shape.dim):
            out[value.name] = (tuple(d.dim_value for d in tensor.shape.dim),
                               np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)))
    for init in model.graph.initializer:
        out[init.name] = (tuple(init.dims),
                          np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)))
    return out


def _make_session(popart: Any, cls_name: str, optimizer_base: type, created: list) -> type:
    """PopART's Python ``InferenceSession`` / ``TrainingSession`` (python_files/session.py) over
    ``_InferenceSessionCore`` / ``_TrainingSessionCore`` (popart.cpp L2001-2330) and
    willow/src/session.cpp, modelled on host arrays.

    Weights: with ``constantWeights`` (the default) an inference session makes every initializer
    a constant (ir.cpp L2330-2336), so it has no weight tensors: readWeights fills nothing
    (Devicex::readWeights reads only the executable's weight tensors, devicex.cpp L534-549) and
    writeWeights raises (session.cpp L537-553). Otherwise the initializers are weights, held
    twice: on the host (what writeWeights writes and readWeights reads) and on the device
    (weightsFromHost copies host to device, weightsToHost device to host, modelToHost writes
    the device's values into the model). Before the first weightsFromHost the device holds
    uninitialised memory, here the byte 0xAB.

    A training session (ir.cpp L1312, L3141-3165, session.cpp L977-1023) needs no anchor; its
    ``loss`` must be a tensor of the model, produced by an op, of at most one element; its
    ``optimizer`` one of this module's optimizers (the Ir holds a clone). Its initializers are
    always weights (``constantWeights`` applies to inference only), and each ``run`` leaves
    :func:`trained_pattern` in every floating-point weight on the device.
    ``updateOptimizerFromHost`` checks the new optimizer as ``Optimizer::validReplacement``
    does (sgd.cpp L691-747, adam.cpp L589-615: same type, same constant values, ...) and writes
    it to the device. ``setRandomSeed`` (session.cpp L286-306) does nothing, as PopART, in a
    session without random behaviour (no op of :data:`RANDOM_OPS`, no stochastic rounding).
    """
    training = cls_name == "TrainingSession"
    spec = MANIFEST["classes"][cls_name]
    params: list[str] = spec["ctor"][0]
    assert params == ["fnModel", "dataFlow", *(["loss", "optimizer"] if training else []),
                      "deviceInfo", "inputShapeInfo", "patterns", "userOptions", "name"], params
    defaults = {k: _ctor_default(popart, v) for k, v in spec["ctor_defaults"].items()}
    garbage = 0xAB

    def fn_model(value: Any, where: str) -> Any:
        if not isinstance(value, (bytes, str)):  # pybind's std::string caster
            raise TypeError(f"{where}: incompatible type {type(value).__name__}; PopART expects "
                            f"bytes (a serialised ModelProto) or a str path")
        return value

    def of_class(cls_name: str) -> Any:
        def check(value: Any, where: str) -> Any:
            if not isinstance(value, getattr(popart, cls_name)):
                raise TypeError(f"{where}: incompatible type {type(value).__name__}; PopART "
                                f"expects a popart.{cls_name} of this module")
            return value
        return check

    def device_info(value: Any, where: str) -> Any:
        if value is None:  # createFromOnnxModel's own check
            raise popart.popart_exception(
                f"Must pass a valid deviceInfo to {cls_name}::createFromOnnxModel")
        if not isinstance(value, DeviceCall) or not isinstance(value.manager,
                                                              popart.DeviceManager):
            raise TypeError(f"{where}: incompatible type {type(value).__name__}; PopART expects "
                            f"a DeviceInfo from this module's DeviceManager")
        if value.method in ("enumerateDevices", "setOnDemandAttachTimeout"):
            raise TypeError(f"{where}: {value.method}() does not return a DeviceInfo")
        return value

    def unsupported(name: str) -> Any:
        def check(value: Any, where: str) -> Any:
            if value is not None:
                raise NotImplementedError(f"{where}: the strict recorder has no {name}; pass "
                                          f"nothing (PopART's default)")
            return value
        return check

    def optimizer(value: Any, where: str) -> Any:
        # `const Optimizer &`: an instance of a bound Optimizer subclass (None does not bind)
        if not isinstance(value, optimizer_base):
            raise TypeError(f"{where}: incompatible type {type(value).__name__}; PopART expects "
                            f"a popart.SGD, popart.ConstSGD or popart.Adam of this module")
        return value

    checkers = {"fnModel": fn_model, "dataFlow": of_class("DataFlow"),
                "deviceInfo": device_info, "inputShapeInfo": unsupported("InputShapeInfo"),
                "patterns": unsupported("Patterns"), "userOptions": of_class("SessionOptions"),
                "name": _checker(popart, "str"), "loss": _checker(popart, "str"),
                "optimizer": optimizer}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        record = SessionRecord(tuple(args), dict(kwargs))
        object.__setattr__(self, "_record", record)
        _, given = _resolve_overload(cls_name, [params], defaults, checkers, args, kwargs)
        record.given = dict(given)
        opts = given["userOptions"]
        record.popdist_init = bool(opts.enableDistributedReplicatedGraphs)
        opts = opts._copy()  # the Ir holds its own SessionOptions
        model = _load_model(popart, given["fnModel"])
        dataflow = given["dataFlow"]._copy()
        if dataflow.nAnchors() == 0 and not training:  # Ir::setDataFlow
            raise popart.popart_exception(
                "User must specify an anchor tensor when doing inference.")
        produced = {o for node in model.graph.node for o in node.output if o}
        tensors = {i.name for i in model.graph.input} | {
            t.name for t in model.graph.initializer} | produced
        for anchor in dataflow.anchors():
            if anchor not in tensors:
                if training and "___" in anchor:  # Gradient___x, Accl___x, ...
                    raise NotImplementedError(
                        f"anchor {anchor!r}: the strict recorder does not build PopART's "
                        f"backward pass, so it cannot tell which of its tensors exist")
                raise popart.popart_exception(f"Anchor tensor `{anchor}' not in Ir Tensors. The "
                                              f"tensors are:\n{sorted(tensors)}")
        optimizer_now = None
        if training:
            loss = given["loss"]
            if loss not in tensors:  # Ir::setFinalLoss
                raise popart.popart_exception(
                    f"Could not find loss tensor '{loss}' in main graph tensors")
            types_ = _tensor_types(model)
            if loss not in types_:
                raise popart.popart_exception(f"strict recorder: no shape for loss {loss}")
            if math.prod(types_[loss][0]) > 1:
                raise popart.popart_exception(f"Loss tensor, '{loss}', must be a scalar tensor")
            if loss not in produced:  # Tensor::getProducer
                raise popart.popart_exception(f"No producer for tensor {loss} to return")
            optimizer_now = given["optimizer"]._clone()
            optimizer_now._set_factors_from_options(opts)
        import onnx.numpy_helper

        initializers = {t.name: onnx.numpy_helper.to_array(t).copy()
                        for t in model.graph.initializer}
        # inference sessions only: ir.cpp L2330-2336
        constant = opts.constantWeights and not training
        random_ops = {n.op_type for n in model.graph.node} & RANDOM_OPS
        state = {
            "model": model, "dataflow": dataflow, "options": opts, "device": given["deviceInfo"],
            "constant": constant, "initializers": initializers,
            "host": {} if constant else {k: v.copy() for k, v in initializers.items()},
            "on_device": {} if constant else {
                k: np.frombuffer(bytes([garbage]) * v.nbytes, v.dtype).reshape(v.shape).copy()
                for k, v in initializers.items()},
            "prepared": False, "engine": False, "runs": 0, "optimizer": optimizer_now,
            "random": bool(random_ops) or opts.enableStochasticRounding, "seed": None,
        }
        object.__setattr__(self, "_state", state)
        created.append(self)

    def log(self, method: str, args: tuple, kwargs: dict) -> None:
        self._record.calls.append((method, tuple(args), dict(kwargs)))

    def load_engine(self) -> None:
        """Devicex::loadEngineAndConnectStreams (devicex.cpp L1307-1315)."""
        st = self._state
        if st["device"].connection_type is popart.DeviceConnectionType.Never:
            raise popart.popart_runtime_error("Trying to load an engine on an offline device")
        if not st["prepared"]:
            raise popart.popart_runtime_error(
                "Trying to load an engine but no compiled engine. Did you forget to call "
                "prepareDevice()?")
        st["engine"] = True

    def run_program(self) -> None:
        """Devicex::run(program): loads the engine first if needed (devicex.cpp L241-251)."""
        if not self._state["engine"]:
            load_engine(self)

    def prepareDevice(self, loadEngine: bool = True) -> None:  # noqa: N802, N803
        log(self, "prepareDevice", (), {"loadEngine": loadEngine})
        check_value(popart, "bool", loadEngine, f"{cls_name}.prepareDevice(loadEngine=)")
        st = self._state
        opts = st["options"]
        if not opts.enableReplicatedGraphs and opts.replicatedGraphCount > 1:
            raise popart.popart_exception(
                "enableReplicatedGraphs is false, but replicatedGraphCount > 1. Either enable "
                "replication, or set the replicated graph count to 1")
        if not opts.compileEngine:
            return  # "Not compiling engine by request"
        st["prepared"] = True
        if loadEngine:
            load_engine(self)

    def weightsFromHost(self) -> None:  # noqa: N802
        log(self, "weightsFromHost", (), {})
        run_program(self)
        st = self._state
        for name, value in st["host"].items():
            st["on_device"][name] = value.copy()

    def weightsToHost(self) -> None:  # noqa: N802
        log(self, "weightsToHost", (), {})
        run_program(self)
        st = self._state
        for name, value in st["on_device"].items():
            st["host"][name] = value.copy()

    def weights_io(method: str, args: tuple, kwargs: dict) -> dict[str, np.ndarray]:
        if kwargs or len(args) != 1:  # bound without py::arg: one positional argument
            raise TypeError(f"{method}(): takes one positional argument (a PyWeightsIO); got "
                            f"{len(args)} positional and keywords {sorted(kwargs)}")
        if not isinstance(args[0], popart.PyWeightsIO):
            raise TypeError(f"{method}(): incompatible type {type(args[0]).__name__}; PopART "
                            f"expects a popart.PyWeightsIO of this module")
        return weights_io_arrays(args[0])

    def readWeights(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802
        log(self, "readWeights", args, kwargs)
        arrays = weights_io("readWeights", args, kwargs)
        st = self._state
        if not st["prepared"]:
            raise popart.popart_runtime_error(
                "strict recorder: readWeights reads the host stream buffers, which exist once "
                "prepareDevice() has been called")
        filled = []
        for name, src in st["host"].items():  # only the IR's weight tensors; others ignored
            if name not in arrays:
                continue
            dst = arrays[name]
            if dst.nbytes != src.nbytes:
                raise popart.popart_runtime_error(
                    f"sizes (in bytes) of src ({src.nbytes}) and dst ({dst.nbytes}) differ in "
                    f"hostStreamToHost for {name}")
            np.copyto(_bytes_view(dst), _bytes_view(np.ascontiguousarray(src)))  # memcpy
            filled.append(name)
        self._record.read.append(filled)

    def writeWeights(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802
        log(self, "writeWeights", args, kwargs)
        arrays = weights_io("writeWeights", args, kwargs)
        st = self._state
        if st["constant"]:
            raise popart.popart_runtime_error(
                "Cannot call writeWeights when constantWeights is set. Set `constantWeights` to "
                "False in the `SessionOption`s when initialising the session to enable this "
                "behaviour.")
        stored = []
        for name, old in st["host"].items():
            if name not in arrays:
                continue
            new = arrays[name]
            if tuple(new.shape) != tuple(old.shape):  # Tensor::verifyMutableVoidInfo
                raise popart.popart_internal_exception(
                    f"The shape of the MutableVoidData for IO does not not match the expected "
                    f"write region of this tensor. Tensor Write ({old.ndim}): {list(old.shape)} "
                    f"!= MutableVoidData ({new.ndim}): {list(new.shape)}")
            if new.nbytes != old.nbytes:  # TensorData::resetData
                raise popart.popart_exception(f"cannot reset tensor data with data of "
                                              f"non-matching size {old.nbytes} vs {new.nbytes}")
            data = old.copy()
            np.copyto(_bytes_view(data), _bytes_view(new))  # raw bytes: no dtype conversion
            st["host"][name] = data
            stored.append(name)
        self._record.written.append(stored)

    def stream_specs(self) -> tuple[dict, dict, int, int, int]:
        st = self._state
        model, opts, dataflow = st["model"], st["options"], st["dataflow"]
        types_ = _tensor_types(model)
        modes = {p.key[len(_STREAM_MODE_KEY):]: _CPP_STREAM_MODES.get(int(p.value))
                 for p in model.metadata_props if p.key.startswith(_STREAM_MODE_KEY)}
        inits = {t.name for t in model.graph.initializer}
        inputs = {}
        for value in model.graph.input:
            if value.name in inits:
                continue
            shape, dtype = types_[value.name]
            inputs[value.name] = (shape, dtype, modes.get(value.name) == "Broadcast")
        R = opts.replicatedGraphCount if opts.enableReplicatedGraphs else 1  # noqa: N806
        A = opts.accumulationFactor if opts.enableGradientAccumulation else 1  # noqa: N806
        bps = dataflow.batchesPerStep()
        anchors = {}
        for name in dataflow.anchors():
            if name not in types_:
                raise popart.popart_exception(f"strict recorder: no shape for anchor {name}")
            art = dataflow.art(name)
            fetches = {"Final": 1, "Sum": 1, "All": bps * A}.get(art.id().name)
            if fetches is None:
                fetches = bps // art.rp() * A
            anchors[name] = (*types_[name], fetches)
        return inputs, anchors, R, bps, A

    def stepio_checker(value: Any, where: str) -> Any:
        if not isinstance(value, (popart.PyStepIO, popart.PyStepIOCallback)):
            raise TypeError(f"{where}: incompatible type {type(value).__name__}; PopART "
                            f"expects a PyStepIO or PyStepIOCallback of this module")
        return value

    def run(self, *args: Any, **kwargs: Any) -> None:
        log(self, "run", args, kwargs)
        if (args and isinstance(args[0], str)) or "programHandle" in kwargs:
            raise NotImplementedError(f"popart.{cls_name}.run(programHandle, stepio, "
                                      "debugName) is not implemented by the strict recorder")
        _, given = _resolve_overload(
            f"{cls_name}.run", [["stepio", "debugName"]], {"debugName": lambda: ""},
            {"stepio": stepio_checker, "debugName": _checker(popart, "str")}, args, kwargs)
        st = self._state
        if st["device"].connection_type is popart.DeviceConnectionType.Never:
            raise popart.popart_runtime_error(
                "Offline IPU device is not configured for execution")
        if not st["prepared"]:
            raise popart.popart_runtime_error(
                "Devicex::prepare() must be called before Devicex::run(const IStepIO &) is "
                "called.")
        stepio = given["stepio"]
        if isinstance(stepio, popart.PyStepIOCallback):
            self._record.runs.append(stepio)
            return  # recorded; drive it with simulate_run
        inputs, anchors, R, bps, A = stream_specs(self)  # noqa: N806
        if st["runs"] == 0:  # Devicex::run: the element-count check of the first run only
            try:
                first_run_check(stepio, inputs, anchors, R=R, bps=bps, A=A)
            except RuntimeError as err:
                raise popart.popart_exception(str(err)) from err
        self._record.runs.append(stepio)
        if not st["engine"]:
            load_engine(self)
        st["runs"] += 1
        _, outputs = stepio_arrays(stepio)
        for array in outputs.values():
            array.reshape(-1)[...] = run_pattern(array.size, array.dtype, st["runs"])
        if training:
            for name, value in st["on_device"].items():
                if np.issubdtype(value.dtype, np.floating):
                    st["on_device"][name] = trained_pattern(value.shape, value.dtype, st["runs"])

    def modelToHost(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802
        log(self, "modelToHost", args, kwargs)
        if kwargs or len(args) != 1 or not isinstance(args[0], str):
            raise TypeError("modelToHost(): takes one positional str (the file name)")
        st = self._state
        if not st["prepared"]:
            raise popart.popart_runtime_error(
                "Devicex::prepare() must be called before Devicex::weightsToHost(const "
                "std::map<TensorId, MutableVoidData> &) is called.")
        run_program(self)
        import onnx
        import onnx.numpy_helper

        model = onnx.ModelProto()
        model.CopyFrom(st["model"])
        for tensor in model.graph.initializer:
            if tensor.name in st["on_device"]:
                tensor.CopyFrom(onnx.numpy_helper.from_array(st["on_device"][tensor.name],
                                                             tensor.name))
        onnx.save(model, args[0])
        if not st["constant"]:  # "Weights in executable, device, and disk now all match"
            for name, value in st["on_device"].items():
                st["host"][name] = value.copy()

    def initAnchorArrays(self) -> dict[str, np.ndarray]:  # noqa: N802
        """python_files/session.py ``_initAnchorArrays``, verbatim in logic."""
        log(self, "initAnchorArrays", (), {})
        st = self._state
        dataflow = st["dataflow"]
        types_ = _tensor_types(st["model"])
        out = {}
        for anchor in dataflow.anchors():
            shape, dtype = types_[anchor]
            bps = dataflow.batchesPerStep()
            art_id = dataflow.art(anchor).id()
            array_shape = [self.replicationFactor]
            if art_id in (popart.AnchorReturnTypeId.Final, popart.AnchorReturnTypeId.Sum):
                pass
            elif art_id is popart.AnchorReturnTypeId.All:
                array_shape.insert(0, self.accumulationFactor)
                array_shape.insert(0, bps)
            elif art_id is popart.AnchorReturnTypeId.EveryN:
                if bps % dataflow.art(anchor).rp() != 0:
                    raise RuntimeError("Invalid anchor period, is not divisble by batchesPerStep")
                array_shape.insert(0, self.accumulationFactor)
                array_shape.insert(0, bps // dataflow.art(anchor).rp())
            array_shape = [x for x in array_shape if x != 1] + list(shape)
            out[anchor] = np.empty(shape=array_shape, dtype=dtype)
        return out

    def dataFlow(self) -> Any:  # noqa: N802
        return self._state["dataflow"]

    def replicationFactor(self) -> int:  # noqa: N802
        opts = self._state["options"]
        return opts.replicatedGraphCount if opts.enableReplicatedGraphs else 1

    def accumulationFactor(self) -> int:  # noqa: N802
        opts = self._state["options"]
        return opts.accumulationFactor if opts.enableGradientAccumulation else 1

    def synthetic(self) -> bool:
        """Ir::useSyntheticData: the Devicex stream programs below do nothing then."""
        return self._state["options"].syntheticDataMode is not popart.SyntheticDataMode.Off

    def setRandomSeed(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802
        """Session::setRandomSeed(uint64_t seedValue), py::arg("seedValue")."""
        log(self, "setRandomSeed", args, kwargs)
        _, given = _resolve_overload(f"{cls_name}.setRandomSeed", [["seedValue"]], {},
                                     {"seedValue": uint64}, args, kwargs)
        seed = given["seedValue"]
        st = self._state
        if not st["random"]:
            # "Trying to set the random seed, but this session has no random behaviour.
            # Doing nothing." (a log warning)
            self._record.seeds.append((seed, False))
            return
        st["seed"] = seed  # executable_->setRandomSeedValue
        if not st["prepared"]:
            raise popart.popart_runtime_error(
                "Devicex::prepare() must be called before "
                "Devicex::setRandomSeedFromHost(uint64_t) is called.")
        if not synthetic(self):
            run_program(self)  # Devicex::setRandomSeedFromHost
        self._record.seeds.append((seed, True))

    def updateOptimizerFromHost(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802
        """TrainingSession::updateOptimizerFromHost(const Optimizer *), bound without py::arg:
        Ir::updateOptimizer (clone, setFactorsFromOptions, validReplacement), then
        Devicex::optimizerFromHost."""
        log(self, "updateOptimizerFromHost", args, kwargs)
        if kwargs or len(args) != 1:
            raise TypeError(f"updateOptimizerFromHost(): takes one positional argument (an "
                            f"optimizer); got {len(args)} positional and keywords "
                            f"{sorted(kwargs)}")
        if not isinstance(args[0], optimizer_base):
            # None would bind as a null pointer, which PopART dereferences
            raise TypeError(f"updateOptimizerFromHost(): incompatible type "
                            f"{type(args[0]).__name__}; PopART expects a popart.SGD, "
                            f"popart.ConstSGD or popart.Adam of this module")
        st = self._state
        new = args[0]._clone()
        new._set_factors_from_options(st["options"])
        st["optimizer"]._valid_replacement(new)
        st["optimizer"] = new
        if not synthetic(self):
            run_program(self)
        self._record.optimizers.append(new)

    def uint64(value: Any, where: str) -> int:
        value = check_value(popart, "int", value, where)
        if not 0 <= value < 2 ** 64:
            raise TypeError(f"{where}: {value} does not convert to uint64_t")
        return value

    implemented = {"prepareDevice": prepareDevice, "weightsFromHost": weightsFromHost,
                   "weightsToHost": weightsToHost, "readWeights": readWeights,
                   "writeWeights": writeWeights, "run": run, "modelToHost": modelToHost,
                   "initAnchorArrays": initAnchorArrays, "setRandomSeed": setRandomSeed}
    if training:
        implemented["updateOptimizerFromHost"] = updateOptimizerFromHost
    assert set(implemented) <= set(spec["methods"]), set(implemented) - set(spec["methods"])
    namespace: dict[str, Any] = {
        name: _not_implemented(cls_name, name) for name in spec["methods"]}
    namespace.update(implemented)
    for name in spec.get("classmethods", {}):
        namespace[name] = classmethod(_not_implemented(cls_name, name))
    properties = {"dataFlow": dataFlow, "replicationFactor": replicationFactor,
                  "accumulationFactor": accumulationFactor}
    assert set(spec["properties"]) == set(properties), spec["properties"]
    namespace.update({k: property(v) for k, v in properties.items()})
    return type(cls_name, (), {
        "__slots__": ("_record", "_state"), "__init__": __init__,
        "__setattr__": _frozen_setattr(cls_name), "__module__": "popart",
        "_created": created, **namespace})


def run_pattern(size: int, dtype: Any, run: int) -> np.ndarray:
    """What the recorder's ``run`` number ``run`` (1-based) writes into an anchor array of
    ``size`` elements: distinct small values, exact in every dtype (True for bools)."""
    return ((np.arange(size) % 50) + run).astype(dtype)


def trained_pattern(shape: tuple[int, ...], dtype: Any, run: int) -> np.ndarray:
    """What a TrainingSession's ``run`` number ``run`` leaves in every floating-point weight on
    the device (the recorder computes no gradients): distinct from the initial weights and
    from every anchor pattern."""
    size = math.prod(shape)
    return (-(np.arange(size) % 50) - run - 0.5).astype(dtype).reshape(shape)


# -- the module -------------------------------------------------------------------------------


def make_popart_module() -> types.ModuleType:
    """A fresh module-like ``popart`` with the manifest's enums, structs, SessionOptions,
    DeviceManager, PyStepIO, PyStepIOCallback, AnchorReturnType, DataFlow, PyWeightsIO, SGD,
    ConstSGD, Adam (and their enums), InferenceSession and TrainingSession (each call builds new
    classes, so logs never leak between tests)."""
    popart = types.ModuleType("popart", "strict recorder of PopART's Python API "
                                        "(tests/contract/popart_api.json)")
    popart.__file__ = __file__
    for name, members in MANIFEST["enums"].items():
        setattr(popart, name, _make_enum(name, members))
    for name, spec in MANIFEST["structs"].items():
        setattr(popart, name, _make_struct(popart, name, spec))
    _make_exceptions(popart)
    popart.SessionOptions = _make_session_options(popart)
    popart.DeviceManager = _make_device_manager(popart)
    popart.PyStepIO = _make_pystepio(popart)
    popart.PyStepIOCallback = _make_pystepio_callback(popart)
    popart.AnchorReturnType = _make_anchor_return_type(popart)
    popart.DataFlow = _make_dataflow(popart)
    popart.PyWeightsIO = _make_pyweightsio(popart)
    optimizer_base = _make_optimizers(popart)
    created: list[Any] = []
    popart.InferenceSession = _make_session(popart, "InferenceSession", optimizer_base, created)
    popart.TrainingSession = _make_session(popart, "TrainingSession", optimizer_base, created)
    return popart


def _plain_matches(type_: str, expected: Any, actual: Any) -> bool:
    """``actual`` (to_plain of the recorder) holds the plain ``expected`` of to_popart_dict."""
    if type_.startswith("struct:"):
        fields = MANIFEST["structs"][type_[7:]]["fields"]
        return all(_plain_matches(fields[k], v, actual[k]) for k, v in expected.items())
    if type_.startswith("set["):
        return sorted(expected) == actual
    if type_ == "float":
        return isinstance(actual, float) and actual == expected
    if isinstance(expected, dict):
        return dict(actual) == expected
    return type(actual) is type(expected) and actual == expected


def option_mismatches(opts: Any, expected: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, expected, recorded) for every option of ``expected`` (a to_popart_dict) that the
    recorded SessionOptions does not hold."""
    out = []
    for name, value in expected.items():
        type_ = MANIFEST["session_options"][name]["type"]
        actual = to_plain(type_, getattr(opts, name))
        if not _plain_matches(type_, value, actual):
            out.append((name, value, actual))
    return out
