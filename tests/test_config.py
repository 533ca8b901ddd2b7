"""SessionConfig: fields, defaults, aliases, immutability, files, and every validation rule."""

from __future__ import annotations

import copy
import json
import tempfile
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from strategies import config_dicts

import popart_kit as pk

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")


def locs(err: ValidationError) -> set[str]:
    return {".".join(map(str, e["loc"])) for e in err.errors()}


def rules(err: ValidationError) -> set[str]:
    return {e["type"].removeprefix("popart_kit.") for e in err.errors()}


def make(**kw: Any) -> pk.SessionConfig:
    kw.setdefault("mode", "training")
    return pk.SessionConfig(**kw)


# -- fields ---------------------------------------------------------------------------------------


def test_defaults_match_popart():
    cfg = make()
    assert cfg.batches_per_step == 1
    assert cfg.ipus_per_replica == 1
    assert cfg.virtual_graph_mode == "off"
    assert cfg.accumulation == pk.Accumulation(factor=1, reduction="sum", mean_strategy="post")
    assert cfg.replication == pk.Replication(local_factor=1, global_factor=None, global_offset=0)
    assert cfg.pipeline == pk.Pipeline(enabled=False, stages=None, recomputation="none")
    assert cfg.device.target == "ipu" and cfg.device.sync_pattern == "full"
    assert cfg.popart_options == {}


def test_mode_is_required():
    with pytest.raises(ValidationError) as info:
        pk.SessionConfig()
    assert locs(info.value) == {"mode"}


def test_virtual_graph_mode_resolves_from_ipus_per_replica():
    assert make(ipus_per_replica=2).virtual_graph_mode == "manual"
    assert make(ipus_per_replica=1).virtual_graph_mode == "off"
    assert make(ipus_per_replica=2, virtual_graph_mode="auto").virtual_graph_mode == "auto"


def test_device_iterations_is_an_alias_of_batches_per_step():
    assert make(device_iterations=300).batches_per_step == 300
    with pytest.raises(ValueError, match="device_iterations=3 and batches_per_step=4"):
        make(device_iterations=3, batches_per_step=4)


def test_popart_spellings_are_accepted():
    cfg = make(ipus_per_replica=2, virtual_graph_mode="ExecutionPhases",
               device={"sync_pattern": "ReplicaAndLadder", "connection": "OnDemand"},
               pipeline={"recomputation": "RecomputeAll"},
               popart_options={"executionPhaseSettings": {"phases": 2}})
    assert cfg.virtual_graph_mode == "execution_phases"
    assert cfg.device.sync_pattern == "replica_and_ladder"
    assert cfg.device.connection == "on_demand"
    assert cfg.pipeline.recomputation == "recompute_all"


def test_models_are_immutable():
    cfg = make()
    with pytest.raises(ValidationError):
        cfg.batches_per_step = 2
    with pytest.raises(ValidationError):
        cfg.replication.local_factor = 2


@pytest.mark.parametrize("data, loc", [
    ({"replicas": 2}, "replicas"),
    ({"replication": {"factor": 2}}, "replication.factor"),
    ({"device": {"ipus": 2}}, "device.ipus"),
])
def test_unknown_keys_are_rejected(data, loc):
    with pytest.raises(ValidationError) as info:
        make(**data)
    assert loc in locs(info.value)


def test_strict_types():
    with pytest.raises(ValidationError) as info:
        make(batches_per_step="4", pipeline={"enabled": "yes"})
    assert locs(info.value) == {"batches_per_step", "pipeline.enabled"}


def test_global_factor_equal_to_local_is_not_distributed():
    rep = pk.Replication(local_factor=4, global_factor=4)
    assert rep.global_factor is None and not rep.is_distributed and rep.instances == 1


def test_replication_derived_numbers():
    rep = pk.Replication(local_factor=2, global_factor=8, global_offset=4)
    assert (rep.instances, rep.instance_index, rep.is_distributed) == (4, 2, True)
    assert list(rep.replica_ids) == [4, 5]
    assert rep.global_replicas == 8


# -- rules: one broken config per rule, and its passing neighbour ---------------------------------

PIPE4 = {"ipus_per_replica": 4, "pipeline": {"enabled": True, "stages": 4}}
CASES: list[tuple[str, dict[str, Any], str, str, dict[str, Any]]] = [
    # name, broken config, expected loc, expected rule, fixed config
    ("global below local", {"replication": {"local_factor": 4, "global_factor": 2}},
     "replication.global_factor", "K-replication-global-below-local",
     {"replication": {"local_factor": 4, "global_factor": 8}}),
    ("global not multiple", {"replication": {"local_factor": 2, "global_factor": 6 + 1}},
     "replication.global_factor", "K-replication-global-multiple",
     {"replication": {"local_factor": 2, "global_factor": 6}}),
    ("offset not multiple", {"replication": {"local_factor": 2, "global_factor": 8,
                                             "global_offset": 3}},
     "replication.global_offset", "K-replication-offset-multiple",
     {"replication": {"local_factor": 2, "global_factor": 8, "global_offset": 2}}),
    ("offset past the end", {"replication": {"local_factor": 2, "global_factor": 8,
                                             "global_offset": 8}},
     "replication.global_offset", "K-replication-offset-range",
     {"replication": {"local_factor": 2, "global_factor": 8, "global_offset": 6}}),
    ("offset without global", {"replication": {"local_factor": 2, "global_offset": 2}},
     "replication.global_offset", "K-replication-offset-without-global",
     {"replication": {"local_factor": 2, "global_factor": 4, "global_offset": 2}}),
    ("negative offset", {"replication": {"global_offset": -1}},
     "replication.global_offset", "greater_than_equal", {"replication": {"global_offset": 0}}),
    ("pipelining on one IPU", {"pipeline": {"enabled": True}},
     "ipus_per_replica", "V1", {"ipus_per_replica": 2, "pipeline": {"enabled": True}}),
    ("pipelining without virtual graphs", {"ipus_per_replica": 2, "virtual_graph_mode": "off",
                                           "pipeline": {"enabled": True}},
     "virtual_graph_mode", "V2", {"ipus_per_replica": 2, "pipeline": {"enabled": True}}),
    ("virtual graphs off on two IPUs", {"ipus_per_replica": 2, "virtual_graph_mode": "off"},
     "virtual_graph_mode", "V23", {"ipus_per_replica": 2, "virtual_graph_mode": "auto"}),
    ("training accumulation below depth", PIPE4 | {"accumulation": {"factor": 6}},
     "accumulation.factor", "V6", PIPE4 | {"accumulation": {"factor": 7}}),
    ("training bps below depth", PIPE4 | {"batches_per_step": 6},
     "batches_per_step", "V7", PIPE4 | {"batches_per_step": 7}),
    ("inference bps below depth", PIPE4 | {"mode": "inference", "batches_per_step": 3},
     "batches_per_step", "V7", PIPE4 | {"mode": "inference", "batches_per_step": 4}),
    ("inference with accumulation", {"mode": "inference", "accumulation": {"factor": 2}},
     "accumulation.factor", "V18", {"mode": "inference"}),
    ("replication on the IPU model", {"replication": {"local_factor": 2},
                                      "device": {"target": "ipu_model"}},
     "replication.local_factor", "K-replication-target", {"device": {"target": "ipu_model"}}),
    ("global replication on the CPU", {"replication": {"global_factor": 2, "global_offset": 1},
                                       "device": {"target": "cpu"}},
     "replication.global_factor", "K-replication-target",
     {"replication": {"global_factor": 2, "global_offset": 1}, "device": {"target": "offline"}}),
    ("sync pattern on a host device",
     {"device": {"target": "cpu", "sync_pattern": "single_pipeline"}},
     "device.sync_pattern", "K-sync-pattern-host", {"device": {"target": "cpu"}}),
    ("two IPUs on the CPU", {"ipus_per_replica": 2, "device": {"target": "cpu"}},
     "ipus_per_replica", "K-cpu-one-ipu", {"ipus_per_replica": 2,
                                           "device": {"target": "ipu_model"}}),
    ("hardware that never attaches", {"device": {"connection": "never"}},
     "device.connection", "K-connection-never",
     {"device": {"target": "offline", "connection": "never"}}),
    ("not a power of two", {"ipus_per_replica": 3},
     "device.round_to_power_of_two", "K-power-of-two",
     {"ipus_per_replica": 3, "device": {"round_to_power_of_two": True}}),
    ("rounding splits replicas unevenly",
     {"ipus_per_replica": 2, "replication": {"local_factor": 3},
      "device": {"round_to_power_of_two": True}},
     "replication.local_factor", "V22",
     {"ipus_per_replica": 3, "replication": {"local_factor": 2},
      "device": {"round_to_power_of_two": True}}),
    ("more than 64 IPUs", {"ipus_per_replica": 4, "replication": {"local_factor": 32}},
     "replication.local_factor", "K-max-ipus",
     {"ipus_per_replica": 4, "replication": {"local_factor": 16, "global_factor": 32}}),
    ("unknown popart option", {"popart_options": {"enablePipeline": True}},
     "popart_options.enablePipeline", "K-option-unknown",
     {"popart_options": {"enableOutlining": True}}),
    ("controlled popart option", {"popart_options": {"replicatedGraphCount": 2}},
     "popart_options.replicatedGraphCount", "K-option-controlled",
     {"replication": {"local_factor": 2}}),
    ("controlled engine option", {"popart_options": {"engineOptions": {"autoReport.all": "true"}}},
     "popart_options.engineOptions.autoReport.all", "K-option-controlled",
     {"profiling": {"auto_report_dir": "reports"}}),
    ("a DataFlow name in popart_options", {"popart_options": {"batchesPerStep": 4}},
     "popart_options.batchesPerStep", "K-option-elsewhere", {"batches_per_step": 4}),
    ("wrongly typed popart option", {"popart_options": {"enableOutlining": "yes"}},
     "popart_options.enableOutlining", "K-option-type",
     {"popart_options": {"enableOutlining": False}}),
    ("unquoted Poplar option", {"popart_options": {"engineOptions": {"debug.instrument": True}}},
     "popart_options.engineOptions", "K-option-type",
     {"popart_options": {"engineOptions": {"debug.instrument": "true"}}}),
    ("unknown enum member", {"popart_options": {"syntheticDataMode": "Random"}},
     "popart_options.syntheticDataMode", "K-option-type",
     {"popart_options": {"syntheticDataMode": "RandomNormal"}}),
    ("unknown struct field", {"popart_options": {"batchSerializationSettings": {"size": 2}}},
     "popart_options.batchSerializationSettings", "K-option-type",
     {"popart_options": {"batchSerializationSettings": {"factor": 2}}}),
    ("explicit main loops without host copy ops",
     {"popart_options": {"enableExplicitMainLoops": True}},
     "popart_options.enableExplicitMainLoops", "V12",
     {"popart_options": {"enableExplicitMainLoops": True, "useHostCopyOps": True}}),
    ("explicit pipelining without explicit recomputation",
     PIPE4 | {"accumulation": {"factor": 8},
              "popart_options": {"enableExplicitMainLoops": True, "useHostCopyOps": True}},
     "popart_options.explicitRecomputation", "V11",
     PIPE4 | {"accumulation": {"factor": 8},
              "popart_options": {"enableExplicitMainLoops": True, "useHostCopyOps": True,
                                 "explicitRecomputation": True}}),
    ("alias zero copy with implicit pipelining",
     PIPE4 | {"accumulation": {"factor": 8}, "popart_options": {"aliasZeroCopy": True}},
     "popart_options.aliasZeroCopy", "V17", PIPE4 | {"accumulation": {"factor": 8}}),
    ("split ratios that do not sum to one",
     {"ipus_per_replica": 2, "virtual_graph_mode": "auto",
      "popart_options": {"virtualGraphSplitRatios": [0.5, 0.4]}},
     "popart_options.virtualGraphSplitRatios", "V28",
     {"ipus_per_replica": 2, "virtual_graph_mode": "auto",
      "popart_options": {"virtualGraphSplitRatios": [0.6, 0.4]}}),
    ("execution phases without the mode",
     {"ipus_per_replica": 2, "popart_options": {"executionPhaseSettings": {"phases": 4}}},
     "virtual_graph_mode", "V29",
     {"ipus_per_replica": 2, "virtual_graph_mode": "execution_phases",
      "popart_options": {"executionPhaseSettings": {"phases": 4}}}),
    ("loop batch serialisation forward in training",
     {"popart_options": {"batchSerializationSettings": {"factor": 2, "method": "Loop"}}},
     "popart_options.batchSerializationSettings.method", "V38",
     {"popart_options": {"batchSerializationSettings": {"factor": 2, "method": "Loop",
                                                        "transformContext": "Bwd"}}}),
    ("odd IO tiles", {"ipus_per_replica": 2, "popart_options": {"numIOTiles": 33}},
     "popart_options.numIOTiles", "V40",
     {"ipus_per_replica": 2, "popart_options": {"numIOTiles": 32}}),
    ("unknown gcl option", {"popart_options": {"gclOptions": {"syncless": "true"}}},
     "popart_options.gclOptions.syncless", "V41",
     {"popart_options": {"gclOptions": {"useSynclessCollectives": "true"}}}),
    ("modify checking with replicas", {"replication": {"local_factor": 2},
                                       "popart_options": {"opxModifyChecking": True}},
     "popart_options.opxModifyChecking", "V42", {"popart_options": {"opxModifyChecking": True}}),
    ("buffering depth zero", {"popart_options": {"defaultBufferingDepth": 0}},
     "popart_options.defaultBufferingDepth", "V43",
     {"popart_options": {"defaultBufferingDepth": 2}}),
    ("buffering depth zero under the deprecated name",
     {"popart_options": {"defaultPrefetchBufferingDepth": 0}},
     "popart_options.defaultPrefetchBufferingDepth", "V43",
     {"popart_options": {"defaultPrefetchBufferingDepth": 1}}),
    ("deep buffers for one host-rearranged stream",
     {"popart_options": {"bufferingDepthMap": {"x": 3}, "rearrangeStreamsOnHost": True}},
     "popart_options.bufferingDepthMap.x", "V43",
     {"popart_options": {"bufferingDepthMap": {"x": 3}}}),
    ("matmul partials that contradict precision",
     {"precision": {"partials_type": "half"},
      "popart_options": {"matmulOptions": {"partialsType": "float"}}},
     "popart_options.matmulOptions.partialsType", "K-partials-conflict",
     {"precision": {"partials_type": "half"},
      "popart_options": {"matmulOptions": {"partialsType": "half"}}}),
    ("the enableExplicitIR method in popart_options",
     {"popart_options": {"enableExplicitIR": True}}, "popart_options.enableExplicitIR",
     "K-option-elsewhere", {"popart_options": {"useHostCopyOps": True}}),
    ("deep buffers on host-rearranged streams",
     {"popart_options": {"defaultBufferingDepth": 2, "rearrangeStreamsOnHost": True}},
     "popart_options.defaultBufferingDepth", "V43",
     {"popart_options": {"defaultBufferingDepth": 1, "rearrangeStreamsOnHost": True}}),
]


@pytest.mark.parametrize("name, broken, loc, rule, fixed", CASES, ids=[c[0] for c in CASES])
def test_rule(name, broken, loc, rule, fixed):
    with pytest.raises(ValidationError) as info:
        make(**broken)
    assert loc in locs(info.value), str(info.value)
    assert rule in rules(info.value), str(info.value)
    make(**fixed)  # the neighbour passes


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValidationError) as info:
        make(mode="inference", batches_per_step=2, ipus_per_replica=3,
             accumulation={"factor": 4}, pipeline={"enabled": True, "stages": 4},
             device={"connection": "never"},
             popart_options={"enablePipeline": True, "accumulationFactor": 4})
    assert locs(info.value) == {
        "accumulation.factor", "batches_per_step", "device.connection",
        "device.round_to_power_of_two", "popart_options.enablePipeline",
        "popart_options.accumulationFactor"}


def test_every_section_problem_is_reported_at_once():
    with pytest.raises(ValidationError) as info:
        make(batches_per_step=0, replication={"local_factor": 2, "global_factor": 7,
                                              "global_offset": 3},
             device={"target": "gpu"}, accumulation={"reduction": "max"})
    assert locs(info.value) == {"batches_per_step", "replication.global_factor",
                                "replication.global_offset", "device.target",
                                "accumulation.reduction"}


def test_section_and_config_problems_are_reported_together():
    with pytest.raises(ValidationError) as info:
        make(replication={"local_factor": 2, "global_factor": 3}, pipeline={"enabled": True})
    assert locs(info.value) == {"replication.global_factor", "ipus_per_replica"}


def test_section_problems_are_reported_with_other_field_errors():
    with pytest.raises(ValidationError) as info:
        make(batches_per_step=0, replication={"local_factor": 2, "global_offset": 2})
    assert locs(info.value) == {"batches_per_step", "replication.global_offset"}


def test_a_standalone_section_checks_its_own_rules():
    with pytest.raises(ValidationError) as info:
        pk.Replication(local_factor=2, global_factor=3)
    assert locs(info.value) == {"global_factor"}


def test_wrongly_typed_options_do_not_crash_the_rules():
    with pytest.raises(ValidationError) as info:
        make(ipus_per_replica=2, virtual_graph_mode="auto",
             popart_options={"virtualGraphSplitRatios": ["a", "b"], "numIOTiles": "32",
                             "executionPhaseSettings": {"phases": "4"}})
    assert rules(info.value) == {"K-option-type"}


@pytest.mark.parametrize("kw, fix", [
    ({"ipus_per_replica": 128}, "split the model over 64 or fewer IPUs per replica"),
    ({"ipus_per_replica": 4, "replication": {"local_factor": 24},
      "device": {"round_to_power_of_two": True}},
     "local_factor=12 with global_factor=24 is 2 instances"),
    ({"ipus_per_replica": 4, "replication": {"local_factor": 32, "global_factor": 64}},
     "local_factor=16 with global_factor=64 is 4 instances"),
])
def test_too_many_ipus_suggests_a_valid_split(kw, fix):
    with pytest.raises(ValidationError) as info:
        make(**kw)
    msgs = [e["msg"] for e in info.value.errors() if e["type"] == "popart_kit.K-max-ipus"]
    assert len(msgs) == 1 and fix in msgs[0], msgs


def test_too_many_ipus_states_the_product():
    with pytest.raises(ValidationError, match="local_factor=24 × ipus_per_replica=4 = 96 IPUs, "
                                              "128 after rounding"):
        make(ipus_per_replica=4, replication={"local_factor": 24},
             device={"round_to_power_of_two": True})


def test_messages_state_numbers_and_fix():
    with pytest.raises(ValidationError) as info:
        make(**PIPE4, accumulation={"factor": 6})
    msg = info.value.errors()[0]["msg"]
    assert "accumulation.factor=6" in msg and "depth 7" in msg and "2×4−1" in msg
    assert "Fix: set accumulation.factor >= 7" in msg

    with pytest.raises(ValidationError) as info:
        pk.Replication(local_factor=2, global_factor=8, global_offset=3)
    assert "use one of 0, 2, 4, 6" in info.value.errors()[0]["msg"]

    with pytest.raises(ValidationError) as info:
        make(ipus_per_replica=3, replication={"local_factor": 2})
    assert "2 × ipus_per_replica=3 = 6" in str(info.value) and "request 8" in str(info.value)


def test_unknown_option_suggests_close_match():
    with pytest.raises(ValidationError, match="did you mean 'enableStochasticRounding'"):
        make(popart_options={"enableStocasticRounding": True})


# -- warnings -----------------------------------------------------------------------------------


def _warnings_of(**kw: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = make(**kw)
    emitted = [str(w.message) for w in caught if issubclass(w.category, pk.PopartKitWarning)]
    assert emitted == list(cfg.warnings)
    return emitted


@pytest.mark.parametrize("kw, rule", [
    (PIPE4 | {"accumulation": {"factor": 8}}, "K-bubble"),            # 6 / 14 = 43 %
    (PIPE4 | {"batches_per_step": 64}, "K-stale-weights"),
    ({"pipeline": {"stages": 2}}, "V3"),
    ({"pipeline": {"recomputation": "pipeline"}}, "K-recompute-pipeline"),
    ({"accumulation": {"mean_strategy": "running"}}, "K-mean-strategy"),
    ({"ipus_per_replica": 2, "virtual_graph_mode": "execution_phases"}, "V30"),
    ({"popart_options": {"executionPhaseSettings": {"phases": 1}}}, "V30"),
    ({"device": {"target": "ipu_model", "round_to_power_of_two": True}}, "K-rounding-target"),
    ({"popart_options": {"defaultPrefetchBufferingDepth": 1}}, "K-option-deprecated"),
    ({"device": {"target": "cpu"}, "popart_options": {"enableEngineCaching": True}},
     "K-caching-target"),
])
def test_warnings(kw, rule):
    assert any(w.endswith(f"[{rule}] (see docs/rules.md#{rule})") for w in _warnings_of(**kw))


def test_no_warning_for_a_healthy_pipeline():
    assert _warnings_of(**PIPE4, accumulation={"factor": 64}) == []   # bubble 6 / 70 = 8.6 %


# -- properties over generated configs ------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(config_dicts())
def test_generated_valid_configs_validate(data):
    cfg = pk.SessionConfig.model_validate(data)
    assert pk.SessionConfig.model_validate(cfg.model_dump()) == cfg


Mutation = Callable[[dict[str, Any]], "dict[str, Any] | None"]


def _set(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return data


def _rep(d: dict[str, Any]) -> dict[str, Any]:
    return d["replication"]


def _pipelined_stages(d: dict[str, Any]) -> int | None:
    pipe = d.get("pipeline", {})
    return pipe.get("stages") if pipe.get("enabled") else None


MUTATIONS: dict[str, tuple[Mutation, str]] = {
    "offset not a multiple": (
        lambda d: _set(d, "replication.global_offset", _rep(d)["global_offset"] + 1)
        if "global_factor" in _rep(d) and _rep(d)["local_factor"] > 1 else None,
        "replication.global_offset"),
    "offset past the end": (
        lambda d: _set(d, "replication.global_offset", _rep(d)["global_factor"])
        if "global_factor" in _rep(d) else None, "replication.global_offset"),
    "global not a multiple": (
        lambda d: _set(d, "replication", {"local_factor": _rep(d)["local_factor"],
                                          "global_factor": 3 * _rep(d)["local_factor"] + 1})
        if _rep(d)["local_factor"] > 1 else None, "replication.global_factor"),
    "offset without global": (
        lambda d: _set(d, "replication", {"local_factor": _rep(d)["local_factor"],
                                          "global_offset": _rep(d)["local_factor"]}),
        "replication.global_offset"),
    "zero batches": (
        lambda d: _set({k: v for k, v in d.items() if k != "device_iterations"},
                       "batches_per_step", 0), "batches_per_step"),
    "accumulation in inference": (
        lambda d: _set(d, "accumulation", {"factor": 2}) if d["mode"] == "inference" else None,
        "accumulation.factor"),
    "accumulation below depth": (
        lambda d: _set(d, "accumulation.factor", 2 * d["pipeline"]["stages"] - 2)
        if _pipelined_stages(d) and d["mode"] == "training"
        and d["accumulation"]["factor"] > 1 else None, "accumulation.factor"),
    "batches below depth": (
        lambda d: _set({k: v for k, v in d.items() if k != "device_iterations"},
                       "batches_per_step", d["pipeline"]["stages"] - 1)
        if _pipelined_stages(d) and d["mode"] == "inference" else None,
        "batches_per_step"),
    "pipeline on one IPU": (
        lambda d: {**_set(d, "pipeline.enabled", True), "ipus_per_replica": 1,
                   "device": {"target": "ipu"}, "replication": {"local_factor": 1}},
        "ipus_per_replica"),
    "no power of two": (
        lambda d: {**d, "ipus_per_replica": 3, "replication": {"local_factor": 1},
                   "device": {"target": "ipu"}}, "device.round_to_power_of_two"),
    "replicas on the IPU model": (
        lambda d: {**d, "replication": {"local_factor": 2}, "device": {"target": "ipu_model"}},
        "replication.local_factor"),
    "never attached hardware": (
        lambda d: _set(d, "device.connection", "never") if d["device"]["target"] == "ipu"
        else None, "device.connection"),
    "unknown option": (
        lambda d: _set(d, "popart_options.enableOutline", True), "popart_options.enableOutline"),
    "controlled option": (
        lambda d: _set(d, "popart_options.globalReplicaOffset", 0),
        "popart_options.globalReplicaOffset"),
    "unknown field": (lambda d: {**d, "replicas": 2}, "replicas"),
    "unknown sync pattern": (lambda d: _set(d, "device.sync_pattern", "ladder"),
                             "device.sync_pattern"),
}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(config_dicts(), st.sampled_from(sorted(MUTATIONS)))
def test_generated_invalid_configs_name_the_field(data, mutation):
    mutate, loc = MUTATIONS[mutation]
    broken = mutate(data)
    assume(broken is not None)
    with pytest.raises(ValidationError) as info:
        pk.SessionConfig.model_validate(broken)
    assert loc in locs(info.value), f"{mutation}: {info.value}"


# -- files ----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(config_dicts(), st.sampled_from([".toml", ".yaml", ".yml", ".json"]))
def test_files_round_trip(data, suffix):
    cfg = pk.SessionConfig.model_validate(data)
    with tempfile.TemporaryDirectory() as tmp:
        path = cfg.to_file(Path(tmp) / f"session{suffix}")
        assert pk.SessionConfig.from_file(path) == cfg


def test_from_file_reports_unknown_suffix_and_bad_top_level(tmp_path):
    with pytest.raises(ValueError, match="unknown configuration format '.ini'"):
        pk.SessionConfig.from_file(tmp_path / "a.ini")
    path = tmp_path / "a.json"
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="expected a table of settings"):
        pk.SessionConfig.from_file(path)


@pytest.mark.parametrize("path", sorted(Path(__file__).parent.parent.glob("examples/configs/*")))
def test_example_configs_are_valid(path):
    assert pk.SessionConfig.from_file(path).plan()


@pytest.mark.parametrize("path", sorted(Path(__file__).parent.parent.glob("examples/configs/*")))
def test_example_configs_satisfy_the_published_schema(path):
    schema = pk.SessionConfig.model_json_schema()
    raw = {".toml": tomllib.loads, ".yaml": yaml.safe_load}[path.suffix](path.read_text())
    jsonschema.validate(raw, schema)  # as written, aliases included
    written = pk.SessionConfig.from_file(path).model_dump(mode="json", exclude_none=True)
    jsonschema.validate(written, schema)  # as to_file writes it


def test_json_schema_lists_sections_and_choices():
    schema = pk.SessionConfig.model_json_schema()
    assert {"mode", "batches_per_step", "replication", "pipeline", "popart_options"} <= set(
        schema["properties"])
    device = schema["$defs"]["Device"]["properties"]
    assert device["sync_pattern"]["enum"] == ["full", "single_pipeline", "replica_and_ladder"]


def test_updated_rederives_virtual_graph_mode():
    cfg = make(ipus_per_replica=2)
    assert cfg.updated(ipus_per_replica=1).virtual_graph_mode == "off"
    explicit = make(ipus_per_replica=2, virtual_graph_mode="auto")
    assert explicit.updated(ipus_per_replica=4).virtual_graph_mode == "auto"
