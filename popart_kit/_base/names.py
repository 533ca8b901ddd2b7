"""The kit's spelling of each choice and PopART's enum member for it.

Config fields take the kit spelling (``"single_pipeline"``); input in PopART's spelling
(``"SinglePipeline"``) or any case is accepted and normalised. The mapping emits PopART's member.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

VIRTUAL_GRAPH_MODE = {"off": "Off", "manual": "Manual", "auto": "Auto",
                      "execution_phases": "ExecutionPhases"}
RECOMPUTATION = {"none": "NoRecompute", "standard": "Standard", "norm_only": "NormOnly",
                 "recompute_all": "RecomputeAll", "pipeline": "Pipeline"}
REDUCTION = {"sum": "Sum", "mean": "Mean"}
MEAN_STRATEGY = {"post": "Post", "running": "Running"}
SYNC_PATTERN = {"full": "Full", "single_pipeline": "SinglePipeline",
                "replica_and_ladder": "ReplicaAndLadder"}
CONNECTION = {"always": "Always", "on_demand": "OnDemand", "never": "Never"}
SELECTION = {"first": "First", "random": "Random"}
TARGET = {"ipu": "Ipu", "ipu_model": "IpuModel", "cpu": "Cpu", "offline": "OfflineIpu"}
PARTIALS = {"float": "float", "half": "half"}

#: PopART's reserved prefix of gradient tensors (popart.reservedGradientPrefix()): anchoring
#: GRADIENT_PREFIX + name returns the gradient of the loss with respect to ``name``.
GRADIENT_PREFIX = "Gradient___"
#: PopART's reserved prefix of restored tensors (popart.reservedRestoredPrefix()): a pipelined
#: training stage's stashed activation as its backward reads it back, equal to the forward's.
RESTORED_PREFIX = "Restored___"

# PopART enum class behind each table, for the contract tests and error messages.
POPART_ENUM = {
    "VirtualGraphMode": VIRTUAL_GRAPH_MODE,
    "RecomputationType": RECOMPUTATION,
    "ReductionType": REDUCTION,
    "MeanReductionStrategy": MEAN_STRATEGY,
    "SyncPattern": SYNC_PATTERN,
    "DeviceConnectionType": CONNECTION,
    "DeviceSelectionCriterion": SELECTION,
    "DeviceType": TARGET,
}


def _squash(s: str) -> str:
    return s.replace("_", "").replace("-", "").replace(" ", "").lower()


def kit_name(table: dict[str, str], popart_member: str) -> str:
    """The kit spelling for a PopART member name (exact), e.g. ``"NoRecompute"`` -> ``"none"``."""
    for kit, member in table.items():
        if member == popart_member:
            return kit
    raise ValueError(f"{popart_member!r} is not one of PopART's members {sorted(table.values())}")


def choice(table: dict[str, str]) -> Any:
    """A Literal of the kit spellings that also accepts PopART's spelling, in any case."""
    lookup = {_squash(k): k for k in table} | {_squash(v): k for k, v in table.items()}

    def normalise(value: Any) -> Any:
        if isinstance(value, str):
            return lookup.get(_squash(value), value)
        member_name = getattr(value, "name", None)  # a popart enum member
        if isinstance(member_name, str):
            return lookup.get(_squash(member_name), value)
        return value

    return Annotated[Literal[tuple(table)], BeforeValidator(normalise)]
