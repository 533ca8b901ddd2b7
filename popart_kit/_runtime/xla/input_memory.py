"""A CPU session's large inputs, put where the program reads them in place.

On one CPU device a program call reads a host array in place when its memory is aligned to
:data:`ALIGNMENT` bytes (XLA:CPU's minimum); any other array it copies, each call, into newly
allocated memory, paying a page fault per 4 KiB page on top of the copy. numpy's own arrays
are aligned to 16 bytes, so a user's input is mostly copied that way: for ResNet's 56x56x64
activations at batch 8 (6.4 MB) a session run took 7.4 ms against 5.5 ms with the same values
aligned (one 3x3 convolution; onnxruntime, reading the user's array where it lies, 5.1 ms).

:class:`AlignedInputs` copies such an input instead into aligned memory it keeps, already
mapped after the first run, and hands the program a view of it. The memory is written again
only when no array over it is left: the program's call holds the view until XLA is done
reading it (JAX lets go of it by the next call), so a run never overwrites what an earlier one
still reads, and two or three buffers serve every run. An input that only
onnxruntime segments read gets such a buffer unfilled (:meth:`AlignedInputs.unfilled`; they
read the caller's array, see :mod:`.delegated`). Inputs under
:data:`MIN_BYTES` and inputs already aligned are passed as they are, and nothing is kept for
other devices or several (a transfer to them copies anyway).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["ALIGNMENT", "KEEP", "MIN_BYTES", "AlignedInputs"]

#: Inputs at least this large are aligned (below it, XLA's own copy costs about as much).
MIN_BYTES = 1 << 20

#: XLA:CPU reads a host array in place from this alignment on.
ALIGNMENT = 64

#: Aligned buffers kept per input for the runs to come; more that come back are freed.
KEEP = 2


class _Lease:
    """Owner of the arrays over one kept buffer: gives it back to ``home`` (while that holds
    fewer than :data:`KEEP`) when the last of them is gone."""

    __slots__ = ("__array_interface__", "_memory", "_home")

    def __init__(self, memory: np.ndarray, home: list[np.ndarray]) -> None:
        self._memory, self._home = memory, home
        self.__array_interface__ = {"shape": (memory.nbytes,), "typestr": "|u1",
                                    "data": (memory.ctypes.data, False), "version": 3}

    def __del__(self) -> None:
        if len(self._home) < KEEP:
            self._home.append(self._memory)


def aligned(array: np.ndarray) -> bool:
    """Whether the program reads ``array`` in place (C-contiguous, :data:`ALIGNMENT`-aligned)."""
    return array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0


def _new(nbytes: int) -> np.ndarray:
    """``nbytes`` of uninitialised memory starting at an :data:`ALIGNMENT` boundary."""
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes]


class AlignedInputs:
    """The large inputs of a session's runs, each copied into aligned memory kept for it
    (``enabled``: one CPU device and no pipeline; otherwise inputs pass as they are)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._free: dict[str, list[np.ndarray]] = {}

    def place(self, name: str, array: Any, dtype: np.dtype, shape: tuple[int, ...]
              ) -> np.ndarray:
        """``array`` as input ``name`` of ``dtype`` and ``shape`` (numpy's ``asarray`` and
        ``reshape``): in aligned memory where it is large and is not there already."""
        if type(array) is np.ndarray and array.dtype == dtype and (
                not self.enabled or array.nbytes < MIN_BYTES):  # every run's small inputs
            return array if array.shape == shape else array.reshape(shape)
        array = np.asarray(array)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if not self.enabled or nbytes < MIN_BYTES or (array.dtype == dtype and aligned(array)):
            return np.asarray(array, dtype=dtype).reshape(shape)
        out = self._kept(name, nbytes, dtype, shape)
        np.copyto(out, array.reshape(shape), casting="unsafe")
        return out

    def unfilled(self, name: str, array: Any, dtype: np.dtype, shape: tuple[int, ...]
                 ) -> np.ndarray | None:
        """For an input the program reads only in onnxruntime segments, which read ``array``
        itself (see ``delegated.Delegation.lend``): where :meth:`place` would copy it, an
        aligned buffer of its size with no values written (None where it would not, or where
        ``array`` is not C-contiguous of ``dtype`` and ``shape``'s size: :meth:`place` it)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if (not self.enabled or nbytes < MIN_BYTES or not isinstance(array, np.ndarray)
                or array.dtype != dtype or not array.flags.c_contiguous
                or array.nbytes != nbytes or aligned(array)):
            return None
        return self._kept(name, nbytes, dtype, shape)

    def _kept(self, name: str, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]
              ) -> np.ndarray:
        """An array over a kept aligned buffer of input ``name``, handed back when dropped."""
        free = self._free.setdefault(name, [])
        memory = free.pop() if free and free[-1].nbytes == nbytes else _new(nbytes)
        return np.asarray(_Lease(memory, free)).view(dtype).reshape(shape)

    def clear(self) -> None:
        """Free the kept buffers (the session closed); buffers still in use go with their
        old lists."""
        self._free = {}
