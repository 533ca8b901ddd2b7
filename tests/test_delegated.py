"""Forward segments of a CPU inference program run by onnxruntime (delegated.py): the same
values as the XLA lowering, the session's current weights always, every micro-batch and
replica its own, and XLA wherever a segment cannot be delegated."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart_kit as pk
from popart_kit._runtime.xla import delegated, hlo_text
from popart_kit._runtime.xla.lowering import lower

pytestmark = pytest.mark.skipif(not delegated.available(), reason="needs onnxruntime")


def _convnet(dtype: type = np.float32, batch: int = 2) -> onnx.ModelProto:
    """Conv, Relu, MaxPool, Conv, Relu, GlobalAveragePool, Flatten, Gemm, Softmax."""
    rng = np.random.default_rng(0)
    k1 = (rng.standard_normal((8, 3, 3, 3)) / 4).astype(dtype)
    k2 = (rng.standard_normal((16, 8, 3, 3)) / 8).astype(dtype)
    w = (rng.standard_normal((16, 10)) / 4).astype(dtype)
    b = (rng.standard_normal(10) / 4).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("Conv", ["x", "k1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "k2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "w", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "convnet", [helper.make_tensor_value_info("x", elem, [batch, 3, 16, 16])],
        [helper.make_tensor_value_info("y", elem, [batch, 10])],
        [numpy_helper.from_array(a, n) for a, n in ((k1, "k1"), (k2, "k2"), (w, "w"),
                                                    (b, "b"))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _session(model: onnx.ModelProto, bps: int = 1, anchors: dict | None = None,
             **options: object) -> pk.InferenceSession:
    return pk.InferenceSession(model.SerializeToString(), pk.SessionConfig(
        mode="inference", batches_per_step=bps, device={"target": "offline"}),
        anchors=anchors, backend="xla", **options)


def _x(shape: tuple[int, ...], seed: int = 0, dtype: type = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _xla(model: onnx.ModelProto, x: np.ndarray, wanted: str = "y",
         weights: dict | None = None) -> np.ndarray:
    """The XLA lowering's values, micro-batch by micro-batch (no delegation)."""
    graph = lower(model)
    return np.stack([np.asarray(graph.evaluate(weights or {}, {"x": v}, [wanted])[wanted])
                     for v in x.reshape((-1, *graph.inputs["x"][0]))])


def _segments(sess: pk.InferenceSession) -> list[delegated.Segment]:
    graph = sess._live.graph
    return [n.op for plan in graph._delegated_plans.values() for n in plan
            if isinstance(n.op, delegated.Segment)]


def test_a_convnet_runs_as_one_segment_with_the_xla_lowerings_values():
    model = _convnet()
    sess = _session(model)
    x = _x((2, 3, 16, 16))
    y = sess.run({"x": x})["y"]
    [segment] = _segments(sess)
    assert len(segment.nodes) == 9 and segment.outputs == ["y"]
    np.testing.assert_allclose(y, _xla(model, x)[0], rtol=1e-5, atol=1e-6)


def test_new_weights_are_what_the_next_run_computes_with():
    """A session holding the weights' values is built per set of weight buffers: after
    write_weights the run reads the new values (a stale session would give the old)."""
    model = _convnet()
    sess = _session(model)
    x = _x((2, 3, 16, 16))
    before = sess.run({"x": x})["y"]
    w = sess.weights()["w"] * -2.0
    sess.write_weights({"w": w})
    after = sess.run({"x": x})["y"]
    np.testing.assert_allclose(after, _xla(model, x, weights={"w": w})[0], rtol=1e-5,
                               atol=1e-6)
    assert not np.allclose(before, after)
    sess.write_weights({"w": w / -2.0})
    np.testing.assert_allclose(sess.run({"x": x})["y"], before, rtol=1e-6, atol=1e-7)
    [segment] = _segments(sess)
    [plan] = [p for p in segment._plans.values() if p is not None]
    assert len(plan._baked) == delegated.KEEP  # the older sessions went with their weights


@pytest.mark.parametrize("bps, chunk", [(4, 4), (4, 2), (3, 1)])
def test_each_micro_batch_is_its_own_run_of_the_segment(bps, chunk):
    model = _convnet()
    sess = _session(model, bps, micro_batches_per_chunk=chunk)
    x = _x((bps, 2, 3, 16, 16), seed=bps + chunk)
    y = sess.run({"x": x})["y"]
    np.testing.assert_allclose(y, _xla(model, x), rtol=1e-5, atol=1e-6)


def test_an_anchor_inside_a_segment_is_one_of_its_outputs():
    model = _convnet()
    sess = _session(model, anchors={"p1": "All", "y": "All"})
    x = _x((2, 3, 16, 16), seed=3)
    out = sess.run({"x": x})
    [segment] = _segments(sess)
    assert segment.outputs == ["p1", "y"]
    np.testing.assert_allclose(out["p1"], _xla(model, x, "p1")[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["y"], _xla(model, x)[0], rtol=1e-5, atol=1e-6)


def _half_model(rng: np.random.Generator, integers: bool, batch: int = 2) -> onnx.ModelProto:
    """Conv (with bias), Relu, MaxPool, Conv, Relu, then Flatten and MatMul beside
    GlobalAveragePool, Flatten and Gemm (alpha, beta, transB), then Add, Mul, Sub, in
    float16: most of what a half segment may hold. ``integers``: every operand a small
    integer, so each float32 sum is exact and only the roundings to half decide the bits."""
    def values(shape: tuple[int, ...], scale: float) -> np.ndarray:
        if integers:
            return rng.integers(-3, 4, shape).astype(np.float16)
        return (rng.standard_normal(shape) * scale).astype(np.float16)

    held = {"k1": values((8, 3, 3, 3), 0.25), "b1": values((8,), 0.25),
            "k2": values((16, 8, 3, 3), 0.125), "w": values((16 * 8 * 8, 10), 1 / 16),
            "b": values((10,), 0.25), "s": values((10,), 1.0), "wg": values((10, 16), 0.25),
            "bg": values((10,), 0.25)}
    nodes = [
        helper.make_node("Conv", ["x", "k1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "k2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Flatten", ["r2"], ["f"], axis=1),
        helper.make_node("MatMul", ["f", "w"], ["m"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["gf"], axis=1),
        helper.make_node("Gemm", ["gf", "wg", "bg"], ["g"], alpha=0.5, beta=2.0, transB=1),
        helper.make_node("Add", ["m", "g"], ["mg"]),
        helper.make_node("Add", ["mg", "b"], ["a"]),
        helper.make_node("Mul", ["a", "s"], ["z"]),
        helper.make_node("Sub", ["z", "m"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "half", [helper.make_tensor_value_info("x", TensorProto.FLOAT16,
                                                      [batch, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [batch, 10])],
        [numpy_helper.from_array(a, n) for n, a in held.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_half_segment_rounds_where_the_xla_lowering_rounds():
    """Integer operands (exact float32 sums, large enough that half keeps every 8th or 16th
    integer): onnxruntime's results equal the lowering's bit for bit, every anchor, in
    baked and direct runs alike; the same values rounded only at the end do not."""
    rng = np.random.default_rng(5)
    model = _half_model(rng, integers=True)
    anchors = {"c1": "All", "p1": "All", "m": "All", "g": "All", "y": "All"}
    sess = _session(model, anchors=anchors)
    x = rng.integers(-3, 4, (2, 3, 16, 16)).astype(np.float16)
    outs = [sess.run({"x": x}) for _ in range(3)]
    [segment] = _segments(sess)
    assert [p is not None for p in segment._plans.values()] == [True]
    assert sess.runtime._direct is not None
    for name in anchors:
        want = _xla(model, x, name)[0]
        for out in outs:
            assert out[name].dtype == np.float16
            np.testing.assert_array_equal(out[name], want)
    f32 = lower(model)
    once = f32.evaluate({k: v.astype(np.float32) for k, v in f32.weights.items()},
                        {"x": x.astype(np.float32)}, ["y"])["y"]
    assert not np.array_equal(np.asarray(once).astype(np.float16), outs[0]["y"])


def test_a_half_convolutions_bias_is_added_to_its_rounded_sum():
    """Integer sums up to about 24 000 (half keeps every 16th integer there) and integer
    biases: the bias goes onto the sum rounded to half, then that is rounded, as the
    lowering computes it, which the bias added before the rounding would not give."""
    rng = np.random.default_rng(7)
    x = rng.integers(-30, 31, (2, 3, 8, 8)).astype(np.float16)
    k = rng.integers(-30, 31, (4, 3, 3, 3)).astype(np.float16)
    b = rng.integers(-30, 31, (4,)).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "k", "b"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4, 6, 6])],
        [numpy_helper.from_array(k, "k"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    sess = _session(model, anchors={"c": "All", "y": "All"})
    out = sess.run({"x": x})
    [segment] = _segments(sess)
    assert [p is not None for p in segment._plans.values()] == [True]
    for name in ("c", "y"):
        np.testing.assert_array_equal(out[name], _xla(model, x, name)[0])
    lowered = lower(model)
    total = np.asarray(lowered.evaluate({"k": k.astype(np.float32), "b": np.zeros(4, np.float32)},
                                        {"x": x.astype(np.float32)}, ["c"])["c"])
    assert np.abs(total).max() > 2048  # where half rounds integers
    at_once = (total + b.astype(np.float32)[:, None, None]).astype(np.float16)
    assert not np.array_equal(at_once, out["c"])


def test_a_half_segment_gives_the_lowerings_values_but_where_a_sums_order_decides():
    """Random operands, micro-batches stacked: the float32 sums' order is onnxruntime's, so a
    rounding can go the other way where a sum lies next to a boundary between half values
    (then a bias or a difference may magnify it, and later layers carry it on): nearly every
    bit of the first layer's values is the lowering's, and every value is close."""
    rng = np.random.default_rng(6)
    model = _half_model(rng, integers=False, batch=4)
    sess = _session(model, bps=2, anchors={"c1": "All", "p1": "All", "y": "All"})
    x = (rng.standard_normal((2, 4, 3, 16, 16))).astype(np.float16)
    out = sess.run({"x": x})
    [segment] = _segments(sess)
    assert any(p is not None for p in segment._plans.values())
    for name in ("c1", "p1", "y"):
        want = _xla(model, x, name)
        got = out[name].reshape(want.shape)
        assert got.dtype == np.float16 and (name == "y" or np.mean(got == want) > 0.99)
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                   rtol=2e-3, atol=2e-3)


def test_a_half_graph_rounds_before_arithmetic_and_keeps_a_conv_next_to_its_relu():
    """Rounding (Cast to float16 and back) only where an arithmetic operator reads a value
    computed in float32, a Conv's bias added to its rounded sum, and a bias-free Conv's Relu
    right after it (one MLAS call with its activation)."""
    from popart_kit._runtime.xla import half_segment

    nodes = [helper.make_node("Conv", ["x", "k", "b"], ["c"]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "k2"], ["c2"]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("MaxPool", ["r2"], ["p"], kernel_shape=[2, 2]),
             helper.make_node("Add", ["p", "p"], ["y"])]
    graph = half_segment.half_graph(nodes, ["x", "k2"], ["k", "b"], ["y"],
                                    {"x": 4, "k": 4, "b": 1, "k2": 4})
    assert [(n.op_type, list(n.input)) for n in graph] == [
        ("Cast", ["x"]), ("Cast", ["k2"]),
        ("Conv", ["x/f32", "k"]), ("Constant", []), ("Reshape", ["b", "c/bias_shape"]),
        ("Cast", ["c/raw"]), ("Cast", ["c/half"]), ("Add", ["c/round", "c/bias"]),
        ("Relu", ["c/biased"]), ("Cast", ["r/raw"]), ("Cast", ["r/half"]),
        ("Conv", ["r/round", "k2/f32"]), ("Relu", ["c2/raw"]), ("MaxPool", ["r2/raw"]),
        ("Cast", ["p/raw"]), ("Cast", ["p/half"]), ("Add", ["p/round", "p/round"]),
        ("Cast", ["y/raw"])]
    assert graph[-1].output == ["y"]


def test_a_half_segment_whose_names_look_like_the_graphs_own_is_still_delegated():
    """Tensors named as the rewritten graph names its own (a Conv "c" with its bias "c/bias",
    a Gemm "g" whose weight is "g/b", an input "m/half"): those get numbered names."""
    rng = np.random.default_rng(8)
    held = {"k": rng.integers(-3, 4, (4, 3, 3, 3)).astype(np.float16),
            "c/bias": rng.integers(-3, 4, (4,)).astype(np.float16),
            "g/b": rng.integers(-3, 4, (5, 4 * 6 * 6)).astype(np.float16)}
    nodes = [helper.make_node("Conv", ["m/half", "k", "c/bias"], ["c"]),
             helper.make_node("Flatten", ["c"], ["f"], axis=1),
             helper.make_node("Gemm", ["f", "g/b"], ["g"], transB=1, alpha=0.5)]
    graph = helper.make_graph(
        nodes, "names", [helper.make_tensor_value_info("m/half", TensorProto.FLOAT16,
                                                       [2, 3, 8, 8])],
        [helper.make_tensor_value_info("g", TensorProto.FLOAT16, [2, 5])],
        [numpy_helper.from_array(a, n) for n, a in held.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.integers(-3, 4, (2, 3, 8, 8)).astype(np.float16)
    sess = _session(model, anchors={"g": "All"})
    got = sess.run({"m/half": x})["g"]
    [segment] = _segments(sess)
    assert [p is not None for p in segment._plans.values()] == [True]
    lowered = lower(model)
    np.testing.assert_array_equal(
        got, np.asarray(lowered.evaluate({}, {"m/half": x}, ["g"])["g"]))


def test_a_half_division_runs_the_xla_lowering():
    """XLA divides by a broadcast divisor as a product with its reciprocal rounded to half:
    a float16 segment holding a Div is not onnxruntime's (whose quotient is rounded once)."""
    rng = np.random.default_rng(9)
    w = (rng.standard_normal((8, 8)) / 4).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]),
         helper.make_node("Div", ["m", "d"], ["y"])], "div",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float16([3.0]), "d")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    sess = _session(model)
    sess.run({"x": rng.standard_normal((4, 8)).astype(np.float16)})
    [segment] = _segments(sess)
    assert not any(segment._plans.values())


def test_a_half_segment_holding_an_operator_that_rounds_between_steps_runs_the_xla_lowering():
    model = _convnet(np.float16)  # GlobalAveragePool, Gemm, Softmax
    sess = _session(model)
    x = _x((2, 3, 16, 16), dtype=np.float16)
    y = sess.run({"x": x})["y"]
    [segment] = _segments(sess)
    assert not any(segment._plans.values())  # decided when traced: no session made
    np.testing.assert_allclose(y.astype(np.float32), _xla(model, x)[0].astype(np.float32),
                               rtol=1e-3, atol=1e-3)


def test_a_segment_onnxruntime_refuses_runs_the_xla_lowering(monkeypatch):
    def refuse(*args: object) -> None:
        raise RuntimeError("onnxruntime refuses")

    monkeypatch.setattr(delegated, "_session", refuse)
    model = _convnet()
    sess = _session(model)
    x = _x((2, 3, 16, 16), seed=5)
    np.testing.assert_allclose(sess.run({"x": x})["y"], _xla(model, x)[0], rtol=1e-5,
                               atol=1e-6)
    [segment] = _segments(sess)
    assert list(segment._plans.values()) == [None]


def test_weights_not_offered_are_read_as_inputs():
    """Evaluated outside a session (nothing offered), the segment's session takes the weights
    as inputs: nothing is held that a later call could find stale."""
    import jax

    model = _convnet()
    graph = lower(model)
    graph.delegation = delegated.Delegation()
    x = _x((2, 3, 16, 16), seed=7)
    run = jax.jit(lambda w, v: graph.evaluate(w, {"x": v}, ["y"])["y"])
    weights = {k: jax.numpy.asarray(v) for k, v in graph.weights.items()}
    np.testing.assert_allclose(run(weights, x), _xla(model, x[None])[0], rtol=1e-5, atol=1e-6)
    doubled = {**weights, "w": weights["w"] * 2}
    np.testing.assert_allclose(run(doubled, x),
                               _xla(model, x[None], weights={"w": np.asarray(doubled["w"])})[0],
                               rtol=1e-5, atol=1e-6)
    [segment] = [n.op for p in graph._delegated_plans.values() for n in p
                 if isinstance(n.op, delegated.Segment)]
    assert all(not p._baked for p in segment._plans.values() if p is not None)


def test_a_segment_differentiates_as_the_xla_lowering():
    import jax

    model = _convnet()
    graph = lower(model)
    plain = lower(model)
    graph.delegation = delegated.Delegation()
    x = _x((2, 3, 16, 16), seed=9)
    weights = {k: jax.numpy.asarray(v) for k, v in graph.weights.items()}

    def loss(g, w):
        return (g.evaluate(w, {"x": x}, ["y"])["y"] ** 2).sum()

    got = jax.grad(lambda w: loss(graph, w))(weights)
    want = jax.grad(lambda w: loss(plain, w))(weights)
    for name in weights:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)


def test_an_operator_onnxruntime_is_not_given_splits_the_segments():
    """A node outside delegated.OPS (Neg here) runs by XLA between two segments; a segment
    without a Conv, Gemm or MatMul is left to XLA."""
    model = _convnet()
    nodes = list(model.graph.node)
    nodes[5].input[0] = "n"  # GlobalAveragePool reads Neg(r2)
    nodes.insert(5, helper.make_node("Neg", ["r2"], ["n"]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    graph = lower(model)
    graph.delegation = delegated.Delegation()
    plan = graph._delegated(("y",))
    assert [type(n.op).__name__ for n in plan] == ["Segment", type(graph.nodes[5].op).__name__,
                                                   "Segment"]
    assert [n.label for n in plan] == ["c1..r2", "n", "g..y"]
    x = _x((2, 3, 16, 16), seed=11)
    sess = _session(model)
    np.testing.assert_allclose(sess.run({"x": x})["y"], _xla(model, x)[0], rtol=1e-5,
                               atol=1e-6)
    tail = graph._delegated(("g",))  # GlobalAveragePool alone after the Neg: XLA's
    assert [type(n.op).__name__ for n in tail][1:] == [type(n.op).__name__
                                                       for n in graph.nodes[5:7]]


def test_training_sessions_are_not_delegated():
    model = _convnet()
    model.graph.node.append(helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    sess = pk.TrainingSession(model.SerializeToString(), pk.SessionConfig(
        mode="training", device={"target": "offline"}), loss="loss",
        optimizer=pk.SGD(learning_rate=0.1), backend="xla")
    assert sess._live.graph.delegation is None


def _mlp(batch: int = 4, reshape: list[int] | None = None) -> onnx.ModelProto:
    """MatMul, Relu, MatMul, Softmax over a [batch, 8] input (a Reshape to ``reshape`` first,
    when given)."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 16)) / 3).astype(np.float32), "w0"),
             numpy_helper.from_array((rng.standard_normal((16, 5)) / 3).astype(np.float32), "w1")]
    nodes = [helper.make_node("MatMul", ["h", "w0"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("MatMul", ["r", "w1"], ["l"]),
             helper.make_node("Softmax", ["l"], ["y"], axis=1)]
    if reshape is None:
        nodes[0].input[0] = "x"
    else:
        inits.append(numpy_helper.from_array(np.array(reshape, np.int64), "shape"))
        nodes.insert(0, helper.make_node("Reshape", ["x", "shape"], ["h"]))
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("reshape, stacked", [(None, True), ([-1, 8], True), ([4, 8], False)])
def test_a_chunks_micro_batches_run_stacked_where_every_node_keeps_them_apart(reshape,
                                                                              stacked):
    """bps 4 in one chunk: one run of 16 rows rather than four of 4, unless a node could mix
    the micro-batches (a Reshape naming the batch size: each runs alone)."""
    model = _mlp(reshape=reshape)
    sess = _session(model, 4, micro_batches_per_chunk=4)
    x = _x((4, 4, 8), seed=13)
    np.testing.assert_allclose(sess.run({"x": x})["y"], _xla(model, x), rtol=1e-5, atol=1e-6)
    [segment] = _segments(sess)
    rows = {dict(key[0])["x"][0] for key, plan in segment._plans.items() if plan is not None}
    assert rows == ({4, 16} if stacked else {4})


def test_replicas_and_micro_batches_stack_into_one_run():
    model = _mlp()
    sess = pk.InferenceSession(model.SerializeToString(), pk.SessionConfig(
        mode="inference", batches_per_step=4, replication={"local_factor": 2},
        device={"target": "offline"}), backend="xla", micro_batches_per_chunk=4)
    assert not sess._live.placement.several  # on CPU the replicas are vectorised
    x = _x((4, 2, 4, 8), seed=17)
    np.testing.assert_allclose(sess.run({"x": x})["y"], _xla(model, x).reshape(4, 2, 4, 5),
                               rtol=1e-5, atol=1e-6)
    [segment] = _segments(sess)
    rows = {dict(key[0])["x"][0] for key, plan in segment._plans.items() if plan is not None}
    assert max(rows) == 4 * 2 * 4  # every micro-batch of every replica in one run


def test_foldable_refuses_what_could_touch_axis_0():
    from onnx import helper as h

    shapes = {"x": (4, 8), "y": (4, 8), "t": (8, 4)}

    def one(node: onnx.NodeProto, constants: dict | None = None) -> bool:
        return delegated.foldable([node], {"x"}, shapes, constants or {}, 13)

    assert one(h.make_node("Softmax", ["x"], ["y"], axis=1))
    assert one(h.make_node("Softmax", ["x"], ["y"], axis=-1))
    assert not one(h.make_node("Softmax", ["x"], ["y"], axis=0))
    assert not one(h.make_node("Softmax", ["x"], ["y"], axis=-2))
    assert one(h.make_node("Transpose", ["x"], ["y"], perm=[0, 1]))
    assert not one(h.make_node("Transpose", ["x"], ["t"], perm=[1, 0]))
    assert not one(h.make_node("Transpose", ["x"], ["t"]))
    assert not one(h.make_node("Gemm", ["x", "w"], ["y"], transA=1))
    assert not one(h.make_node("MatMul", ["w", "x"], ["y"]))
    assert not one(h.make_node("Concat", ["x", "w"], ["y"], axis=1))
    assert not one(h.make_node("Concat", ["x", "x"], ["y"], axis=0))
    assert one(h.make_node("Concat", ["x", "x"], ["y"], axis=1))
    assert not one(h.make_node("Flatten", ["x"], ["y"], axis=0))
    assert not one(h.make_node("Reshape", ["x", "s"], ["y"]), {"s": np.array([4, 8])})
    assert one(h.make_node("Reshape", ["x", "s"], ["y"]), {"s": np.array([-1, 8])})
    assert not one(h.make_node("Unsqueeze", ["x", "a"], ["y"]), {"a": np.array([0])})
    assert one(h.make_node("Unsqueeze", ["x", "a"], ["y"]), {"a": np.array([1])})
    assert not one(h.make_node("Squeeze", ["x"], ["y"]))
    assert not one(h.make_node("Neg", ["x"], ["y"]))  # not known to keep it: no


def test_a_session_whose_shapes_differ_from_the_lowerings_is_not_used():
    """Checked once, on zeros, when a plan is made: a shape onnxruntime computes otherwise
    would fail every run, so XLA runs the segment instead."""
    import onnxruntime as ort

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    session = ort.InferenceSession(helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString(),
        providers=["CPUExecutionProvider"])
    f32 = np.dtype(np.float32)
    delegated._check_shapes(session, {"x": (2, 3)}, {}, {"y": (2, 3)}, f32)
    with pytest.raises(ValueError, match=r"'y': \(\(2, 3\), \(3, 2\)\)"):
        delegated._check_shapes(session, {"x": (2, 3)}, {}, {"y": (3, 2)}, f32)


@pytest.mark.parametrize("value, stops", [(None, False), ("0", True)])
def test_the_segments_threads_stop_when_a_run_ends_if_asked(monkeypatch, value, stops):
    if value is None:
        monkeypatch.delenv(delegated.SPINNING, raising=False)
    else:
        monkeypatch.setenv(delegated.SPINNING, value)
    sess = _session(_convnet())
    sess.run({"x": _x((2, 3, 16, 16))})
    [segment] = _segments(sess)
    [plan] = [p for p in segment._plans.values() if p is not None]
    [(session, _)] = plan._baked.values()
    config = session.get_session_options().get_session_config_entry
    assert config("session.intra_op.allow_spinning") == "1"
    try:
        stop = config("session.force_spinning_stop")
    except Exception:  # noqa: BLE001 - onnxruntime raises for a key never set
        stop = "0"
    assert (stop == "1") == stops


def test_a_delegating_session_takes_larger_chunks(monkeypatch):
    """Its segments run stacked in onnxruntime: chunks of up to CHUNK_BYTES of activations,
    where XLA alone keeps to steps.chunk_bytes (about 1.8 MB a micro-batch here: 4 of 16
    micro-batches by XLA's measure, all 16 delegated)."""
    model = _convnet(batch=64)
    delegating = _session(model, 16)
    monkeypatch.setattr(delegated, "available", lambda: False)
    alone = _session(model, 16)
    assert alone.runtime.graph.delegation is None
    assert (alone.runtime.chunk, delegating.runtime.chunk) == (4, 16)


def _unaligned(values: np.ndarray) -> np.ndarray:
    """``values`` 16 bytes past a 64-byte boundary, as numpy's own large arrays lie."""
    raw = np.empty(values.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + 16
    out = raw[start:start + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


@pytest.mark.parametrize("bps", [1, 3])
def test_an_input_only_segments_read_is_read_where_it_lies(bps, monkeypatch):
    """A large unaligned input read by nothing but a segment: the program takes an aligned
    buffer with no values copied in, and onnxruntime reads each run's own array."""
    from popart_kit._runtime.xla import input_memory

    copies: list[int] = []
    copyto = np.copyto
    monkeypatch.setattr(input_memory.np, "copyto",
                        lambda dst, src, **kw: copies.append(dst.nbytes) or copyto(dst, src,
                                                                                  **kw))
    model = _convnet(batch=64)  # 64 x 3 x 16 x 16 float32: 192 KiB a micro-batch
    monkeypatch.setattr(input_memory, "MIN_BYTES", 1 << 16)
    sess = _session(model, bps, micro_batches_per_chunk=bps)
    runs = [_x((bps, 64, 3, 16, 16), seed=40 + i) for i in range(4)]
    outs = [sess.run({"x": _unaligned(x if bps > 1 else x[0])})["y"] for x in runs]
    assert sess.runtime._segment_inputs == {"x"} and not copies
    for x, y in zip(runs, outs, strict=True):
        np.testing.assert_allclose(y.reshape(bps, 64, 10), _xla(model, x).reshape(bps, 64, 10),
                                   rtol=1e-5, atol=1e-6)


def test_an_input_xla_also_reads_is_copied():
    """Anchored as well (XLA returns it): the program reads it, so it gets the values."""
    model = _convnet(batch=64)
    sess = _session(model, anchors={"x": "All", "y": "All"})
    x = _unaligned(_x((64, 3, 16, 16), seed=5))
    out = sess.run({"x": x})
    assert sess.runtime._segment_inputs == set()
    np.testing.assert_array_equal(out["x"], x)
    np.testing.assert_allclose(out["y"], _xla(model, x)[0], rtol=1e-5, atol=1e-6)


def test_a_buffer_no_segment_read_fills_the_inputs_and_runs_again(monkeypatch):
    """Were the program to read a copy of the unfilled buffer (no segment then reads it), the
    run is made again with the values copied, and every later run copies them."""
    from popart_kit._runtime.xla import input_memory

    monkeypatch.setattr(input_memory, "MIN_BYTES", 1 << 16)
    model = _convnet(batch=64)
    sess = _session(model)
    sess.prepare()
    monkeypatch.setattr(delegated.Delegation, "source", lambda self, array: array)
    x = _x((64, 3, 16, 16), seed=6)
    y = sess.run({"x": _unaligned(x)})["y"]
    assert sess.runtime._segment_inputs == set()
    np.testing.assert_allclose(y, _xla(model, x)[0], rtol=1e-5, atol=1e-6)


_HLO = """HloModule m, entry_computation_layout={(f32[4]{0}, f32[4]{0})->f32[4]{0}}

%f (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4]{0} parameter(0)
}

ENTRY %main.3 (a.1: f32[4], b.1: f32[4], c.1: f32[2,2]) -> (f32[4], f32[4]) {
  %a.1 = f32[4]{0} parameter(0)
  %b.1 = f32[4]{0} parameter(1), metadata={op_name="b"}
  %c.1 = f32[2,2]{1,0} parameter(2)
  %bitcast = f32[2,2]{1,0} bitcast(%a.1)
  %cb = f32[4]{0} custom-call(%bitcast, %b.1), custom_call_target="xla_buffer_python_cpu_callback"
  %add = f32[4]{0} add(%b.1, %cb)
  %cb2 = f32[4]{0} custom-call(%c.1), custom_call_target="xla_buffer_python_cpu_callback", \
output_to_operand_aliasing={{}: (0, {})}
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%add, %cb2)
}
"""


def test_callback_only_parameters_reads_the_entry_computations_uses():
    """a reaches only a callback (through a bitcast); b is added too; c goes to a callback
    that may write into it."""
    assert hlo_text.callback_only_parameters(_HLO) == {0}
    returned = _HLO.replace("ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%add, %cb2)",
                            "ROOT %t = (f32[4]{0}, f32[2,2]{1,0}) tuple(%add, %bitcast)")
    assert hlo_text.callback_only_parameters(returned) == set()
    assert hlo_text.callback_only_parameters("HloModule m\n\nENTRY %main { what }") == set()
    assert hlo_text.callback_only_parameters("not HLO") == set()


@pytest.mark.parametrize("bps, replicas", [(1, 1), (3, 1), (2, 2)])
def test_a_program_that_is_one_segment_call_is_called_from_the_host(bps, replicas):
    """The whole model one stacked segment: the runs after the first call the segment
    itself, on each run's own inputs and the session's current weights, every anchor one of
    its outputs (an inside tensor too)."""
    model = _convnet()
    sess = pk.InferenceSession(model.SerializeToString(), pk.SessionConfig(
        mode="inference", batches_per_step=bps, replication={"local_factor": replicas},
        device={"target": "offline"}), backend="xla", micro_batches_per_chunk=bps,
        anchors={"p1": "All", "y": "All"})
    lead = (bps,) * (bps > 1) + (replicas,) * (replicas > 1)
    runs = [_x((*lead, 2, 3, 16, 16), seed=60 + i) for i in range(3)]
    outs = [sess.run({"x": x}) for x in runs[:2]]
    assert sess.runtime._direct is not None
    w = sess.weights()["w"] * 3.0
    sess.write_weights({"w": w})
    outs.append(sess.run({"x": _unaligned(runs[2])}))  # read where it lies
    for i, (x, out) in enumerate(zip(runs, outs, strict=True)):
        weights = {"w": w} if i == 2 else None
        for name in ("p1", "y"):
            want = _xla(model, x, name, weights=weights)
            np.testing.assert_allclose(out[name].reshape(want.shape), want, rtol=1e-5,
                                       atol=1e-6)


def test_a_large_anchor_held_by_the_caller_is_never_written_by_a_later_direct_run():
    model = _convnet(batch=512)  # y is small; p1 512 x 8 x 8 x 8 float32 = 1 MiB
    sess = _session(model, anchors={"p1": "All", "y": "All"})
    x1, x2 = _x((512, 3, 16, 16), seed=70), _x((512, 3, 16, 16), seed=71)
    sess.run({"x": x1})
    held = sess.run({"x": x1})["p1"]
    assert sess.runtime._direct is not None and held.flags.writeable
    kept = held.copy()
    sess.run({"x": x2})
    np.testing.assert_array_equal(held, kept)


def test_direct_runs_read_each_runs_values_and_hand_out_arrays_of_their_own():
    """The same input array refilled between runs, then another array: each run computes
    from the values its input holds then, and every run's anchors are writable arrays that
    no later run writes."""
    model = _convnet()
    sess = _session(model, anchors={"p1": "All", "y": "All"})
    x = _x((2, 3, 16, 16), seed=90)
    sess.run({"x": x})
    outs, wants = [], []
    for seed in (91, 92):
        x[...] = _x((2, 3, 16, 16), seed=seed)
        outs.append(sess.run({"x": x}))
        wants.append({name: _xla(model, x.copy(), name) for name in ("p1", "y")})
    assert sess.runtime._direct is not None
    other = _x((2, 3, 16, 16), seed=93)
    outs.append(sess.run({"x": other}))
    wants.append({name: _xla(model, other, name) for name in ("p1", "y")})
    for out, want in zip(outs, wants, strict=True):
        for name in ("p1", "y"):
            assert out[name].flags.writeable
            np.testing.assert_allclose(out[name].reshape(want[name].shape), want[name],
                                       rtol=1e-5, atol=1e-6)
    assert not np.shares_memory(outs[0]["y"], outs[1]["y"])


def test_a_program_that_computes_more_than_one_segment_call_runs_as_compiled():
    """The input anchored too (the program returns it): every run is the program's."""
    model = _convnet()
    sess = _session(model, anchors={"x": "All", "y": "All"})
    xs = [_x((2, 3, 16, 16), seed=80 + i) for i in range(2)]
    outs = [sess.run({"x": x}) for x in xs]
    assert sess.runtime._direct is None
    for x, out in zip(xs, outs, strict=True):
        np.testing.assert_array_equal(out["x"], x)
        np.testing.assert_allclose(out["y"], _xla(model, x)[0], rtol=1e-5, atol=1e-6)


_ONE = """HloModule m

ENTRY %main.3 (w.1: f32[8], x.1: f32[1,2,4], a.1: f32[1,2,4]) -> (f32[1,2,4], f32[1,8]) {
  %w.1 = f32[8]{0} parameter(0)
  %x.1 = f32[1,2,4]{2,1,0} parameter(1)
  %a.1 = f32[1,2,4]{2,1,0} parameter(2)
  %bitcast = f32[2,4]{1,0} bitcast(%x.1)
  %cb = (f32[8]{0}, f32[2,4]{1,0}) custom-call(%bitcast, %w.1), \
custom_call_target="xla_buffer_python_cpu_callback", backend_config={index = 0 : ui64}
  %gte.0 = f32[8]{0} get-tuple-element(%cb), index=0
  %gte.1 = f32[2,4]{1,0} get-tuple-element(%cb), index=1
  %bitcast.1 = f32[1,2,4]{2,1,0} bitcast(%gte.1)
  %bitcast.2 = f32[1,8]{1,0} bitcast(%gte.0)
  ROOT %t = (f32[1,2,4]{2,1,0}, f32[1,8]{1,0}) tuple(%bitcast.1, %bitcast.2)
}
"""


def test_one_callback_maps_operands_to_parameters_and_results_to_callback_results():
    assert hlo_text.one_callback(_ONE) == hlo_text.OneCallback((1, 0), (1, 0), 3)
    for other in ("tuple(%bitcast.1, %bitcast.1)",  # a result twice, one never
                  "tuple(%bitcast.1, %x.1)",  # a parameter returned
                  "tuple(%bitcast.1, %add)"):  # something computed
        text = _ONE.replace("tuple(%bitcast.1, %bitcast.2)", other)
        if "%add" in other:
            text = text.replace("  ROOT", "  %add = f32[1,8]{1,0} add(%bitcast.2, %bitcast.2)"
                                "\n  ROOT")
        assert hlo_text.one_callback(text) is None, other
    assert hlo_text.one_callback(_ONE.replace('custom_call_target="xla_buffer_python_cpu_'
                                              'callback"', 'custom_call_target="other"')) is None


def _copied(layout: str) -> str:
    """_ONE with its first result laid out as ``layout`` by the bitcast, then copied to the
    row-major layout by a fusion that is one copy."""
    text = _ONE.replace("%bitcast.1 = f32[1,2,4]{2,1,0} bitcast(%gte.1)",
                        f"%bitcast.1 = f32[1,2,4]{{{layout}}} bitcast(%gte.1)\n"
                        "  %wrapped_copy = f32[1,2,4]{2,1,0} fusion(%bitcast.1), kind=kLoop, "
                        "calls=%wrapped_copy_computation")
    text = text.replace("tuple(%bitcast.1, %bitcast.2)", "tuple(%wrapped_copy, %bitcast.2)")
    return text.replace("\nENTRY", f"""
%wrapped_copy_computation (param_0: f32[1,2,4]) -> f32[1,2,4] {{
  %param_0 = f32[1,2,4]{{{layout}}} parameter(0)
  ROOT %copy.2 = f32[1,2,4]{{2,1,0}} copy(%param_0)
}}

ENTRY""")


def test_one_callback_sees_through_copies_that_move_no_byte():
    """A copy between layouts that differ only in where a dimension of size 1 goes keeps
    every byte in place; one that transposes does not."""
    assert hlo_text.one_callback(_copied("2,0,1")) == hlo_text.OneCallback((1, 0), (1, 0), 3)
    assert hlo_text.one_callback(_copied("1,2,0")) is None


def test_one_callback_sees_through_a_fusion_of_bitcasts_and_such_a_copy():
    fused = _ONE.replace("%bitcast.1 = f32[1,2,4]{2,1,0} bitcast(%gte.1)",
                         "%bitcast.1 = f32[1,2,4]{2,1,0} fusion(%gte.1), kind=kLoop, "
                         "calls=%fused_computation")
    body = """
%fused_computation (param_0: f32[2,4]) -> f32[1,2,4] {{
  %param_0 = f32[2,4]{{1,0}} parameter(0)
  %bitcast.9 = f32[1,2,4]{{{layout}}} bitcast(%param_0)
  ROOT %copy.9 = f32[1,2,4]{{2,1,0}} copy(%bitcast.9)
}}

ENTRY"""
    def text(layout: str) -> str:
        return fused.replace("\nENTRY", body.format(layout=layout))

    assert hlo_text.one_callback(text("2,0,1")) == hlo_text.OneCallback((1, 0), (1, 0), 3)
    assert hlo_text.one_callback(text("1,2,0")) is None


def test_a_direct_step_is_made_only_when_the_first_run_agrees_with_the_program():
    """Exactly one call, as many parameters as the program takes, a weight operand that
    weight's own buffer, sizes that match: anything else and the program keeps running."""
    import jax
    import jax.numpy as jnp

    from popart_kit._runtime.xla.delegated import SegmentCall
    from popart_kit._runtime.xla.direct import direct_step

    w = jnp.ones((8,), jnp.float32)
    shape = hlo_text.OneCallback((1, 0), (0,), 3)
    parameters = [("weights", "w", (8,)), ("inputs", "x", (1, 2, 4)), ("slots", "y", (1, 8))]
    outputs = {"y": jax.ShapeDtypeStruct((1, 8), np.float32)}

    call = SegmentCall(None, ("x", "w"), ("y",), ())
    good = [(call, [((2, 4), 0), ((8,), w.unsafe_buffer_pointer())], [(8,)])]
    made = direct_step(shape, good, parameters, {"w": w}, outputs, {"y": (8,)})
    assert made is not None and [op[:2] for op in made.operands] == [("inputs", "x"),
                                                                      ("weights", "w")]
    looped = [(dataclasses.replace(call, loops=(2,)), *good[0][1:])]  # one run per index
    assert direct_step(shape, looped, parameters, {"w": w}, outputs, {"y": (8,)}) is None
    assert direct_step(shape, good * 2, parameters, {"w": w}, outputs, None) is None
    assert direct_step(shape, good, parameters[:2], {"w": w}, outputs, None) is None
    moved = [(call, [((2, 4), 0), ((8,), w.unsafe_buffer_pointer() + 64)], [(8,)])]
    assert direct_step(shape, moved, parameters, {"w": w}, outputs, None) is None
    resized = [(call, [((2, 4), 0), ((8,), w.unsafe_buffer_pointer())], [(4,)])]
    assert direct_step(shape, resized, parameters, {"w": w}, outputs, None) is None


def test_has_host_callbacks_finds_every_kind_of_python_call():
    """What decides how an inference program is dispatched (executors._runnable)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback
    from jax.experimental.buffer_callback import buffer_callback

    x = jnp.ones(4, jnp.float32)
    out = jax.ShapeDtypeStruct((4,), jnp.float32)

    def fill(ctx, result, value):
        np.asarray(result)[...] = np.asarray(value)

    programs = {
        "pure": lambda v: jax.pure_callback(lambda a: np.asarray(a) * 2, out, v),
        "io": lambda v: io_callback(lambda a: np.asarray(a), out, v),
        "buffer": lambda v: buffer_callback(fill, out)(v),
        "looped": lambda v: jax.lax.fori_loop(
            0, 2, lambda i, a: jax.pure_callback(lambda b: np.asarray(b), out, a), v),
        "none": lambda v: v * 2,
    }
    found = {name: hlo_text.has_host_callbacks(jax.jit(fn).lower(x).compile().as_text())
             for name, fn in programs.items()}
    assert found == {"pure": True, "io": True, "buffer": True, "looped": True, "none": False}
