"""The drop-in's training semantics PopART's sessions have: a weight's anchor after its update,
the optimizer's compound scalars as anchors (compoundscalarhelper.hpp's formulas) and the
optimizer state of a checkpoint (modelToHost's Accl___/Accl1___/Step___ initializers) taken up
by the next session."""

from __future__ import annotations

import numpy as np
import pytest

import popart_kit.popart as popart

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")


def _model() -> tuple[popart.Builder, str, str, str]:
    """loss = sum(x * w): every micro-batch's gradient is x."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.array([1.0, -2.0], np.float32))
    loss = b.aiGraphcore.identityloss([b.aiOnnx.mul([x, w])], popart.ReductionType.Sum)
    return b, x, w, loss


def _session(model, loss, optimizer, anchors, bps=1, acc=1):
    opts = popart.SessionOptions()
    if acc > 1:  # the mean of the A micro-batches' gradients (Post: PopART's default)
        opts.enableGradientAccumulation, opts.accumulationFactor = True, acc
        opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
    sess = popart.TrainingSession(fnModel=model, dataFlow=popart.DataFlow(bps, anchors),
                                  loss=loss, optimizer=optimizer, userOptions=opts,
                                  deviceInfo=popart.DeviceManager().createCpuDevice())
    sess.prepareDevice()
    sess.weightsFromHost()
    return sess


def _run(sess, feed):
    anchors = sess.initAnchorArrays()
    sess.run(popart.PyStepIO(feed, anchors))
    return anchors


def test_weight_anchor_is_the_weight_after_the_update():
    b, x, w, loss = _model()
    sess = _session(b.getModelProto(), loss, popart.ConstSGD(0.5),
                    {w: popart.AnchorReturnType("All")}, bps=2)
    got = _run(sess, {x: np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)})[w]
    # w - 0.5 x after each micro-batch's update (irlowering.cpp: copied after the VarUpdate)
    np.testing.assert_allclose(got, [[0.5, -3.0], [-1.0, -5.0]])


@pytest.mark.parametrize("momentum, separate", [(0.0, False), (0.5, False), (0.5, True)])
def test_compound_scalars_are_anchors(momentum, separate):
    b, x, w, loss = _model()
    lr, wd, ls, dm, vs, acc = 0.3, 0.1, 4.0, 0.2, 2.0, 2
    values = {"defaultLearningRate": (lr, False), "defaultWeightDecay": (wd, False),
              "lossScaling": (ls, False), "defaultDampening": (dm, False)}
    if momentum:
        values.update(defaultMomentum=(momentum, False), defaultVelocityScaling=(vs, False))
    if separate:  # SGD2 (compoundscalarhelper.hpp): Post mean divides the dampening by A
        want = {"scaledLearningRate2": lr / vs, "scaledMomentum2": momentum,
                "scaledWeightDecay1": (1 - dm) * wd * vs,
                "dampeningScaleFactor2": (1 - dm) * vs / (ls * acc)}
    elif momentum:
        want = {"scaledLearningRate1": lr / vs, "scaledMomentum1": momentum,
                "scaledWeightDecay1": (1 - dm) * wd * vs,
                "dampeningScaleFactor1": (1 - dm) * vs / (ls * acc)}
    else:  # Post mean accumulation divides the learning rate by A
        want = {"scaledLearningRate0": lr * (1 - dm) / (ls * acc),
                "weightDecayScaleFactor0": 1 - lr * (1 - dm) * wd}
    names = {f"{k}___default___FLOAT": v for k, v in want.items()}
    mode = popart.SGDAccumulatorAndMomentum.Separate if separate else \
        popart.SGDAccumulatorAndMomentum.Combined
    sess = _session(b.getModelProto(), loss, popart.SGD(values, accumulatorAndMomentum=mode),
                    {n: popart.AnchorReturnType("Final") for n in names}, acc=acc)
    got = _run(sess, {x: np.ones((acc, 2), np.float32)})
    for name, value in names.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("optimizer", [
    lambda: popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, False)}),
    lambda: popart.Adam({"defaultLearningRate": (0.1, False)})])
def test_a_checkpoint_s_optimizer_state_is_taken_up(optimizer, tmp_path):
    b, x, w, loss = _model()
    feeds = [{x: np.array(v, np.float32)} for v in ([1.0, 2.0], [-3.0, 0.5])]
    straight = _session(b.getModelProto(), loss, optimizer(), {})
    for feed in feeds:
        _run(straight, feed)
    first = _session(b.getModelProto(), loss, optimizer(), {})
    _run(first, feeds[0])
    first.modelToHost(str(tmp_path / "checkpoint.onnx"))
    again = _session(str(tmp_path / "checkpoint.onnx"), loss, optimizer(), {})
    state = again._optimizer_tensors()
    assert state and all(np.any(v != 0) for v in state.values())  # not restarted from zero
    _run(again, feeds[1])
    np.testing.assert_array_equal(again._weights()[w], straight._weights()[w])
    for name, value in straight._optimizer_tensors().items():
        np.testing.assert_array_equal(again._optimizer_tensors()[name], value, err_msg=name)


def test_pipelined_sessions_return_the_run_s_constant_anchors():
    """The loss scale and the compound scalars, which no stage computes, in a session the
    pipeline executor runs; a new learning rate shows in the next run's anchor."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 2]))
    h = x
    for stage in range(2):
        w = b.addInitializedInputTensor(np.eye(2, dtype=np.float32))
        h = b.aiOnnx.matmul([h, w])
        b.virtualGraph(h, stage)
    loss = b.aiGraphcore.l1loss([h], 0.1)
    b.virtualGraph(loss, 1)
    opts = popart.SessionOptions()
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    opts.enablePipelining, opts.enableGradientAccumulation, opts.accumulationFactor = \
        True, True, 4
    lr, ls = "scaledLearningRate0___default___FLOAT", "lossScaling_FLOAT"
    sess = popart.TrainingSession(
        fnModel=b.getModelProto(), dataFlow=popart.DataFlow(1, [lr, ls]), loss=loss,
        optimizer=popart.SGD({"defaultLearningRate": (1.0, False), "lossScaling": (2.0, False)}),
        userOptions=opts, deviceInfo=popart.DeviceManager().createCpuDevice())
    assert sess._kit.runtime.pipeline is not None
    sess.prepareDevice()
    sess.weightsFromHost()
    feed = {x: np.ones((4, 2, 2), np.float32)}
    np.testing.assert_allclose(_run(sess, feed)[lr], 0.5)  # lr / ls (Sum: no factor)
    sess.updateOptimizerFromHost(popart.SGD({"defaultLearningRate": (0.5, False),
                                             "lossScaling": (2.0, False)}))
    got = _run(sess, feed)
    np.testing.assert_allclose(got[lr], 0.25)
    np.testing.assert_allclose(got[ls], 2.0)
