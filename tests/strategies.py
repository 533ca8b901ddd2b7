"""Hypothesis strategies for valid SessionConfig inputs (plain dicts, as files hold them)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from popart_kit._base import names as _names
from popart_kit._config import catalog

ENUMS = catalog.ENUMS


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@st.composite
def config_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A valid SessionConfig as a dict: every rule holds by construction. Extra popart_options
    always differ from PopART's defaults, so a SessionOptions object can carry them back."""
    mode = draw(st.sampled_from(["training", "inference"]))
    training = mode == "training"
    target = draw(st.sampled_from(["ipu", "ipu", "ipu", "ipu_model", "cpu", "offline"]))

    ipus = 1 if target == "cpu" else draw(st.sampled_from([1, 2, 2, 3, 4, 4, 6, 8]))
    if target in ("ipu_model", "cpu"):
        local, glob, offset = 1, None, 0
    else:
        local = draw(st.sampled_from([1, 1, 2, 4]))
        if draw(st.booleans()):
            instances = draw(st.integers(2, 4))
            glob = local * instances
            offset = local * draw(st.integers(0, instances - 1))
        else:
            glob, offset = None, 0
    rounding = draw(st.booleans())
    if target == "ipu" and not _pow2(local * ipus):
        rounding = True  # local is a power of two, so the rounded count divides evenly

    vgm_choices = [None, "manual", "auto", "execution_phases"] + (["off"] if ipus == 1 else [])
    vgm = draw(st.sampled_from(vgm_choices))
    effective_vgm = vgm if vgm is not None else ("manual" if ipus > 1 else "off")

    pipelined = ipus >= 2 and effective_vgm != "off" and draw(st.booleans())
    stages = draw(st.one_of(st.none(), st.integers(1, 4)))
    recomputation = draw(st.sampled_from(list(_names.RECOMPUTATION)))

    factor = draw(st.sampled_from([1, 1, 2, 4, 8, 16])) if training else 1
    bps = draw(st.integers(1, 20))
    if pipelined and stages is not None:
        depth = 2 * stages - 1 if training else stages
        if training and 1 < factor < depth:
            factor = depth + draw(st.integers(0, 3))
        if (not training or factor == 1) and bps < depth:
            bps = depth + draw(st.integers(0, 3))

    accumulation: dict[str, Any] = {"factor": factor}
    reduction = draw(st.sampled_from([None, "sum", "mean"]))
    if reduction is not None:
        accumulation["reduction"] = reduction
    strategy = draw(st.sampled_from([None, "post", "running"]))
    if strategy is not None:
        accumulation["mean_strategy"] = strategy

    host = target in ("ipu_model", "cpu")
    device = {
        "target": target,
        "sync_pattern": "full" if host else draw(st.sampled_from(list(_names.SYNC_PATTERN))),
        "connection": draw(st.sampled_from(
            ["always", "on_demand"] if target == "ipu" else list(_names.CONNECTION))),
        "selection": draw(st.sampled_from(list(_names.SELECTION))),
        "tiles_per_ipu": draw(st.sampled_from([0, 0, 1216, 1472])),
        "round_to_power_of_two": rounding,
    }

    popart_options: dict[str, Any] = {}
    # each extra option 1 time in 3, always with a non-default value: a SessionOptions object
    # cannot tell "set to the default" from "not set" (see the partial-struct test below)
    maybe = lambda: draw(st.integers(0, 2)) == 0  # noqa: E731
    if maybe():
        popart_options["enableOutlining"] = False
    if maybe():
        popart_options["syntheticDataMode"] = draw(
            st.sampled_from(["Zeros", "RandomNormal", "RandomUniform"]))
    if maybe():
        popart_options["engineOptions"] = draw(st.sampled_from([
            {"debug.instrument": "true"},
            {"debug.instrument": "true", "opt.enableMultiAccessCopies": "false"}]))
    if maybe():
        popart_options["convolutionOptions"] = {"availableMemoryProportion": "0.3"}
    if maybe():
        popart_options["hardwareInstrumentations"] = draw(
            st.sampled_from([["Inner"], ["Inner", "Outer"]]))  # set[enum]; sorted, as read back
    if maybe():
        popart_options["outlineThreshold"] = draw(st.sampled_from([2, 0.5]))  # int for float
    if maybe():
        popart_options["bufferingDepthMap"] = {"x": draw(st.integers(1, 3))}
    if maybe():
        popart_options["customCodelets"] = ["codelets.cpp"]
    if maybe():
        popart_options["dotChecks"] = ["Fwd0"]
    if maybe():
        popart_options["accumulateOuterFragmentSettings"] = {
            "schedule": draw(st.sampled_from(  # not "Serial" with []: that is the default
                [m for m in ENUMS["AccumulateOuterFragmentSchedule"] if m != "Serial"])),
            "excludedVirtualGraphs": draw(st.sampled_from([[], [0], [0, 1]]))}
    if maybe():
        popart_options["weightTensorLocationSettings"] = {
            "location": {"storage": "OffChip", "loadTileSet": "IO", "storageTileSet": "Compute",
                         "replicatedTensorSharding": draw(st.sampled_from(["Off", "On"])),
                         "shardingDomain": {"type": "Consecutive", "replicaGroupSize": 2}},
            "minElementsForOffChip": 4, "minElementsForReplicatedTensorSharding": 8192}
    if effective_vgm == "execution_phases" and maybe():
        popart_options["executionPhaseSettings"] = {
            "phases": draw(st.integers(2, 6)), "stages": draw(st.integers(1, 2)),
            "weightIOSchedule": "OnDemand", "activationIOSchedule": "Preload",
            "optimizerStateIOSchedule": "OnDemand", "accumulatorIOSchedule": "Preload",
            "schedule": draw(st.sampled_from(ENUMS["ExecutionPhaseSchedule"]))}

    kwargs: dict[str, Any] = {
        "mode": mode,
        "batches_per_step": bps,
        "micro_batch_size": draw(st.one_of(st.none(), st.sampled_from([1, 4, 8]))),
        "ipus_per_replica": ipus,
        "replication": {"local_factor": local, "global_factor": glob, "global_offset": offset},
        "accumulation": accumulation,
        "pipeline": {"enabled": pipelined, "stages": stages, "recomputation": recomputation},
        "device": device,
        "precision": {"partials_type": draw(st.sampled_from([None, "float", "half"])),
                      "stochastic_rounding": draw(st.booleans())},
        "profiling": {"auto_report_dir": draw(st.sampled_from([None, "reports", "/tmp/r x"])),
                      "cycle_counter": draw(st.booleans())},
        "popart_options": popart_options,
    }
    if vgm is not None:
        kwargs["virtual_graph_mode"] = vgm
    if draw(st.booleans()):  # the alias, and PopART's spellings of choices, are accepted too
        kwargs["device_iterations"] = kwargs.pop("batches_per_step")
    if draw(st.booleans()):
        device["sync_pattern"] = _names.SYNC_PATTERN[device["sync_pattern"]]
    return _drop_none(kwargs)


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    return {k: (_drop_none(v) if isinstance(v, dict) and k != "popart_options" else v)
            for k, v in data.items() if v is not None}


