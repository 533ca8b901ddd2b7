"""Facts about the machine a sweep ran on, recorded with its results."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["machine_facts", "load_average", "describe"]

_LIBRARIES = ("popart-kit", "jax", "jaxlib", "numpy", "onnx", "onnxruntime", "matplotlib")


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_facts(backend: str = "xla") -> dict[str, Any]:
    """CPU model, cores, memory, devices, library versions, load average and the kit's commit."""
    versions = {}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    facts: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "system": f"{platform.system()} {platform.release()}",
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "libraries": versions,
        "commit": _commit(),
        "backend": backend,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_start": load_average(),
    }
    if backend == "xla":
        import jax

        devices = jax.devices()
        facts["devices"] = {"platform": devices[0].platform, "count": len(devices),
                            "kind": devices[0].device_kind}
    return facts


def describe(facts: dict[str, Any]) -> str:
    """One line: CPU, cores, devices, load."""
    dev = facts.get("devices") or {}
    load = facts.get("load_start")
    end = facts.get("load_end")
    loads = "" if load is None else f", load {load:.2f}" + ("" if end is None else f"-{end:.2f}")
    return (f"{facts.get('cpu')}, {facts.get('cores_usable')} cores"
            + (f", {dev.get('count')} {dev.get('platform')} devices" if dev else "")
            + f"; {facts.get('backend')} backend, jax "
              f"{(facts.get('libraries') or {}).get('jax')}{loads}")
