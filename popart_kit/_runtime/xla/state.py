"""A session's state, and the one way a training step changes it.

:class:`SessionState` is everything a run reads and a training run replaces: the weights, the
optimizer's state and the count of weight updates applied, as one frozen pytree. Every way of
running a step (looped, host-driven, pipelined; one instance or several) changes it only
through :func:`apply_update` - the gradient reduced once by :func:`reduce_gradients` under the
session's :class:`Reduction`, then the optimizer - and a run's result is kept only after
:func:`check_finite` has passed it: the session commits a new state in one assignment. Beside
it, host-side, the :class:`RandomSeed` gives a model's random operators each run's seeds (a
stream input) and moves on with every committed run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.shapes import StepShape
from ...errors import NonFiniteUpdate
from .host_exchange import sum_over_instances
from .placement import PROCESS

__all__ = ["SessionState", "RandomSeed", "Reduction", "reduce_gradients", "apply_update",
           "finite_flags", "all_finite", "check_finite"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SessionState:
    """The weights (by name), the optimizer's state (``()`` for inference), the number of
    weight updates applied so far (a device scalar) and automatic loss scaling's update
    factor (a float32 device scalar; ``()`` without it, see :mod:`.loss_scaling`)."""

    weights: dict[str, Any]
    optimizer: Any = ()
    updates: Any = field(default_factory=lambda: np.int32(0))
    scaling: Any = ()

    def with_weights(self, new: Mapping[str, Any]) -> SessionState:
        """The state with some weights replaced (the others, and the optimizer, kept)."""
        return replace(self, weights={**self.weights, **new})


_WORD = 1 << 32


@dataclass(frozen=True)
class RandomSeed:
    """A session's random seed (PopART's ``setRandomSeed``) and the micro-batch steps drawn
    since: host-side, read by every run of a model with random operators and moved on by
    every run that succeeds (a failed run leaves it, as it leaves the :class:`SessionState`).

    As on an IPU, the seed is two 32-bit words [lo, hi]: micro-batch step k (counted from 1
    since the seed was set) of global replica r draws from [lo + k x G + r, hi + k] (G the
    global replica count), so every step and replica has a seed of its own; ``current`` is
    the seed the next run continues from (PopART's ``getRandomSeed``: setting it again
    continues the same sequence)."""

    seed: int
    steps: int = 0

    def words(self, micro_batches: int, replicas: int, first_replica: int,
              global_replicas: int) -> np.ndarray:
        """[micro_batches, replicas, 2] uint32: each micro-batch's seed on each local replica
        of a run (``first_replica``: the global index of this instance's first)."""
        k = self.steps + 1 + np.arange(micro_batches, dtype=np.uint64)[:, None]
        r = first_replica + np.arange(replicas, dtype=np.uint64)[None, :]
        lo = (np.uint64(self.seed % _WORD) + k * np.uint64(global_replicas) + r) % _WORD
        hi = np.broadcast_to((np.uint64(self.seed // _WORD) + k) % _WORD, lo.shape)
        return np.stack([lo, hi], axis=-1).astype(np.uint32)

    def advanced(self, micro_batches: int) -> RandomSeed:
        """The seed after a run of ``micro_batches`` steps."""
        return replace(self, steps=self.steps + micro_batches)

    def current(self, global_replicas: int) -> int:
        lo = (self.seed % _WORD + self.steps * global_replicas) % _WORD
        hi = (self.seed // _WORD + self.steps) % _WORD
        return hi * _WORD + lo


@dataclass(frozen=True)
class Reduction:
    """How a weight update's gradient is reduced: summed over the mesh ``axes`` the program
    runs over (empty: the program already holds the sum), as one all-reduce of the flattened
    gradients when ``flat`` (between processes: one message instead of one per weight), then
    divided by ``divisor`` (1 for ``reduction='sum'``; accumulation factor x global replicas
    for ``'mean'``, as PopART's Post accumulation-reduction strategy does), or by a weight's
    own entry of ``divisors`` ((name, divisor) pairs: a grouped weight's under the Running
    strategy, see :mod:`.grouped`)."""

    axes: tuple[str, ...] = ()
    flat: bool = False
    divisor: int = 1
    divisors: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, config: Any, axes: Sequence[str] = (), flat: bool = False) -> Reduction:
        shape = StepShape.of(config)
        mean = config.accumulation.reduction == "mean"
        return cls(tuple(axes), flat, shape.accumulation * shape.global_replicas if mean else 1)


def reduce_gradients(grads: Mapping[str, Any], reduction: Reduction) -> dict[str, Any]:
    """An update's gradient reduced over every replica of every instance (inside a program)."""
    if reduction.axes and reduction.flat:  # over instances: shared memory on one host
        grads = sum_over_instances(grads, reduction.axes, PROCESS)
    elif reduction.axes:
        grads = jax.lax.psum(dict(grads), reduction.axes)
    own = dict(reduction.divisors)
    if reduction.divisor != 1 or own:
        grads = {n: g if own.get(n, reduction.divisor) == 1 else g / own.get(n, reduction.divisor)
                 for n, g in grads.items()}
    return dict(grads)


def apply_update(state: SessionState, grads: Mapping[str, Any], hyper: Any, optimizer: Any,
                 reduction: Reduction) -> SessionState:
    """One weight update: the weights ``grads`` names (its keys) reduced and stepped by the
    optimizer; the other weights unchanged; the update counted."""
    grads = reduce_gradients(grads, reduction)
    trained = {n: state.weights[n] for n in grads}
    new, opt_state = optimizer.apply(hyper, trained, grads, state.optimizer)
    return replace(state, weights={**state.weights, **new}, optimizer=opt_state,
                   updates=state.updates + 1)


def finite_flags(losses_finite: Any, weights: Mapping[str, Any], trained: Sequence[str]) -> Any:
    """[updates + trained] booleans (inside a program): whether each update's losses were
    finite, then whether each trained weight ends finite (a non-finite gradient or update
    leaves its weight non-finite for good: no optimizer makes NaN or Inf finite again)."""
    ends = jnp.stack([all_finite(weights[n]) for n in trained]) if trained else \
        jnp.zeros((0,), bool)
    return jnp.concatenate([jnp.asarray(losses_finite, bool), ends])


def all_finite(x: Any) -> Any:
    """Whether every element of ``x`` is finite (inside a program), as a product with zeros:
    NaN or Inf times 0 is NaN and a finite value times 0 is 0, so ``x`` (as rows of k) times a
    zero vector is finite exactly where each row is. One vectorised pass, where XLA:CPU's
    boolean reduction over ``isfinite`` is several times slower."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.size == 0:
        return jnp.isfinite(x).all()
    k = next(k for k in (256, 128, 64, 32, 16, 8, 4, 2, 1) if x.size % k == 0)
    rows = jnp.reshape(x, (-1, k))
    return jnp.isfinite(jnp.matmul(rows, jnp.zeros((k,), x.dtype),
                                   precision=jax.lax.Precision.HIGHEST)).all()


def check_finite(flags: np.ndarray, trained: Sequence[str], updates: int) -> None:
    """Refuse (NonFiniteUpdate) a run whose :func:`finite_flags` are not all true, naming the
    first update with a non-finite loss and the weights that ended non-finite."""
    flags = np.asarray(flags, bool)
    if b"\x00" not in flags.tobytes():  # all true: one C call, this is every run's path
        return
    losses, weights = flags[:updates], flags[updates:]
    found = []
    if not losses.all():
        found.append(f"the loss of weight update {int(np.argmin(losses))} (of {updates})")
    bad = [repr(n) for n, ok in zip(trained, weights, strict=True) if not ok]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        found.append(f"the updated weight(s) {shown} (a non-finite gradient or update)")
    raise NonFiniteUpdate(
        f"this run met NaN or Inf in {' and in '.join(found)}; no update of the run was "
        f"applied: the weights and optimizer state are as before the run. Fix: look for "
        f"NaN/Inf or extreme values in this run's inputs, lower the learning rate or the "
        f"loss scaling; check_finite=False skips this check.")
