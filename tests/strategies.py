"""Hypothesis strategies for valid SessionConfig inputs (plain dicts, as files hold them)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

SAFE_OPTIONS: dict[str, Any] = {
    "enableOutlining": st.booleans(),
    "outlineThreshold": st.floats(0.5, 100.0, allow_nan=False),
    "syntheticDataMode": st.sampled_from(["Off", "Zeros", "RandomNormal", "RandomUniform"]),
    "engineOptions": st.dictionaries(
        st.sampled_from(["debug.instrument", "target.hostSyncTimeout"]),
        st.sampled_from(["true", "600"]), max_size=2),
    "reportOptions": st.just({"showExecutionSteps": "true"}),
    "hardwareInstrumentations": st.sampled_from([["Outer"], ["Inner", "Outer"]]),
    "dotChecks": st.lists(st.sampled_from(["Fwd0", "Final"]), unique=True, max_size=2),
    "constantWeights": st.booleans(),
    "mergeVarUpdate": st.sampled_from(["Off", "All", "AutoTight"]),
    "batchSerializationSettings": st.fixed_dictionaries({}, optional={
        "factor": st.integers(0, 4), "method": st.sampled_from(["UnrollDynamic", "UnrollStatic"])}),
    "accumulateOuterFragmentSettings": st.just({"schedule": "OverlapMemoryOptimized",
                                                "excludedVirtualGraphs": [0]}),
}


@st.composite
def config_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A valid SessionConfig as a dict: every rule holds by construction."""
    mode = draw(st.sampled_from(["training", "inference"]))
    training = mode == "training"
    ipus = draw(st.integers(1, 8))
    local = draw(st.sampled_from([1, 2, 4, 8]).filter(lambda r: r * ipus <= 64))
    instances = draw(st.integers(1, 4))
    need = local * ipus
    target = "ipu"
    if local == 1 and instances == 1:
        target = draw(st.sampled_from(["ipu", "ipu", "ipu_model", "offline"]
                                      + (["cpu"] if ipus == 1 else [])))
    pow2 = need & (need - 1) == 0
    if target == "ipu" and (need > 32 and not pow2):
        ipus, need, pow2 = 1, local, True
    data: dict[str, Any] = {"mode": mode, "ipus_per_replica": ipus}
    if ipus > 1 and draw(st.booleans()):
        data["virtual_graph_mode"] = draw(st.sampled_from(["manual", "auto", "Manual"]))

    pipelined = ipus > 1 and draw(st.booleans())
    stages = draw(st.one_of(st.none(), st.integers(2, 4))) if pipelined else None
    depth = (2 * stages - 1 if training else stages) if stages else 1
    acc = 1
    if training and draw(st.booleans()):
        acc = draw(st.integers(max(2, depth), 64))
    bps_floor = depth if acc == 1 else 1
    bps = draw(st.integers(bps_floor, max(bps_floor, 64)))
    data["device_iterations" if draw(st.booleans()) else "batches_per_step"] = bps
    if draw(st.booleans()):
        data["micro_batch_size"] = draw(st.integers(1, 64))
    if pipelined:
        data["pipeline"] = {"enabled": True, "stages": stages,
                            "recomputation": draw(st.sampled_from(
                                ["none", "standard", "pipeline"] if training else ["none"]))}
    if training:
        reduction = draw(st.sampled_from(["sum", "mean"]))
        data["accumulation"] = {"factor": acc, "reduction": reduction}
        if reduction == "mean":
            data["accumulation"]["mean_strategy"] = draw(st.sampled_from(["post", "running"]))
    replication: dict[str, Any] = {"local_factor": local}
    if instances > 1:
        replication["global_factor"] = local * instances
        replication["global_offset"] = local * draw(st.integers(0, instances - 1))
    data["replication"] = replication
    device: dict[str, Any] = {"target": target}
    if target == "ipu":
        device["round_to_power_of_two"] = (not pow2) or draw(st.booleans())
        device["sync_pattern"] = draw(st.sampled_from(["full", "single_pipeline",
                                                       "replica_and_ladder", "SinglePipeline"]))
        device["connection"] = draw(st.sampled_from(["always", "on_demand"]))
        device["selection"] = draw(st.sampled_from(["first", "random"]))
    if target in ("ipu", "offline"):
        device["tiles_per_ipu"] = draw(st.sampled_from([0, 1472]))
    data["device"] = device
    if draw(st.booleans()):
        data["precision"] = {"partials_type": draw(st.sampled_from(["float", "half"])),
                             "stochastic_rounding": draw(st.booleans())}
    if draw(st.booleans()):
        data["profiling"] = {"auto_report_dir": draw(st.sampled_from(["reports", "/tmp/r x"])),
                             "cycle_counter": draw(st.booleans())}
    names = draw(st.lists(st.sampled_from(sorted(SAFE_OPTIONS)), unique=True, max_size=4))
    data["popart_options"] = {name: draw(SAFE_OPTIONS[name]) for name in names}
    return data
