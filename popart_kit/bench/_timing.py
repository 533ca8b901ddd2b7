"""One way to time things: warm-up calls excluded, then calls interleaved so every function
sees the same machine load, summarised as median and spread."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Stats", "interleaved", "best_of", "stats"]


@dataclass(frozen=True)
class Stats:
    """Seconds of several timed calls."""

    median: float
    p25: float
    p75: float
    min: float
    max: float
    runs: int

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0.05 = the middle half within 5 %)."""
        return (self.p75 - self.p25) / self.median if self.median > 0 else float("nan")


def stats(times: list[float]) -> Stats:
    """The summary of ``times`` (seconds; at least one)."""
    ordered = sorted(times)
    if len(ordered) == 1:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return Stats(statistics.median(ordered), q1, q3, ordered[0], ordered[-1], len(ordered))


def interleaved(repeat: int, warmup: int = 1, block: int = 1, settle: float = 0.02,
                **fns: Callable[[], object]) -> dict[str, Stats]:
    """Each function called ``warmup`` times (not counted), then all in turn ``repeat`` times,
    in a new order each turn (shuffled, the same shuffles every time: none always runs right
    after another): with ``block`` > 1, each turn first calls it uncounted for ``settle``
    seconds (once at least), then ``block`` counted calls in a row. Blocks time each function
    in its own steady state (its data in the caches, its threads awake) and keep a function's
    aftermath out of the next one's times: onnxruntime's idle threads spin for a while after
    each run, taking the cores from whatever runs next (measured: a 1.6 ms call ran at 2.1 ms
    for the first 10 ms after onnxruntime's runs; in a fixed order of seven, the kit's
    session of a 540x960 convolution, always right after onnxruntime's, timed 0.92x of it,
    and 1.00x in turns of the two)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    shuffles = random.Random(0)
    for _ in range(max(1, repeat)):
        shuffles.shuffle(order)
        for name, fn in order:
            if block > 1:
                lead = time.perf_counter() + settle
                fn()
                while time.perf_counter() < lead:
                    fn()
            for _ in range(max(1, block)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: stats(t) for name, t in times.items()}


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    """Seconds of the fastest of ``repeat`` calls of ``fn`` after one warm-up call."""
    return interleaved(repeat, fn=fn)["fn"].min
