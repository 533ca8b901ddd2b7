"""What popart_kit.popart needs from the kit's runtime: gradient anchors
(``Gradient___<tensor>`` per micro-batch) and the optimizer state
(``pk.TrainingSession.optimizer_state()``), which modelToHost stores under PopART's reserved
names."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from models import W0, data, options, regression

import popart_kit.popart as popart

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")


def session_with(anchors, optimizer, bps=2, acc=2, reps=2, micro=2):
    model, x, t, w, y, loss = regression(micro)
    names = {"x": x, "w": w, "y": y, "loss": loss}
    flow = popart.DataFlow(bps, {popart.reservedGradientPrefix() + names[n]:
                                 popart.AnchorReturnType("All") for n in anchors})
    session = popart.TrainingSession(model, flow, loss, optimizer,
                                     popart.DeviceManager().acquireAvailableDevice(reps),
                                     userOptions=options(reps, acc))
    session.prepareDevice()
    session.weightsFromHost()
    return session, names


def test_gradient_anchors_per_micro_batch():
    bps, acc, reps, micro = 2, 2, 2, 2
    session, n = session_with(["x", "w", "y", "loss"],
                              popart.SGD({"defaultLearningRate": (1e-9, False)}))
    anchors = session.initAnchorArrays()
    g = popart.reservedGradientPrefix()
    assert anchors[g + n["w"]].shape == (bps, acc, reps, 4, 3)
    assert anchors[g + n["x"]].shape == (bps, acc, reps, micro, 4)
    xs, ts = data(bps, acc, reps, micro)
    session.run(popart.PyStepIO({n["x"]: xs, "t": ts}, anchors))
    d = xs @ W0 - ts                                   # weights barely move (lr 1e-9)
    np.testing.assert_allclose(anchors[g + n["y"]], 2 * d / d[0, 0, 0].size, rtol=1e-3)
    np.testing.assert_allclose(anchors[g + n["x"]], 2 * d @ W0.T / d[0, 0, 0].size, rtol=1e-3)
    expected_w = np.einsum("barmi,barmo->bario", xs, 2 * d / d[0, 0, 0].size)
    np.testing.assert_allclose(anchors[g + n["w"]], expected_w, rtol=1e-3)
    np.testing.assert_allclose(anchors[g + n["loss"]], 1.0)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_model_to_host_holds_optimizer_state(tmp_path, kind):
    optimizer = (popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, False)})
                 if kind == "sgd" else popart.Adam({"defaultLearningRate": (0.01, False)}))
    session, n = session_with([], optimizer, bps=1, acc=1, reps=1)
    xs, ts = data(1, 1, 1, 2)
    session.run(popart.PyStepIO({n["x"]: xs, "t": ts}, session.initAnchorArrays()))
    path = str(tmp_path / "m.onnx")
    session.modelToHost(path)
    names = {i.name for i in onnx.load(path).graph.initializer}
    w = n["w"]
    expected = ({popart.reservedAcclPrefix() + w} if kind == "sgd" else
                {popart.reservedAccl1Prefix() + w, popart.reservedAccl2Prefix() + w,
                 popart.reservedStepPrefix() + w})
    assert expected <= names
