"""Pure arithmetic shared by the configuration rules and the plan: no JAX, no I/O."""

from __future__ import annotations

__all__ = [
    "is_power_of_two",
    "next_power_of_two",
    "pipeline_depth",
    "pipeline_fill_micro_batches",
    "bubble_fraction",
]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"next_power_of_two needs n >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def pipeline_depth(forward_stages: int, training: bool) -> int:
    """Stages PopART runs for F forward stages, before merging same-IPU neighbours.

    Training adds a backward stage for every forward stage but the last (whose backward shares
    the loss stage): 2F - 1. Inference runs the F forward stages.
    """
    return 2 * forward_stages - 1 if training else forward_stages


def pipeline_fill_micro_batches(
    training: bool, batches_per_step: int, accumulation_factor: int
) -> int:
    """Micro-batches that pass through the pipeline between two flushes.

    With gradient accumulation PopART flushes before every weight update (A micro-batches);
    otherwise the pipeline fills once per ``run`` (batches_per_step micro-batches).
    """
    if training and accumulation_factor > 1:
        return accumulation_factor
    return batches_per_step


def bubble_fraction(depth: int, micro_batches: int) -> float:
    """Idle share of a fill-drain pipeline: (K - 1) / (M + K - 1) for K stages, M micro-batches."""
    if depth < 1 or micro_batches < 1:
        raise ValueError(f"bubble_fraction needs depth >= 1 and micro_batches >= 1, "
                         f"got depth={depth}, micro_batches={micro_batches}")
    return (depth - 1) / (micro_batches + depth - 1)
