"""Which JAX devices run a session's replicas.

Replicas are JAX devices on a mesh axis. On CPU, JAX shows one device unless told otherwise
before it initialises, so the kit asks for enough host devices first; where JAX is already
initialised with too few, replicas run vectorised on the devices there are (identical numerics)
and the kit says so once.
"""

from __future__ import annotations

import warnings

import jax
from jax._src import xla_bridge

from ..._problems import PopartKitWarning

__all__ = ["ensure_host_devices", "replica_devices", "HOST_DEVICES"]

HOST_DEVICES = 8  # virtual CPU devices asked for when JAX has not started yet
_warned: set[tuple[int, int]] = set()


def ensure_host_devices(count: int = HOST_DEVICES) -> None:
    """Ask JAX for ``count`` CPU devices if it has not initialised yet (else do nothing)."""
    if not xla_bridge.backends_are_initialized():
        current = jax.config.jax_num_cpu_devices
        jax.config.update("jax_num_cpu_devices", max(count, current if current > 0 else 1))


def replica_devices(replicas: int) -> list[jax.Device]:
    """The devices that run ``replicas`` replicas: as many as divide the replica count evenly
    (each device then runs a block of replicas, vectorised)."""
    ensure_host_devices(max(replicas, HOST_DEVICES))
    available = jax.devices()
    used = max(d for d in range(1, min(replicas, len(available)) + 1) if replicas % d == 0)
    if used < replicas and (replicas, len(available)) not in _warned:
        _warned.add((replicas, len(available)))
        platform = available[0].platform
        why = (f"JAX was started with {len(available)} CPU device(s) before this session asked "
               f"for {replicas}; create sessions before other code initialises JAX"
               if platform == "cpu" else f"there are {len(available)} {platform} device(s)")
        warnings.warn(
            f"{replicas} replicas run on {used} {platform} device(s), {replicas // used} "
            f"vectorised per device ({why}). Numerics are identical.", PopartKitWarning,
            stacklevel=4)
    return available[:used]
