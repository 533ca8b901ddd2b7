"""The xla backend's lowering: Builder-made models agree with onnxruntime (the oracle) at
PopART's opsets, unsupported models are refused all at once, PopART's losses follow their
formulas, and ``evaluate`` traces under jit, vmap and grad."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import popart_kit as pk
from popart_kit._runtime.xla.lowering import LoweredGraph, UnsupportedModel, lower, unsupported
from popart_kit._runtime.xla.ops import OPS

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

RNG = np.random.default_rng(0)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def builder(opset: int = 10) -> pk.Builder:
    return pk.Builder(opsets={"ai.onnx": opset, "ai.graphcore": 1})


def model_of(b: pk.Builder, outputs: list[str]) -> onnx.ModelProto:
    for out in outputs:
        b.addOutputTensor(out)
    return onnx.load_from_string(b.getModelProto())


def xla(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outputs: list[str]
        ) -> list[np.ndarray]:
    graph = lower(model)
    run = jax.jit(lambda w, x: graph.evaluate(w, x, outputs))
    got = run(graph.weights, feeds)
    return [np.asarray(got[o]) for o in outputs]


def agree(b: pk.Builder, outputs: list[str], feeds: dict[str, np.ndarray],
          rtol: float = 1e-5, atol: float = 1e-5) -> list[np.ndarray]:
    """The model gives onnxruntime's outputs (values, shapes, dtypes) on the xla backend."""
    model = model_of(b, outputs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(outputs, feeds)
    got = xla(model, feeds, outputs)
    for name, g, w in zip(outputs, got, want, strict=True):
        assert g.shape == w.shape, f"{name}: {g.shape} vs onnxruntime's {w.shape}"
        w = w.astype(np.int32) if w.dtype == np.int64 else w  # JAX's default: no 64-bit
        assert g.dtype == w.dtype, f"{name}: {g.dtype} vs onnxruntime's {w.dtype}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)
    return got


# -- Builder models against onnxruntime ------------------------------------------------------------


def test_mlp():
    b = builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 8]))
    w1, b1 = b.addInitializedInputTensor(f32(8, 16)), b.addInitializedInputTensor(f32(16))
    w2, b2 = b.addInitializedInputTensor(f32(3, 16)), b.addInitializedInputTensor(f32(3))
    h = b.aiOnnx.relu([b.aiOnnx.add([b.aiOnnx.matmul([x, w1]), b1])])
    logits = b.aiOnnx.gemm([h, w2, b2], alpha=0.5, beta=2.0, transB=1)
    probs = b.aiOnnx.softmax([logits], axis=1)
    agree(b, [h, logits, probs], {x: f32(4, 8)})


def test_conv_net():
    b = builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3, 9, 9]))
    w = b.addInitializedInputTensor(f32(4, 3, 3, 3))
    bias = b.addInitializedInputTensor(f32(4))
    conv = b.aiOnnx.conv([x, w, bias], pads=[1, 1, 1, 1], strides=[2, 2])
    stats = [b.addInitializedInputTensor(v) for v in
             (f32(4), f32(4), f32(4), np.abs(f32(4)) + 0.5)]
    bn = b.aiOnnx.batchnormalization([conv, *stats], 1, epsilon=1e-3)[0]
    act = b.aiOnnx.relu([bn])
    pooled = b.aiOnnx.maxpool([act], 1, [2, 2], strides=[1, 1], pads=[0, 0, 1, 1])[0]
    grouped = b.aiOnnx.conv([pooled, b.addInitializedInputTensor(f32(4, 2, 3, 3))], group=2,
                            dilations=[2, 2], pads=[2, 2, 2, 2])
    gap = b.aiOnnx.globalaveragepool([grouped])
    flat = b.aiOnnx.flatten([gap], axis=1)
    logits = b.aiOnnx.gemm([flat, b.addInitializedInputTensor(f32(4, 5)),
                            b.addInitializedInputTensor(f32(5))])
    probs = b.aiOnnx.softmax([logits], axis=1)
    avg = b.aiOnnx.averagepool([act], [3, 3], ceil_mode=1, count_include_pad=1,
                               pads=[1, 1, 1, 1], strides=[2, 2])
    agree(b, [conv, bn, pooled, grouped, probs, avg], {x: f32(2, 3, 9, 9)}, rtol=1e-4)


def test_pooling_variants():
    b = builder(12)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [1, 2, 7, 6]))
    values, indices = b.aiOnnx.maxpool([x], 2, [3, 2], pads=[1, 0, 1, 1], strides=[2, 2],
                                       ceil_mode=1, dilations=[1, 2])
    avg = b.aiOnnx.averagepool([x], [2, 3], strides=[2, 1], pads=[0, 1, 1, 1])
    lp = b.aiOnnx.lppool([x], [2, 2], p=3)
    gmax = b.aiOnnx.globalmaxpool([x])
    agree(b, [values, indices, avg, lp, gmax], {x: f32(1, 2, 7, 6)}, rtol=1e-4)


@pytest.mark.parametrize("kernel,strides,pads,ceil,dilations", [
    ([2, 2], [2, 2], [0, 0, 0, 0], 0, [1, 1]), ([3, 3], [2, 2], [1, 1, 1, 1], 0, [1, 1]),
    ([3, 2], [1, 2], [1, 0, 2, 1], 1, [1, 1]), ([2, 3], [2, 1], [0, 1, 0, 1], 0, [2, 1])])
def test_max_pool_as_strided_slices_is_reduce_window_value_and_gradient(
        kernel, strides, pads, ceil, dilations):
    """A MaxPool of few taps runs as a maximum of strided slices (no reduce_window in its
    forward pass): onnxruntime's values, and reduce_window's gradient exactly, ties (the zeros
    of a Relu) included."""
    from popart_kit._runtime.xla import ops

    b = builder(12)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3, 9, 8]))
    (y,) = b.aiOnnx.maxpool([b.aiOnnx.relu([x])], 1, kernel, pads=pads, strides=strides,
                            ceil_mode=ceil, dilations=dilations)
    feeds = {x: f32(2, 3, 9, 8)}
    agree(b, [y], feeds)
    graph = lower(model_of(b, [y]))
    text = str(jax.make_jaxpr(lambda f: graph.evaluate({}, f, [y]))(feeds))
    assert "reduce_window" not in text and "custom_vjp" in text

    def loss(f, reference):  # reference: SLICED_MAX_TAPS 0, reduce_window's pooling
        if reference:
            saved, ops.SLICED_MAX_TAPS = ops.SLICED_MAX_TAPS, 0
        try:
            out = graph.evaluate({}, f, [y])[y]
        finally:
            if reference:
                ops.SLICED_MAX_TAPS = saved
        return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape))

    if max(dilations) == 1:  # JAX has no max pool gradient with window dilation
        fast = jax.grad(lambda f: loss(f, False))(feeds)[x]
        slow = jax.grad(lambda f: loss(f, True))(feeds)[x]  # the op traced anew: reduce_window
        np.testing.assert_array_equal(fast, slow)
        assert np.count_nonzero(fast) > 0


@pytest.mark.parametrize("opset", [10, 11, 13])
def test_reshape_transpose_concat_slice_gather(opset):
    b = builder(opset)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3, 4]))
    idx = b.addInputTensor(pk.TensorInfo("INT64", [2, 2]))
    shape = b.addInitializedInputTensor(np.array([0, 4, -1], np.int64))  # a static initializer
    reshaped = b.aiOnnx.reshape([x, shape])
    moved = b.aiOnnx.transpose([reshaped], perm=[2, 0, 1])
    joined = b.aiOnnx.concat([moved, b.aiOnnx.neg([moved])], axis=-1)
    const = b.aiOnnx.constant
    sliced = b.aiOnnx.slice([joined, const(np.array([-1, 0], np.int64)),
                             const(np.array([-100, 100], np.int64)),
                             const(np.array([0, 2], np.int64)), const(np.array([-1, 3]))])
    gathered = b.aiOnnx.gather([joined, idx], axis=2)
    rows = b.aiOnnx.gather([x, b.aiOnnx.constant(np.array(-1, np.int64))], axis=1)
    shape_of = b.aiOnnx.shape([rows])
    again = b.aiOnnx.reshape([b.aiOnnx.flatten([rows], axis=0), shape_of])  # shape-derived
    agree(b, [reshaped, moved, joined, sliced, gathered, rows, shape_of, again],
          {x: f32(2, 3, 4), idx: np.array([[0, -1], [2, 1]], np.int64)})
    graph = lower(b.getModelProto())  # bytes, as PopART's Builder gives them
    assert shape in graph.constants and shape not in graph.weights


def test_cast_and_where():
    b = builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [3, 4]))
    y = b.addInputTensor(pk.TensorInfo("INT32", [4]))
    as_int = b.aiOnnx.cast([x], "INT32")
    as_half = b.aiOnnx.cast([x], "FLOAT16")
    as_bool = b.aiOnnx.cast([y], "BOOL")
    back = b.aiOnnx.cast([as_int], "FLOAT")
    mask = b.aiOnnx.greater([x, b.aiOnnx.cast([y], "FLOAT")])
    picked = b.aiOnnx.where([mask, x, b.aiOnnx.cast([y], "FLOAT")])
    ints = b.aiOnnx.where([as_bool, y, b.aiOnnx.neg([y])])
    both = b.aiOnnx.logical_and([mask, b.aiOnnx.logical_not([as_bool])])
    agree(b, [as_int, as_half, as_bool, back, mask, picked, ints, both],
          {x: 3 * f32(3, 4), y: np.array([0, 1, -2, 0], np.int32)}, rtol=1e-3)


@pytest.mark.parametrize("opset", [10, 11, 13])
def test_softmax_axis_semantics_follow_the_opset(opset):
    """Before opset 13 Softmax flattens to 2-D at ``axis``; from 13 it works along it."""
    b = builder(opset)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3, 4]))
    outs = [b.aiOnnx.softmax([x], axis=1), b.aiOnnx.logsoftmax([x], axis=1),
            b.aiOnnx.hardmax([x], axis=1)]
    got = agree(b, outs, {x: f32(2, 3, 4)})
    sums = got[0].sum(axis=(1, 2) if opset < 13 else 1)
    np.testing.assert_allclose(sums, 1, rtol=1e-5)


def test_opset_10_attribute_forms():
    b = builder(10)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 1, 6]))
    outs = [
        b.aiOnnx.reducesum([x], axes=[2], keepdims=0), b.aiOnnx.reducemax([x]),
        b.aiOnnx.reducemean([x], axes=[-1]), b.aiOnnx.reducel2([x], axes=[0, 2]),
        b.aiOnnx.reducelogsumexp([x], axes=[2]), b.aiOnnx.reduceprod([x], axes=[1]),
        b.aiOnnx.squeeze([x], axes=[1]), b.aiOnnx.squeeze([x]), b.aiOnnx.unsqueeze([x], [0, 3]),
        b.aiOnnx.clip([x], min=-0.5, max=0.25), b.aiOnnx.pad([x], [0, 0, 1, 0, 1, 2]),
        b.aiOnnx.pad([x], [0, 0, 2, 0, 0, 3], mode="reflect"),
        b.aiOnnx.pad([x], [0, 0, 1, 0, 0, -2], mode="edge"),
        *b.aiOnnx.split([x], 3, axis=2, split=[1, 2, 3]),
        *b.aiOnnx.topk([x, b.aiOnnx.constant(np.array([2], np.int64))], axis=-1),
        b.aiOnnx.argmax([x], axis=2, keepdims=0), b.aiOnnx.argmin([x], axis=2),
        b.aiOnnx.dropout([x], 2, ratio=0.25)[0],
        b.aiOnnx.leakyrelu([x], alpha=0.2), b.aiOnnx.elu([x]), b.aiOnnx.hardsigmoid([x]),
        b.aiOnnx.softplus([x]), b.aiOnnx.sqrt([b.aiOnnx.abs([x])]), b.aiOnnx.floor([x]),
        b.aiOnnx.ceil([x]), b.aiOnnx.reciprocal([x]), b.aiOnnx.sin([x]), b.aiOnnx.cos([x]),
        b.aiOnnx.sum([x, x, x]), b.aiOnnx.mean([x, x]), b.aiOnnx.log([b.aiOnnx.exp([x])]),
        b.aiOnnx.pow([b.aiOnnx.abs([x]), b.aiOnnx.constant(np.array(1.5, np.float32))]),
        b.aiOnnx.less([x, b.aiOnnx.neg([x])]),
    ]
    agree(b, outs, {x: f32(2, 1, 6)}, rtol=1e-5)


def test_opset_9_attribute_forms():
    b = builder(9)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [3, 5]))
    outs = [b.aiOnnx.slice([x], [100, -1], [1, -4], axes=[0, 1]),
            b.aiOnnx.slice([x], [2], [0]),
            *b.aiOnnx.topk([x], 2, axis=0),
            b.aiOnnx.softmax([x], axis=0)]
    agree(b, outs, {x: f32(3, 5)})


@pytest.mark.parametrize("opset, mask_type", [(7, np.float32), (10, np.bool_), (12, np.bool_)])
def test_dropout_is_the_identity_with_a_mask_of_ones(opset, mask_type):
    """Inference Dropout; the mask is all ones (onnxruntime gives zeros before opset 12, where
    ONNX leaves it unspecified; ONNX's own reference gives ones)."""
    b = builder(opset)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [3, 5]))
    y, mask = b.aiOnnx.dropout([x], 2)  # ratio 0.5
    data = f32(3, 5)
    got_y, got_mask = xla(model_of(b, [y, mask]), {x: data}, [y, mask])
    np.testing.assert_array_equal(got_y, data)
    assert got_mask.dtype == mask_type and got_mask.all() and got_mask.shape == (3, 5)


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_input_forms_of_newer_opsets(opset):
    """Axes, splits, pads and clip bounds as inputs (constants), as newer opsets take them."""
    b = builder(opset)
    c = b.aiOnnx.constant
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 1, 6]))
    outs = [b.aiOnnx.clip([x, c(np.array(-0.5, np.float32)), c(np.array(0.5, np.float32))]),
            b.aiOnnx.clip([x, c(np.array(0.1, np.float32))]),  # min only
            b.aiOnnx.pad([x, c(np.array([0, 0, 1, 0, 1, 2], np.int64)),
                          c(np.array(7.0, np.float32))]),
            b.aiOnnx.expand([x, c(np.array([3, 2, 1, 1], np.int64))]),
            b.aiOnnx.tile([x, c(np.array([1, 2, 2], np.int64))]),
            b.aiOnnx.constantofshape([c(np.array([2, 3], np.int64))], np.array([4], np.int32)),
            b.aiOnnx.range([c(np.array(1.0, np.float32)), c(np.array(4.0, np.float32)),
                            c(np.array(0.5, np.float32))]),
            b.aiOnnx.cumsum([x, c(np.array(2, np.int64))], exclusive=1, reverse=1)]
    if opset >= 13:
        axes = c(np.array([1], np.int64))
        outs += [b.aiOnnx.squeeze([x, axes]), b.aiOnnx.unsqueeze([x, axes]),
                 b.aiOnnx.reducesum([x, c(np.array([2], np.int64))], keepdims=0)]
    else:
        outs += [b.aiOnnx.squeeze([x], axes=[1]), b.aiOnnx.unsqueeze([x], axes=[-1])]
    if opset == 13:  # (the Builder cannot make Split at 18, where num_outputs is an attribute)
        outs += b.aiOnnx.split([x, c(np.array([4, 2], np.int64))], 2, axis=-1)
    if opset >= 18:
        outs += [b.aiOnnx.reducemean([x, c(np.array([0, 2], np.int64))]),
                 b.aiOnnx.reducemax([x, c(np.array([-1], np.int64))], keepdims=0)]
    agree(b, outs, {x: f32(2, 1, 6)})


def test_layer_normalization_and_friends():
    b = builder(17)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3, 4]))
    scale, bias = b.addInitializedInputTensor(f32(3, 4)), b.addInitializedInputTensor(f32(3, 4))
    y, mean, inv = b.aiOnnx.layernormalization([x, scale, bias], 3, axis=1, epsilon=1e-3)
    gelu = b.aiOnnx.erf([x])
    inst = b.aiOnnx.instancenormalization([x, b.addInitializedInputTensor(f32(3)),
                                           b.addInitializedInputTensor(f32(3))])
    agree(b, [y, mean, inv, gelu, inst], {x: f32(2, 3, 4)}, rtol=1e-4)


# -- refusals --------------------------------------------------------------------------------------


def test_unsupported_model_lists_every_problem_at_once():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="fine"),
        helper.make_node("NonZero", ["r"], ["nz"], name="find_nonzero"),
        helper.make_node("Reshape", ["r", "shape"], ["reshaped"]),  # unnamed: its output
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", auto_pad="SOMETIMES"),
        helper.make_node("Unique", ["r"], ["u"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [1, 1, 3, 3])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
         for o in ("nz", "reshaped", "c", "u")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(UnsupportedModel) as info:
        lower(model)
    problems = info.value.problems
    assert len(problems) == 4, problems
    text = str(info.value)
    assert isinstance(info.value, ValueError) and "4 problem(s)" in text
    assert "find_nonzero (NonZero): operator ai.onnx.NonZero is not supported" in text
    assert "u (Unique): operator ai.onnx.Unique is not supported" in text
    assert "reshaped (Reshape): input 1 ('shape') must be a compile-time constant" in text
    assert "conv (Conv): attribute auto_pad='SOMETIMES' is not supported" in text
    assert unsupported(model) == problems


def test_static_inputs_fold_a_shape_fed_as_an_input():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("Reshape", ["r", "shape"], ["reshaped"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("reshaped", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert len(unsupported(model)) == 1
    lowered = lower(model, static_inputs={"shape": np.array([2, 8]), "x": np.zeros(16)})
    assert list(lowered.inputs) == ["x"] and "shape" in lowered.constants  # x stays an input
    got = lowered.evaluate({}, {"x": np.ones((1, 1, 4, 4), np.float32)}, ["reshaped"])
    assert got["reshaped"].shape == (2, 8)


def test_unsupported_attribute_values_are_refused_at_lowering():
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"], mode="mirror"),
             helper.make_node("DepthToSpace", ["x"], ["d"], blocksize=2, mode="XYZ"),
             helper.make_node("Cast", ["x"], ["s"], to=TensorProto.STRING),
             helper.make_node("L1", ["x"], ["l"], domain="ai.graphcore", reduction="Median",
                              **{"lambda": 0.1})]
    pads = helper.make_tensor("pads", TensorProto.INT64, [8], [0] * 8)
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in "pdsl"],
        initializer=[pads])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("ai.graphcore", 1)])
    problems = unsupported(model)
    assert len(problems) == 4, problems
    assert "p (Pad): attribute mode='mirror' is not supported" in problems[0]
    assert "mode='XYZ'" in problems[1] and "to=8" in problems[2]
    assert "l (L1): attribute reduction='Median'" in problems[3]


# -- ai.graphcore operators ------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", list(pk.ReductionType))
def test_graphcore_losses_follow_their_formulas(reduction):
    b = builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 5]))
    label = b.addInputTensor(pk.TensorInfo("INT32", [4]))
    probs = b.aiOnnx.softmax([x], axis=1)
    l1 = b.aiGraphcore.l1loss([x], 0.3, reduction=reduction)
    nll = b.aiGraphcore.nllloss([probs, label], reduction=reduction)
    nll_ignore = b.aiGraphcore.nllloss([probs, label], reduction=reduction, ignoreIndex=2)
    nll_log = b.aiGraphcore.nllloss([b.aiOnnx.logsoftmax([x], axis=1), label],
                                    reduction=reduction, inputIsLogProbability=True)
    ident = b.aiGraphcore.identityloss([x], reduction=reduction)
    gelu = b.aiGraphcore.gelu([x])
    data, labels = f32(4, 5), np.array([1, 2, 0, 2], np.int32)
    outs = [l1, nll, nll_ignore, nll_log, ident, gelu]
    got = dict(zip(outs, xla(model_of(b, outs), {x: data, label: labels}, outs), strict=True))

    def reduce(v: np.ndarray, count: float | None = None) -> np.ndarray:
        if reduction is pk.ReductionType.Sum:
            return v.sum()
        if reduction is pk.ReductionType.Mean:
            return v.sum() / (v.size if count is None else count)
        return v

    p = np.exp(data) / np.exp(data).sum(1, keepdims=True)
    picked = -np.log(p[np.arange(4), labels])
    kept = labels != 2
    np.testing.assert_allclose(got[l1], reduce(0.3 * np.abs(data)), rtol=1e-5)
    np.testing.assert_allclose(got[nll], reduce(picked), rtol=1e-5)
    np.testing.assert_allclose(got[nll_ignore], reduce(picked * kept, kept.sum()), rtol=1e-5)
    np.testing.assert_allclose(got[nll_log], reduce(picked), rtol=1e-5)
    np.testing.assert_allclose(got[ident], reduce(data), rtol=1e-5)
    # popnn's GELU, the tanh form (popx/op/gelux.cpp); aiGraphcore.geluerf is the erf form
    inner = math.sqrt(2 / math.pi) * (data + 0.044715 * data ** 3)
    np.testing.assert_allclose(got[gelu], 0.5 * data * (1 + np.tanh(inner)), rtol=1e-5,
                               atol=1e-6)
    shape = (4, 5) if reduction is pk.ReductionType.NoReduction else ()
    assert got[l1].shape == shape and got[ident].shape == shape
    assert got[nll].shape == ((4,) if reduction is pk.ReductionType.NoReduction else ())


# -- evaluate under JAX transformations ------------------------------------------------------------


def _mlp_with_l1() -> tuple[LoweredGraph, str, str, dict[str, str]]:
    b = builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [6, 4]))
    w1 = b.addInitializedInputTensor(f32(4, 5), "w1")
    b1 = b.addInitializedInputTensor(f32(5), "b1")
    w2 = b.addInitializedInputTensor(f32(5, 3), "w2")
    pre = b.aiOnnx.add([b.aiOnnx.matmul([x, w1]), b1])
    y = b.aiOnnx.matmul([b.aiOnnx.relu([pre]), w2])
    loss = b.aiGraphcore.l1loss([y], 0.1, reduction=pk.ReductionType.Mean)
    return lower(model_of(b, [loss])), x, loss, {"w1": w1, "b1": b1, "w2": w2}


def test_grad_through_evaluate_matches_backprop():
    graph, x, loss, names = _mlp_with_l1()
    data = f32(6, 4)

    def objective(weights):
        return graph.evaluate(weights, {x: data}, [loss])[loss]

    grads = jax.jit(jax.grad(objective))(graph.weights)
    w1, b1, w2 = (graph.weights[names[k]] for k in ("w1", "b1", "w2"))
    pre = data @ w1 + b1
    h = np.maximum(pre, 0)
    y = h @ w2
    dy = 0.1 * np.sign(y) / y.size
    dpre = (dy @ w2.T) * (pre > 0)
    np.testing.assert_allclose(grads[names["w2"]], h.T @ dy, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads[names["w1"]], data.T @ dpre, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads[names["b1"]], dpre.sum(0), rtol=1e-5, atol=1e-7)
    assert float(objective(graph.weights)) == pytest.approx(0.1 * np.abs(y).mean(), rel=1e-5)


def test_vmap_over_evaluate_is_the_stacked_result():
    graph, x, loss, _ = _mlp_with_l1()
    batch = f32(3, 6, 4)
    vmapped = jax.vmap(lambda d: graph.evaluate(graph.weights, {x: d}, [loss])[loss])(batch)
    each = [graph.evaluate(graph.weights, {x: d}, [loss])[loss] for d in batch]
    np.testing.assert_allclose(vmapped, np.stack(each), rtol=1e-6)


def test_lowered_graph_describes_the_model():
    graph, x, loss, names = _mlp_with_l1()
    assert graph.inputs == {x: ((6, 4), np.dtype(np.float32))}
    assert set(graph.weights) == set(names.values()) and graph.outputs == [loss]
    assert set(graph.trainable) == set(graph.weights)
    assert {x, loss, *names.values()} <= graph.tensors and "MatMul:0" in graph.tensors
    got = graph.evaluate(graph.weights, {x: f32(6, 4)}, ["MatMul:0", x, names["w1"]])
    assert got["MatMul:0"].shape == (6, 5) and got[names["w1"]].shape == (4, 5)
    with pytest.raises(KeyError, match="not tensors of the model"):
        graph.evaluate(graph.weights, {x: f32(6, 4)}, ["nope"])
    with pytest.raises(KeyError, match="input 'input' is missing"):
        graph.evaluate(graph.weights, {}, [loss])
    assert isinstance(graph.evaluate({}, {x: f32(6, 4)}, [loss])[loss], jax.Array)


def test_table_covers_the_operators_asked_for():
    wanted = ["Add", "Sub", "Mul", "Div", "MatMul", "Gemm", "Relu", "Sigmoid", "Tanh", "Erf",
              "Softmax", "LogSoftmax", "Reshape", "Transpose", "Concat", "Slice", "Gather", "Conv",
              "MaxPool", "AveragePool", "GlobalAveragePool", "BatchNormalization", "Flatten",
              "Identity", "Cast", "ReduceMean", "ReduceSum", "Exp", "Log", "Sqrt", "Pow", "Neg",
              "Abs", "Dropout", "Where", "Equal", "Less", "Greater", "Constant", "Squeeze",
              "Unsqueeze", "Clip", "Max", "Min", "LayerNormalization"]
    assert {("", op) for op in wanted} <= set(OPS)
    assert {("ai.graphcore", op) for op in ("L1", "Nll", "IdentityLoss", "Gelu")} <= set(OPS)


def test_batch_normalization_training_outputs_use_batch_statistics():
    b = builder(10)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 2, 3]))
    stats = [b.addInitializedInputTensor(v) for v in (f32(2), f32(2), f32(2),
                                                      np.abs(f32(2)) + 0.5)]
    y, mean, var, saved_mean, saved_var = b.aiOnnx.batchnormalization(
        [x, *stats], 5, epsilon=1e-5, momentum=0.8)
    data = f32(4, 2, 3)
    outs = [y, mean, var, saved_mean, saved_var]
    graph = lower(model_of(b, outs))
    got = graph.evaluate(graph.weights, {x: data}, outs)
    scale, bias, m0, v0 = (graph.weights[s] for s in stats)
    bm, bv = data.mean((0, 2)), data.var((0, 2))
    want = (data - bm[:, None]) / np.sqrt(bv[:, None] + 1e-5) * scale[:, None] + bias[:, None]
    np.testing.assert_allclose(got[y], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[mean], 0.8 * m0 + 0.2 * bm, rtol=1e-5)
    np.testing.assert_allclose(got[var], 0.8 * v0 + 0.2 * bv, rtol=1e-5)
    np.testing.assert_allclose(got[saved_mean], bm, rtol=1e-5, atol=1e-6)


def test_int64_inputs_run_as_jax_default_ints():
    b = builder(13)
    x = b.addInputTensor(pk.TensorInfo("INT64", [3]))
    y = b.aiOnnx.add([x, b.aiOnnx.constant(np.array(2, np.int64))])
    got = lower(model_of(b, [y])).evaluate({}, {x: np.array([1, 2, 3])}, [y])[y]
    assert got.dtype == jnp.int32 and got.tolist() == [3, 4, 5]


def test_grad_through_a_conv_net_matches_finite_differences():
    b = builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 2, 6, 6]))
    w = b.addInitializedInputTensor(f32(3, 2, 3, 3), "w")
    conv = b.aiOnnx.conv([x, w], pads=[1, 1, 1, 1])
    stats = [b.addInitializedInputTensor(v) for v in (f32(3), f32(3), f32(3),
                                                      np.abs(f32(3)) + 0.5)]
    act = b.aiOnnx.relu([b.aiOnnx.batchnormalization([conv, *stats], 1)[0]])
    pooled = b.aiOnnx.maxpool([act], 1, [2, 2], strides=[2, 2])[0]
    avg = b.aiOnnx.averagepool([act], [3, 3], pads=[1, 1, 1, 1], strides=[2, 2])
    both = b.aiOnnx.add([pooled, avg])
    loss = b.aiGraphcore.identityloss([b.aiOnnx.mul([both, both])],
                                      reduction=pk.ReductionType.Sum)
    graph = lower(model_of(b, [loss]))
    data = f32(2, 2, 6, 6)

    def objective(weight):
        return graph.evaluate({**graph.weights, w: weight}, {x: data}, [loss])[loss]

    grad = jax.jit(jax.grad(objective))(graph.weights[w])
    direction = f32(3, 2, 3, 3)
    eps = 1e-2
    numeric = (objective(graph.weights[w] + eps * direction)
               - objective(graph.weights[w] - eps * direction)) / (2 * eps)
    assert float(jnp.vdot(grad, direction)) == pytest.approx(float(numeric), rel=2e-2)
