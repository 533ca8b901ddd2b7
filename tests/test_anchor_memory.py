"""A CPU session's large anchors (anchor_memory.py): each run's its own writable array over
the run's result buffer, whose memory a later run uses again only once no array over it is
left - through both executors, inference and training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnx.reference
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart_kit as pk
from popart_kit._runtime.xla.anchor_memory import KEEP, MIN_BYTES, RecycledAnchors
from popart_kit._runtime.xla.placement import Placement

SHAPE = (4, 256, 256)  # 1 MiB of float32 per micro-batch: recycled


def _model(op: str = "Mul", shape: tuple[int, ...] = SHAPE) -> bytes:
    """y = x * w (or a 3x3 convolution of x by w, ``op="Conv"``), w a weight."""
    if op == "Conv":
        w = np.full((shape[0], shape[0], 3, 3), 0.1, np.float32)
        node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
        x_shape = [1, *shape]
    else:
        w = np.full(shape[-1:], 3.0, np.float32)
        node = helper.make_node("Mul", ["x", "w"], ["y"])
        x_shape = list(shape)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape)],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


def _inference(model: bytes, bps: int = 1, **options: int) -> pk.InferenceSession:
    return pk.InferenceSession(model, pk.SessionConfig(
        mode="inference", batches_per_step=bps, device={"target": "offline"}), backend="xla",
        **options)


def _x(seed: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_each_run_gives_an_array_of_its_own_that_can_be_written():
    sess = _inference(_model())
    first = sess.run({"x": _x(0)})["y"]
    second = sess.run({"x": _x(1)})["y"]
    assert first.nbytes >= MIN_BYTES and first.flags.writeable and second.flags.writeable
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, _x(0) * 3)
    first[...] = -1.0  # the caller's to change: neither the next run nor the last sees it
    np.testing.assert_array_equal(second, _x(1) * 3)
    np.testing.assert_array_equal(sess.run({"x": _x(2)})["y"], _x(2) * 3)


def test_a_buffer_comes_back_once_no_array_over_it_is_left():
    """RecycledAnchors alone: the array handed out is the buffer's memory; the buffer is the
    next slot only after the array and its views are gone; at most KEEP wait."""
    shapes = {"big": jax.ShapeDtypeStruct((MIN_BYTES // 4,), jnp.float32),
              "small": jax.ShapeDtypeStruct((4,), jnp.float32)}
    recycled = RecycledAnchors(Placement(1), shapes)
    assert set(recycled.abstract()) == {"big"}
    slot = recycled.slots()["big"]
    buffers = {"big": slot + 1, "small": jnp.ones(4)}
    out = recycled.hand_out(buffers)
    assert out["small"] is buffers["small"]  # left for the backend to copy
    big = out["big"]
    assert big.ctypes.data == buffers["big"].unsafe_buffer_pointer() and big.flags.writeable
    np.testing.assert_array_equal(big, np.ones(MIN_BYTES // 4))
    view = big[::2]
    del out, big
    assert recycled.slots()["big"] is not buffers["big"]  # the view still reads it
    del view
    assert recycled.slots()["big"] is buffers["big"]
    handed = [jnp.full(MIN_BYTES // 4, float(i)) for i in range(KEEP + 2)]
    arrays = [recycled.hand_out({"big": b})["big"] for b in handed]
    del arrays
    slots = [recycled.slots()["big"] for _ in range(KEEP + 2)]
    assert sum(any(s is b for b in handed) for s in slots) == KEEP  # the rest were freed
    recycled.clear()


def test_a_dropped_anchor_memory_is_what_the_next_run_writes():
    sess = _inference(_model())
    y = sess.run({"x": _x(0)})["y"]
    address = y.ctypes.data
    del y
    y = sess.run({"x": _x(1)})["y"]
    assert y.ctypes.data == address
    np.testing.assert_array_equal(y, _x(1) * 3)


def test_a_view_kept_alive_keeps_its_memory_from_later_runs():
    sess = _inference(_model())
    y = sess.run({"x": _x(0)})["y"]
    row = y[1]
    del y  # the array is gone, its view is not: the buffer must not come back
    later = [sess.run({"x": _x(seed)})["y"] for seed in (1, 2)]
    np.testing.assert_array_equal(row, _x(0)[1] * 3)
    assert not any(np.shares_memory(row, other) for other in later)


def test_small_anchors_are_copies_of_their_own():
    sess = _inference(_model(shape=(2, 8, 8)))
    y, z = (sess.run({"x": _x(seed, (2, 8, 8))})["y"] for seed in (0, 1))
    assert y.nbytes < MIN_BYTES and y.flags.writeable and not np.shares_memory(y, z)
    np.testing.assert_array_equal(y, _x(0, (2, 8, 8)) * 3)


def test_a_host_driven_step_recycles_its_anchors_too():
    """A convolution's chunks are driven from the host on CPU (see steps.py): its anchor
    buffer is zeroed into the donated memory by the run's first program."""
    sess = _inference(_model("Conv"), bps=2, micro_batches_per_chunk=1)
    assert type(sess.runtime.executor).__name__ == "HostDrivenExecutor"
    x = np.stack([_x(0, (1, *SHAPE)), _x(1, (1, *SHAPE))])
    reference = onnx.reference.ReferenceEvaluator(onnx.load_from_string(_model("Conv")))
    want = np.stack([reference.run(None, {"x": x[i]})[0] for i in range(2)])
    addresses = set()
    for _ in range(3):
        y = sess.run({"x": x})["y"]
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
        addresses.add(y.ctypes.data)
        del y
        assert len(sess.runtime.executor.recycled._free["y"]) == 1  # back for the next run
    assert len(addresses) <= 2


@pytest.mark.parametrize("bps", [1, 2])
def test_a_training_step_hands_out_its_large_anchors_alike(bps):
    """An activation anchored with All beside the loss: the anchor is the run's own and
    recycled; the loss is a small copy; the weights train as without recycling."""
    w0 = np.full(SHAPE[-1:], 0.5, np.float32)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"]),
         helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(w0, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    sess = pk.TrainingSession(model.SerializeToString(), pk.SessionConfig(
        mode="training", batches_per_step=bps, device={"target": "offline"}), loss="loss",
        optimizer=pk.SGD(1e-6), anchors={"y": "All", "loss": "All"}, backend="xla")
    x = np.stack([_x(seed) for seed in range(bps)])
    w = w0.astype(np.float64)
    addresses = set()
    for _ in range(3):
        out = sess.run({"x": x if bps > 1 else x[0]})
        y = out["y"].reshape(bps, *SHAPE)
        for b in range(bps):  # each micro-batch's y with the weights before its update
            np.testing.assert_allclose(y[b], x[b] * w, rtol=1e-5)
            w = w - 1e-6 * (2 * x[b] ** 2 * w).sum(axis=(0, 1))
        assert out["loss"].nbytes < MIN_BYTES and out["y"].flags.writeable
        addresses.add(out["y"].ctypes.data)
        del out, y
        assert len(sess.runtime.executor.recycled._free["y"]) == 1  # back for the next run
    assert len(addresses) <= 2
    np.testing.assert_allclose(sess.weights()["w"], w, rtol=1e-4)


def test_a_popart_program_gets_its_large_anchors_in_its_own_arrays_run_after_run():
    """PyStepIO writes each run's anchor into the arrays of initAnchorArrays; the session's
    view of the run's buffer is gone after the copy, so the buffer serves the next run."""
    import popart_kit.popart as popart

    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", list(SHAPE)))
    w = b.addInitializedInputTensor(np.full(SHAPE[-1:], 3.0, np.float32))
    y = b.aiOnnx.mul([x, w])
    flow = popart.DataFlow(1, {y: popart.AnchorReturnType("All")})
    session = popart.InferenceSession(b.getModelProto(), flow,
                                      popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    held = anchors[y]
    for seed in range(3):
        session.run(popart.PyStepIO({x: _x(seed)}, anchors))
        assert anchors[y] is held  # the program's own array, written in place
        np.testing.assert_array_equal(held, _x(seed) * 3)
    free = session._kit.runtime.executor.recycled._free[y]
    assert len(free) == 1  # the last run's buffer, back for the next


def test_closing_a_session_keeps_no_buffer_of_its_anchors():
    """After close, an anchor dropped later takes its buffer with it (nothing kept)."""
    sess = _inference(_model())
    y = sess.run({"x": _x(0)})["y"]
    recycled = sess.runtime.executor.recycled
    sess.close()
    del y
    assert all(not free for free in recycled._free.values())
