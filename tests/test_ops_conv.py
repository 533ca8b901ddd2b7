"""Conv and ConvTranspose on the xla backend (popart_kit/_runtime/xla/ops_conv.py): every
lowering it chooses between (channels-last XLA convolution; grouped ones split into one dense
convolution per group; shifted multiply-adds for depthwise and one-input-channel
convolutions, the latter with XLA's gradient) against
onnxruntime forward on odd shapes, half precision with each partials type, and the gradients
against jax.grad of lax.conv_general_dilated, also under vmap, checkpoint and a loop."""

from __future__ import annotations

import concurrent.futures
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from jax import lax
from onnx import TensorProto, helper

from popart_kit._runtime.xla import conv_mlas, ops_conv
from popart_kit._runtime.xla.lowering import lower
from popart_kit._runtime.xla.ops_conv import lowering_for

ort.set_default_logger_severity(3)
RNG = np.random.default_rng(5)


def conv_model(x_shape, w_shape, op="Conv", bias=False, dtype=np.float32, **attrs
               ) -> onnx.ModelProto:
    """One Conv (or ConvTranspose) of graph inputs x, w (and b)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    names = ["x", "w"] + (["b"] if bias else [])
    out_channels = w_shape[1] * attrs.get("group", 1) if op == "ConvTranspose" else w_shape[0]
    shapes = [x_shape, w_shape] + ([[out_channels]] if bias else [])
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], **attrs)], "g",
        [helper.make_tensor_value_info(n, elem, list(s))
         for n, s in zip(names, shapes, strict=True)],
        [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def feeds_for(model: onnx.ModelProto, dtype=np.float32) -> dict[str, np.ndarray]:
    return {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
            .astype(dtype) for i in model.graph.input}


def run_kit(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    graph = lower(model)
    return np.asarray(jax.jit(lambda f: graph.evaluate({}, f, ["y"])["y"])(feeds))


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


# (x shape, w shape, attributes, the lowering lowering_for must choose)
CONVS = {
    "dense strided dilated": ((2, 3, 11, 10), (5, 3, 3, 2),
                              dict(strides=[2, 3], dilations=[2, 1], pads=[1, 0, 2, 1]),
                              "channels_last"),
    "grouped": ((2, 4, 9, 8), (6, 2, 3, 3), dict(group=2, strides=[2, 1], pads=[1, 1, 0, 2]),
                "split"),
    "many groups": ((1, 132, 4, 3), (66, 2, 1, 2), dict(group=66, pads=[0, 1, 0, 0]),
                    "channels_last"),
    "1x1": ((3, 8, 5, 4), (7, 8, 1, 1), {}, "channels_last"),
    "depthwise": ((2, 6, 13, 9), (6, 1, 3, 3),
                  dict(group=6, strides=[2, 1], dilations=[1, 2], pads=[2, 1, 0, 3]), "shifted"),
    "depthwise multiplier": ((2, 3, 8, 7), (6, 1, 3, 2), dict(group=3, pads=[1, 1, 1, 0]),
                             "shifted"),
    "depthwise same upper": ((1, 4, 7, 8), (4, 1, 4, 3), dict(group=4, strides=[2, 2],
                                                                auto_pad="SAME_UPPER"), "shifted"),
    "one input channel": ((3, 1, 12, 11), (5, 1, 5, 5), dict(strides=[1, 2]), "shifted"),
    "1-D dense": ((2, 3, 17), (4, 3, 4), dict(strides=[3], pads=[2, 1]), "channels_last"),
    "1-D depthwise": ((2, 5, 16), (5, 1, 3), dict(group=5, dilations=[3], pads=[1, 2]),
                      "shifted"),
    "3-D dense": ((1, 2, 5, 6, 4), (3, 2, 2, 3, 2), dict(strides=[1, 2, 1], pads=[1] * 6),
                  "channels_last"),
    "3-D depthwise": ((2, 3, 5, 4, 6), (3, 1, 3, 2, 2), dict(group=3, pads=[1, 0, 1, 1, 1, 0]),
                      "shifted"),
    "big kernel depthwise": ((1, 2, 12, 12), (2, 1, 8, 8), dict(group=2), "split"),
}


@pytest.mark.parametrize("case", CONVS)
def test_conv_matches_onnxruntime(case):
    x_shape, w_shape, attrs, path = CONVS[case]
    assert lowering_for(x_shape, w_shape, attrs.get("group", 1)) == path
    model = conv_model(x_shape, w_shape, bias=True, **attrs)
    feeds = feeds_for(model)
    want = run_ort(model, feeds)
    got = run_kit(model, feeds)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


CONV_TRANSPOSES = {
    "strided output padding": ((2, 3, 5, 4), (3, 4, 3, 2),
                               dict(strides=[2, 3], output_padding=[1, 2], pads=[1, 0, 0, 1])),
    "grouped dilated": ((1, 4, 6, 5), (4, 3, 3, 3), dict(group=2, dilations=[2, 1],
                                                           strides=[1, 2])),
    "1-D": ((2, 2, 7), (2, 3, 4), dict(strides=[2], pads=[1, 2])),
    "depthwise": ((1, 3, 4, 5), (3, 1, 2, 3), dict(group=3, strides=[2, 1])),
}


@pytest.mark.parametrize("case", CONV_TRANSPOSES)
def test_conv_transpose_matches_onnxruntime(case):
    x_shape, w_shape, attrs = CONV_TRANSPOSES[case]
    model = conv_model(x_shape, w_shape, op="ConvTranspose", bias=True, **attrs)
    feeds = feeds_for(model)
    np.testing.assert_allclose(run_kit(model, feeds), run_ort(model, feeds), rtol=1e-5,
                               atol=2e-5)


@pytest.mark.parametrize(("auto_pad", "rows"), [("SAME_UPPER", slice(1, 3)),
                                                ("SAME_LOWER", slice(0, 2))])
def test_conv_transpose_same_pads_with_output_shape_as_popart(auto_pad, rows):
    """convtranspose.cpp: with output_shape, the odd padding's larger half is cut from the
    start for SAME_UPPER, from the end for SAME_LOWER (the full 3x3 result, cropped)."""
    x = np.array([[[[1.0, 2.0], [3.0, 4.0]]]], np.float32)
    w = np.array([[[[1.0, 2.0], [2.0, 1.0]]]], np.float32)
    full = run_kit(conv_model(x.shape, w.shape, op="ConvTranspose"), {"x": x, "w": w})
    model = conv_model(x.shape, w.shape, op="ConvTranspose", auto_pad=auto_pad,
                       output_shape=[2, 2])
    np.testing.assert_array_equal(run_kit(model, {"x": x, "w": w}),
                                  full[..., rows, rows])
    if auto_pad == "SAME_UPPER":  # PopART's operators_test_2 expectation
        np.testing.assert_array_equal(run_kit(model, {"x": x, "w": w})[0, 0],
                                      [[15.0, 10.0], [11.0, 4.0]])


@pytest.mark.parametrize(("case", "kind"), [
    ("dense strided dilated", None), ("dense strided dilated", "float"),
    ("dense strided dilated", "half"), ("grouped", "float"), ("depthwise", "half"),
    ("depthwise", None), ("one input channel", "float")])
def test_half_convolutions_accumulate_in_float_and_round_once(case, kind):
    """Half inputs (any partials type: XLA:CPU's convolution upcasts half itself) give the
    float32 convolution of the same values rounded once to half."""
    x_shape, w_shape, attrs, _ = CONVS[case]
    if kind is not None:
        attrs = dict(attrs, __partials_type=kind)
    model = conv_model(x_shape, w_shape, dtype=np.float16, **attrs)
    feeds = feeds_for(model, np.float16)
    got = run_kit(model, feeds)
    wide = conv_model(x_shape, w_shape, **{k: v for k, v in attrs.items()
                                           if k != "__partials_type"})
    want = run_ort(wide, {k: v.astype(np.float32) for k, v in feeds.items()})
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float16).astype(np.float32),
                               rtol=2e-3, atol=2e-3)


def reference(x, w, attrs):
    """lax.conv_general_dilated of the ONNX attributes (explicit pads only)."""
    n = x.ndim - 2
    pads = attrs.get("pads", [0] * 2 * n)
    return lax.conv_general_dilated(x, w, attrs.get("strides", [1] * n),
                                    list(zip(pads[:n], pads[n:], strict=True)),
                                    rhs_dilation=attrs.get("dilations", [1] * n),
                                    feature_group_count=attrs.get("group", 1),
                                    precision=lax.Precision.HIGHEST)


GRAD_CASES = ["dense strided dilated", "grouped", "many groups", "depthwise",
              "depthwise multiplier", "one input channel", "3-D depthwise"]


@pytest.mark.parametrize("case", GRAD_CASES)
def test_conv_gradients_match_lax(case):
    x_shape, w_shape, attrs, _ = CONVS[case]
    model = conv_model(x_shape, w_shape, **attrs)
    graph = lower(model)
    feeds = {k: jnp.asarray(v) for k, v in feeds_for(model).items()}
    probe = jnp.asarray(RNG.standard_normal(reference(feeds["x"], feeds["w"], attrs).shape),
                        jnp.float32)

    def kit(x, w):
        return jnp.sum(graph.evaluate({}, {"x": x, "w": w}, ["y"])["y"] * probe)

    def ref(x, w):
        return jnp.sum(reference(x, w, attrs) * probe)

    got = jax.jit(jax.grad(kit, argnums=(0, 1)))(feeds["x"], feeds["w"])
    want = jax.jit(jax.grad(ref, argnums=(0, 1)))(feeds["x"], feeds["w"])
    for g, w, name in zip(got, want, "xw", strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def test_custom_gradient_under_vmap_checkpoint_and_loops():
    """The one-input-channel lowering's custom gradient inside the transformations the runtime
    uses: vmap over replicas, jax.checkpoint (recomputation), a fori_loop over micro-batches."""
    x_shape, w_shape, attrs, _ = CONVS["one input channel"]
    graph = lower(conv_model(x_shape, w_shape, **attrs))
    xs = jnp.asarray(RNG.standard_normal((2, *x_shape)), jnp.float32)
    ws = jnp.asarray(RNG.standard_normal((2, *w_shape)), jnp.float32)

    def loss(w, x, fn):
        return jnp.sum(jnp.tanh(fn(x, w)))

    def kit(x, w):
        return graph.evaluate({}, {"x": x, "w": w}, ["y"])["y"]

    def looped(w, x, fn):
        return lax.fori_loop(0, 2, lambda i, acc: acc + jax.grad(loss)(w, x, fn),
                             jnp.zeros_like(w))

    def ref(x, w):
        return reference(x, w, attrs)

    got = jax.jit(jax.vmap(lambda w, x: looped(w, x, jax.checkpoint(kit))))(ws, xs)
    want = jax.jit(jax.vmap(lambda w, x: looped(w, x, ref)))(ws, xs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# -- onnxruntime's MLAS through buffer_callback (conv_mlas.py) ----------------------------------

# (x shape, w shape, attributes, the layout MLAS takes on a machine of 16-channel blocks)
MLAS_CONVS = {
    "dense blocked, odd channels, strided dilated": (
        (2, 20, 11, 10), (24, 20, 3, 2),
        dict(strides=[2, 1], dilations=[1, 2], pads=[1, 0, 2, 1]), "nchwc"),
    "few input channels": ((2, 3, 12, 9), (16, 3, 4, 4), dict(strides=[2, 2], pads=[3] * 4),
                           "nchwc_bo"),
    "grouped blocks": ((1, 32, 6, 7), (32, 16, 3, 3), dict(group=2, pads=[1] * 4), "nchwc"),
    "grouped small": ((2, 8, 7, 6), (12, 2, 3, 3), dict(group=4, pads=[0, 1, 1, 0]), "nchw"),
    "depthwise": ((1, 16, 7, 7), (16, 1, 3, 3), dict(group=16, pads=[1] * 4), "nchwc_bo"),
}


def mlas_args(case, bias=True):
    """The case's operands and geometry (strides, pads, dilations, group) as conv_mlas takes
    them, and its model."""
    x_shape, w_shape, attrs, _ = MLAS_CONVS[case]
    model = conv_model(x_shape, w_shape, bias=bias, **attrs)
    feeds = feeds_for(model)
    pads = attrs.get("pads", [0] * 4)
    geometry = (tuple(attrs.get("strides", [1, 1])), ((pads[0], pads[2]), (pads[1], pads[3])),
                tuple(attrs.get("dilations", [1, 1])), attrs.get("group", 1))
    return model, feeds, geometry


def mlas_and_xla(geometry):
    """conv_mlas.conv and the XLA lowering it falls back to, of (x, w, b)."""
    strides, pads, dilations, group = geometry
    xla = functools.partial(ops_conv._xla_conv, strides=strides, pads=pads, dilations=dilations,
                            group=group)
    return (lambda x, w, b=None: conv_mlas.conv(x, w, b, strides, pads, dilations, group, xla),
            lambda x, w, b=None: xla(x, w, b))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", MLAS_CONVS)
def test_mlas_matches_onnxruntime_and_xla(case, bias):
    model, feeds, geometry = mlas_args(case, bias)
    if conv_mlas.block_size() == 16:
        x_shape, w_shape, attrs, layout = MLAS_CONVS[case]
        assert conv_mlas.layout_for(w_shape, attrs.get("group", 1)) == layout
    mlas, xla = mlas_and_xla(geometry)
    args = [jnp.asarray(feeds[k]) for k in ("x", "w", "b")[:len(feeds)]]
    got = np.asarray(jax.jit(mlas)(*args))
    assert "buffer_callback" in str(jax.make_jaxpr(mlas)(*args))
    np.testing.assert_allclose(got, run_ort(model, feeds), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(got, np.asarray(jax.jit(xla)(*args)), rtol=1e-5, atol=2e-5)


def test_lowering_chooses_mlas_for_large_float_convolutions_only():
    """A ResNet 3x3 layer: "mlas" at float32 and in half precision (and through the lowered
    model, where its result is onnxruntime's); its XLA lowering where no dtype is given, for
    small ones (by the thresholds of their kind: few input channels, 1x1, dense) and
    depthwise."""
    big = ((8, 64, 56, 56), (64, 64, 3, 3), 1)
    assert lowering_for(*big, np.float32) == "mlas"
    assert lowering_for(*big, np.float16) == "mlas"
    assert lowering_for(*big, ml_dtypes.bfloat16) == lowering_for(*big) == "channels_last"
    assert lowering_for((8, 256, 14, 14), (256, 256, 1, 1), 1, np.float32) == "mlas"
    assert lowering_for((1, 512, 7, 7), (512, 512, 1, 1), 1, np.float32) == "channels_last"
    assert lowering_for((8, 3, 32, 32), (16, 3, 3, 3), 1, np.float32) == "mlas"
    assert lowering_for((1, 3, 32, 32), (16, 3, 3, 3), 1, np.float32) == "channels_last"
    assert lowering_for((1, 16, 8, 8), (16, 16, 3, 3), 1, np.float32) == "channels_last"
    assert lowering_for((8, 128, 28, 28), (128, 1, 3, 3), 128, np.float32) == "shifted"
    assert lowering_for((8, 128, 28, 28), (128, 4, 3, 3), 32, np.float32) == "mlas"
    model = conv_model((2, 32, 64, 64), (32, 32, 3, 3), bias=True, pads=[1] * 4)
    assert lowering_for((2, 32, 64, 64), (32, 32, 3, 3), 1, np.float32) == "mlas"
    graph = lower(model)
    feeds = feeds_for(model)
    assert "buffer_callback" in str(jax.make_jaxpr(
        lambda f: graph.evaluate({}, f, ["y"])["y"])(feeds))
    np.testing.assert_allclose(run_kit(model, feeds), run_ort(model, feeds), rtol=1e-4,
                               atol=1e-4)


def test_mlas_under_vmap_folds_the_batch_or_falls_back():
    """vmap of the input alone (nested too) folds into N: one callback, of the folded shape;
    a batched filter runs XLA's lowering, vmapped."""
    _, feeds, geometry = mlas_args("dense blocked, odd channels, strided dilated")
    mlas, xla = mlas_and_xla(geometry)
    x, w, b = (jnp.asarray(feeds[k]) for k in "xwb")
    xs = jnp.stack([x, 2 * x, -x])
    folded = jax.vmap(jax.vmap(mlas, (0, None, None)), (0, None, None))
    text = str(jax.make_jaxpr(folded)(xs[None], w, b))
    assert text.count("buffer_callback") == 1 and "f32[6,20,11,10]" in text
    want = jax.vmap(xla, (0, None, None))(xs, w, b)
    np.testing.assert_allclose(jax.jit(folded)(xs[None], w, b)[0], want, rtol=1e-5, atol=2e-5)
    ws = jnp.stack([w, -w, w])
    both = jax.vmap(mlas, (0, 0, None))
    assert "buffer_callback" not in str(jax.make_jaxpr(both)(xs, ws, b))
    np.testing.assert_allclose(jax.jit(both)(xs, ws, b), jax.vmap(xla, (0, 0, None))(xs, ws, b),
                               rtol=1e-5, atol=2e-5)


def test_mlas_gradients_are_the_xla_lowerings_inside_scan_and_fori_loop():
    """The forward inside lax.scan equals the XLA lowering's, and the gradient inside a
    fori_loop (device iterations) is the XLA lowering's own: bit for bit, for a loss linear in
    the output (whose gradient does not read the forward's result)."""
    _, feeds, geometry = mlas_args("grouped small")
    mlas, xla = mlas_and_xla(geometry)
    x, w, b = (jnp.asarray(feeds[k]) for k in "xwb")
    xs = jnp.stack([x, 2 * x, -x])

    def scanned(fn):
        return lax.scan(lambda c, xi: (c + jnp.sum(fn(xi, w, b)), fn(xi, w, b)), 0.0, xs)

    (total, ys), (want_total, want) = jax.jit(lambda: scanned(mlas))(), scanned(xla)
    np.testing.assert_allclose(ys, want, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(total, want_total, rtol=1e-4)

    probe = jnp.asarray(RNG.standard_normal(want.shape[1:]), jnp.float32)

    def looped(fn):
        grad = jax.grad(lambda x, w, b: jnp.sum(fn(x, w, b) * probe), argnums=(0, 1, 2))
        return lax.fori_loop(0, 2, lambda i, acc: jax.tree.map(jnp.add, acc, grad(x, w, b)),
                             jax.tree.map(jnp.zeros_like, (x, w, b)))

    got, want = jax.jit(lambda: looped(mlas))(), jax.jit(lambda: looped(xla))()
    for g, r, name in zip(got, want, "xwb", strict=True):
        np.testing.assert_array_equal(g, r, err_msg=f"d{name}")


def test_mlas_runs_from_several_threads():
    """Pipeline stages call compiled programs from threads: concurrent calls of one program
    (one onnxruntime session, an io_binding per call) each get their own result."""
    _, feeds, geometry = mlas_args("few input channels")
    mlas, xla = mlas_and_xla(geometry)
    w, b = jnp.asarray(feeds["w"]), jnp.asarray(feeds["b"])
    fn = jax.jit(mlas)
    xs = [jnp.asarray(feeds["x"]) * (i + 1) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: np.asarray(fn(x, w, b)), xs))
    for x, y in zip(xs, got, strict=True):
        np.testing.assert_allclose(y, xla(x, w, b), rtol=1e-5, atol=2e-5)


def test_mlas_unavailable_falls_back_to_xla(monkeypatch):
    """Without onnxruntime or jax's buffer_callback (the one cached check) a Conv MLAS would
    run takes its XLA lowering."""
    monkeypatch.setattr(conv_mlas, "available", lambda: False)
    x_shape, w_shape = (2, 32, 64, 64), (32, 32, 3, 3)
    assert lowering_for(x_shape, w_shape, 1, np.float32) == "channels_last"
    model = conv_model(x_shape, w_shape, pads=[1] * 4)
    graph = lower(model)
    feeds = feeds_for(model)
    assert "buffer_callback" not in str(jax.make_jaxpr(
        lambda f: graph.evaluate({}, f, ["y"])["y"])(feeds))
    np.testing.assert_allclose(run_kit(model, feeds), run_ort(model, feeds), rtol=1e-4,
                               atol=1e-4)


def test_importing_popart_kit_does_not_import_onnxruntime():
    code = ("import sys, popart_kit, popart_kit._runtime.xla.ops_conv; "
            "assert 'onnxruntime' not in sys.modules, 'onnxruntime imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- Conv -> Relu as one MLAS call (lowering.py's FUSIONS, ops_conv.conv_relu) -------------------

X, W = (2, 16, 12, 10), (16, 16, 3, 3)  # small: the tests take MLAS at any size (small_mlas)


@pytest.fixture
def small_mlas(monkeypatch):
    """MLAS chosen for dense float32 Convs of any size (their MLAS_MIN_* thresholds 0): small,
    fast tests."""
    for name in ("MLAS_MIN_WORK", "MLAS_MIN_FEW_CHANNELS_WORK", "MLAS_MIN_POINTWISE_WORK"):
        monkeypatch.setattr(ops_conv, name, 0)


def conv_relu_model(x_shape=X, w_shape=W, dtype=np.float32, extra_reader=False
                    ) -> onnx.ModelProto:
    """x -> Conv (w, b; "c") -> Relu ("y"); with ``extra_reader`` an Add also reads c ("z")."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1] * 4),
             helper.make_node("Relu", ["c"], ["y"])]
    out = [x_shape[0], w_shape[0], *x_shape[2:]]  # 3x3, pads 1
    outputs = [helper.make_tensor_value_info("y", elem, out)]
    if extra_reader:
        nodes.append(helper.make_node("Add", ["c", "c"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", elem, out))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, elem, list(s))
         for n, s in (("x", x_shape), ("w", w_shape), ("b", w_shape[:1]))], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def fused_types(graph, wanted):
    """The op types the lowering evaluates for ``wanted`` (a fused pair as "Conv+Relu")."""
    return [n.ctx.op_type for n in graph._fused(tuple(wanted))]


def mlas_key(x_shape, activation, w_shape=W):
    """conv_mlas's session key for conv_relu_model's Conv (3x3, pads 1, bias)."""
    return (x_shape, w_shape, True, (1, 1), ((1, 1), (1, 1)), (1, 1), 1, activation, "float32")


def apart(model):
    """``model`` lowered with the lowering's fusions off (the Conv and its Relu apart)."""
    graph = lower(model)
    graph.fused = False
    return graph


def evaluate(graph, feeds, wanted=("y",)):
    return jax.jit(lambda f: graph.evaluate({}, f, list(wanted)))(feeds)


@pytest.mark.parametrize("layout,x_shape,w_shape", [
    ("nchwc", X, W), ("nchwc_bo", (2, 3, 12, 10), (16, 3, 3, 3)),
    ("nchw", (2, 18, 12, 10), (16, 18, 3, 3))])
def test_conv_relu_fused_into_one_mlas_call_matches_onnxruntime_and_apart(
        small_mlas, layout, x_shape, w_shape):
    """A float32 Conv whose only reader is a Relu runs as one MLAS call with MLAS's Relu
    (onnxruntime's NCHWc Conv, or its FusedConv for the plain layout); its result is
    onnxruntime's (which fuses them alike) and the unfused pair's, raw and through a
    session."""
    import popart_kit as pk

    if conv_mlas.block_size() == 16:
        assert conv_mlas.layout_for(w_shape, 1) == layout
    model = conv_relu_model(x_shape, w_shape)
    feeds = feeds_for(model)
    graph = lower(model)
    assert fused_types(graph, ["y"]) == ["Conv+Relu"]
    text = str(jax.make_jaxpr(lambda f: graph.evaluate({}, f, ["y"])["y"])(feeds))
    assert text.count("buffer_callback") == 1
    key = mlas_key(x_shape, "Relu", w_shape)
    conv_mlas._SESSIONS.pop(key, None)
    got = np.asarray(evaluate(graph, feeds)["y"])
    assert key in conv_mlas._SESSIONS  # MLAS's Relu ran
    np.testing.assert_array_equal(got, evaluate(apart(model), feeds)["y"])
    np.testing.assert_allclose(got, run_ort(model, feeds), rtol=1e-4, atol=1e-4)
    assert np.min(got) == 0 and np.mean(got == 0) > 0.2
    sess = pk.InferenceSession(model, pk.SessionConfig(
        mode="inference", batches_per_step=1, device={"target": "offline"}),
        anchors={"y": "All"}, backend="xla")  # delegated: onnxruntime's session (its filter
    #                                           reordered once, not per call as here)
    np.testing.assert_allclose(sess.run(feeds)["y"], run_ort(model, feeds), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(sess.run(feeds)["y"], got, rtol=1e-4, atol=1e-4)


def test_conv_relu_fused_gradients_are_the_pairs(small_mlas):
    """The fused pair's gradients (Relu's mask from the output, then the XLA lowering's
    backward) are the unfused pair's, bit for bit; under vmap (the batch folded into one
    fused call; a batched filter falls back to XLA then Relu) and scan its values too."""
    model = conv_relu_model()
    feeds = {k: jnp.asarray(v) for k, v in feeds_for(model).items()}
    fused, separate = lower(model), apart(model)
    probe = jnp.asarray(RNG.standard_normal((2, 16, 12, 10)), jnp.float32)

    def grads(graph):
        return jax.jit(jax.grad(lambda f: jnp.sum(
            graph.evaluate({}, f, ["y"])["y"] * probe)))(feeds)

    got, want = grads(fused), grads(separate)
    for name in "xwb":
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"d{name}")
    assert float(jnp.max(jnp.abs(got["w"]))) > 0

    xs = jnp.stack([feeds["x"], -feeds["x"]])  # (2, 2, 16, 12, 10)

    def mapped(graph):
        def one(x):
            return graph.evaluate({}, {**feeds, "x": x}, ["y"])["y"]
        return jax.jit(jax.vmap(one))(xs), jax.jit(lambda: lax.scan(
            lambda c, x: (c + jnp.sum(one(x)), one(x)), 0.0, xs))()

    (vm, (total, sc)), (vm_want, (total_want, sc_want)) = mapped(fused), mapped(separate)
    text = str(jax.make_jaxpr(jax.vmap(lambda x: fused.evaluate(
        {}, {**feeds, "x": x}, ["y"])["y"]))(xs))
    assert text.count("buffer_callback") == 1 and "f32[4,16,12,10]" in text
    assert mlas_key((4, 16, 12, 10), "Relu") in conv_mlas._SESSIONS
    np.testing.assert_array_equal(vm, vm_want)
    np.testing.assert_array_equal(sc, sc_want)
    np.testing.assert_allclose(total, total_want, rtol=1e-5)
    ws = jnp.stack([feeds["w"], -feeds["w"]])

    def by_filter(graph):
        return jax.jit(jax.vmap(lambda w, x: graph.evaluate(
            {}, {**feeds, "x": x, "w": w}, ["y"])["y"]))(ws, xs)

    np.testing.assert_allclose(by_filter(fused), by_filter(separate), rtol=1e-5, atol=2e-5)


def test_conv_relu_not_fused_where_the_conv_output_is_wanted_or_read_elsewhere(small_mlas):
    """The Conv's output anchored, a gradient anchor (an offset), a graph output or read by
    another node: the pair runs apart (MLAS's Conv without Relu, then the Relu)."""
    model = conv_relu_model()
    feeds = feeds_for(model)
    graph = lower(model)
    assert fused_types(graph, ["y", "c"]) == ["Conv", "Relu"]
    conv_mlas._SESSIONS.pop(mlas_key(X, None), None)
    got = evaluate(graph, feeds, ["y", "c"])
    assert mlas_key(X, None) in conv_mlas._SESSIONS  # MLAS's Conv alone
    assert float(jnp.min(got["c"])) < 0
    np.testing.assert_array_equal(got["y"], np.maximum(got["c"], 0))
    dc = jax.grad(lambda d: jnp.sum(graph.evaluate({}, feeds, ["y"], offsets={"c": d})["y"]))(
        jnp.zeros(X[:1] + W[:1] + X[2:], jnp.float32))
    np.testing.assert_array_equal(dc, (got["c"] > 0).astype(np.float32))
    shared = conv_relu_model(extra_reader=True)
    graph = lower(shared)
    assert fused_types(graph, ["y"]) == ["Conv", "Relu"]
    assert fused_types(graph, ["y", "z"]) == ["Conv", "Relu", "Add"]
    np.testing.assert_allclose(evaluate(graph, feeds)["y"], run_ort(shared, feeds), rtol=1e-4,
                               atol=1e-4)
    as_output = conv_relu_model()
    as_output.graph.output.append(helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT,
                                                               [2, 16, 12, 10]))
    assert fused_types(lower(as_output), ["y"]) == ["Conv", "Relu"]


@pytest.mark.parametrize("kind", ["small", "1x1"])
def test_conv_relu_other_lowerings_run_apart(kind):
    """A Conv that does not take the "mlas" lowering: the fused node declines and the Conv and
    Relu run as ever (XLA fuses the Relu itself), the same values as unfused."""
    shapes = {"small": (X, W), "1x1": ((1, 512, 7, 7), (512, 512, 1, 1))}[kind]
    assert lowering_for(*shapes, 1, np.float32) != "mlas"
    model = conv_relu_model(*shapes)
    feeds = feeds_for(model)
    graph = lower(model)
    assert fused_types(graph, ["y"]) == ["Conv+Relu"]  # decided when traced, by the lowering
    text = str(jax.make_jaxpr(lambda f: graph.evaluate({}, f, ["y"])["y"])(feeds))
    assert "buffer_callback" not in text
    np.testing.assert_array_equal(evaluate(graph, feeds)["y"],
                                  evaluate(apart(model), feeds)["y"])


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_half_convolutions_by_mlas_round_once_then_add_the_bias_in_half(small_mlas, bias, relu):
    """A float16 Conv taking "mlas" runs MLAS in float32 on the exactly converted operands and
    rounds its sum once to half; a bias is then added in half, as the XLA lowering adds it
    (the Relu fused into MLAS only without one). The gradient is the XLA lowering's, bit for
    bit."""
    if relu:
        model = conv_relu_model(dtype=np.float16)
        if not bias:
            model.graph.node[0].input.pop()
            model.graph.input.pop()
    else:
        model = conv_model(X, W, bias=bias, dtype=np.float16, pads=[1] * 4)
    feeds = feeds_for(model, np.float16)
    graph = lower(model)
    text = str(jax.make_jaxpr(lambda f: graph.evaluate({}, f, ["y"])["y"])(feeds))
    assert "buffer_callback" in text
    got = np.asarray(evaluate(graph, feeds)["y"])
    assert got.dtype == np.float16
    plain = conv_model(X, W, pads=[1] * 4)
    want = run_ort(plain, {"x": feeds["x"].astype(np.float32),
                           "w": feeds["w"].astype(np.float32)}).astype(np.float16)
    if bias:
        want = want + feeds["b"].reshape(-1, 1, 1)
    if relu:
        want = np.maximum(want, np.float16(0))
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3,
                               atol=2e-3)  # each rounding's last bit, summed in any order

    def gradient(graph):
        return jax.jit(jax.grad(lambda x: graph.evaluate(
            {}, {**feeds, "x": x}, ["y"])["y"].astype(jnp.float32).sum()))(feeds["x"])

    if not relu:  # the Relu's gradient reads the output, whose last bits may differ
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(conv_mlas, "available", lambda: False)
            xla = lower(model)
        np.testing.assert_array_equal(np.asarray(gradient(graph)), np.asarray(gradient(xla)))


def test_a_half_conv_relu_in_an_inference_session_is_one_mlas_call(small_mlas):
    """In an inference session that delegates segments to onnxruntime, a float16 segment
    XLA computes (it holds a Sigmoid, which the lowering computes with roundings of its own)
    computes its Conv and Relu as any other pair: one MLAS call with its Relu (no pass over
    the output after it), the values the pair's apart."""
    import popart_kit as pk

    model = conv_relu_model(dtype=np.float16)
    model.graph.node[0].input.pop()  # no bias: the Relu joins MLAS's call
    model.graph.input.pop()
    model.graph.node.append(helper.make_node("Sigmoid", ["y"], ["s"]))
    model.graph.output.append(helper.make_tensor_value_info(
        "s", TensorProto.FLOAT16, [X[0], W[0], *X[2:]]))
    feeds = feeds_for(model, np.float16)
    key = (X, W, False, (1, 1), ((1, 1), (1, 1)), (1, 1), 1, "Relu", "float16")
    conv_mlas._SESSIONS.pop(key, None)
    sess = pk.InferenceSession(model, pk.SessionConfig(
        mode="inference", batches_per_step=1, device={"target": "offline"}),
        anchors={"y": "All", "s": "All"}, backend="xla")
    got = sess.run(feeds)
    assert sess.runtime.graph.delegation is not None and sess.runtime._direct is None
    assert key in conv_mlas._SESSIONS  # MLAS's Relu ran
    want = evaluate(apart(model), feeds, ("y", "s"))
    for name in ("y", "s"):
        np.testing.assert_array_equal(got[name], np.asarray(want[name]))
