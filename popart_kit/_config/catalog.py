"""What popart.SessionOptions accepts: attribute names, value types, defaults and enum members.

The data (``_data/session_options.json``) is written from PopART's Python bindings; the contract
tests hold it against an independent manifest of PopART's API. The functions check a value
against its type, set it on a real ``SessionOptions`` and read one back as plain data.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from ..errors import short

__all__ = ["OPTIONS", "DEFAULTS", "ENUMS", "STRUCTS", "DEPRECATED", "CONTROLLED_OPTIONS",
           "CONTROLLED_MAP_KEYS", "ELSEWHERE",
           "type_problem", "assign", "plain", "readable"]

_DATA = json.loads(resources.files(__package__).joinpath("_data/session_options.json")
                   .read_text(encoding="utf-8"))

OPTIONS: dict[str, str] = {k: v["type"] for k, v in _DATA["session_options"].items()}
DEFAULTS: dict[str, Any] = {k: v["default"] for k, v in _DATA["session_options"].items()}
ENUMS: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in _DATA["enums"].items()}
STRUCTS: dict[str, dict[str, str]] = {k: v["fields"] for k, v in _DATA["structs"].items()}
#: The positional constructor forms of structs whose forms are not their fields in order.
STRUCT_CTORS: dict[str, list[list[str]]] = {k: v["ctor"] for k, v in _DATA["structs"].items()
                                            if "ctor" in v}
DEPRECATED: dict[str, str] = _DATA["deprecated"]  # alias -> current name; PopART warns on set


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _value_problem(type_: str, value: Any) -> str | None:
    """Why ``value`` does not fit PopART type ``type_`` (None when it does)."""
    if type_ == "bool":
        return None if isinstance(value, bool) else "expected true or false"
    if type_ == "int":
        return None if _is_int(value) else "expected an integer"
    if type_ == "float":
        return None if _is_int(value) or isinstance(value, float) else "expected a number"
    if type_ == "str":
        return None if isinstance(value, str) else "expected a string"
    if type_.startswith("enum:"):
        members = ENUMS[type_[5:]]
        return None if value in members else f"expected one of {', '.join(members)}"
    if type_ == "map[str,str]":
        if not isinstance(value, dict):
            return "expected a table of string keys to string values"
        bad = [k for k, v in value.items() if not isinstance(k, str) or not isinstance(v, str)]
        return f"Poplar options are strings; quote the values of {short(bad)}" if bad else None
    if type_ == "dict[str,int]":
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and _is_int(v) for k, v in value.items()):
            return "expected a table of tensor names to integers"
        return None
    if type_.startswith("other:optional list[str]"):  # a struct field PopART leaves unset
        if value is None or (isinstance(value, list) and all(isinstance(v, str)
                                                             for v in value)):
            return None
        return "expected a list of tensor names, or none"
    if type_.startswith(("list[", "set[")):
        inner = type_[type_.index("[") + 1:-1]
        if not isinstance(value, list):
            return f"expected a list of {inner}"
        problems = [p for v in value if (p := _value_problem(inner, v))]
        return f"every item: {problems[0]}" if problems else None
    if type_.startswith("struct:"):
        fields = STRUCTS.get(type_[7:])
        if fields is None:
            return "this settings class cannot be given in a configuration file"
        if not isinstance(value, dict):
            return f"expected a table with some of the fields {', '.join(fields)}"
        unknown = [k for k in value if k not in fields]
        if unknown:
            return f"{short(unknown)} are not fields of {type_[7:]} (fields: {', '.join(fields)})"
        problems = [f"{k}: {p}" for k, v in value.items() if (p := _value_problem(fields[k], v))]
        return "; ".join(problems) or None
    return f"options of type {type_} cannot be given in a configuration file; set them on the " \
           f"SessionOptions object that to_session_options() returns"


def type_problem(name: str, value: Any) -> str | None:
    return _value_problem(OPTIONS[name], value)


def _to_popart(popart: Any, type_: str, value: Any, current: Any = None) -> Any:
    if type_.startswith("enum:"):
        return getattr(getattr(popart, type_[5:]), value)
    if type_.startswith("set["):
        return {_to_popart(popart, type_[4:-1], v) for v in value}
    if type_.startswith("list["):
        return [_to_popart(popart, type_[5:-1], v) for v in value]
    if type_.startswith("struct:"):
        struct = current if current is not None else getattr(popart, type_[7:])()
        fields = STRUCTS[type_[7:]]
        for key, v in value.items():
            setattr(struct, key, _to_popart(popart, fields[key], v, getattr(struct, key, None)))
        return struct
    if type_ == "map[str,str]" or type_ == "dict[str,int]":
        return dict(value)
    return value


def assign(opts: Any, popart: Any, name: str, value: Any) -> None:
    """Set option ``name`` (plain value, as in popart_options) on a real SessionOptions."""
    type_ = OPTIONS[name]
    current = getattr(opts, name) if type_.startswith("struct:") else None
    setattr(opts, name, _to_popart(popart, type_, value, current))


def _plain(type_: str, value: Any) -> Any:
    if type_.startswith("enum:"):
        return value if isinstance(value, str) else value.name
    if type_.startswith("set["):
        return sorted(_plain(type_[4:-1], v) for v in value)
    if type_.startswith("list["):
        return [_plain(type_[5:-1], v) for v in value]
    if type_.startswith("struct:"):
        fields = STRUCTS.get(type_[7:], {})
        if isinstance(value, dict):
            return {k: _plain(fields.get(k, "other"), v) for k, v in value.items()}
        return {k: _plain(t, getattr(value, k)) for k, t in fields.items()}
    if type_ in ("map[str,str]", "dict[str,int]"):
        return dict(value)
    return value


def plain(name: str, value: Any) -> Any:
    """An option's value as plain data (member names, lists, dicts), as popart_options holds it."""
    return _plain(OPTIONS[name], value)


def readable(opts: Any, name: str) -> bool:
    return hasattr(opts, name)


# SessionOptions attributes the typed fields set: a popart_options entry may not set them too.
CONTROLLED_OPTIONS: dict[str, str] = {
    "virtualGraphMode": "virtual_graph_mode",
    "enablePipelining": "pipeline.enabled",
    "autoRecomputation": "pipeline.recomputation",
    "enableGradientAccumulation": "accumulation.factor",
    "accumulationFactor": "accumulation.factor",
    "accumulationAndReplicationReductionType": "accumulation.reduction",
    "meanAccumulationAndReplicationReductionStrategy": "accumulation.mean_strategy",
    "enableReplicatedGraphs": "replication.local_factor",
    "replicatedGraphCount": "replication.local_factor",
    "enableDistributedReplicatedGraphs": "replication.global_factor",
    "globalReplicationFactor": "replication.global_factor",
    "globalReplicaOffset": "replication.global_offset",
    "partialsTypeMatMuls": "precision.partials_type",
    "enableStochasticRounding": "precision.stochastic_rounding",
    "instrumentWithHardwareCycleCounter": "profiling.cycle_counter",
}
# Keys of map options that typed fields set; other keys of these maps pass through.
CONTROLLED_MAP_KEYS: dict[tuple[str, str], str] = {
    ("engineOptions", "autoReport.all"): "profiling.auto_report_dir",
    ("engineOptions", "autoReport.directory"): "profiling.auto_report_dir",
    ("convolutionOptions", "partialsType"): "precision.partials_type",
}
# Names people reach for that are not SessionOptions attributes.
ELSEWHERE: dict[str, str] = {
    "batchesPerStep": "batches_per_step (PopART DataFlow)",
    "numIpus": "ipus_per_replica and replication.local_factor (device request)",
    "tilesPerIpu": "device.tiles_per_ipu", "tilesPerIPU": "device.tiles_per_ipu",
    "syncPattern": "device.sync_pattern", "connectionType": "device.connection",
    "enableExplicitIR": "useHostCopyOps, enableExplicitMainLoops and explicitRecomputation "
                        "(what the enableExplicitIR method sets)",
}
