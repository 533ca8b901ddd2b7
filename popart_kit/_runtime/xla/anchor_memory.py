"""A CPU session's large anchors: handed out without a copy, their memory used again.

XLA on CPU gives every run's results newly allocated memory, and the first write to newly
allocated memory costs a page fault per 4 KiB page: for a 33 MB anchor (a convolution's output
at 540x960) about 10 ms, more than onnxruntime takes for the whole convolution. Copying the
result into a fresh host array pays the faults a second time. On one CPU device,
:class:`RecycledAnchors` instead

* hands each large anchor out as a writable numpy array over the run's own result buffer (on
  CPU the device's memory is the host's, and XLA never reads a result buffer again), and
* once no array over that buffer is left (the caller dropped the anchor and every view of it),
  keeps the buffer and donates it to the next run's program, which then writes that run's
  anchor into memory already mapped.

A run never writes into memory a live array uses: a buffer comes back only when the last array
over it is gone. Anchors under :data:`MIN_BYTES` are copied to the host as before (a copy costs
less than the bookkeeping), and so is everything on other devices or over several (their
allocators keep memory of their own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .placement import Placement

__all__ = ["MIN_BYTES", "RecycledAnchors"]

#: Anchors at least this large are recycled (a copy of 1 MiB takes about 0.1 ms).
MIN_BYTES = 1 << 20

#: Buffers kept per anchor for the runs to come; more that come back are freed.
KEEP = 2


class _Lease:
    """Owner of the host arrays over one result buffer: gives the buffer back to ``home``
    (while it holds fewer than :data:`KEEP`) when the last of them is gone."""

    __slots__ = ("__array_interface__", "_buffer", "_home")

    def __init__(self, buffer: jax.Array, home: list[jax.Array]) -> None:
        self._buffer, self._home = buffer, home
        self.__array_interface__ = {"shape": (buffer.nbytes,), "typestr": "|u1",
                                    "data": (buffer.unsafe_buffer_pointer(), False),
                                    "version": 3}

    def __del__(self) -> None:
        if len(self._home) < KEEP:
            self._home.append(self._buffer)


class RecycledAnchors:
    """The recycled anchors of an executor's runs, given the anchor buffers' ``shapes`` (see
    :class:`~.anchors.AnchorBuffers`); none where the placement is not one CPU device."""

    def __init__(self, placement: Placement,
                 shapes: Mapping[str, jax.ShapeDtypeStruct]) -> None:
        self._device = placement.devices[0]
        self._shapes = {name: s for name, s in shapes.items()
                        if placement.one_cpu and int(np.prod(s.shape, dtype=np.int64)) *
                        np.dtype(s.dtype).itemsize >= MIN_BYTES}
        self._free: dict[str, list[jax.Array]] = {name: [] for name in self._shapes}

    def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
        """What :meth:`slots` gives, for compiling: the program's donated argument."""
        sharding = jax.sharding.SingleDeviceSharding(self._device)
        return {name: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
                for name, s in self._shapes.items()}

    def slots(self) -> dict[str, jax.Array]:
        """A buffer for each recycled anchor, for the next run to donate: one that came back,
        else a new one (the first run, or while the caller holds the earlier anchors)."""
        out = {}
        for name, s in self._shapes.items():
            free = self._free[name]
            out[name] = free.pop() if free else jnp.zeros(s.shape, s.dtype, device=self._device)
        return out

    def hand_out(self, buffers: Mapping[str, Any]) -> dict[str, Any]:
        """``buffers`` with each recycled anchor a writable host array over its buffer (the
        others as they are, for the backend to copy)."""
        out = dict(buffers)
        for name in self._shapes:
            buffer = out[name]
            buffer.block_until_ready()
            out[name] = np.asarray(_Lease(buffer, self._free[name])).view(
                buffer.dtype).reshape(buffer.shape)
        return out

    def clear(self) -> None:
        """Free the kept buffers (the session closed): new free lists, so that buffers whose
        arrays are dropped later go with their old lists rather than being kept."""
        self._free = {name: [] for name in self._shapes}
