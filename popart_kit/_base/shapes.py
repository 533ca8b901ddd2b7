"""PopART's host-array layout: pure shape arithmetic (no numpy, no JAX, no I/O).

Inputs are ``[bps, A, R, *S]`` and anchors ``All [bps, A, R]``, ``EveryN(N) [bps/N, A, R]``,
``Final [R]``, ``Sum [R]`` followed by ``S``, with every leading factor that equals 1 left out and
tensor dimensions always kept (as PopART lays out PyStepIO arrays). Broadcast inputs
drop ``R``; global replication never changes these per-instance shapes.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import ConfigError

__all__ = [
    "AnchorReturnType",
    "StepShape",
    "input_shape",
    "anchor_shape",
    "input_elements",
    "anchor_elements",
    "leading_factors",
    "anchor_leading_factors",
]

_NAMES = {"all": "All", "final": "Final", "sum": "Sum", "everyn": "EveryN"}


@dataclass(frozen=True)
class StepShape:
    """The shape of one run: ``batches_per_step`` steps of ``accumulation`` micro-batches each
    (a training run makes one weight update per step), on ``replicas`` local replicas of each
    of ``instances`` instances. The one place these factors are multiplied."""

    batches_per_step: int
    accumulation: int = 1
    replicas: int = 1
    instances: int = 1

    @classmethod
    def of(cls, config: Any) -> StepShape:
        """A session config's run shape."""
        return cls(config.batches_per_step, config.accumulation.factor,
                   config.replication.local_factor, config.replication.instances)

    @property
    def micro_batches(self) -> int:
        """Micro-batches a run takes on each replica: bps x A."""
        return self.batches_per_step * self.accumulation

    @property
    def global_replicas(self) -> int:
        return self.replicas * self.instances

    def returned(self, art: AnchorReturnType) -> range:
        """The micro-batches of a run an anchor returns (see
        :meth:`AnchorReturnType.returned_micro_batches`)."""
        return art.returned_micro_batches(self.batches_per_step, self.accumulation)


def _refuse(popart: str, fix: str) -> NoReturn:
    """A ConfigError with PopART's words (dataflow.cpp), which the drop-in raises as they are."""
    err = ConfigError(f"{popart}. Fix: {fix}")
    err.popart_text = popart
    raise err


@dataclass(frozen=True, init=False)
class AnchorReturnType:
    """How an anchor is returned per run: ``"All"``, ``"Final"``, ``"Sum"`` or ``("EveryN", N)``.

    Names are case-insensitive, as in PopART, and the constructor refuses what PopART's refuses:
    an unknown name, a period for a type other than EveryN, EveryN without a period, a period <= 0.
    """

    name: str
    period: int | None

    def __init__(self, name: str, period: int | None = None) -> None:
        canonical = _NAMES.get(name.lower()) if isinstance(name, str) else None
        if canonical is None:
            _refuse(f"Invalid anchor return type ID supplied: {name}",
                    "use one of All, Final, Sum, EveryN (any case).")
        if canonical != "EveryN" and period is not None:
            _refuse("A return period should not be supplied for this anchor return type",
                    f"drop the period ({canonical}, period={period}), or use EveryN.")
        if canonical == "EveryN":
            if period is None:
                _refuse("Must specify return period with option 'EVERYN'",
                        "AnchorReturnType('EveryN', N) with N dividing batches_per_step.")
            period = _count(period)
            if period is None or period <= 0:
                _refuse("Anchor return period must be greater than zero",
                        f"a positive integer that divides batches_per_step, not {period!r}.")
        object.__setattr__(self, "name", canonical)
        object.__setattr__(self, "period", period)

    @classmethod
    def of(cls, value: Any) -> AnchorReturnType:
        """Accept an AnchorReturnType, a name, a ``(name, period)`` pair, or PopART's object."""
        if isinstance(value, AnchorReturnType):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, tuple) and len(value) == 2:
            return cls(*value)
        if hasattr(value, "id") and hasattr(value, "rp"):  # popart.AnchorReturnType
            name = value.id().name
            return cls(name, value.rp() if name == "EveryN" else None)
        raise ConfigError(f"cannot read an anchor return type from {value!r}. Fix: give 'All', "
                         f"'Final', 'Sum' or ('EveryN', N).")

    def __repr__(self) -> str:
        return f"AnchorReturnType({self.name!r}" + (
            f", {self.period})" if self.period is not None else ")")

    def batches_per_step_problem(self, batches_per_step: int) -> tuple[str, str] | None:
        """Why this return type cannot be used with ``batches_per_step``, and the fix
        (None when it can)."""
        n = self.period
        if n is None or (n <= batches_per_step and batches_per_step % n == 0):
            return None
        # a bounded search: the small divisors, then batches_per_step itself
        small = [d for d in range(1, min(batches_per_step, 64) + 1) if batches_per_step % d == 0]
        if batches_per_step <= 64 and len(small) <= 8:
            listed = str(small)
        else:
            listed = "[" + ", ".join(map(str, small[:7])) + f", …, {batches_per_step}]"
        fix = f"use a period that divides {batches_per_step}: one of {listed}."
        if n > batches_per_step:
            return (f"EveryN period {n} exceeds batches_per_step={batches_per_step} (PopART: "
                    f"'Return period must be <= to the number of batches per step').", fix)
        return f"EveryN period {n} does not divide batches_per_step={batches_per_step}.", fix

    def fetches_per_replica(self, batches_per_step: int, accumulation_factor: int = 1) -> int:
        """Anchor values returned per replica per run (PopART's numOutFetchesPerRepl)."""
        if self.name in ("Final", "Sum"):
            return 1
        return batches_per_step * accumulation_factor // (self.period or 1)

    def returned_micro_batches(self, batches_per_step: int,
                               accumulation_factor: int = 1) -> range:
        """Which of the run's bps × A micro-batches (0-based) the anchor returns; Sum adds them."""
        total = batches_per_step * accumulation_factor
        if self.name == "Final":
            return range(total - 1, total)
        if self.name == "EveryN":
            return range(self.period - 1, total, self.period)
        return range(total)

    def prefix(self, batches_per_step: int, accumulation_factor: int,
               replication_factor: int) -> tuple[int, ...]:
        """Leading factors before 1s are left out."""
        if self.name in ("Final", "Sum"):
            return (replication_factor,)
        steps = batches_per_step // self.period if self.name == "EveryN" else batches_per_step
        return steps, accumulation_factor, replication_factor


def _count(value: object) -> int | None:
    """An int from an int or numpy integer (not a bool); None for anything else."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _positive(**factors: int) -> None:
    bad = {k: v for k, v in factors.items() if (_count(v) or 0) < 1}
    if bad:
        raise ConfigError(", ".join(f"{k}={v!r}" for k, v in bad.items())
                         + " must be positive integers. Fix: pass counts of 1 or more.")


def _tensor_shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(_count(d) for d in shape)
    if any(d is None or d < 0 for d in dims):
        raise ConfigError(f"tensor shape {tuple(shape)!r} must hold non-negative integers.")
    return dims  # type: ignore[return-value]


def leading_factors(batches_per_step: int, accumulation_factor: int = 1,
                    replication_factor: int = 1, broadcast: bool = False
                    ) -> tuple[tuple[str, int], ...]:
    """The named leading factors of an input array, 1s left out: e.g. (("bps", 4), ("R", 2))."""
    _positive(batches_per_step=batches_per_step, accumulation_factor=accumulation_factor,
              replication_factor=replication_factor)
    named = [("batches_per_step", batches_per_step), ("accumulation_factor", accumulation_factor)]
    if not broadcast:
        named.append(("replication_factor", replication_factor))
    return tuple((k, v) for k, v in named if v != 1)


def anchor_leading_factors(art: AnchorReturnType | str | tuple, batches_per_step: int,
                           accumulation_factor: int = 1, replication_factor: int = 1
                           ) -> tuple[tuple[str, int], ...]:
    """The named leading factors of an anchor array, 1s left out: e.g. (("bps/N", 2), ("R", 4)).

    Refuses an EveryN period that does not divide batches_per_step."""
    art = AnchorReturnType.of(art)
    _positive(batches_per_step=batches_per_step, accumulation_factor=accumulation_factor,
              replication_factor=replication_factor)
    problem = art.batches_per_step_problem(batches_per_step)
    if problem:
        raise ConfigError(f"{problem[0]} Fix: {problem[1]}")
    names = {"All": ("batches_per_step", "accumulation_factor", "replication_factor"),
             "EveryN": ("batches_per_step/N", "accumulation_factor", "replication_factor"),
             }.get(art.name, ("replication_factor",))
    prefix = art.prefix(batches_per_step, accumulation_factor, replication_factor)
    return tuple((k, v) for k, v in zip(names, prefix, strict=True) if v != 1)


def input_shape(shape: Sequence[int], batches_per_step: int, accumulation_factor: int = 1,
                replication_factor: int = 1, broadcast: bool = False) -> tuple[int, ...]:
    """The host array of one input for one run: ``[bps, A, R, *S]`` with 1-factors left out."""
    dims = _tensor_shape(shape)
    factors = leading_factors(batches_per_step, accumulation_factor, replication_factor, broadcast)
    return tuple(v for _, v in factors) + dims


def anchor_shape(shape: Sequence[int], art: AnchorReturnType | str | tuple,
                 batches_per_step: int, accumulation_factor: int = 1,
                 replication_factor: int = 1) -> tuple[int, ...]:
    """The host array of one anchor for one run (PopART's initAnchorArrays)."""
    factors = anchor_leading_factors(art, batches_per_step, accumulation_factor,
                                     replication_factor)
    return tuple(v for _, v in factors) + _tensor_shape(shape)


def input_elements(shape: Sequence[int], batches_per_step: int, accumulation_factor: int = 1,
                   replication_factor: int = 1, broadcast: bool = False) -> int:
    """PopART's own size check: nelms(S) × A × bps × (1 if Broadcast else R)."""
    return math.prod(input_shape(shape, batches_per_step, accumulation_factor,
                                 replication_factor, broadcast))


def anchor_elements(shape: Sequence[int], art: AnchorReturnType | str | tuple,
                    batches_per_step: int, accumulation_factor: int = 1,
                    replication_factor: int = 1) -> int:
    """PopART's expected anchor size: nelms(S) × R × fetches per replica."""
    return math.prod(anchor_shape(shape, art, batches_per_step, accumulation_factor,
                                  replication_factor))
