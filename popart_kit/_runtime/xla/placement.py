"""Where a session runs: the one place that knows devices, the mesh and host <-> device movement.

A :class:`Placement` owns the device mesh of a session's local replicas and everything that
follows from it: which devices run which replicas (each device runs a block of replicas,
vectorised), the sharding of every argument, how the run's canonical host arrays reach the
devices (one transfer) and how results come back as host arrays (one fetch). The mesh axis is
named :data:`REPLICA`, under a :data:`PROCESS` axis (global replication: one row of devices per
instance, of size 1 in a single process). A pipelined session's stages get devices of their own
here too (:meth:`Placement.stage_devices`), and where a session spans instances each stage's
update runs as one program over that stage's device in every instance
(:meth:`Placement.across_instances`).

Over several processes the mesh holds every global replica; each instance gives and gets only
its own: :meth:`Placement.put` builds global arrays from this process's host arrays and
:meth:`Placement.fetch` returns only this process's shards (its local replicas).

How many devices replicas use is measured, not assumed: on CPU every XLA program already uses
all cores (its operators run multi-threaded), and splitting replicas over virtual CPU devices
that share those cores ran slower than the same replicas vectorised on one device
(``benchmarks/runtime_bench.py``), so CPU replicas run vectorised on one device. On GPUs each
device is real: replicas spread over as many as divide the replica count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import xla_bridge  # backends_are_initialized has no public API (JAX 0.10.2)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...errors import ConfigError
from .compilation_cache import use_compilation_cache

__all__ = ["REPLICA", "PROCESS", "HOST_DEVICES", "Placement", "ensure_host_devices",
           "replica_devices"]

REPLICA = "replica"
PROCESS = "process"
#: At most this many CPU devices run a session's replicas (see the module docs).
CPU_REPLICA_DEVICES = 1
HOST_DEVICES = 8  # virtual CPU devices asked for when JAX has not started yet


def ensure_host_devices(count: int = HOST_DEVICES) -> None:
    """Ask JAX for ``count`` CPU devices if it has not initialised yet (else do nothing); and
    turn on the persistent compilation cache (see :mod:`.compilation_cache`)."""
    use_compilation_cache()
    if not xla_bridge.backends_are_initialized():
        current = jax.config.jax_num_cpu_devices
        jax.config.update("jax_num_cpu_devices", max(count, current if current > 0 else 1))


def replica_devices(replicas: int, platform: str | None = None) -> list[jax.Device]:
    """The devices that run ``replicas`` local replicas: as many as divide the replica count
    evenly, at most :data:`CPU_REPLICA_DEVICES` on CPU (see the module docs); each runs a block
    of replicas, vectorised. This process's devices only."""
    ensure_host_devices()
    available = jax.local_devices(backend=platform)
    usable = len(available) if available[0].platform != "cpu" else min(
        len(available), CPU_REPLICA_DEVICES)
    used = max(d for d in range(1, min(replicas, usable) + 1) if replicas % d == 0)
    return available[:used]


class Placement:
    """The devices of a session's ``replicas`` local replicas, and all host <-> device movement.

    Arrays with a replica axis are split over the mesh along it; everything else (weights,
    optimizer state, hyperparameters, Broadcast inputs) has a copy on every device.
    ``processes`` > 1: this process is one of that many instances (``jax.distributed`` started),
    each with ``replicas`` local replicas on the same number of its own devices.
    """

    def __init__(self, replicas: int, devices: Sequence[jax.Device] | None = None,
                 processes: int = 1) -> None:
        self.replicas, self.processes = replicas, processes
        self.devices = list(devices) if devices is not None else replica_devices(replicas)
        if replicas % len(self.devices):
            raise ConfigError(f"{replicas} replicas cannot be split evenly over "
                             f"{len(self.devices)} devices. Fix: use a device count that "
                             f"divides the replica count.", rule="K-placement")
        self.per_device = replicas // len(self.devices)
        self.mesh = Mesh(self._grid(), (PROCESS, REPLICA))
        self.platform = self.devices[0].platform
        self._stage_meshes: dict[tuple[jax.Device, ...], Mesh] = {}

    def _grid(self) -> np.ndarray:
        """Devices by (process, local position): every process uses the same count."""
        if self.processes == 1:
            return np.array([self.devices])
        if jax.process_count() != self.processes:
            raise ConfigError(f"the session has {self.processes} instances but JAX runs "
                              f"{jax.process_count()} processes. Fix: start one process per "
                              f"instance (popart-kit launch).", rule="K-placement")
        count = len(self.devices)
        rows = [[d for d in jax.devices(self.devices[0].platform) if d.process_index == p][:count]
                for p in range(self.processes)]
        return np.array(rows)

    @property
    def several(self) -> bool:
        """Whether replicas span several devices (programs then run SPMD over the mesh)."""
        return self.mesh.size > 1

    @property
    def one_cpu(self) -> bool:
        """Whether everything runs on one CPU device, whose memory is the host's (large anchors
        handed out in place, large inputs read in place, onnxruntime segments)."""
        return self.platform == "cpu" and not self.several

    @property
    def distributed(self) -> bool:
        """Whether the mesh spans several processes (arrays are then global)."""
        return self.processes > 1

    @property
    def axes(self) -> tuple[str, str]:
        """The mesh axes every replica spans: reductions over all replicas run over them."""
        return (PROCESS, REPLICA)

    def everywhere(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def split(self, replica_axis: int | None) -> NamedSharding:
        """The sharding of an array whose axis ``replica_axis`` is the replica (None: a copy on
        every device)."""
        return NamedSharding(self.mesh, self.spec(replica_axis))

    def spec(self, replica_axis: int | None) -> P:
        return P() if replica_axis is None else P(*(None,) * replica_axis, self.axes)

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
        if self.distributed:  # this process's replicas of global arrays
            return {k: jax.make_array_from_process_local_data(
                self.split(axes[k]), v, self.global_shape(v.shape, axes[k]))
                for k, v in arrays.items()}
        return jax.device_put(dict(arrays), {k: self.split(axes[k]) for k in arrays})

    def put_everywhere(self, tree: Any) -> Any:
        """A pytree with a copy on every device (weights, optimizer state, hyperparameters);
        over several processes each gives the same values."""
        if self.distributed:
            return jax.tree.map(lambda v: jax.make_array_from_process_local_data(
                self.everywhere(), np.asarray(v)), tree)
        return jax.device_put(tree, self.everywhere() if self.several else self.devices[0])

    def global_shape(self, shape: Sequence[int], replica_axis: int | None) -> tuple[int, ...]:
        """The shape over all processes of a local array whose axis ``replica_axis`` holds
        this process's replicas."""
        if replica_axis is None or not self.distributed:
            return tuple(shape)
        return (*shape[:replica_axis], shape[replica_axis] * self.processes,
                *shape[replica_axis + 1:])

    def abstract(self, arrays: Mapping[str, Any], axes: Mapping[str, int | None]) -> dict:
        """The shapes, dtypes and shardings of what :meth:`put` would give (for compiling)."""
        return {k: jax.ShapeDtypeStruct(self.global_shape(v.shape, axes[k]), v.dtype,
                                        sharding=self.split(axes[k]) if self.several
                                        else jax.sharding.SingleDeviceSharding(self.devices[0]))
                for k, v in arrays.items()}

    # -- pipeline stages --------------------------------------------------------------------

    def stage_devices(self, stages: int) -> list[list[jax.Device]]:
        """This process's devices for each of ``stages`` pipeline stages: a stage's replicas
        on as many devices as the unpipelined placement gives them while the host has R x K
        (one each on CPU, and across instances), else one. A host with fewer devices than
        stages (one GPU) gives them in turn, stage s the device s modulo their number: the
        stages keep their schedule, and those sharing a device take turns on it."""
        devices = jax.local_devices(backend=self.platform)
        if len(devices) < stages:
            return [[devices[s % len(devices)]] for s in range(stages)]
        per = len(self.devices)
        per = per if len(devices) >= per * stages and not self.distributed else 1
        return [devices[s * per:(s + 1) * per] for s in range(stages)]

    def on_stage(self, group: Sequence[jax.Device], replica_axis: int | None = None) -> Any:
        """Where a stage on ``group`` keeps an array: its device, or over its devices split
        along ``replica_axis`` (None: a copy on each)."""
        if len(group) == 1:
            return group[0]
        key = tuple(group)
        if key not in self._stage_meshes:
            self._stage_meshes[key] = Mesh(np.array(group), (REPLICA,))
        spec = P() if replica_axis is None else P(*(None,) * replica_axis, REPLICA)
        return NamedSharding(self._stage_meshes[key], spec)

    def stage_put(self, arrays: Mapping[str, np.ndarray], group: Sequence[jax.Device],
                  axes: Mapping[str, int | None]) -> dict:
        """Host arrays onto a stage's devices in one transfer (``axes``: each one's replica
        axis)."""
        return jax.device_put(dict(arrays), {k: self.on_stage(group, axes[k]) for k in arrays})

    def to_stage(self, tree: Any, group: Sequence[jax.Device]) -> Any:
        """A pytree (a stage's state, the hyperparameters) with a copy on each of a stage's
        devices; arrays already there are not copied."""
        return jax.device_put(tree, self.on_stage(group))

    def across_instances(self, fn: Callable, donate: tuple[int, ...],
                         device: jax.Device) -> Callable:
        """``fn`` compiled for ``device``; over several instances, one program over that
        device and its counterpart (the same local position) in every other instance, whose
        collectives over :data:`PROCESS` reach every instance. Arguments and results are this
        process's arrays on ``device``; every instance must call it, in the same order."""
        if not self.distributed:
            return jax.jit(fn, donate_argnums=donate)
        position = jax.local_devices(backend=self.platform).index(device)
        rows = [[d for d in jax.devices(self.platform) if d.process_index == p][position]
                for p in range(self.processes)]
        mesh = Mesh(np.array(rows).reshape(self.processes, 1), (PROCESS, REPLICA))
        program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(),
                                        check_vma=False), donate_argnums=donate)
        copies = NamedSharding(mesh, P())

        def call(*args: Any) -> Any:
            def global_(a: Any) -> Any:
                local = jax.device_put(a, device)
                return jax.make_array_from_single_device_arrays(np.shape(local), copies,
                                                                [local])

            out = program(*jax.tree.map(global_, args))
            return jax.tree.map(lambda a: a.addressable_data(0), out)

        return call

    @staticmethod
    def local_copy(tree: Any) -> Any:
        """A pytree's arrays as this process's own: of a global array every device holds
        whole (weights, state, hyperparameters), the copy on one of this process's devices."""
        return jax.tree.map(lambda a: a.addressable_data(0) if isinstance(a, jax.Array)
                            and not a.is_fully_addressable else a, tree)

    @staticmethod
    def fetch(tree: Any) -> Any:
        """Device results as writable host arrays (one copy each; host arrays pass as they
        are); of a global array, only this process's part (its local replicas)."""
        leaves, structure = jax.tree.flatten(tree)
        if any(not getattr(leaf, "is_fully_addressable", True) for leaf in leaves):
            return jax.tree.unflatten(structure, [_local_part(leaf) for leaf in leaves])
        if len(leaves) > 1:
            for leaf in leaves:
                if isinstance(leaf, jax.Array):
                    leaf.copy_to_host_async()  # all transfers start before the first waits
        elif len(leaves) == 1:
            return jax.tree.unflatten(structure, [np.array(leaves[0])])
        return jax.tree.unflatten(structure, [np.array(leaf) for leaf in leaves])


def _local_part(array: Any) -> np.ndarray:
    """This process's part of a global array: its shards joined along the one axis they
    split (a replicated array: one copy)."""
    if getattr(array, "is_fully_addressable", True):
        return np.array(array)
    shards = {}
    for shard in array.addressable_shards:
        key = tuple(s.indices(n)[:2] for s, n in zip(shard.index, array.shape, strict=True))
        shards.setdefault(key, shard)
    if len(shards) == 1:
        return np.array(next(iter(shards.values())).data)
    keys = sorted(shards)
    axis = next(i for i in range(array.ndim) if len({k[i] for k in keys}) > 1)
    return np.concatenate([np.asarray(shards[k].data) for k in keys], axis=axis)
