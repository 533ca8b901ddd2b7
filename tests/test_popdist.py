"""The POPDIST_* environment: reading what poprun sets, and writing it back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from strategies import config_dicts

import popart_kit as pk

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

# From the poprun launch log in seed 004 (--num-replicas 16 --ipus-per-replica 4, one instance).
POD64_ENV = {
    "POPDIST_NUM_TOTAL_REPLICAS": "16", "POPDIST_NUM_IPUS_PER_REPLICA": "4",
    "POPDIST_NUM_LOCAL_REPLICAS": "16", "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "1",
    "POPDIST_REPLICA_INDEX_OFFSET": "0", "POPDIST_LOCAL_INSTANCE_INDEX": "0",
    "IPUOF_VIPU_API_PARTITION_ID": "p-bert-poprun-64ipus-gc-dev-0",
}


def instance_env(total: int, local: int, offset: int, ipus: int) -> dict[str, str]:
    return {"POPDIST_NUM_TOTAL_REPLICAS": str(total), "POPDIST_NUM_LOCAL_REPLICAS": str(local),
            "POPDIST_REPLICA_INDEX_OFFSET": str(offset),
            "POPDIST_NUM_IPUS_PER_REPLICA": str(ipus)}


def test_pod64_single_instance():
    rep = pk.Replication.from_popdist_env(POD64_ENV)
    assert rep == pk.Replication(local_factor=16)
    assert not rep.is_distributed and rep.instances == 1


@pytest.mark.parametrize("offset", [0, 2, 4, 6])
def test_four_instances(offset):
    # poprun --num-replicas 8 --num-instances 4 --ipus-per-replica 2
    env = instance_env(8, 2, offset, 2)
    rep = pk.Replication.from_popdist_env(env)
    assert (rep.global_factor, rep.instances, rep.instance_index) == (8, 4, offset // 2)
    cfg = pk.SessionConfig(mode="training").with_popdist_env(env)
    assert cfg.ipus_per_replica == 2 and cfg.virtual_graph_mode == "manual"
    assert cfg.replication == rep
    assert cfg.to_popart_dict()["globalReplicaOffset"] == offset


def test_reads_os_environ(monkeypatch):
    for name, value in instance_env(4, 2, 2, 1).items():
        monkeypatch.setenv(name, value)
    assert pk.Replication.from_popdist_env().global_offset == 2


def test_not_under_poprun():
    with pytest.raises(ValueError, match="not launched by poprun"):
        pk.Replication.from_popdist_env({"PATH": "/bin"})


def test_every_missing_or_malformed_variable_is_reported():
    env = {"POPDIST_NUM_TOTAL_REPLICAS": "eight", "POPDIST_NUM_LOCAL_REPLICAS": "0",
           "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "0"}
    with pytest.raises(ValueError) as info:
        pk.PopdistEnv.read(env)
    msg = str(info.value)
    for part in ("POPDIST_REPLICA_INDEX_OFFSET is missing",
                 "POPDIST_NUM_IPUS_PER_REPLICA is missing",
                 "POPDIST_NUM_TOTAL_REPLICAS='eight' is not an integer",
                 "POPDIST_NUM_LOCAL_REPLICAS=0 is below 1",
                 "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE='0'"):
        assert part in msg


def test_inconsistent_numbers_name_the_variables():
    with pytest.raises(ValueError) as info:
        pk.PopdistEnv.read(instance_env(8, 2, 3, 1))
    msg = str(info.value)
    assert "POPDIST_REPLICA_INDEX_OFFSET=3" in msg and "not a multiple of local_factor=2" in msg


@settings(max_examples=80, deadline=None)
@given(config_dicts())
def test_environment_round_trip(data):
    cfg = pk.SessionConfig.model_validate(data)
    env = pk.PopdistEnv.for_config(cfg).to_env()
    assert pk.Replication.from_popdist_env(env) == cfg.replication
    assert cfg.with_popdist_env(env) == cfg
