"""Half precision on the xla backend: models made FLOAT16 as PopART users build them, partials
in float32 or float16, and the settings the xla backend cannot honour named once."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import onnx
import pytest

import popart_kit as pk
from popart_kit._runtime.xla import runtime
from popart_kit._runtime.xla.lowering import lower
from popart_kit._runtime.xla.ops import partials

RNG = np.random.default_rng(5)
W1 = (RNG.standard_normal((6, 8)) / 3).astype(np.float32)
W2 = (RNG.standard_normal((8, 3)) / 3).astype(np.float32)


def classifier(micro=8):
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [micro, 6]), debugContext="x")
    label = b.addInputTensor(pk.TensorInfo("INT32", [micro]), debugContext="label")
    h = b.aiOnnx.relu([b.aiOnnx.matmul([x, b.addInitializedInputTensor(W1, "w1")])])
    scaled = b.aiOnnx.mul([h, b.aiOnnx.constant(np.full((1,), 0.5, np.float32))])
    probs = b.aiOnnx.softmax([b.aiOnnx.matmul([scaled, b.addInitializedInputTensor(W2, "w2")])],
                             axis=1)
    loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)
    return b.getModelProto(), loss


def test_to_half_makes_every_float_tensor_float16_and_keeps_integers():
    model, _ = classifier()
    half = pk.to_half(model)
    onnx.checker.check_model(half, full_check=True)
    graph = half.graph
    assert {t.name: t.data_type for t in graph.initializer} == {
        "w1": onnx.TensorProto.FLOAT16, "w2": onnx.TensorProto.FLOAT16}
    types = {v.name: v.type.tensor_type.elem_type for v in graph.input}
    assert types["x"] == onnx.TensorProto.FLOAT16 and types["label"] == onnx.TensorProto.INT32
    constants = [a.t for n in graph.node for a in n.attribute if a.type == a.TENSOR]
    assert constants and all(t.data_type == onnx.TensorProto.FLOAT16 for t in constants)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(graph.initializer[0]),
                                  W1.astype(np.float16))


def test_a_half_model_trains_with_loss_scaling_close_to_its_float_twin():
    model, loss = classifier()
    cfg = pk.SessionConfig(mode="training", batches_per_step=4, device={"target": "offline"},
                           precision={"partials_type": "float"})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8, 6)).astype(np.float32)
    y = rng.integers(0, 3, (4, 8)).astype(np.int32)
    full = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(0.1), backend="xla")
    half = pk.TrainingSession(pk.to_half(model), cfg, loss=loss,
                              optimizer=pk.SGD(0.1, loss_scaling=128.0), backend="xla")
    full.run({"x": x, "label": y})
    half.run({"x": x.astype(np.float16), "label": y})
    for name, value in full.weights().items():
        assert half.weights()[name].dtype == np.float16
        np.testing.assert_allclose(half.weights()[name].astype(np.float32), value, atol=3e-3)


@pytest.mark.parametrize("kind, accumulator", [("float", "float32"), ("half", "float16"),
                                               (None, None)])
def test_partials_choose_how_half_products_accumulate(kind, accumulator):
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT16", [2, 64]))
    w = b.addInitializedInputTensor(np.ones((64, 3), np.float16))
    y = b.aiOnnx.matmul([x, w])
    graph = lower(b.getModelProto())
    value = np.ones((2, 64), np.float16)
    with partials(kind):
        text = str(jax.make_jaxpr(lambda v: graph.evaluate({}, {x: v}, [y]))(value))
        result = jax.eval_shape(lambda v: graph.evaluate({}, {x: v}, [y]), value)[y]
    if accumulator is None:
        assert "preferred_element_type=float32" not in text
    else:
        assert f"preferred_element_type={accumulator}" in text
    assert result.dtype == np.float16  # the product keeps its inputs' type


def test_stochastic_rounding_is_named_once_on_xla(monkeypatch):
    monkeypatch.setattr(runtime, "_WARNED", set())
    model, loss = classifier()
    cfg = pk.SessionConfig(mode="inference", device={"target": "offline"},
                           precision={"stochastic_rounding": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            pk.InferenceSession(model, cfg, anchors={loss: "All"}, backend="xla")
    named = [w for w in caught if "precision.stochastic_rounding" in str(w.message)]
    assert len(named) == 1 and named[0].filename == __file__


def test_a_popart_program_is_told_of_stochastic_rounding_in_popart_s_option_name(monkeypatch):
    import popart_kit.popart as popart

    monkeypatch.setattr(runtime, "_WARNED", set())
    model, loss = classifier()
    opts = popart.SessionOptions()
    opts.enableStochasticRounding = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        popart.InferenceSession(model, popart.DataFlow(1, [loss]),
                                popart.DeviceManager().createCpuDevice(), userOptions=opts)
    texts = [str(w.message) for w in caught if "K-xla-stochastic-rounding" in str(w.message)]
    assert len(texts) == 1 and texts[0].startswith("SessionOptions.enableStochasticRounding")
    assert "precision." not in texts[0]
