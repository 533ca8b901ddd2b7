"""Memory a step needs, checked before anything is allocated for it.

A step holds the run's inputs on the device, the anchor buffers (and, for the host, their
copies), the weights (training: old and new, so a failed run leaves the old ones), and the
program's own temporaries, which XLA reports once the program is compiled. The estimate is
made twice: from shapes alone before compiling (so a step whose anchors or inputs cannot fit is
refused without compiling), and again with XLA's numbers after compiling, before the first run.
A step that does not fit the device (host RAM on CPU) is refused with the estimate, what
dominates it and how to make it smaller; nothing is left half-built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

from ..._base.problems import Problem, raise_errors
from ...errors import InvalidConfig
from .host_memory import kept_free_bytes

__all__ = ["available_bytes", "check_fits", "human"]

#: The fraction of the free memory a step may plan to use (the rest is for everything else).
HEADROOM = 0.9


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def available_bytes(device: jax.Device) -> tuple[int, str]:
    """Free memory of ``device`` and what it is: a GPU's own memory, else the host's RAM (what
    the system has available, and what this process's malloc keeps free for it:
    :mod:`.host_memory`)."""
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)),
                    f"{device.platform} device {device.id}")
    return _system_available() + kept_free_bytes(), "host RAM"


def _system_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(who: str, parts: Mapping[str, int], device: jax.Device, fix: str,
               detail: Mapping[str, int] | None = None) -> int:
    """Refuse (a ValueError naming the estimate, its largest parts and ``fix``) when the
    ``parts`` (label -> bytes) add up to more than the device can give; return the total."""
    total = sum(parts.values())
    free, what = available_bytes(device)
    if total <= HEADROOM * free:
        return total
    ranked = sorted(parts.items(), key=lambda kv: -kv[1])
    listed = ", ".join(f"{label} {human(n)}" for label, n in ranked if n)
    largest = ""
    if detail:
        top = sorted(detail.items(), key=lambda kv: -kv[1])[:3]
        largest = " Largest: " + ", ".join(f"{k} {human(v)}" for k, v in top) + "."
    raise_errors(who, [Problem(
        ("memory",), f"this step needs about {human(total)} ({listed}) but the {what} has "
                     f"{human(free)} free.{largest}", fix, "K-memory")], error=InvalidConfig)
    return total  # pragma: no cover - raise_errors raised
