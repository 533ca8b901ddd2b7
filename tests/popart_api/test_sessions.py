"""PopART programs on popart_kit.popart, in the style of PopART's integration tests: anchor
return types under replication and accumulation, gradient accumulation against numpy,
pipelining against no pipelining, virtual graphs, weight I/O and stepio callbacks."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from models import W0, data, numpy_training, options, regression

import popart_kit.popart as popart

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")


def training(bps, acc, reps, optimizer, stages=0, anchors=None, micro=2):
    model, x, t, w, y, loss = regression(micro, stages)
    flow = popart.DataFlow(bps, anchors(x, y, loss) if anchors else {})
    device = popart.DeviceManager().acquireAvailableDevice(reps * (2 if stages else 1))
    session = popart.TrainingSession(fnModel=model, dataFlow=flow, loss=loss,
                                     optimizer=optimizer, deviceInfo=device,
                                     userOptions=options(reps, acc, pipelining=bool(stages)))
    session.prepareDevice()
    session.weightsFromHost()
    return session, x, t, w, y, loss


def read_weight(session, w):
    out = np.zeros(W0.shape, np.float32)
    session.weightsToHost()
    session.readWeights(popart.PyWeightsIO({w: out}))
    return out


def test_anchor_return_types_with_replication_and_accumulation():
    bps, acc, reps, micro = 4, 2, 2, 2
    art = {"All": popart.AnchorReturnType("All"), "EveryN": popart.AnchorReturnType("EveryN", 2),
           "Final": popart.AnchorReturnType("FINAL"), "Sum": popart.AnchorReturnType("sum")}
    results = {}
    for name, return_type in art.items():
        session, x, t, w, y, loss = training(
            bps, acc, reps, popart.SGD({"defaultLearningRate": (0.1, False)}),
            anchors=lambda x, y, loss, rt=return_type: {x: rt})
        anchors = session.initAnchorArrays()
        xs, ts = data(bps, acc, reps, micro)
        session.run(popart.PyStepIO({x: xs, t: ts}, anchors))
        results[name] = anchors[x]
    assert results["All"].shape == (bps, acc, reps, micro, 4)
    np.testing.assert_array_equal(results["All"], xs)
    # EveryN: micro-batches N-1, 2N-1, ... of the bps x A sequence, shape [bps/N, A, R, ...]
    assert results["EveryN"].shape == (bps // 2, acc, reps, micro, 4)
    flat = xs.reshape(bps * acc, reps, micro, 4)
    np.testing.assert_array_equal(results["EveryN"].reshape(-1, reps, micro, 4), flat[1::2])
    assert results["Final"].shape == (reps, micro, 4)
    np.testing.assert_array_equal(results["Final"], xs[-1, -1])
    assert results["Sum"].shape == (reps, micro, 4)
    np.testing.assert_allclose(results["Sum"], xs.sum(axis=(0, 1)), rtol=1e-5)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_gradient_accumulation_matches_numpy(kind):
    bps, acc, reps, micro, lr = 2, 3, 2, 2, 0.05
    optimizer = (popart.SGD({"defaultLearningRate": (lr, False)}) if kind == "sgd" else
                 popart.Adam({"defaultLearningRate": (lr, False)}))
    session, x, t, w, y, loss = training(
        bps, acc, reps, optimizer,
        anchors=lambda x, y, loss: {loss: popart.AnchorReturnType("All")})
    anchors = session.initAnchorArrays()
    xs, ts = data(bps, acc, reps, micro, seed=1)
    session.run(popart.PyStepIO({x: xs, t: ts}, anchors))
    assert anchors[loss].shape == (bps, acc, reps)
    expected = numpy_training(xs, ts, lr, kind)
    np.testing.assert_allclose(read_weight(session, w), expected, rtol=1e-4, atol=1e-5)
    # the loss of the first micro-batch of replica 0 is taken with the initial weights
    d = xs[0, 0, 0] @ W0 - ts[0, 0, 0]
    np.testing.assert_allclose(anchors[loss][0, 0, 0], np.mean(d * d), rtol=1e-5)


def test_pipelining_gives_the_weights_of_no_pipelining():
    bps, acc, micro = 2, 4, 2
    xs, ts = data(bps, acc, 1, micro, seed=2)
    weights = []
    for stages in (0, 2):
        session, x, t, w, y, loss = training(
            bps, acc, 1, popart.SGD({"defaultLearningRate": (0.1, False),
                                     "defaultMomentum": (0.9, False)}), stages=stages)
        session.run(popart.PyStepIO({x: xs, t: ts}, session.initAnchorArrays()))
        weights.append(read_weight(session, w))
    np.testing.assert_allclose(weights[1], weights[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(weights[0], W0)


def test_virtual_graphs_in_inference_match_one_ipu():
    micro = 3
    outputs = []
    for ipus in (1, 2):
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [micro, 4]), "x")
        w = b.addInitializedInputTensor(W0.copy(), "w")
        with b.virtualGraph(0):
            h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w])])
        with b.virtualGraph(ipus - 1):
            y = b.aiGraphcore.scale([h], 0.5)
        opts = popart.SessionOptions()
        opts.virtualGraphMode = popart.VirtualGraphMode.Manual
        session = popart.InferenceSession(
            b.getModelProto(), popart.DataFlow(2, [y]),
            popart.DeviceManager().createIpuModelDevice({"numIPUs": ipus}), userOptions=opts)
        session.prepareDevice()
        anchors = session.initAnchorArrays()
        xs = np.random.default_rng(4).standard_normal((2, micro, 4)).astype(np.float32)
        session.run(popart.PyStepIO({x: xs}, anchors))
        outputs.append(anchors[y])
    np.testing.assert_allclose(outputs[0], outputs[1])
    np.testing.assert_allclose(outputs[0], 0.5 * np.maximum(xs @ W0, 0), rtol=1e-5)


def test_weight_io_round_trip(tmp_path):
    session, x, t, w, y, loss = training(
        1, 1, 1, popart.SGD({"defaultLearningRate": (0.1, False)}),
        anchors=lambda x, y, loss: {y: popart.AnchorReturnType("All")})
    new = np.arange(12, dtype=np.float32).reshape(4, 3)
    session.writeWeights(popart.PyWeightsIO({w: new}))
    np.testing.assert_array_equal(read_weight(session, w), W0)  # not on the device yet
    session.weightsFromHost()
    np.testing.assert_array_equal(read_weight(session, w), new)
    anchors = session.initAnchorArrays()
    xs, ts = data(1, 1, 1, 2)
    session.run(popart.PyStepIO({x: xs, t: ts}, anchors))
    # the forward pass ran before the update
    np.testing.assert_allclose(anchors[y], (xs @ new)[0, 0, 0], rtol=1e-5)
    path = str(tmp_path / "model.onnx")
    session.modelToHost(path)
    saved = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}
    np.testing.assert_allclose(saved[w], read_weight(session, w))
    assert not np.allclose(saved[w], new)
    session.writeWeights(popart.PyWeightsIO({w: W0}))
    session.weightsFromHost()
    session.resetHostWeights(path)
    session.weightsFromHost()
    np.testing.assert_allclose(read_weight(session, w), saved[w])
    with pytest.raises(popart.popart_exception, match="not a weight"):
        session.writeWeights(popart.PyWeightsIO({"nope": new}))


def test_stepio_callbacks_are_asked_micro_batch_major_replica_minor():
    bps, reps, micro = 2, 2, 3
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [micro, 4]), "x")
    y = b.aiGraphcore.scale([x], 3.0)
    opts = options(reps)
    flow = popart.DataFlow(bps, {y: popart.AnchorReturnType("All")})
    session = popart.InferenceSession(b.getModelProto(), flow,
                                      popart.DeviceManager().createCpuDevice(), userOptions=opts)
    session.prepareDevice()
    xs = np.random.default_rng(5).standard_normal((bps, reps, micro, 4)).astype(np.float32)
    feed = iter(xs.reshape(bps * reps, micro, 4))
    outputs, calls = [], []

    def input_callback(name, prefetch):
        calls.append(("in", name))
        return next(feed)

    def output_callback(name):
        outputs.append(np.zeros((micro, 4), np.float32))
        return outputs[-1]

    session.run(popart.PyStepIOCallback(input_callback, lambda n: calls.append(("done", n)),
                                        output_callback, lambda n: None))
    assert calls == [("in", x), ("done", x)] * (bps * reps)
    np.testing.assert_allclose(np.stack(outputs), 3 * xs.reshape(bps * reps, micro, 4))
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO({x: xs}, anchors))
    np.testing.assert_allclose(anchors[y].reshape(-1, micro, 4), np.stack(outputs))


def test_stepio_errors_are_popart_errors():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]), "x")
    y = b.aiGraphcore.scale([x], 2.0)
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(2, [y]),
                                      popart.DeviceManager().createCpuDevice())
    anchors = session.initAnchorArrays()
    with pytest.raises(popart.popart_exception, match="Devicex::prepare\\(\\) must be called "
                                                      "before Devicex::run"):
        session.run(popart.PyStepIO({x: np.zeros(4, np.float32)}, anchors))
    session.prepareDevice()
    with pytest.raises(popart.popart_exception,
                       match="Unexpected number of input elements for Tensor x. Expected 4, "
                             "but received 2"):
        session.run(popart.PyStepIO({x: np.zeros(2, np.float32)}, anchors))
    with pytest.raises(popart.popart_exception, match="Type discrepancy for tensor x"):
        session.run(popart.PyStepIO({x: np.zeros(4, np.float64)}, anchors))
    with pytest.raises(popart.popart_exception, match="No tensor x provided"):
        session.run(popart.PyStepIO({}, anchors))
    session.run(popart.PyStepIO({x: np.arange(4, dtype=np.float32)}, anchors))
    np.testing.assert_allclose(anchors[y], 2 * np.arange(4).reshape(2, 2))
