"""Anchors as a step produces them: device buffers filled chunk by chunk, in bounded memory.

What each return type returns is defined once, by
:meth:`popart_kit._base.shapes.AnchorReturnType.returned_micro_batches`: of a run's M = bps x A
micro-batches, every ``N``-th starting at ``N - 1`` (All: N = 1, EveryN: its period, Final:
N = M), or for Sum all of them added. Here every kind but Sum is a buffer of M / N slots where
micro-batch ``m`` is written to slot ``m // N``: the last micro-batch written to a slot is the
one PopART returns, so chunks write their values in order and only the slots are kept. Sum is an
accumulator in the anchor's dtype. Only All keeps every micro-batch.

Buffers are ``[slots, replicas, *S]`` (Sum ``[replicas, *S]``); flattening the leading axes gives
the anchor's host array (``StepIOFactory.anchor_shape``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._base.shapes import AnchorReturnType, StepShape

__all__ = ["AnchorBuffers", "chunk_size"]


@dataclass(frozen=True)
class _Anchor:
    period: int | None          # None: Sum
    slots: int
    shape: tuple[int, ...]
    dtype: np.dtype


class AnchorBuffers:
    """The anchors of a run of ``shape`` (its micro-batches on its local replicas)."""

    def __init__(self, anchors: Mapping[str, AnchorReturnType],
                 specs: Mapping[str, tuple[tuple[int, ...], Any]], shape: StepShape) -> None:
        self.micro_batches = shape.micro_batches
        self.replicas = shape.replicas
        self._anchors: dict[str, _Anchor] = {}
        for name, art in anchors.items():
            dims, dtype = specs[name]
            if art.name == "Sum":
                period, slots = None, 1
            else:
                returned = shape.returned(art)
                period, slots = returned.start + 1, len(returned)
            self._anchors[name] = _Anchor(period, slots, tuple(dims), np.dtype(dtype))

    @property
    def periods(self) -> set[int]:
        return {a.period for a in self._anchors.values() if a.period is not None}

    def replica_axes(self) -> dict[str, int]:
        """The replica axis of each buffer."""
        return {name: 0 if a.period is None else 1 for name, a in self._anchors.items()}

    def shapes(self, replicas: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        r = self.replicas if replicas is None else replicas
        return {name: jax.ShapeDtypeStruct(
                    ((r,) if a.period is None else (a.slots, r)) + a.shape, a.dtype)
                for name, a in self._anchors.items()}

    def nbytes(self) -> dict[str, int]:
        """Bytes of each buffer."""
        return {name: int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize
                for name, s in self.shapes().items()}

    def init(self, replicas: int) -> dict[str, jax.Array]:
        """Zeroed buffers for ``replicas`` replicas (a device's block)."""
        return {name: jnp.zeros(s.shape, s.dtype) for name, s in self.shapes(replicas).items()}

    def write(self, buffers: Mapping[str, jax.Array], values: Mapping[str, jax.Array],
              start: Any) -> dict[str, jax.Array]:
        """Add a chunk: ``values[name]`` is ``[c, replicas, *S]`` for the micro-batches
        ``start .. start + c - 1`` (``start`` a multiple of ``c``; ``c`` compatible with every
        period, see :func:`chunk_size`). An anchor missing from ``values`` keeps its buffer
        (written elsewhere: a weight's value after an update)."""
        out = {}
        for name, anchor in self._anchors.items():
            if name not in values:
                out[name] = buffers[name]
                continue
            buffer, value = buffers[name], values[name].astype(buffers[name].dtype)
            if anchor.period is None:
                out[name] = buffer + value.sum(axis=0, dtype=buffer.dtype)
                continue
            step = min(value.shape[0], anchor.period)
            out[name] = lax.dynamic_update_slice_in_dim(
                buffer, value[step - 1::step], start // anchor.period, axis=0)
        return out


def chunk_size(micro_batches: int, target: int, periods: set[int]) -> int:
    """The largest chunk ``c <= target`` that divides ``micro_batches`` and, for every anchor
    period ``N``, is a multiple or a divisor of ``N`` (so each chunk's writes line up with the
    slots). 1 always qualifies; the search is over at most ``target`` candidates."""
    for c in range(min(target, micro_batches), 0, -1):
        if micro_batches % c == 0 and all(c % n == 0 or n % c == 0 for n in periods):
            return c
    return 1
