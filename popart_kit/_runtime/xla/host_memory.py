"""Freed host memory kept mapped for the next run (glibc's malloc), on CPU sessions.

XLA on the CPU allocates every run's temporaries as one block and each result as a block of
its own. glibc serves a block over 32 MiB (its largest mmap threshold) with newly mapped pages
and unmaps it when it is freed, so every run faults each page of it in again, a fault per
4 KiB (touching 165 MB of fresh pages took 87 ms on the 2-core machine the benchmarks ran on,
17 ms mapped): 41,000 faults in each training step of a 4->64 k4 convolution at 540x960,
whose jitted forward and gradient took 119 ms with them and 87 ms without.
:func:`keep_freed_memory` asks glibc to serve such blocks from its heap instead, and to keep up
to :data:`KEPT_BYTES` of freed memory at the heap's top mapped: the next run's blocks reuse
pages already faulted in. Measured on training sessions (bps 1, load 1-2): that convolution's
step 77-81 -> 54-60 ms; the ResNet 3x3 step and MLP steps, which faulted little, unchanged;
a float16 540x960 inference run 9.5-10.5 -> 9.3-9.4 ms.

The cost is memory: the process keeps what it freed (its peak) rather than returning it, 847-895
against 1051-1062 MiB of peak RSS in that measurement; :func:`kept_free_bytes` says how much
of it is free for the process's own next allocations (the step memory check counts it as
available). ``POPART_KIT_KEEP_FREED_MEMORY=0`` leaves glibc's defaults. Elsewhere than glibc on
Linux nothing changes. Imports no JAX.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = ["KEPT_BYTES", "VARIABLE", "keep_freed_memory", "kept_free_bytes"]

#: Environment variable: "0" (or "off", "false", "no") leaves glibc's defaults.
VARIABLE = "POPART_KIT_KEEP_FREED_MEMORY"
#: Freed memory at the top of the heap kept mapped (glibc's trim threshold, a C int).
KEPT_BYTES = (1 << 31) - 1

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory mapped (see the module docs), once per process;
    whether it is set. Refused (False): the variable says no, or the C library is not glibc's
    (``mallopt`` missing or refusing)."""
    global _done
    if _done is None:
        _done = False
        if (os.environ.get(VARIABLE, "").lower() not in ("0", "off", "false", "no")
                and sys.platform.startswith("linux")):
            try:
                libc = _libc()
                _done = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(
                    libc.mallopt(_M_TRIM_THRESHOLD, KEPT_BYTES))
            except (OSError, AttributeError):
                _done = False
    return _done


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def kept_free_bytes() -> int:
    """Bytes glibc's malloc holds free for this process (``mallinfo2``'s ``fordblks``: freed
    blocks it keeps mapped, which the next allocations reuse); 0 where that is unknown (not
    glibc 2.33 or later)."""
    try:
        mallinfo2 = _libc().mallinfo2
    except (OSError, AttributeError):
        return 0
    mallinfo2.restype = _Mallinfo2
    return int(mallinfo2().fordblks)
