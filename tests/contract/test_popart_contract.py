"""Contract tests: what popart_kit hands to PopART matches PopART's real Python API.

The API facts live in ``popart_api.json`` (written from PopART's sources, independently of the
package's own catalog); ``strict_popart`` turns them into a strict recorder that raises where real
PopART would (unknown attribute, wrong type, unknown enum member, unknown keyword).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, reject, settings
from strategies import config_dicts
from strict_popart import (
    BROKEN_OPTIONS,
    MANIFEST,
    DeviceCall,
    EnumMember,
    make_popart_module,
    set_log,
    to_plain,
)

import popart_kit as pk
from popart_kit._base import names as _names
from popart_kit._config import catalog

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

OPTIONS: dict[str, dict[str, Any]] = MANIFEST["session_options"]
ENUMS: dict[str, list[str]] = MANIFEST["enums"]
STRUCTS: dict[str, dict[str, Any]] = MANIFEST["structs"]
ACQUIRE = MANIFEST["device_manager"]["acquireAvailableDevice"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _build(kwargs: dict[str, Any]) -> pk.SessionConfig:
    try:
        return pk.SessionConfig.model_validate(kwargs)
    except ValueError:
        reject()  # never expected: test_generated_configs_are_valid keeps the share at 100%


configs = config_dicts().map(_build)
ipu_configs = config_dicts().filter(lambda k: k["device"]["target"] == "ipu").map(_build)


# -- plain-data type check against the manifest (independent of popart_kit's catalog) ----------


def plain_problem(type_: str, value: Any) -> str | None:
    """Why ``value`` is not the plain form (as to_popart_dict gives it) of manifest ``type_``."""
    if type_ == "bool":
        return None if isinstance(value, bool) else "not a bool"
    if type_ == "int":
        return None if _is_int(value) else "not an int"
    if type_ == "float":
        return None if _is_int(value) or isinstance(value, float) else "not a number"
    if type_ == "str":
        return None if isinstance(value, str) else "not a str"
    if type_.startswith("enum:"):
        members = ENUMS[type_[5:]]
        return None if isinstance(value, str) and value in members else \
            f"{value!r} is not a member name of {type_[5:]} {members}"
    if type_ == "map[str,str]":
        if type(value) is not dict:
            return "not a dict"
        return None if all(isinstance(k, str) and isinstance(v, str)
                           for k, v in value.items()) else "not dict[str, str]"
    if type_ == "dict[str,int]":
        if type(value) is not dict:
            return "not a dict"
        return None if all(isinstance(k, str) and _is_int(v)
                           for k, v in value.items()) else "not dict[str, int]"
    if type_.startswith(("list[", "set[")):
        if not isinstance(value, list):
            return "not a list"
        inner = type_[type_.index("[") + 1:-1]
        if type_.startswith("set[") and len(set(map(repr, value))) != len(value):
            return "duplicate set items"
        problems = [p for v in value if (p := plain_problem(inner, v))]
        return problems[0] if problems else None
    if type_.startswith("struct:"):
        fields = STRUCTS[type_[7:]]["fields"]
        if not isinstance(value, dict):
            return "not a dict"
        unknown = set(value) - set(fields)
        if unknown:
            return f"{sorted(unknown)} are not fields of {type_[7:]}"
        problems = [f"{k}: {p}" for k, v in value.items() if (p := plain_problem(fields[k], v))]
        return problems[0] if problems else None
    return f"the kit should not emit options of type {type_}"


def _matches(type_: str, expected: Any, actual: Any) -> bool:
    """``actual`` (strict_popart.to_plain of the recorder) holds plain ``expected``; a struct
    given partially is compared on the fields given."""
    if type_.startswith("struct:"):
        fields = STRUCTS[type_[7:]]["fields"]
        return all(_matches(fields[k], v, actual[k]) for k, v in expected.items())
    if type_.startswith("set["):
        return sorted(expected) == actual
    if type_ == "float":
        return isinstance(actual, float) and actual == expected
    return type(actual) is type(expected) and actual == expected or \
        (isinstance(expected, dict) and dict(actual) == expected)


def _state(opts: Any) -> dict[str, Any]:
    """Every readable SessionOptions attribute of the recorder, as plain data."""
    return {name: to_plain(spec["type"], getattr(opts, name)) for name, spec in OPTIONS.items()
            if name not in BROKEN_OPTIONS}


def _rest(cfg: pk.SessionConfig) -> dict[str, Any]:
    """What SessionOptions does not hold, for from_session_options."""
    return {"mode": cfg.mode, "batches_per_step": cfg.batches_per_step,
            "ipus_per_replica": cfg.ipus_per_replica, "device": cfg.device.model_dump(),
            "micro_batch_size": cfg.micro_batch_size, "pipeline": {"stages": cfg.pipeline.stages}}


# -- the generator itself ----------------------------------------------------------------------


@SETTINGS
@given(config_dicts())
def test_generated_configs_are_valid(kwargs):
    pk.SessionConfig.model_validate(kwargs)  # a ValueError here is a generator (or kit) bug


# -- a. to_popart_dict speaks PopART's names and types ----------------------------------------


@SETTINGS
@given(configs)
def test_to_popart_dict_names_and_types(cfg):
    d = cfg.to_popart_dict()
    unknown = sorted(set(d) - set(OPTIONS))
    assert not unknown, f"not SessionOptions attributes in PopART: {unknown}"
    assert not set(d) & BROKEN_OPTIONS
    problems = {k: p for k, v in d.items() if (p := plain_problem(OPTIONS[k]["type"], v))}
    assert not problems, problems
    assert set(catalog.CONTROLLED_OPTIONS) <= set(d)
    for name in ("engineOptions", "convolutionOptions"):
        assert OPTIONS[name]["type"] == "map[str,str]" and type(d[name]) is dict


# -- b. device_request is acquireAvailableDevice's keywords ---------------------------------


def _enum_of(param: str) -> str:
    return ACQUIRE["defaults"][param].split(".")[0]


@SETTINGS
@given(ipu_configs)
def test_device_request_matches_acquire_available_device(cfg):
    req = cfg.device_request()
    assert list(req) == ACQUIRE["params"] or set(req) == set(ACQUIRE["params"])
    assert _enum_of("pattern") == "SyncPattern"
    assert _enum_of("connectionType") == "DeviceConnectionType"
    assert _enum_of("selectionCriterion") == "DeviceSelectionCriterion"
    assert req["pattern"] in ENUMS["SyncPattern"]
    assert req["connectionType"] in ENUMS["DeviceConnectionType"]
    assert req["selectionCriterion"] in ENUMS["DeviceSelectionCriterion"]
    assert _is_int(req["numIpus"]) and _pow2(req["numIpus"])
    assert req["numIpus"] >= cfg.replication.local_factor * cfg.ipus_per_replica
    assert _is_int(req["tilesPerIpu"]) and req["tilesPerIpu"] == cfg.device.tiles_per_ipu

    # and the strict DeviceManager takes it, once the names are PopART's enum members
    popart = make_popart_module()
    args = {k: (getattr(getattr(popart, _enum_of(k)), v) if k in
                ("pattern", "connectionType", "selectionCriterion") else v)
            for k, v in req.items()}
    call = popart.DeviceManager().acquireAvailableDevice(**args)
    assert isinstance(call, DeviceCall) and call.kwargs["numIpus"] == req["numIpus"]


@pytest.mark.parametrize("target", ["ipu_model", "cpu", "offline"])
def test_device_request_only_for_hardware(target):
    cfg = pk.SessionConfig(mode="inference", device=pk.Device(target=target))
    with pytest.raises(ValueError, match="acquireAvailableDevice"):
        cfg.device_request()


# -- c. to_session_options through the strict recorder --------------------------------------


@SETTINGS
@given(configs)
def test_to_session_options_on_strict_popart(cfg):
    popart = make_popart_module()
    opts = cfg.to_session_options(popart=popart)
    assert isinstance(opts, popart.SessionOptions)
    d = cfg.to_popart_dict()

    log = set_log(opts)
    set_names = [name for name, _ in log]
    assert sorted(set_names) == sorted(d), "each option is set exactly once, nothing else"
    for name, stored in log:  # what was stored passed the strict checks: PopART objects
        if OPTIONS[name]["type"].startswith("enum:"):
            assert isinstance(stored, EnumMember)
            assert stored is getattr(getattr(popart, OPTIONS[name]["type"][5:]), stored.name)

    for name, expected in d.items():
        type_ = OPTIONS[name]["type"]
        actual = to_plain(type_, getattr(opts, name))
        assert _matches(type_, expected, actual), (name, expected, actual)

    untouched = {n: v for n, v in _state(opts).items()
                 if n not in d and not n.startswith("_")}
    for name, value in untouched.items():
        assert value == OPTIONS[name]["default"], name


# -- d. from_session_options inverts to_session_options and to_popart_dict ---------------------


@SETTINGS
@given(configs)
def test_roundtrip_through_strict_session_options(cfg):
    popart = make_popart_module()
    opts = cfg.to_session_options(popart=popart)
    back = pk.SessionConfig.from_session_options(opts, **_rest(cfg))
    assert back.model_dump() == cfg.model_dump()
    assert back == cfg
    assert back.to_popart_dict() == cfg.to_popart_dict()


@SETTINGS
@given(configs)
def test_roundtrip_through_popart_dict(cfg):
    back = pk.SessionConfig.from_session_options(cfg.to_popart_dict(), **_rest(cfg))
    assert back.model_dump() == cfg.model_dump()
    assert back == cfg


def test_roundtrip_of_defaults_and_partial_structs_is_equivalent():
    # A SessionOptions object cannot tell "set to the default" from "not set", and it holds
    # whole structs: the config read back differs in spelling, but sets PopART up identically.
    cfg = pk.SessionConfig(
        mode="training", ipus_per_replica=2, virtual_graph_mode="execution_phases",
        popart_options={"enableOutlining": True, "executionPhaseSettings": {"phases": 2},
                        "engineOptions": {}})
    popart = make_popart_module()
    opts = cfg.to_session_options(popart=popart)
    back = pk.SessionConfig.from_session_options(opts, **_rest(cfg))
    again = back.to_session_options(popart=popart)
    assert _state(again) == _state(opts)
    assert back.popart_options["executionPhaseSettings"]["phases"] == 2


# -- e. the package's tables agree with the manifest ------------------------------------------


@pytest.mark.parametrize("enum_name", sorted(_names.POPART_ENUM))
def test_name_tables_map_to_manifest_members(enum_name):
    assert enum_name in ENUMS, f"popart.{enum_name} does not exist"
    table = _names.POPART_ENUM[enum_name]
    missing = sorted(set(table.values()) - set(ENUMS[enum_name]))
    assert not missing, f"not members of popart.{enum_name}: {missing}"
    assert len(set(table.values())) == len(table), "two kit names for one member"


@pytest.mark.parametrize("name", sorted(catalog.OPTIONS))
def test_catalog_option_matches_manifest(name):
    assert name in OPTIONS, f"{name} is not a SessionOptions attribute"
    assert name not in BROKEN_OPTIONS
    assert catalog.OPTIONS[name] == OPTIONS[name]["type"], name
    assert catalog.DEFAULTS[name] == OPTIONS[name]["default"], name


def test_catalog_covers_every_public_manifest_option():
    expected = {n for n, spec in OPTIONS.items()
                if not n.startswith("_") and not spec["type"].startswith("other:")}
    missing = sorted(expected - set(catalog.OPTIONS))
    assert not missing, f"SessionOptions attributes the catalog lacks: {missing}"


def test_catalog_enums_and_structs_match_manifest():
    for name, members in catalog.ENUMS.items():
        assert list(members) == ENUMS.get(name), name
    for name, fields in catalog.STRUCTS.items():
        assert name in STRUCTS and fields == STRUCTS[name]["fields"], name
    used = {t.split(":", 1)[1].rstrip("]") for t in catalog.OPTIONS.values()
            if "enum:" in t or "struct:" in t}
    assert used <= set(catalog.ENUMS) | set(catalog.STRUCTS)
    for alias, current in catalog.DEPRECATED.items():
        assert alias in OPTIONS and current in OPTIONS
        assert OPTIONS[alias]["type"] == OPTIONS[current]["type"]


def test_catalog_defaults_load_into_strict_popart():
    # every catalog default, assigned the kit's way, passes PopART's type checks unchanged
    popart = make_popart_module()
    opts = popart.SessionOptions()
    before = _state(opts)
    for name in catalog.OPTIONS:
        if catalog.type_problem(name, catalog.DEFAULTS[name]) is None:
            catalog.assign(opts, popart, name, catalog.DEFAULTS[name])
    assert _state(opts) == before


# -- f. the options the typed fields control exist ---------------------------------------------


def test_controlled_options_exist():
    missing = sorted(set(catalog.CONTROLLED_OPTIONS) - set(OPTIONS))
    assert not missing, missing
    for name, _key in catalog.CONTROLLED_MAP_KEYS:
        assert OPTIONS[name]["type"] == "map[str,str]", name
    wrongly_elsewhere = sorted(set(catalog.ELSEWHERE) & set(OPTIONS))
    assert not wrongly_elsewhere, f"real SessionOptions attributes: {wrongly_elsewhere}"


# -- g. the recorder is strict, so the tests above can fail -----------------------------------


def test_strict_recorder_rejects_unknown_attribute():
    popart = make_popart_module()
    opts = popart.SessionOptions()
    with pytest.raises(AttributeError):
        opts.enableOutliningg = False
    with pytest.raises(AttributeError):
        opts.batchesPerStep = 4
    with pytest.raises(AttributeError):
        opts.notAnOption  # noqa: B018
    with pytest.raises(AttributeError):
        opts.updatableBuffers  # noqa: B018 - broken in PopART itself
    with pytest.raises(AttributeError):
        opts.executionPhaseSettings.phase = 2
    with pytest.raises(AttributeError):
        popart.NotAClass  # noqa: B018
    assert set_log(opts) == []


@pytest.mark.parametrize("name, value", [
    ("enableOutlining", 1),                        # bool is not int, nor int bool
    ("accumulationFactor", True),
    ("accumulationFactor", 2.0),
    ("outlineThreshold", "1.0"),
    ("logDir", None),
    ("virtualGraphMode", "Manual"),                # a name, not a member
    ("engineOptions", {"debug.instrument": True}),  # map values must be str
    ("engineOptions", [("a", "b")]),
    ("hardwareInstrumentations", ["Outer"]),       # a set must be a set
    ("customCodelets", ("a.cpp",)),                # a list must be a list
    ("bufferingDepthMap", {"x": True}),
    ("executionPhaseSettings", {"phases": 2}),     # a struct must be the struct class
])
def test_strict_recorder_rejects_wrong_type(name, value):
    opts = make_popart_module().SessionOptions()
    with pytest.raises(TypeError):
        setattr(opts, name, value)
    assert set_log(opts) == []


def test_strict_recorder_rejects_wrong_enum_and_struct_types():
    popart = make_popart_module()
    opts = popart.SessionOptions()
    with pytest.raises(TypeError):
        opts.virtualGraphMode = popart.RecomputationType.NoRecompute
    with pytest.raises(TypeError):
        opts.virtualGraphMode = make_popart_module().VirtualGraphMode.Manual  # another module's
    with pytest.raises(TypeError):
        opts.hardwareInstrumentations = {popart.SyncPattern.Full}
    with pytest.raises(TypeError):
        opts.executionPhaseSettings.weightIOSchedule = "OnDemand"
    with pytest.raises(TypeError):
        opts.weightTensorLocationSettings = popart.TensorLocation()
    with pytest.raises(TypeError):
        opts.weightTensorLocationSettings.location.shardingDomain = popart.TensorLocation()
    # the right types go through, and read back as PopART objects
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    opts.outlineThreshold = 3
    opts.hardwareInstrumentations = {popart.Instrumentation.Inner}
    opts.weightTensorLocationSettings.location.shardingDomain = popart.CommGroup(
        popart.CommGroupType.Consecutive, 2)
    assert opts.virtualGraphMode is popart.VirtualGraphMode.Manual
    assert opts.outlineThreshold == 3.0 and isinstance(opts.outlineThreshold, float)
    assert opts.weightTensorLocationSettings.location.shardingDomain.replicaGroupSize == 2
    assert [n for n, _ in set_log(opts)] == ["virtualGraphMode", "outlineThreshold",
                                             "hardwareInstrumentations"]


def test_strict_recorder_rejects_unknown_enum_member():
    popart = make_popart_module()
    with pytest.raises(AttributeError):
        popart.VirtualGraphMode.Bogus  # noqa: B018
    with pytest.raises(AttributeError):
        popart.RecomputationType.none  # noqa: B018 - the kit's spelling is not PopART's
    assert popart.SyncPattern.Full is popart.SyncPattern.Full
    assert popart.SyncPattern.Full != "Full" and popart.SyncPattern.Full.name == "Full"
    assert popart.SyncPattern.Full != popart.SyncPattern.SinglePipeline


def test_strict_recorder_defaults_and_pybind_copy_semantics():
    popart = make_popart_module()
    opts = popart.SessionOptions()
    assert _state(opts) == {n: s["default"] for n, s in OPTIONS.items()
                            if n not in BROKEN_OPTIONS}
    opts.bufferingDepthMap["x"] = 2           # pybind copies maps: lost
    assert opts.bufferingDepthMap == {}
    opts.engineOptions["a"] = "b"             # PopART's DictWrapper writes back
    assert opts.engineOptions == {"a": "b"} and opts._engineOptions == {"a": "b"}
    opts.executionPhaseSettings.phases = 3    # def_readwrite structs: by reference
    assert opts.executionPhaseSettings.phases == 3


def test_strict_device_manager_rejects_unknown_keywords():
    popart = make_popart_module()
    dm = popart.DeviceManager()
    with pytest.raises(TypeError):
        dm.acquireAvailableDevice(numIPUs=2)
    with pytest.raises(TypeError):
        dm.acquireAvailableDevice(numIpus=2, syncPattern=popart.SyncPattern.Full)
    with pytest.raises(TypeError):
        dm.acquireAvailableDevice(numIpus=2, pattern="Full")
    with pytest.raises(TypeError):
        dm.createIpuModelDevice(arg0={"numIPUs": "2"})  # positional only
    with pytest.raises(TypeError):
        dm.acquireDeviceById()  # id is required
    call = dm.acquireAvailableDevice(numIpus=4, tilesPerIpu=1472,
                                     pattern=popart.SyncPattern.SinglePipeline)
    assert call.kwargs["pattern"] is popart.SyncPattern.SinglePipeline
    assert dm.createIpuModelDevice({"numIPUs": "2"}).kwargs == {"arg0": {"numIPUs": "2"}}
    assert [c.method for c in dm.calls] == ["acquireAvailableDevice", "createIpuModelDevice"]
