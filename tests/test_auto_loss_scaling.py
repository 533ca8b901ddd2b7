"""PopART's automatic loss scaling on the xla backend, through popart_kit.popart.

Oracles: PopART's rule (willow/src/popx/op/lossscaleupdatex.cpp, transforms/
automaticlossscaling.cpp) run in numpy on gradients worked out by hand: for y = x @ w and
loss = sum(y), w's gradient is ls x (column sums of x) in every column, whatever w is, so the
whole sequence of loss scales follows from the inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import popart_kit.popart as popart
from popart_kit._runtime.xla import loss_scaling as als

EDGE_LOCATION, THRESHOLD = 0.5, 0.2


def _rule(factor, upper, lower, threshold=THRESHOLD):
    """PopART's LossScaleUpdate in numpy: halve if upper > t / (1 - t) x lower, else double."""
    return factor / 2 if upper > threshold / (1 - threshold) * lower else factor * 2


def _options(period=1, accumulation=1, replicas=1, method=None, track=None,
             threshold=THRESHOLD, edge=EDGE_LOCATION):
    opts = popart.SessionOptions()
    s = opts.automaticLossScalingSettings
    s.enabled, s.binEdgeLocation, s.thresholdUpperCountProportion = True, edge, threshold
    s.updatePeriod = period
    if method is not None:
        s.gradientTensorTrackingMethod = method
    if track is not None:
        s.toTrackTensors = track
    if accumulation > 1:
        opts.enableGradientAccumulation, opts.accumulationFactor = True, accumulation
    if replicas > 1:
        opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, replicas
    return opts


def _linear(micro=2, stages=False):
    """y = x @ w (fp16), loss = sum(y); ``stages``: on two pipeline stages."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [micro, 3]), "x")
    w = b.addInitializedInputTensor(np.ones((3, 4), np.float16), "w")
    y = b.aiOnnx.matmul([x, w])
    loss = b.aiGraphcore.identityloss([y], reduction=popart.ReductionType.Sum)
    if stages:
        for stage, tensor in enumerate((y, loss)):
            b.virtualGraph(tensor, stage)
            b.pipelineStage(tensor, stage)
    return b.getModelProto(), x, w, loss


def _device(replicas=1):
    return (popart.DeviceManager().acquireAvailableDevice(replicas) if replicas > 1
            else popart.DeviceManager().createCpuDevice())


def _session(proto, loss, opts, anchors, ls=10.0, bps=6, replicas=1, const=False):
    session = popart.TrainingSession(
        fnModel=proto, dataFlow=popart.DataFlow(bps, anchors), loss=loss,
        optimizer=popart.SGD({"defaultLearningRate": (0.01, False),
                              "lossScaling": (ls, const)}),
        deviceInfo=_device(replicas), userOptions=opts)
    session.prepareDevice()
    session.weightsFromHost()
    return session


def _expected_scales(colsums, ls, period, threshold=THRESHOLD):
    """PopART's finalLossScale of each update: ``colsums`` [updates, k, 3] - the column sums
    of x of the k micro-batches (and replicas) of each update."""
    factor, out = np.float16(1), []
    edge = np.float32(65504 * EDGE_LOCATION)
    for update, sums in enumerate(colsums):
        scale = np.float16(ls) * factor
        out.append(scale)
        if update % period == 0:
            with np.errstate(over="ignore"):  # fp16 overflows to Inf, counted upper
                grads = np.repeat((scale * sums.astype(np.float16))[..., None], 4, axis=-1)
            upper = int(np.sum(np.abs(grads.astype(np.float32)) >= edge))
            factor = np.float16(_rule(factor, upper, grads.size - upper, threshold))
    return np.array(out, np.float16)


def test_rule_matches_popart_formula():
    """histogram, next_factor and counted against PopART's formulas in numpy."""
    rng = np.random.default_rng(0)
    x = np.clip(rng.standard_normal((5, 7)) * 3e4, -6e4, 6e4).astype(np.float16)
    x[0, 0], x[0, 1] = np.inf, -np.inf
    edge = np.float32(65504 * 0.25)
    counts = np.asarray(als.histogram([x, x[:2]], edge))
    upper = np.sum(np.abs(x) >= edge) + np.sum(np.abs(x[:2]) >= edge)
    assert counts.tolist() == [x.size + 14 - upper, upper]
    # the level is the tensor's dtype's: below fp16's range it is 0, and zeros count upper
    assert np.asarray(als.histogram([np.zeros(6, np.float16)], 65504 * 1e-20)).tolist() == \
        [0, 6]
    assert np.asarray(als.histogram([np.zeros(6, np.float32)], 65504 * 1e-20)).tolist() == \
        [6, 0]
    for t in (0.0, 0.2, 0.5, 0.99):
        settings = als.Settings(threshold=t)
        for lower, up in ((10, 0), (10, 3), (3, 10), (0, 0), (5, 5)):
            got = als.next_factor(np.float16(8), np.array([lower, up], np.float32),
                                  settings.ratio)
            assert float(got) == _rule(8.0, up, lower, t)
    assert [bool(als.counted(u, 3)) for u in range(7)] == [True, False, False, True, False,
                                                           False, True]


def test_final_loss_scale_follows_the_gradients():
    """Both directions: the scale doubles while the gradients sit low, and halves once more
    than 20% of them reach the bin edge, step after step (finalLossScale per micro-batch), and
    the factor carries over to the next run."""
    proto, x, _, loss = _linear()
    session = _session(proto, loss, _options(), [als.FINAL_LOSS_SCALE, "lossScaling_FLOAT16"])
    anchors = session.initAnchorArrays()
    data = np.zeros((6, 2, 3), np.float16)
    data[:, 0] = [1, 100, 1000]  # w's gradient: ls x [1, 100, 1000] in each column
    for run in range(2):
        session.run(popart.PyStepIO({x: data}, anchors))
        expected = _expected_scales(data.sum(axis=1, keepdims=True).repeat(2, 0)[:12], 10.0, 1)
        assert np.array_equal(anchors[als.FINAL_LOSS_SCALE], expected[6 * run:6 * run + 6])
        assert np.array_equal(anchors["lossScaling_FLOAT16"], np.full(6, 10, np.float16))
    assert expected.tolist()[:5] == [10, 20, 40, 20, 40]  # up, up, down, up, ...


@pytest.mark.parametrize("period", [2])
def test_counts_summed_over_micro_batches_and_replicas(period):
    """The counts of an update are summed over its accumulated micro-batches and every
    replica before the rule is applied; with updatePeriod P the factor moves on every P-th
    update only."""
    proto, x, _, loss = _linear()
    bps, acc, reps = 6, 2, 2
    session = _session(proto, loss, _options(period, acc, reps, threshold=0.3),
                       [als.FINAL_LOSS_SCALE], bps=bps, replicas=reps)
    anchors = session.initAnchorArrays()
    data = np.zeros((bps, acc, reps, 2, 3), np.float16)
    data[:, 0, 0, 0] = [1000, 1000, 1000]  # one micro-batch of one replica has large gradients
    data[:, 1, 1, 0] = [1, 1, 1]
    session.run(popart.PyStepIO({x: data}, anchors))
    sums = data.sum(axis=3).reshape(bps, acc * reps, 3)
    expected = _expected_scales(sums, 10.0, period, 0.3)
    # the data tells pooling apart: the first replica's or micro-batch's counts alone differ
    assert not np.array_equal(expected, _expected_scales(sums[:, :1], 10.0, period, 0.3))
    got = anchors[als.FINAL_LOSS_SCALE].reshape(bps, acc, reps)
    assert np.array_equal(got, np.broadcast_to(expected[:, None, None], got.shape))


def test_pipelined_with_accumulation_runs_as_popart_counts():
    """PopART takes automatic loss scaling with pipelining when it accumulates (it flushes
    before each update): the stages run one after the other, the same loss scales."""
    proto, x, _, loss = _linear(stages=True)
    opts = _options(accumulation=3)
    opts.enablePipelining, opts.virtualGraphMode = True, popart.VirtualGraphMode.Manual
    with pytest.warns(UserWarning, match="automatic loss scaling is on"):
        session = popart.TrainingSession(
            fnModel=proto, dataFlow=popart.DataFlow(4, [als.FINAL_LOSS_SCALE]), loss=loss,
            optimizer=popart.SGD({"lossScaling": (10.0, False)}), deviceInfo=_device(2),
            userOptions=opts)
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    data = np.zeros((4, 3, 2, 3), np.float16)
    data[:, 0, 0] = [1, 100, 1000]
    session.run(popart.PyStepIO({x: data}, anchors))
    expected = _expected_scales(data.sum(axis=2), 10.0, 1)
    assert np.array_equal(anchors[als.FINAL_LOSS_SCALE], np.repeat(expected, 3).reshape(4, 3))


def _mlp():
    """x @ w1 -> relu -> @ w2 -> loss (fp16): h = relu input, r = relu output."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [2, 3]), "x")
    rng = np.random.default_rng(1)
    w1 = b.addInitializedInputTensor(rng.standard_normal((3, 5)).astype(np.float16), "w1")
    w2 = b.addInitializedInputTensor(rng.standard_normal((5, 4)).astype(np.float16), "w2")
    h = b.aiOnnx.matmul([x, w1], "h")
    r = b.aiOnnx.relu([h], "r")
    y = b.aiOnnx.matmul([r, w2])
    loss = b.aiGraphcore.identityloss([y], reduction=popart.ReductionType.Sum)
    return b.getModelProto(), x, loss, h, r


def _convnet():
    """conv(x, w1) -> relu -> flatten -> @ w2 -> loss (fp16)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [2, 1, 4, 4]), "x")
    rng = np.random.default_rng(1)
    w1 = b.addInitializedInputTensor(rng.standard_normal((2, 1, 3, 3)).astype(np.float16), "w1")
    w2 = b.addInitializedInputTensor(rng.standard_normal((8, 3)).astype(np.float16), "w2")
    r = b.aiOnnx.relu([b.aiOnnx.conv([x, w1])])
    y = b.aiOnnx.matmul([b.aiOnnx.flatten([r]), w2])
    loss = b.aiGraphcore.identityloss([y], reduction=popart.ReductionType.Sum)
    return b.getModelProto(), x, loss


M = popart.GradientTensorTrackingMethod


@pytest.mark.parametrize("method, track, elements", [
    (M.ConvAndMatmulGradients, None, 15 + 10 + 20),      # dw1, dr, dw2 (x has no gradient)
    (M.AllNonViewChangingGradientTensors, None, 15 + 10 + 20 + 10),  # and relu's dh
    (M.GradientsOfUserSpecifiedTensors, ["r", "w1"], 10 + 15),
])
def test_tracked_gradients_and_statistics_accumulator(method, track, elements):
    """Accum___autoLossScaleStats: per micro-batch of an accumulated update, the counts so
    far; every element of every tracked gradient counted once per micro-batch."""
    proto, x, loss, h, r = _mlp()
    track = None if track is None else [r if t == "r" else t for t in track]
    session = _session(proto, loss, _options(accumulation=3, method=method, track=track),
                       [als.STATISTICS], bps=2)
    anchors = session.initAnchorArrays()
    data = np.random.default_rng(2).standard_normal((2, 3, 2, 3)).astype(np.float16)
    session.run(popart.PyStepIO({x: data}, anchors))
    totals = anchors[als.STATISTICS].reshape(2, 3, 2).sum(axis=-1)
    assert np.array_equal(totals, np.array([[1, 2, 3]] * 2) * elements)


def test_weights_identical_to_a_run_without_automatic_loss_scaling():
    """Powers of two in the loss scale, divided out by the optimizer: the same fp16 weights
    as the same session without automatic loss scaling, bit for bit, across an optimizer
    change, with gradient accumulation; the loss scale did move."""
    proto, x, loss = _convnet()
    data = np.random.default_rng(3).standard_normal((2, 2, 2, 1, 4, 4)).astype(np.float16)
    weights = []
    for enabled in (False, True):
        opts = _options(accumulation=2)
        opts.automaticLossScalingSettings.enabled = enabled
        session = popart.TrainingSession(
            fnModel=proto, dataFlow=popart.DataFlow(2, [als.FINAL_LOSS_SCALE] if enabled
                                                    else []), loss=loss,
            optimizer=popart.SGD({"defaultLearningRate": (0.05, False),
                                  "defaultMomentum": (0.5, False), "lossScaling": (10, False)}),
            deviceInfo=_device(), userOptions=opts)
        session.prepareDevice()
        session.weightsFromHost()
        anchors = session.initAnchorArrays()
        session.run(popart.PyStepIO({x: data}, anchors))
        session.updateOptimizerFromHost(popart.SGD({
            "defaultLearningRate": (0.02, False), "defaultMomentum": (0.5, False),
            "lossScaling": (0.5, False)}))
        session.run(popart.PyStepIO({x: data}, anchors))
        if enabled:
            assert len(np.unique(anchors[als.FINAL_LOSS_SCALE])) > 1
        out = {"w1": np.zeros((2, 1, 3, 3), np.float16), "w2": np.zeros((8, 3), np.float16)}
        session.weightsToHost()
        session.readWeights(popart.PyWeightsIO(out))
        weights.append(out)
    for name in ("w1", "w2"):
        assert np.array_equal(weights[0][name], weights[1][name])


def _refused(opts, mode="training", const=False, model=None, ipus=1, optimizer=None):
    proto, _, _, loss = model or _linear()
    with pytest.raises(popart.popart_exception) as err:
        if mode == "inference":
            popart.InferenceSession(proto, popart.DataFlow(1, [loss]), _device(),
                                    userOptions=opts)
        else:
            popart.TrainingSession(
                fnModel=proto, dataFlow=popart.DataFlow(1, []), loss=loss,
                optimizer=optimizer or popart.SGD({"lossScaling": (2, const)}),
                deviceInfo=_device(ipus),
                userOptions=opts)
    return str(err.value)


def _fp32_linear(dtype="FLOAT", stages=False):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo(dtype, [2, 3]), "x")
    w = b.addInitializedInputTensor(np.ones((3, 4), {"FLOAT": np.float32}.get(dtype, np.float16)),
                                    "w")
    with b.virtualGraph(0), b.pipelineStage(0):
        y = b.aiOnnx.matmul([x, w])
    with b.virtualGraph(1 if stages else 0), b.pipelineStage(1 if stages else 0):
        loss = b.aiGraphcore.identityloss([y])
    return b.getModelProto(), x, w, loss


def test_popart_refusals():
    """PopART's errors, with its texts (the transform's checks, in its order)."""
    pre = "[AutomaticLossScale transform] "
    assert _refused(_options(), "inference") == pre + "Only compatible when doing training"
    assert _refused(_options(), const=True) == \
        pre + "The optimizer must have non-const loss scaling"
    assert _refused(_options(), optimizer=popart.Adam(
        {"lossScaling": (2, False)}, scaled_optimizer_state=True)) == \
        "scaledOptimizerState and automaticLossScaling are not compatible."
    assert _refused(_options(), model=_fp32_linear()) == \
        pre + "No tracked gradient tensors of type fp16 were found."
    assert _refused(_options(edge=1.5)).startswith(pre + "Out of range value for "
                                                   "'binEdgeLocation'. The current value is 1.5")
    assert _refused(_options(threshold=-0.1)).startswith(
        "Out of range value for 'thresholdUpperCountProportion'.")
    assert _refused(_options(track=["w"])).startswith(pre + "toTrackTensors has been set")
    assert "do not exist in the model" in _refused(
        _options(method=M.GradientsOfUserSpecifiedTensors, track=["nope"]))
    assert "An empty list" in _refused(_options(method=M.GradientsOfUserSpecifiedTensors,
                                                track=[]))
    opts = _options()
    opts.enablePipelining, opts.virtualGraphMode = True, popart.VirtualGraphMode.Manual
    assert _refused(opts, model=_fp32_linear("FLOAT16"), ipus=2).endswith(
        "'enableGradientAccumulation' SessionOption is set to 'false'")


def _counters(path):
    """{kind: value} of a checkpoint's automatic loss scaling variables: the update factor
    and the INT32 counters (read from int32_data, where PopART writes them)."""
    import onnx
    out = {}
    for t in onnx.load(path).graph.initializer:
        if t.name == "lossScaleUpdateFactor":
            out["factor"] = float(onnx.numpy_helper.to_array(t))
        elif t.name.endswith("_counter"):
            assert t.data_type == onnx.TensorProto.INT32 and len(t.int32_data) == 1
            kind = "histogram" if "(ai.graphcore.Histogram:1)" in t.name else "update"
            out.setdefault(kind, set()).add(t.int32_data[0])
    return out


@pytest.mark.parametrize("acc", [1, 2])
def test_a_checkpoint_carries_the_factor_and_the_period_s_phase(acc, tmp_path):
    """modelToHost writes PopART's lossScaleUpdateFactor and, with updatePeriod P > 1, the
    counters of its Histogram ops (-1, then one step per micro-batch modulo A x P) and of its
    LossScaleUpdate (one per update modulo P); a session made from the checkpoint goes on as
    the uninterrupted session does (same loss scales, same weights)."""
    proto, x, w, loss = _linear()
    period, runs = 2, 4
    data = np.zeros((runs, acc, 2, 3), np.float16)
    data[:, :, 0] = [1, 100, 1000]
    feeds = [{x: d if acc > 1 else d[0]} for d in data]
    straight = _session(proto, loss, _options(period, acc), [als.FINAL_LOSS_SCALE], bps=1)
    straight.modelToHost(str(tmp_path / "start.onnx"))
    assert _counters(tmp_path / "start.onnx") == {"factor": 1.0, "histogram": {-1},
                                                   "update": {-1}}
    path = proto
    for run, feed in enumerate(feeds):
        anchors = straight.initAnchorArrays()
        straight.run(popart.PyStepIO(feed, anchors))
        again = _session(path, loss, _options(period, acc), [als.FINAL_LOSS_SCALE], bps=1)
        resumed = again.initAnchorArrays()
        again.run(popart.PyStepIO(feed, resumed))
        assert np.array_equal(resumed[als.FINAL_LOSS_SCALE], anchors[als.FINAL_LOSS_SCALE])
        path = str(tmp_path / f"{run}.onnx")
        again.modelToHost(path)
        found = _counters(path)
        assert found["histogram"] == {((run + 1) * acc - 1) % (acc * period)}
        assert found["update"] == {run % period}
        straight.modelToHost(str(tmp_path / "straight.onnx"))
        assert found["factor"] == _counters(tmp_path / "straight.onnx")["factor"]
    assert found["factor"] != 1.0  # the factor moved
    weights = {w: np.zeros((3, 4), np.float16)}
    straight.readWeights(popart.PyWeightsIO(weights))
    mine = {w: np.zeros((3, 4), np.float16)}
    again.readWeights(popart.PyWeightsIO(mine))
    np.testing.assert_array_equal(mine[w], weights[w])
