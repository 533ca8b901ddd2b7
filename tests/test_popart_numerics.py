"""PopART's own arithmetic where it departs from the ONNX formula or from autodiff (its op and
opx sources), held at the inputs where the difference shows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popart_kit.popart as popart
from popart_kit._runtime.xla.ops import _nll_log


def test_nll_clamps_the_log_and_its_gradient_as_popart_does():
    # nllx.cpp: loss -log(max(p, 1e-7)), gradient -1/max(p, 1e-10); float16 uses 6.104e-5
    p = jnp.array([0.0, 1e-12, 1e-8, 0.25], jnp.float32)
    np.testing.assert_allclose(_nll_log(p), np.log([1e-7, 1e-7, 1e-7, 0.25]), rtol=1e-6)
    grad = jax.vmap(jax.grad(_nll_log))(p)
    np.testing.assert_allclose(grad, [1e10, 1e10, 1e8, 4.0], rtol=1e-6)
    half = jnp.array([0.0, 0.5], jnp.float16)
    np.testing.assert_allclose(np.float32(_nll_log(half)[0]), np.log(6.104e-5), rtol=1e-3)
    assert np.isfinite(np.asarray(jax.vmap(jax.grad(_nll_log))(half), np.float32)).all()


def test_a_pipelined_nll_program_with_unit_normal_weights_trains_without_nan():
    """The shape of PopART's published pipelining example: two dense layers with N(0,1)
    weights, softmax, nllloss, two stages; saturated softmax outputs make plain log(p) -inf."""
    rng = np.random.default_rng(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 32]))
    label = b.addInputTensor(popart.TensorInfo("INT32", [4]))
    with b.virtualGraph(0), b.pipelineStage(0):
        h = b.aiOnnx.relu([b.aiOnnx.matmul([x, b.addInitializedInputTensor(
            rng.standard_normal((32, 64)).astype(np.float32))])])
    with b.virtualGraph(1), b.pipelineStage(1):
        probs = b.aiOnnx.softmax([b.aiOnnx.matmul([h, b.addInitializedInputTensor(
            rng.standard_normal((64, 10)).astype(np.float32))])], axis=1)
        loss = b.aiGraphcore.nllloss([probs, label])
    opts = popart.SessionOptions()
    opts.enablePipelining = True
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    opts.enableGradientAccumulation = True
    opts.accumulationFactor = 4
    session = popart.TrainingSession(b.getModelProto(), popart.DataFlow(2, [loss]), loss,
                                     popart.SGD({"defaultLearningRate": (0.01, False)}),
                                     popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                                     userOptions=opts)
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    xs = (rng.standard_normal((2, 4, 4, 32)) * 4).astype(np.float32)
    labels = rng.integers(0, 10, (2, 4, 4)).astype(np.int32)
    losses = []
    for _ in range(3):
        session.run(popart.PyStepIO({x: xs, label: labels}, anchors))
        losses.append(anchors[loss].copy())
    assert all(np.isfinite(v).all() for v in losses)
    assert np.max(losses[0]) > 10   # saturated: some label's probability underflowed


def test_softmax_then_nll_sends_popart_s_direct_gradient_to_the_logits():
    """PopART's default pattern NlllWithSoftmaxGradDirect: d loss / d logits = p - onehot (scaled
    by the reduction), finite and non-zero where the label's probability underflows."""
    b = popart.Builder()
    logits = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    label = b.addInputTensor(popart.TensorInfo("INT32", [2]))
    w = b.addInitializedInputTensor(np.ones((2, 3), np.float32))
    scaled = b.aiOnnx.mul([logits, w])
    probs = b.aiOnnx.softmax([scaled], axis=1)
    loss = b.aiGraphcore.nllloss([probs, label], popart.ReductionType.Sum)
    grad = popart.reservedGradientPrefix() + scaled
    session = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss, grad, probs]),
                                     loss, popart.SGD({"defaultLearningRate": (0.0, False)}),
                                     popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    data = np.array([[200.0, 0.0, -200.0], [0.5, 1.0, -1.0]], np.float32)  # row 0 saturates
    labels = np.array([2, 1], np.int32)
    session.run(popart.PyStepIO({logits: data, label: labels}, anchors))
    expected = anchors[probs] - np.eye(3, dtype=np.float32)[labels]
    np.testing.assert_allclose(anchors[grad], expected, rtol=1e-6, atol=1e-7)
    assert anchors[grad][0, 2] == -1.0 and np.isclose(anchors[loss],
                                                      -np.log(1e-7) - np.log(anchors[probs][1, 1]))


def test_nll_refuses_labels_not_shaped_as_the_probabilities_rows_in_popart_s_words():
    b = popart.Builder()
    probs = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4, 3]))
    label = b.addInputTensor(popart.TensorInfo("INT32", [2, 5]))
    loss = b.aiGraphcore.nllloss([probs, label])
    with pytest.raises(popart.popart_exception) as refused:
        popart.TrainingSession(fnModel=b.getModelProto(), dataFlow=popart.DataFlow(1, [loss]),
                               loss=loss, optimizer=popart.ConstSGD(0.1),
                               deviceInfo=popart.DeviceManager().createCpuDevice())
    assert refused.value.args[0].startswith(  # nll.cpp
        "The label tensor (INT32   [2 5]) must have shape [2 4] to match all but the final "
        "dimension of the probabilities tensor (FLOAT   [2 4 3])")


def test_a_gradient_anchor_on_a_constant_gets_its_gradient_as_popart_gives_it():
    table = np.arange(9, dtype=np.float32).reshape(3, 3)
    b = popart.Builder()
    const = b.aiOnnx.constant(table)
    rows = b.aiOnnx.gather([const, b.aiOnnx.constant(np.array([0, 2, 2], np.int32))], 0)
    loss = b.aiGraphcore.identityloss([rows], reduction=popart.ReductionType.Sum)
    grad = popart.reservedGradientPrefix() + const
    session = popart.TrainingSession(fnModel=b.getModelProto(),
                                     dataFlow=popart.DataFlow(1, [rows, grad]), loss=loss,
                                     optimizer=popart.ConstSGD(0.1),
                                     deviceInfo=popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO({}, anchors))
    np.testing.assert_array_equal(anchors[rows], table[[0, 2, 2]])
    # not folded away: the gather's gradient, row 2 taken twice
    np.testing.assert_array_equal(anchors[grad], np.array([[1] * 3, [0] * 3, [2] * 3], np.float32))
