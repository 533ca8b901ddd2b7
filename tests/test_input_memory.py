"""A CPU session's large inputs (input_memory.py): copied into aligned memory the program
reads in place, that memory written again only once nothing holds it."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart_kit as pk
from popart_kit._runtime.xla import input_memory
from popart_kit._runtime.xla.input_memory import ALIGNMENT, KEEP, MIN_BYTES, AlignedInputs

SHAPE = (4, 256, 256)  # 1 MiB of float32


def _unaligned(values: np.ndarray) -> np.ndarray:
    """``values`` in memory 16 bytes past an :data:`ALIGNMENT` boundary (numpy's own arrays
    are only 16-byte aligned)."""
    raw = np.empty(values.nbytes + 2 * ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT + 16
    out = raw[start:start + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    assert out.ctypes.data % ALIGNMENT == 16
    return out


def _x(seed: int, dtype: type = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=SHAPE).astype(dtype)


def test_a_large_unaligned_input_is_copied_into_aligned_memory_kept_for_the_next_run():
    staged = AlignedInputs(True)
    x = _unaligned(_x(0))
    first = staged.place("x", x, np.dtype(np.float32), SHAPE)
    assert first.ctypes.data % ALIGNMENT == 0 and not np.shares_memory(first, x)
    np.testing.assert_array_equal(first, x)
    address = first.ctypes.data
    del first  # nothing holds it: the next run writes the same memory
    second = staged.place("x", _unaligned(_x(1)), np.dtype(np.float32), SHAPE)
    assert second.ctypes.data == address
    np.testing.assert_array_equal(second, _x(1))


def test_memory_still_held_is_never_written():
    """While anything holds an earlier run's input (XLA, until it has read it), a run gets
    memory of its own; more than KEEP buffers coming back are freed."""
    staged = AlignedInputs(True)
    held = [staged.place("x", _unaligned(_x(i)), np.dtype(np.float32), SHAPE)
            for i in range(KEEP + 2)]
    assert len({a.ctypes.data for a in held}) == KEEP + 2
    for i, array in enumerate(held):
        np.testing.assert_array_equal(array, _x(i))
    del held, array
    gc.collect()
    assert len(staged._free["x"]) == KEEP


def test_small_aligned_and_disabled_inputs_pass_as_they_are():
    x = _x(0)
    aligned = np.empty(x.nbytes + ALIGNMENT, np.uint8)
    start = -aligned.ctypes.data % ALIGNMENT
    aligned = aligned[start:start + x.nbytes].view(np.float32).reshape(SHAPE)
    aligned[...] = x
    staged = AlignedInputs(True)
    assert np.shares_memory(staged.place("x", aligned, np.dtype(np.float32), SHAPE), aligned)
    small = np.ones((4, 4), np.float32)
    assert np.shares_memory(staged.place("s", small, np.dtype(np.float32), (16,)), small)
    off = AlignedInputs(False)
    unaligned = _unaligned(x)
    assert np.shares_memory(off.place("x", unaligned, np.dtype(np.float32), SHAPE), unaligned)
    assert not staged._free.get("s") and not off._free


def test_a_dtype_conversion_is_the_copy_into_aligned_memory():
    staged = AlignedInputs(True)
    x = _x(3, np.float64)
    placed = staged.place("x", x, np.dtype(np.float32), (4, 65536))
    assert placed.dtype == np.float32 and placed.shape == (4, 65536)
    assert placed.ctypes.data % ALIGNMENT == 0
    np.testing.assert_array_equal(placed, x.astype(np.float32).reshape(4, 65536))


@pytest.mark.parametrize("bps", [1, 3])
def test_a_session_fed_unaligned_arrays_computes_each_run_from_its_own_values(bps,
                                                                              monkeypatch):
    """Each run's values, from memory the runs use again: JAX lets go of a run's input
    buffer by the next run at the latest, so a few buffers serve every run."""
    made: list[int] = []
    new = input_memory._new
    monkeypatch.setattr(input_memory, "_new", lambda n: made.append(n) or new(n))
    w = np.full(SHAPE[-1:], 3.0, np.float32)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(SHAPE))],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    sess = pk.InferenceSession(model.SerializeToString(), pk.SessionConfig(
        mode="inference", batches_per_step=bps, device={"target": "offline"}), backend="xla")
    assert SHAPE[0] * SHAPE[1] * SHAPE[2] * 4 >= MIN_BYTES
    runs = [np.stack([_x(10 * run + step) for step in range(bps)]) for run in range(8)]
    outs = [sess.run({"x": _unaligned(x if bps > 1 else x[0])})["y"] for x in runs]
    for x, y in zip(runs, outs, strict=True):
        np.testing.assert_array_equal(y.reshape(x.shape), x * 3)
    assert sess._live.staged.enabled and 1 <= len(made) <= KEEP + 1
