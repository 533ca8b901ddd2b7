"""Plan: the seeds' numbers, topology and batch identities, sync groups, poprun and IPUJob."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from hypothesis import given, settings
from strategies import config_dicts

import popart_kit as pk
from popart_kit._config.plan import sync_groups

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")


def plan(**kw) -> pk.Plan:
    kw.setdefault("mode", "training")
    return pk.SessionConfig(**kw).plan()


# -- the numbers in the seeds ---------------------------------------------------------------------


def test_two_ipu_model_replicated_four_times_needs_eight_ipus():
    # seed 000: "if your model is split onto 2 IPUs and you set Trainer(ipus=4) this will
    # require 8 IPUs in total"
    p = plan(ipus_per_replica=2, replication={"local_factor": 4})
    assert (p.num_ipus, p.ipus_to_request, p.global_num_ipus) == (8, 8, 8)


def test_micro_batches_per_run():
    # 300 device iterations × 4 replicas × 8 accumulation = 9600 micro-batches per run
    p = plan(device_iterations=300, replication={"local_factor": 4}, accumulation={"factor": 8},
             micro_batch_size=2)
    assert p.micro_batches_per_step == 9600
    assert p.samples_per_step == 19200
    assert p.global_batch_size == 2 * 8 * 4
    assert p.weight_updates_per_step == 300


def test_four_instances_of_two_local_replicas():
    # seed 003: local replication 2 over four PopART processes, global factor 8, offsets 0, 2, 4, 6
    seen = []
    for offset in (0, 2, 4, 6):
        p = plan(replication={"local_factor": 2, "global_factor": 8, "global_offset": offset})
        assert (p.instances, p.instance_index, p.global_replicas) == (4, offset // 2, 8)
        assert p.num_ipus == 2 and p.global_num_ipus == 8
        mine = p.local_replica_placements
        assert [r.global_id for r in mine] == [offset, offset + 1]
        assert [r.local_id for r in mine] == [0, 1]
        seen += [r.global_id for r in mine]
    assert seen == list(range(8))


def test_pod64_poprun_example():
    # seed 004: poprun --num-instances 1 --num-replicas 16 --ipus-per-replica 4 on 64 IPUs
    p = plan(ipus_per_replica=4, replication={"local_factor": 16})
    assert p.num_ipus == 64
    assert p.poprun_command("python3 run_pretraining.py --config pretrain_large_128_POD64") == [
        "poprun", "--num-instances", "1", "--num-replicas", "16", "--ipus-per-replica", "4",
        "--print-topology", "yes", "python3", "run_pretraining.py", "--config",
        "pretrain_large_128_POD64"]
    job = p.ipujob_manifest(image="graphcore/pytorch:3.3.0", command="python3 train.py",
                            name="bert-poprun-64ipus")
    assert job["apiVersion"] == "graphcore.ai/v1alpha1" and job["kind"] == "IPUJob"
    assert job["metadata"] == {"generateName": "bert-poprun-64ipus-"}
    assert job["spec"]["ipusPerJobInstance"] == "64"
    assert job["spec"]["modelReplicasPerWorker"] == "16"
    pod = job["spec"]["workers"]["template"]["spec"]
    assert pod["hostIPC"] is True
    container = pod["containers"][0]
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert container["volumeMounts"] == [{"mountPath": "/dev/shm", "name": "devshm"}]
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "10Gi"}
    # replicated: poprun starts the instance, as in seed 004's POD64 job
    assert container["args"] == [
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_ALLOW_RUN_AS_ROOT=1 poprun --allow-run-as-root 1 "
        "--num-instances 1 --num-replicas 16 --ipus-per-replica 4 --print-topology yes "
        "python3 train.py"]
    assert yaml.safe_load(yaml.safe_dump(job)) == job


def test_ipujob_of_one_unreplicated_model_runs_the_command():
    # seed 004's first job: BERT on 4 IPUs, one replica
    job = plan(ipus_per_replica=4).ipujob_manifest(image="graphcore/pytorch:3.3.0",
                                                     command="python3 run_pretraining.py",
                                                     name="bert-training-multi-ipu")
    assert job["spec"]["ipusPerJobInstance"] == "4"
    assert "modelReplicasPerWorker" not in job["spec"]
    container = job["spec"]["workers"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["python3 run_pretraining.py"]


def test_ipujob_of_several_instances_runs_poprun():
    p = plan(ipus_per_replica=2, replication={"local_factor": 2, "global_factor": 8})
    job = p.ipujob_manifest(image="img", command=["python3", "train.py", "--lr", "0.1"],
                            name="dp")
    script = job["spec"]["workers"]["template"]["spec"]["containers"][0]["args"][0]
    assert "poprun --allow-run-as-root 1 --num-instances 4 --num-replicas 8 " \
           "--ipus-per-replica 2" in script
    assert script.endswith("python3 train.py --lr 0.1")
    assert job["spec"]["ipusPerJobInstance"] == "16"


def test_four_instances_of_one_replica_each():
    p = plan(replication={"local_factor": 1, "global_factor": 4, "global_offset": 3})
    assert (p.instances, p.instance_index) == (4, 3)
    assert [r.global_id for r in p.local_replica_placements] == [3]


# -- pipeline -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, stages, depth", [("inference", 3, 3), ("training", 3, 5),
                                                  ("training", 4, 7)])
def test_pipeline_depth(mode, stages, depth):
    p = plan(mode=mode, ipus_per_replica=4, batches_per_step=64,
             pipeline={"enabled": True, "stages": stages})
    assert (p.pipeline_stages, p.pipeline_depth) == (stages, depth)


def test_bubble_counts_micro_batches_between_flushes():
    # with accumulation PopART flushes every A micro-batches: (K-1)/(A+K-1)
    p = plan(ipus_per_replica=4, batches_per_step=10, accumulation={"factor": 16},
             pipeline={"enabled": True, "stages": 4})
    assert p.bubble_fraction == pytest.approx(6 / 22)
    # inference fills once per run: bps micro-batches
    p = plan(mode="inference", ipus_per_replica=4, batches_per_step=16,
             pipeline={"enabled": True, "stages": 4})
    assert p.bubble_fraction == pytest.approx(3 / 19)


def test_stages_from_the_model_are_unknown_here():
    p = plan(ipus_per_replica=2, batches_per_step=8, accumulation={"factor": 8},
             pipeline={"enabled": True})
    assert (p.pipeline_stages, p.pipeline_depth, p.bubble_fraction) == (None, None, None)


def test_unpipelined_plan():
    p = plan()
    assert (p.pipelined, p.pipeline_stages, p.pipeline_depth, p.bubble_fraction) == (
        False, 1, 1, None)


# -- IPUs -----------------------------------------------------------------------------------------


def test_rounding_to_a_power_of_two_leaves_idle_ipus_per_replica():
    p = plan(ipus_per_replica=3, replication={"local_factor": 2},
             device={"round_to_power_of_two": True})
    assert (p.num_ipus, p.ipus_to_request, p.idle_ipus) == (6, 8, 2)
    assert [r.ipus for r in p.replicas] == [(0, 1, 2), (4, 5, 6)]
    assert "rounded up to a power of two" in p.render()


def test_host_targets_do_not_round():
    p = plan(ipus_per_replica=3, device={"target": "ipu_model"})
    assert p.ipus_to_request == 3


# -- sync groups ----------------------------------------------------------------------------------


def test_sync_groups_of_the_figure():
    # PopART's sync-pattern figure: four IPUs A, B, C, D = 0, 1, 2, 3
    assert sync_groups("full", 4) == {"GS1": [[0, 1, 2, 3]], "GS2": [[0, 1, 2, 3]]}
    assert sync_groups("single_pipeline", 4) == {"GS1": [[0], [1], [2], [3]],
                                                 "GS2": [[0, 1, 2, 3]]}
    assert sync_groups("replica_and_ladder", 4) == {"GS1": [[0, 2], [1, 3]],
                                                    "GS2": [[0, 1, 2, 3]]}
    with pytest.raises(ValueError, match="unknown sync pattern 'ladder'"):
        sync_groups("ladder", 4)


def test_plan_sync_groups_cover_the_requested_device():
    p = plan(ipus_per_replica=4, replication={"local_factor": 2},
             device={"sync_pattern": "single_pipeline"})
    assert p.sync_groups["GS1"] == [[i] for i in range(8)]


# -- properties -----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(config_dicts())
def test_plan_identities(data):
    cfg = pk.SessionConfig.model_validate(data)
    p = cfg.plan()
    rep = cfg.replication
    assert p.num_ipus == rep.local_factor * cfg.ipus_per_replica
    assert p.global_num_ipus == p.num_ipus * p.instances
    assert p.instances * p.local_replicas == p.global_replicas
    assert p.ipus_to_request >= p.num_ipus
    if cfg.device.target == "ipu":
        assert p.ipus_to_request & (p.ipus_to_request - 1) == 0
        assert p.ipus_to_request < 2 * p.num_ipus
    assert p.ipus_to_request <= 64
    assert p.micro_batches_per_step == (cfg.batches_per_step * cfg.accumulation.factor
                                        * rep.local_factor)
    if cfg.micro_batch_size:
        assert p.global_samples_per_step == p.samples_per_step * p.instances
        assert p.global_batch_size * cfg.batches_per_step == p.global_samples_per_step
    # replicas: every global id once, each instance holds a contiguous block of local replicas
    assert [r.global_id for r in p.replicas] == list(range(p.global_replicas))
    assert [r.global_id for r in p.local_replica_placements] == list(rep.replica_ids)
    used = [i for r in p.local_replica_placements for i in r.ipus]
    assert len(used) == len(set(used)) == p.num_ipus
    assert all(0 <= i < p.ipus_to_request for i in used)
    # each sync group partitions the device's IPUs
    for groups in p.sync_groups.values():
        flat = sorted(i for g in groups for i in g)
        assert flat == list(range(p.ipus_to_request))
    if p.bubble_fraction is not None:
        k = p.pipeline_depth
        m = (cfg.accumulation.factor if cfg.is_training and cfg.accumulation.factor > 1
             else cfg.batches_per_step)
        assert math.isclose(p.bubble_fraction, (k - 1) / (m + k - 1))
    json.dumps(p.to_dict())  # plain data
    assert_rule_gives_every_placement(p)


def test_render_shows_every_section():
    p = plan(micro_batch_size=2, ipus_per_replica=4, replication={"local_factor": 4},
             accumulation={"factor": 8}, pipeline={"enabled": True, "stages": 4})
    text = p.render()
    for heading in ("Topology", "Batches", "Pipeline", "Replicas", "Sync groups (full)",
                    "Warnings"):
        assert heading in text
    assert "pipeline bubble 42.9%" in text


# -- the plan as data: bounded at POD scale -----------------------------------------------------


def assert_rule_gives_every_placement(p: pk.Plan) -> None:
    """The JSON's rule, evaluated as written, gives every placement ``replicas="all"`` lists."""
    table = p.to_dict(replicas="all")["replicas"]
    numbers = {k: table[k] for k in ("per_instance", "ipu_stride", "ipus_per_replica")}
    rule = table["rule"]
    for row in table["placements"]:
        names = {**numbers, "global_id": row["global_id"]}
        names["local_id"] = eval(rule["local_id"], names)
        assert eval(rule["instance"], names) == row["instance"]
        assert names["local_id"] == row["local_id"]
        assert list(eval(rule["ipus"], names)) == row["ipus"]
        ids = eval(rule["global_ids"], {**numbers, "instance": row["instance"]})
        assert row["global_id"] in ids
    assert [r["global_id"] for r in table["placements"]] == list(range(p.global_replicas))


def pod(global_factor: int, offset: int = 8) -> pk.Plan:
    return plan(replication={"local_factor": 4, "global_factor": global_factor,
                             "global_offset": offset})


def test_to_dict_lists_this_instances_replicas_and_the_rule_for_all():
    p = plan(ipus_per_replica=3, device={"round_to_power_of_two": True},
             replication={"local_factor": 2, "global_factor": 8, "global_offset": 4})
    replicas = p.to_dict()["replicas"]
    assert {k: replicas[k] for k in ("count", "per_instance", "ipus_per_replica", "ipu_stride",
                                     "this_instance", "listed")} == {
        "count": 8, "per_instance": 2, "ipus_per_replica": 3, "ipu_stride": 4,
        "this_instance": {"first_global_id": 4, "last_global_id": 5}, "listed": "instance"}
    assert replicas["placements"] == [
        {"instance": 2, "global_id": 4, "local_id": 0, "ipus": [0, 1, 2]},
        {"instance": 2, "global_id": 5, "local_id": 1, "ipus": [4, 5, 6]}]
    assert_rule_gives_every_placement(p)


def test_to_dict_all_replicas_lists_every_one():
    p = pod(64)
    everyone = p.to_dict(replicas="all")["replicas"]
    assert everyone["listed"] == "all"
    assert [r["global_id"] for r in everyone["placements"]] == list(range(64))
    assert everyone["placements"][8:12] == p.to_dict()["replicas"]["placements"]


def test_plan_json_does_not_grow_with_the_global_replica_count():
    small, huge = pod(64).to_dict(), pod(64_000).to_dict()
    assert huge["replicas"]["placements"] == small["replicas"]["placements"]
    assert huge["sync_groups"] == small["sync_groups"]
    # only the digits of the counts differ (64 -> 64000, 16 -> 16000 instances)
    assert 0 < len(json.dumps(huge)) - len(json.dumps(small)) <= 16
    assert len(pod(64_000).replicas) == 64_000  # the table itself still has them all


def test_to_dict_refuses_an_unknown_listing():
    with pytest.raises(ValueError, match="replicas='every' is not a listing: use 'instance'"):
        pod(64).to_dict(replicas="every")


def test_render_of_a_pod_shows_this_instances_replicas_and_the_rule():
    text = pod(64_000, offset=63_996).render(width=200)
    rows = [line.split("│")[1:-1] for line in text.splitlines() if line.count("│") == 5]
    assert [int(r[1]) for r in rows] == [63_996, 63_997, 63_998, 63_999]
    words = " ".join(text.split())  # the caption wraps at the table's width
    assert "this instance's 4 replicas (64,000 in all); instance i runs global ids 4·i … " \
           "4·i+3" in words
