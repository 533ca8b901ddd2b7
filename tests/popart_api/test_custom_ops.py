"""Builder.customOp: PopART's own ops by name, and a program's custom op run from the
computation registered for it (popart_kit.register_custom_op), with its gradient."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import onnx
import pytest

import popart_kit as pk
import popart_kit.popart as popart
from popart_kit._model.custom_ops import CUSTOM_OPS


@pytest.fixture
def registry():
    saved = dict(CUSTOM_OPS)
    yield
    CUSTOM_OPS.clear()
    CUSTOM_OPS.update(saved)


def _cpu():
    return popart.DeviceManager().createCpuDevice()


def test_a_custom_op_runs_its_registered_computation_and_gradient(registry):
    # a "scaled leaky relu" with an attribute; its gradient as the program's C++ grad op gives
    pk.register_custom_op(
        "com.acme", "ScaledLeakyRelu", 1,
        lambda x, alpha=0.1, scale=1.0: scale * jnp.where(x > 0, x, alpha * x),
        infer=lambda types, attrs: [types[0]],
        gradient=lambda xs, outs, gs, attrs: (
            gs[0] * attrs.get("scale", 1.0) * jnp.where(xs[0] > 0, 1.0, attrs["alpha"]),))
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    w = b.addInitializedInputTensor(np.ones((2, 3), np.float32))
    (y,) = b.customOp("ScaledLeakyRelu", 1, "com.acme", [b.aiOnnx.mul([x, w])],
                      {"alpha": 0.25, "scale": 2.0})
    assert b.getTensorShape(y) == [2, 3]   # typed by the registered infer
    model = onnx.load_from_string(b.getModelProto())
    assert ("com.acme", 1) in {(o.domain, o.version) for o in model.opset_import}
    loss = b.aiGraphcore.l1loss([y], 1.0, reduction=popart.ReductionType.Sum)
    grad = popart.reservedGradientPrefix() + x
    session = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [y, grad]), loss,
                                     popart.SGD({"defaultLearningRate": (0.0, False)}), _cpu())
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    data = np.array([[1.0, -2.0, 3.0], [-0.5, 0.5, -1.0]], np.float32)
    session.run(popart.PyStepIO({x: data}, anchors))
    np.testing.assert_allclose(anchors[y], 2.0 * np.where(data > 0, data, 0.25 * data))
    slope = 2.0 * np.where(data > 0, 1.0, 0.25)
    np.testing.assert_allclose(anchors[grad], np.sign(anchors[y]) * slope, rtol=1e-6)


def test_popart_s_own_ops_by_name_and_an_unregistered_op_refused_with_the_fix(registry):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4]))
    (relu,) = b.customOp("Relu", 6, "ai.onnx", [x], {})
    (scaled,) = b.customOp("Scale", 1, "ai.graphcore", [x], {"scale": 3.0})
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [relu, scaled]),
                                      _cpu())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    data = np.array([-1.0, 0.0, 2.0, -3.0], np.float32)
    session.run(popart.PyStepIO({x: data}, anchors))
    np.testing.assert_allclose(anchors[relu], np.maximum(data, 0))
    np.testing.assert_allclose(anchors[scaled], 3 * data)
    (mystery,) = b.customOp("Mystery", 2, "com.acme", [x], {})
    assert b.getTensorDtypeString(x) == "float32"  # the unregistered op's output is untyped
    with pytest.raises(popart.popart_exception, match="register_custom_op"):
        popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [mystery]), _cpu())
    with pytest.raises(ValueError, match="domain 'ai.onnx' is ONNX's or PopART's own"):
        pk.register_custom_op("ai.onnx", "Relu", 1, lambda x: x)
