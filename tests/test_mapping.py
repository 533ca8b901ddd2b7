"""SessionConfig -> PopART values and back (the strict API checks live in tests/contract)."""

from __future__ import annotations

import sys
import types

import pytest
from hypothesis import given, settings
from strategies import config_dicts

import popart_kit as pk
from popart_kit._config.mapping import import_popart

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")


def make(**kw) -> pk.SessionConfig:
    kw.setdefault("mode", "training")
    return pk.SessionConfig(**kw)


@pytest.mark.parametrize("replication, flags", [
    ({}, (False, 1, False, 1, 0)),
    ({"local_factor": 2}, (True, 2, False, 1, 0)),
    # one local replica per instance: enableReplicatedGraphs must stay False (PopART V35)
    ({"local_factor": 1, "global_factor": 4, "global_offset": 3}, (False, 1, True, 4, 3)),
    ({"local_factor": 2, "global_factor": 8, "global_offset": 2}, (True, 2, True, 8, 2)),
    ({"local_factor": 4, "global_factor": 4}, (True, 4, False, 1, 0)),
])
def test_replication_flags_follow_popart(replication, flags):
    d = make(replication=replication).to_popart_dict()
    assert (d["enableReplicatedGraphs"], d["replicatedGraphCount"],
            d["enableDistributedReplicatedGraphs"], d["globalReplicationFactor"],
            d["globalReplicaOffset"]) == flags


def test_every_controlled_option_is_explicit_even_when_default():
    d = make().to_popart_dict()
    assert d["enableGradientAccumulation"] is False and d["accumulationFactor"] == 1
    assert d["virtualGraphMode"] == "Off" and d["autoRecomputation"] == "NoRecompute"
    assert d["accumulationAndReplicationReductionType"] == "Sum"
    assert d["meanAccumulationAndReplicationReductionStrategy"] == "Post"
    assert d["partialsTypeMatMuls"] == "" and d["engineOptions"] == {}


def test_enum_values_are_popart_member_names():
    d = make(ipus_per_replica=4, accumulation={"factor": 8, "reduction": "mean",
                                               "mean_strategy": "running"},
             pipeline={"enabled": True, "stages": 4, "recomputation": "norm_only"}).to_popart_dict()
    assert (d["virtualGraphMode"], d["autoRecomputation"]) == ("Manual", "NormOnly")
    assert d["accumulationAndReplicationReductionType"] == "Mean"
    assert d["meanAccumulationAndReplicationReductionStrategy"] == "Running"
    assert (d["enablePipelining"], d["enableGradientAccumulation"]) == (True, True)


def test_profiling_and_precision_merge_into_poplar_option_maps():
    d = make(profiling={"auto_report_dir": "reports", "cycle_counter": True},
             precision={"partials_type": "half", "stochastic_rounding": True},
             popart_options={"engineOptions": {"target.hostSyncTimeout": "600"},
                             "convolutionOptions": {"availableMemoryProportion": "0.3"},
                             "enableOutlining": False}).to_popart_dict()
    assert d["engineOptions"] == {"target.hostSyncTimeout": "600", "autoReport.all": "true",
                                  "autoReport.directory": "reports"}
    assert d["convolutionOptions"] == {"availableMemoryProportion": "0.3", "partialsType": "half"}
    assert d["partialsTypeMatMuls"] == "half"
    assert d["enableStochasticRounding"] is True
    assert d["instrumentWithHardwareCycleCounter"] is True
    assert d["enableOutlining"] is False


def test_device_request():
    cfg = make(ipus_per_replica=3, replication={"local_factor": 2},
               device={"round_to_power_of_two": True, "sync_pattern": "replica_and_ladder",
                       "connection": "on_demand", "tiles_per_ipu": 1472, "selection": "random"})
    assert cfg.device_request() == {"numIpus": 8, "tilesPerIpu": 1472,
                                    "pattern": "ReplicaAndLadder", "connectionType": "OnDemand",
                                    "selectionCriterion": "Random"}
    with pytest.raises(ValueError, match="createIpuModelDevice"):
        make(device={"target": "ipu_model"}).device_request()


@settings(max_examples=120, deadline=None)
@given(config_dicts())
def test_round_trip_through_the_options_dict(data):
    cfg = pk.SessionConfig.model_validate(data)
    rest = {"mode": cfg.mode, "batches_per_step": cfg.batches_per_step,
            "ipus_per_replica": cfg.ipus_per_replica, "device": cfg.device,
            "micro_batch_size": cfg.micro_batch_size, "pipeline": {"stages": cfg.pipeline.stages}}
    again = pk.SessionConfig.from_session_options(cfg.to_popart_dict(), **rest)
    assert again == cfg
    assert again.to_popart_dict() == cfg.to_popart_dict()


@pytest.mark.parametrize("opts, message", [
    ({"enableGradientAccumulation": False, "accumulationFactor": 4}, "V19"),
    ({"enableReplicatedGraphs": False, "replicatedGraphCount": 2}, "V21"),
    ({"partialsTypeMatMuls": "half", "convolutionOptions": {"partialsType": "float"}},
     "precision.partials_type sets both"),
    ({"enableOutlinning": True}, "not SessionOptions attributes"),
    ({"engineOptions": {"autoReport.all": "false", "autoReport.directory": "d"}},
     "autoReport.directory='d' without autoReport.all='true'"),
    ({"accumulationAndReplicationReductionType": "NoReduction"},
     "'NoReduction' leaves gradients unreduced"),
])
def test_from_session_options_refuses_inconsistent_options(opts, message):
    with pytest.raises(ValueError, match=message):
        pk.SessionConfig.from_session_options(opts, mode="training")


def test_from_session_options_reads_foreign_options():
    cfg = pk.SessionConfig.from_session_options(
        {"enableReplicatedGraphs": True, "replicatedGraphCount": 4,
         "engineOptions": {"autoReport.all": "true", "debug.instrument": "true"},
         "partialsTypeMatMuls": "Half", "syntheticDataMode": "Zeros", "virtualGraphMode": "Auto"},
        mode="inference", ipus_per_replica=2)
    assert cfg.replication.local_factor == 4
    assert cfg.profiling.auto_report_dir == "."
    assert cfg.precision.partials_type == "half"
    assert cfg.popart_options == {"engineOptions": {"debug.instrument": "true"},
                                  "syntheticDataMode": "Zeros"}
    assert cfg.virtual_graph_mode == "auto"


@pytest.mark.parametrize("engine, report_dir, rest", [
    ({"autoReport.all": "true", "autoReport.directory": "out"}, "out", {}),
    ({"autoReport.all": "true"}, ".", {}),
    ({"autoReport.all": "false"}, None, {}),
    ({"autoReport.all": "false", "autoReport.outputGraphProfile": "true"}, None,
     {"engineOptions": {"autoReport.outputGraphProfile": "true"}}),
])
def test_auto_report_options_map_to_profiling(engine, report_dir, rest):
    cfg = pk.SessionConfig.from_session_options({"engineOptions": engine}, mode="training")
    assert cfg.profiling.auto_report_dir == report_dir
    assert cfg.popart_options == rest


def test_from_session_options_validates_the_result():
    # PopART's default virtualGraphMode (Off) cannot drive a 2-IPU replica
    with pytest.raises(ValueError, match="V23"):
        pk.SessionConfig.from_session_options({}, mode="inference", ipus_per_replica=2)


def test_without_the_sdk_the_error_says_where_popart_comes_from(monkeypatch):
    monkeypatch.setitem(sys.modules, "popart", None)  # import popart -> ImportError
    with pytest.raises(ImportError, match="ships only inside the Poplar SDK"):
        make().to_session_options()


def test_the_unrelated_pypi_popart_is_recognised(monkeypatch):
    monkeypatch.setitem(sys.modules, "popart", types.ModuleType("popart"))
    with pytest.raises(ImportError, match="PyPI package called popart is unrelated"):
        import_popart()
