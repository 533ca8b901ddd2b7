"""Freed host memory kept mapped for the next run (host_memory.py): a block over glibc's
mmap threshold, freed and allocated again, reuses pages already faulted in; the variable
turns that off. Each case in a fresh process (the setting is the process's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = """
import json, resource, sys
setup = sys.argv[1]
if setup == "session":
    import popart_kit as pk
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]))
    b.addOutputTensor(b.aiOnnx.relu([x]))
    pk.InferenceSession(b.getModelProto(), pk.SessionConfig(
        mode="inference", device={"target": "offline"}), backend="xla")
else:
    from popart_kit._runtime.xla.host_memory import keep_freed_memory
    print(json.dumps({"set": keep_freed_memory()}))
import ctypes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
size = 64 << 20  # twice glibc's largest mmap threshold (numpy's arrays would ask for huge pages)
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
from popart_kit._runtime.xla.host_memory import kept_free_bytes
print(json.dumps({"kept": kept_free_bytes()}))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size)
ctypes.memset(block, 1, size)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""

_PAGES = (64 << 20) // 4096


def _faults(setup: str, keep: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "POPART_KIT_KEEP_FREED_MEMORY"}
    if keep is not None:
        env["POPART_KIT_KEEP_FREED_MEMORY"] = keep
    out = subprocess.run([sys.executable, "-c", _SCRIPT, setup], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    found: dict = {}
    for line in out.splitlines():
        if line.startswith("{"):
            found.update(json.loads(line))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_cpu_session_keeps_freed_memory_mapped_unless_told_not_to():
    """After a CPU session is made, a freed 64 MiB block is kept (malloc counts it free) and,
    allocated again, faults in almost none of its 16,384 pages; with
    POPART_KIT_KEEP_FREED_MEMORY=0 it is returned and faults in every one."""
    kept = _faults("session", None)
    assert kept["faults"] < _PAGES // 10 and kept["kept"] >= 64 << 20, kept
    plain = _faults("plain", "0")
    assert plain["set"] is False and plain["faults"] >= _PAGES * 0.9, plain
    assert plain["kept"] < 64 << 20, plain


def test_the_memory_check_counts_what_malloc_keeps_free(monkeypatch):
    """The host's available memory is the system's plus what this process's malloc keeps
    free for it (a step may reuse it)."""
    import jax

    from popart_kit._runtime.xla import memory

    cpu = jax.devices("cpu")[0]
    monkeypatch.setattr(memory, "_system_available", lambda: 1 << 30)
    monkeypatch.setattr(memory, "kept_free_bytes", lambda: 3 << 30)
    assert memory.available_bytes(cpu) == (4 << 30, "host RAM")
