"""Resize and Upsample on the xla backend (popart_kit/_runtime/xla/ops_resize.py), computed as
PopART computes them: against onnxruntime where PopART and ONNX agree (nearest in every
nearest_mode, linear, cubic; scales and sizes; 1-D to 4-D; up and down), against numpy
formulas read from PopART's resize.cpp / resizex.cpp where PopART differs (the "pytorch"
nearest mode and opset 10's defaults, float32 output sizes, align_corners' unrounded length,
cubic_coeff_a ignored, ResizeGrad), the gradients, and what PopART refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import popart_kit as pk
import popart_kit.popart as popart
from popart_kit._model.checks import model_problems
from popart_kit._runtime.xla.lowering import UnsupportedModel, lower, unsupported

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")
ort.set_default_logger_severity(3)

RNG = np.random.default_rng(11)
F32 = np.float32


def resize_model(shape, opset=13, scales=None, sizes=None, op="Resize", dtype=np.float32,
                 omitted=False, **attrs) -> onnx.ModelProto:
    """One Resize (or Upsample) of input x; scales / sizes as initializers (scales empty
    beside sizes, or "" where ``omitted`` or from opset 13)."""
    inits, inputs = [], ["x"]

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        inputs.append(name)

    if op == "Upsample" and opset < 9:
        attrs["scales"] = [float(s) for s in scales]
    elif op == "Upsample" or opset == 10:
        const("scales", np.asarray(scales, F32))
    else:
        const("roi", np.zeros(0, F32))
        if scales is not None:
            const("scales", np.asarray(scales, F32))
        elif opset < 13 and not omitted:
            const("scales", np.zeros(0, F32))
        else:
            inputs.append("")
        if sizes is not None:
            const("sizes", np.asarray(sizes, np.int64))
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", elem, list(shape))],
                              [helper.make_tensor_value_info("y", elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def ours(model, x):
    graph = lower(model)
    return np.asarray(graph.evaluate({}, {"x": x}, ["y"])["y"])


def onnxruntime(model, x):
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def data(*shape):
    return RNG.random(shape).astype(F32)


def out_size(n, s):
    return int(np.floor(F32(n) * F32(s)))  # resize.cpp setup: floor in float32


# -- where PopART and ONNX agree: onnxruntime is the oracle --------------------------------------

# (shape, scales): for align_corners and pytorch_half_pixel PopART uses the unrounded
# in * scale as the output length, so these cases keep it whole (ONNX uses the rounded one)
AGREE = [((6,), (2.0,)), ((5, 6), (2.4, 0.5)), ((2, 3, 4), (2.0, 1.0, 0.75)),
         ((1, 2, 4, 6), (1.0, 1.0, 0.5, 2.5))]
NEAREST = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
TRANSFORMS = ["half_pixel", "pytorch_half_pixel", "asymmetric", "align_corners"]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("nearest", NEAREST)
def test_nearest_agrees_with_onnxruntime(nearest, transform):
    for shape, scales in AGREE:
        x = data(*shape)
        model = resize_model(shape, 13, scales, nearest_mode=nearest,
                             coordinate_transformation_mode=transform)
        np.testing.assert_array_equal(ours(model, x), onnxruntime(model, x),
                                      err_msg=f"{shape} x {scales}")


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shape, scales", [((4, 6), (0.5, 1.5)), ((2, 4, 6), (1.5, 0.5, 2.0)),
                                           ((1, 2, 4, 3), (1.0, 1.0, 0.75, 3.0))])
def test_linear_agrees_with_onnxruntime(shape, scales, transform):
    x = data(*shape)
    model = resize_model(shape, 13, scales, mode="linear",
                         coordinate_transformation_mode=transform)
    np.testing.assert_allclose(ours(model, x), onnxruntime(model, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shape, scales", [((5, 6), (2.4, 0.5)),
                                           ((1, 1, 4, 3), (1.0, 1.0, 1.5, 3.0))])
def test_cubic_agrees_with_onnxruntime(shape, scales, transform):
    x = data(*shape)
    model = resize_model(shape, 11, scales, mode="cubic",
                         coordinate_transformation_mode=transform)
    np.testing.assert_allclose(ours(model, x), onnxruntime(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [11, 19])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_sizes_agree_with_onnxruntime(opset, mode):
    for shape, sizes in [((1, 8), (1, 3)), ((4, 4), (9, 5)), ((1, 2, 3, 5), (1, 2, 6, 2))]:
        x = data(*shape)
        model = resize_model(shape, opset, sizes=sizes, mode=mode)
        got = ours(model, x)
        assert got.shape == tuple(sizes)
        np.testing.assert_allclose(got, onnxruntime(model, x), rtol=1e-5, atol=1e-6)


def test_opset_18_axes_agree_with_onnxruntime():
    x = data(2, 3, 4, 6)
    for given in ({"scales": (2.0, 0.5)}, {"sizes": (8, 3)}):
        model = resize_model(x.shape, 18, axes=[-2, 3], mode="linear", **given)
        np.testing.assert_allclose(ours(model, x), onnxruntime(model, x), rtol=1e-5)


@pytest.mark.parametrize("opset", [7, 9])
def test_upsample_agrees_with_onnxruntime(opset):
    for shape, scales in [((1, 1, 2, 3), (1.0, 1.0, 2.0, 3.0)), ((3, 2), (2.5, 1.5)),
                          ((4,), (3.0,))]:
        x = data(*shape)
        model = resize_model(shape, opset, scales, op="Upsample")
        np.testing.assert_array_equal(ours(model, x), onnxruntime(model, x))


def test_nearest_keeps_integer_and_half_tensors():
    for dtype in (np.int32, np.uint8, np.float16):
        x = (RNG.random((3, 4)) * 100).astype(dtype)
        model = resize_model(x.shape, 13, (2.0, 0.5), dtype=dtype)
        got = ours(model, x)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, onnxruntime(model, x))


# -- where PopART differs from ONNX: numpy formulas from PopART's source ------------------------

def test_opset_10_defaults_to_the_pytorch_nearest_mode():
    """Resize-10: nearest_mode 'pytorch' (index floor(i / scale)), where onnxruntime's
    Resize-10 rounds up when downsampling."""
    x = data(1, 1, 6)
    model = resize_model(x.shape, 10, (1.0, 1.0, 0.51))
    index = np.floor(np.arange(3, dtype=F32) / F32(0.51)).astype(int)
    np.testing.assert_array_equal(ours(model, x), x[..., index])
    assert not np.array_equal(ours(model, x), onnxruntime(model, x))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_pytorch_nearest_mode_ignores_the_transform_and_same_size_dimensions(transform):
    x = data(2, 5, 3)
    model = resize_model(x.shape, 11, (1.12, 2.3, 0.5), nearest_mode="pytorch",
                         coordinate_transformation_mode=transform)
    rows = np.floor(np.arange(11, dtype=F32) / F32(2.3)).astype(int)
    # dimension 0 keeps its size (floor(2 * 1.12) = 2): left as it is
    np.testing.assert_array_equal(ours(model, x), x[:, rows][:, :, [0]])


def test_same_size_dimension_still_moves_in_other_modes():
    """A scale other than 1 that keeps the size still resamples (PopART checks the scale);
    onnxruntime copies such a dimension."""
    x = np.arange(8, dtype=F32)
    model = resize_model((8,), 11, (1.12,), nearest_mode="floor",
                         coordinate_transformation_mode="asymmetric")
    np.testing.assert_array_equal(ours(model, x), [0, 0, 1, 2, 3, 4, 5, 6])


def test_align_corners_uses_the_unrounded_output_length():
    x = data(5)
    model = resize_model((5,), 11, (2.3,), mode="linear",
                         coordinate_transformation_mode="align_corners")
    coords = np.arange(11, dtype=F32) * F32(4) / (F32(5) * F32(2.3) - F32(1))
    low = np.floor(coords).astype(int)
    high = np.minimum(np.ceil(coords).astype(int), 4)
    frac = coords - np.floor(coords)
    np.testing.assert_allclose(ours(model, x), x[low] * (1 - frac) + x[high] * frac,
                               rtol=1e-6)


def test_opset_10_linear_uses_half_pixel():
    x = data(4)
    model = resize_model((4,), 10, (2.5,), mode="linear")
    coords = np.maximum((np.arange(10, dtype=F32) + F32(0.5)) / F32(2.5) - F32(0.5), 0)
    low, frac = np.floor(coords).astype(int), coords - np.floor(coords)
    high = np.minimum(low + 1, 3)
    np.testing.assert_allclose(ours(model, x), x[low] * (1 - frac) + x[high] * frac,
                               rtol=1e-6)


def test_output_sizes_are_rounded_in_float32():
    """sizes become scales float(size) / in, and the size floor(in * scale) in float32: 7 to
    31 gives 30 in PopART; 6 x 5/6 gives 5 (ONNX's double arithmetic says 4)."""
    x = data(7)
    assert ours(resize_model((7,), 11, sizes=(31,)), x).shape == (out_size(7, F32(31) / 7),)
    assert out_size(7, F32(31) / 7) == 30
    y = data(6)
    assert ours(resize_model((6,), 11, (5 / 6,)), y).shape == (5,)


def test_cubic_coeff_a_is_ignored():
    x = data(4, 5)
    given = resize_model(x.shape, 11, (2.0, 1.5), mode="cubic", cubic_coeff_a=-0.5)
    default = resize_model(x.shape, 11, (2.0, 1.5), mode="cubic")
    np.testing.assert_array_equal(ours(given, x), ours(default, x))
    np.testing.assert_allclose(ours(given, x), onnxruntime(default, x), rtol=1e-5, atol=1e-6)


# -- gradients: PopART's ResizeGrad -------------------------------------------------------------

def grad(model, x, weight):
    graph = lower(model)  # jitted: one compilation, where eager gradients compile every step
    return np.asarray(jax.jit(jax.grad(
        lambda v: jnp.sum(graph.evaluate({}, {"x": v}, ["y"])["y"] * weight)))(jnp.asarray(x)))


@pytest.mark.parametrize("opset, scales, attrs", [
    (10, (2.5, 0.5), {}),
    (11, (3.0, 1 / 3), {"nearest_mode": "round_prefer_ceil"}),  # forward picks 3i+1
    (11, (0.3, 2.3), {"coordinate_transformation_mode": "align_corners"}),
])
def test_nearest_gradient_is_popart_resize_grad(opset, scales, attrs):
    """resizex.cpp: output gradient i adds into input floor(i * (1 / scale)) along each
    dimension whose size changed, whatever the forward's nearest mode."""
    x = data(6, 4)
    model = resize_model(x.shape, opset, scales, **attrs)
    out = tuple(out_size(n, s) for n, s in zip(x.shape, scales, strict=True))
    weight = data(*out)
    expected = weight
    for axis, (n, s) in enumerate(zip(x.shape, scales, strict=True)):
        index = np.floor(np.arange(out[axis], dtype=F32) * (F32(1) / F32(s))).astype(int)
        summed = np.zeros(expected.shape[:axis] + (n,) + expected.shape[axis + 1:], F32)
        np.add.at(np.moveaxis(summed, axis, 0), index, np.moveaxis(expected, axis, 0))
        expected = summed
    np.testing.assert_allclose(grad(model, x, weight), expected, rtol=1e-6)


def cubic_matrix(n, scale):
    """onnxruntime's half_pixel cubic along one dimension, as an (out, n) matrix."""
    model = resize_model((1, n), 11, (1.0, scale), mode="cubic")
    return np.stack([onnxruntime(model, np.eye(n, dtype=F32)[i:i + 1])[0]
                     for i in range(n)], axis=1)


@pytest.mark.parametrize("transform", ["half_pixel", "align_corners"])
def test_cubic_gradient_is_the_half_pixel_transpose(transform):
    """The grad op takes PopART's default transform (half_pixel), whatever the forward's."""
    x = data(4, 5)
    model = resize_model(x.shape, 11, (2.0, 1.5), mode="cubic",
                         coordinate_transformation_mode=transform)
    weight = data(8, 7)
    expected = cubic_matrix(4, 2.0).T @ weight @ cubic_matrix(5, 1.5)
    np.testing.assert_allclose(grad(model, x, weight), expected, rtol=1e-5, atol=1e-6)


def test_linear_is_refused_when_trained():
    model = resize_model((4,), 11, (2.0,), mode="linear")
    with pytest.raises(UnsupportedModel, match="not supported when training") as info:
        grad(model, data(4), data(8))
    assert info.value.popart_text == "Resize mode 'linear' is not supported when training."


def test_a_training_session_learns_through_resize():
    """popart_kit.popart: the weight gradient through a nearest Resize, and linear refused."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 1, 2, 3]))
    w = b.addInitializedInputTensor(np.ones((1, 1, 2, 3), F32))
    scales = b.aiOnnx.constant(np.array([1, 1, 2, 1.5], F32))
    y = b.aiOnnx.resize([b.aiOnnx.mul([x, w]), scales])
    loss = b.aiGraphcore.l1loss([y], 1.0, reduction=popart.ReductionType.Sum)
    grad_w = popart.reservedGradientPrefix() + w
    session = popart.TrainingSession(
        fnModel=b.getModelProto(), loss=loss, optimizer=popart.ConstSGD(0.01),
        dataFlow=popart.DataFlow(1, {y: popart.AnchorReturnType("All"),
                                     grad_w: popart.AnchorReturnType("All")}),
        deviceInfo=popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    value = data(1, 1, 2, 3) + 0.5
    session.run(popart.PyStepIO({x: value}, anchors))
    assert anchors[y].shape == (1, 1, 4, 4)
    # opset 10's pytorch mode: row r goes to outputs 2r, 2r+1; column c to the outputs j with
    # floor(j / 1.5) = c; an l1 loss gives each copy gradient 1, so dw = x * copies
    counts = np.zeros(3)
    np.add.at(counts, np.floor(np.arange(4, dtype=F32) * (F32(1) / F32(1.5))).astype(int), 1)
    np.testing.assert_allclose(anchors[grad_w][0, 0], value[0, 0] * 2 * counts, rtol=1e-6)
    # linear has no ResizeGrad in PopART: refused when the session is prepared, in its words
    if "mode" in b.getAllNodeAttributeNames({y}):
        b.removeNodeAttribute("mode", {y})
    b.addNodeAttribute("mode", "linear", {y})
    session = popart.TrainingSession(
        fnModel=b.getModelProto(), loss=loss, optimizer=popart.ConstSGD(0.01),
        dataFlow=popart.DataFlow(1, {y: popart.AnchorReturnType("All")}),
        deviceInfo=popart.DeviceManager().createCpuDevice())
    with pytest.raises(popart.popart_exception,
                       match="^Resize mode 'linear' is not supported when training.$"):
        session.prepareDevice()


# -- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("opset, scales, attrs, words", [
    (11, (2.0,), {"mode": "area"}, "Unrecognised resize mode area"),
    (11, (2.0,), {"nearest_mode": "nearest"}, "Unrecognised resize nearest mode nearest"),
    (13, (2.0,), {"coordinate_transformation_mode": "tf_half_pixel_for_nn"},
     "Unrecognised resize coordinate transformation mode tf_half_pixel_for_nn"),
    (19, (2.0,), {"coordinate_transformation_mode": "half_pixel_symmetric"},
     "Unrecognised resize coordinate transformation mode half_pixel_symmetric"),
    (11, (2.0,), {"coordinate_transformation_mode": "tf_crop_and_resize", "mode": "linear"},
     "Unsupported coordinate transformation mode"),
    (11, (2.0,), {"exclude_outside": 1}, "Unsupported value '1' for attribute 'exclude_outside'"),
    (18, (2.0,), {"antialias": 1}, "antialias"),
    (18, (2.0,), {"keep_aspect_ratio_policy": "not_larger"}, "keep_aspect_ratio_policy"),
])
def test_refusals(opset, scales, attrs, words):
    problems = unsupported(resize_model((4,), opset, scales, **attrs))
    assert len(problems) == 1 and words in problems[0], problems


def test_refusals_of_inputs():
    both = resize_model((4, 6), 11, (1.0, 2.0), (1, 2))
    assert "Only one of these tensors should be present" in unsupported(both)[0]
    with pytest.raises(UnsupportedModel, match=r"scales \(1\) must match the number of "
                                               r"dimensions of the input \(2\)"):
        ours(resize_model((4, 6), 11, (2.0,)), data(4, 6))
    with pytest.raises(UnsupportedModel, match="linear Resize of a int32 tensor"):
        ours(resize_model((4,), 11, (2.0,), mode="linear", dtype=np.int32),
             np.arange(4, dtype=np.int32))
    assert "only supports the mode 'nearest'" in unsupported(
        resize_model((4,), 9, (2.0,), op="Upsample", mode="linear"))[0]
    assert "Upsample is deprecated" in unsupported(resize_model((4,), 10, (2.0,), op="Upsample"))[0]


def test_drop_in_raises_popart_words():
    b = popart.Builder(opsets={"ai.onnx": 11, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 6]))
    roi = b.aiOnnxOpset11.constant(np.zeros(0, F32), False)
    scales = b.aiOnnxOpset11.constant(np.array([1.0, 2.0], np.float16), False)
    sizes = b.aiOnnxOpset11.constant(np.array([1, 2], np.int64), False)
    y = b.aiOnnxOpset11.resize([x, roi, scales, sizes])
    with pytest.raises(popart.popart_exception) as info:
        popart.InferenceSession(fnModel=b.getModelProto(),
                                dataFlow=popart.DataFlow(1, {y: popart.AnchorReturnType("All")}),
                                deviceInfo=popart.DeviceManager().createCpuDevice())
    assert info.value.args[0].startswith("Resize op has inputs for `sizes` and `scales`. Only "
                                         "one of these tensors should be present.")


# -- the forms PopART's builder and model checks take -------------------------------------------

def test_builder_takes_popart_resize_forms():
    """Omitted scales beside sizes at opset 11, float16 scales, int32 sizes: PopART's builder
    takes them; ONNX's inference alone does not."""
    b = pk.Builder(opsets={"ai.onnx": 11, "ai.graphcore": 1})
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [1, 1, 2, 2]))
    roi = b.aiOnnxOpset11.constant(np.zeros(0, F32), False)
    sizes = b.aiOnnxOpset11.constant(np.array([1, 1, 4, 6], np.int32), False)
    half = b.aiOnnxOpset11.constant(np.array([1, 1, 2, 3], np.float16), False)
    assert b.getTensorShape(b.aiOnnxOpset11.resize([x, roi, "", sizes])) == [1, 1, 4, 6]
    assert b.getTensorShape(b.aiOnnxOpset11.resize([x, roi, half])) == [1, 1, 4, 6]
    b10 = pk.Builder()
    x10 = b10.addInputTensor(pk.TensorInfo("FLOAT", [1, 1, 2, 2]))
    half10 = b10.aiOnnx.constant(np.array([1, 1, 2, 3], np.float16))
    assert b10.getTensorShape(b10.aiOnnx.resize([x10, half10])) == [1, 1, 4, 6]


def shaped(model, dims):
    model.graph.output[0].type.tensor_type.shape.dim.extend(
        [onnx.TensorShapeProto.Dimension(dim_value=n) for n in dims])
    return model


def test_model_checks_take_attributes_popart_reads():
    model = shaped(resize_model((1, 1, 4), 10, (1, 1, 2.0), nearest_mode="floor",
                                coordinate_transformation_mode="asymmetric"), (1, 1, 8))
    assert [p.rule for p in model_problems(model)] == []
    assert len(model.graph.node[0].attribute) == 2  # the model itself is left as it was
    model.graph.node[0].attribute.append(helper.make_attribute("cubic_coeff_a", -0.5))
    assert [p.rule for p in model_problems(model)] == ["K-model-attribute-unknown"]
    omitted = shaped(resize_model((1, 1, 4), 11, sizes=(1, 1, 8), omitted=True), (1, 1, 8))
    assert [p.rule for p in model_problems(omitted)] == []
    assert list(omitted.graph.node[0].input) == ["x", "roi", "", "sizes"]
