"""Where a session runs: the one place that knows devices, the mesh and host <-> device movement.

A :class:`Placement` owns the device mesh of a session's local replicas and everything that
follows from it: which devices run which replicas (each device runs a block of replicas,
vectorised), the sharding of every argument, how the run's canonical host arrays reach the
devices (one transfer) and how results come back as host arrays (one fetch). The mesh axis is
named :data:`REPLICA`; a process axis (global replication over instances) and a stage axis
(pipeline stages on their own devices) join it there.

How many devices replicas use is measured, not assumed: on CPU every XLA program already uses
all cores (its operators run multi-threaded), and splitting replicas over virtual CPU devices
that share those cores ran slower than the same replicas vectorised on one device
(``benchmarks/runtime_bench.py``), so CPU replicas run vectorised on one device. On GPUs each
device is real: replicas spread over as many as divide the replica count.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax._src import xla_bridge
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...errors import ConfigError

__all__ = ["REPLICA", "HOST_DEVICES", "Placement", "ensure_host_devices", "replica_devices",
           "use_compilation_cache"]

REPLICA = "replica"
#: At most this many CPU devices run a session's replicas (see the module docs).
CPU_REPLICA_DEVICES = 1
HOST_DEVICES = 8  # virtual CPU devices asked for when JAX has not started yet
#: Environment variable: a directory for JAX's persistent compilation cache, or "off".
CACHE_VARIABLE = "POPART_KIT_COMPILATION_CACHE"


def ensure_host_devices(count: int = HOST_DEVICES) -> None:
    """Ask JAX for ``count`` CPU devices if it has not initialised yet (else do nothing); and
    turn on the persistent compilation cache (see :func:`use_compilation_cache`)."""
    use_compilation_cache()
    if not xla_bridge.backends_are_initialized():
        current = jax.config.jax_num_cpu_devices
        jax.config.update("jax_num_cpu_devices", max(count, current if current > 0 else 1))


def use_compilation_cache() -> str | None:
    """Keep compiled programs on disk so a second process skips compiling the same step.

    The directory is ``$POPART_KIT_COMPILATION_CACHE``, else ``$XDG_CACHE_HOME/popart_kit/xla``
    (``~/.cache/popart_kit/xla``); ``POPART_KIT_COMPILATION_CACHE=off`` turns it off, and a
    cache directory the user gave JAX is left as it is. Returns the directory in use."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    setting = os.environ.get(CACHE_VARIABLE, "")
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    if setting:
        directory = Path(setting)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        directory = Path(base) / "popart_kit" / "xla"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: compile every time rather than fail
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # the kit's step programs compile in well under JAX's default threshold of one second
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return str(directory)


def replica_devices(replicas: int, platform: str | None = None) -> list[jax.Device]:
    """The devices that run ``replicas`` local replicas: as many as divide the replica count
    evenly, at most :data:`CPU_REPLICA_DEVICES` on CPU (see the module docs); each runs a block
    of replicas, vectorised."""
    ensure_host_devices()
    available = jax.devices(platform) if platform else jax.devices()
    usable = len(available) if available[0].platform != "cpu" else min(
        len(available), CPU_REPLICA_DEVICES)
    used = max(d for d in range(1, min(replicas, usable) + 1) if replicas % d == 0)
    return available[:used]


class Placement:
    """The devices of a session's ``replicas`` local replicas, and all host <-> device movement.

    Arrays with a replica axis are split over the mesh along it; everything else (weights,
    optimizer state, hyperparameters, Broadcast inputs) has a copy on every device.
    """

    def __init__(self, replicas: int, devices: Sequence[jax.Device] | None = None) -> None:
        self.replicas = replicas
        self.devices = list(devices) if devices is not None else replica_devices(replicas)
        if replicas % len(self.devices):
            raise ConfigError(f"{replicas} replicas cannot be split evenly over "
                             f"{len(self.devices)} devices. Fix: use a device count that "
                             f"divides the replica count.", rule="K-placement")
        self.per_device = replicas // len(self.devices)
        self.mesh = Mesh(np.array(self.devices), (REPLICA,))
        self.platform = self.devices[0].platform

    @property
    def several(self) -> bool:
        """Whether replicas span several devices (programs then run SPMD over the mesh)."""
        return len(self.devices) > 1

    def everywhere(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def split(self, replica_axis: int | None) -> NamedSharding:
        """The sharding of an array whose axis ``replica_axis`` is the replica (None: a copy on
        every device)."""
        if replica_axis is None:
            return self.everywhere()
        return NamedSharding(self.mesh, P(*(None,) * replica_axis, REPLICA))

    def spec(self, replica_axis: int | None) -> P:
        return P() if replica_axis is None else P(*(None,) * replica_axis, REPLICA)

    def spmd(self, fn: Callable, in_axes: Any, out_axes: Any) -> Callable:
        """``fn`` run per device on its block of replicas: ``in_axes`` / ``out_axes`` are
        pytrees (prefixes) of the replica axis of each argument / result, None for values
        every device holds whole. On one device, ``fn`` itself."""
        if not self.several:
            return fn

        def specs(axes: Any) -> Any:
            return jax.tree.map(self.spec, axes, is_leaf=lambda a: a is None)

        return jax.shard_map(fn, mesh=self.mesh, in_specs=specs(in_axes),
                             out_specs=specs(out_axes),
                             check_vma=False)  # replicas are independent but for the psum

    def put(self, arrays: Mapping[str, np.ndarray], axes: Mapping[str, int | None],
            resident: bool = False) -> dict:
        """Host arrays onto the devices in one transfer (``axes``: each one's replica axis).
        On one device the arrays stay on the host unless ``resident``: the program call that
        takes them transfers them itself, which costs less than a transfer of its own."""
        if not self.several:
            return jax.device_put(dict(arrays), self.devices[0]) if resident else dict(arrays)
        return jax.device_put(dict(arrays), {k: self.split(axes[k]) for k in arrays})

    def put_everywhere(self, tree: Any) -> Any:
        """A pytree with a copy on every device (weights, optimizer state, hyperparameters)."""
        return jax.device_put(tree, self.everywhere() if self.several else self.devices[0])

    def abstract(self, arrays: Mapping[str, Any], axes: Mapping[str, int | None]) -> dict:
        """The shapes, dtypes and shardings of what :meth:`put` would give (for compiling)."""
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                        sharding=self.split(axes[k]) if self.several
                                        else jax.sharding.SingleDeviceSharding(self.devices[0]))
                for k, v in arrays.items()}

    @staticmethod
    def fetch(tree: Any) -> Any:
        """Device results as writable host arrays (one copy each)."""
        leaves, structure = jax.tree.flatten(tree)
        if len(leaves) > 1:
            for leaf in leaves:
                leaf.copy_to_host_async()  # all transfers start before the first is awaited
        elif len(leaves) == 1:
            return jax.tree.unflatten(structure, [np.array(leaves[0])])
        return jax.tree.unflatten(structure, [np.array(leaf) for leaf in leaves])
