"""Timing shared by the benchmark scripts: the best of several runs, after one warm-up run."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    """Seconds of the fastest of ``repeat`` calls of ``fn`` (one uncounted call first: it
    compiles, allocates and warms the caches)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
