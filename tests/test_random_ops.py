"""Random operators on the xla backend (ops_random, state.RandomSeed): Dropout in training,
ShapedDropout, RandomNormal/Uniform(Like), reproducible from the session's seed, with each
micro-batch, step and replica drawing its own values, and PopART's setRandomSeed rules.

The generator is not Poplar's, so the oracles are the operators' definitions: the dropped
fraction, the 1/(1 - ratio) scaling, the moments of the draws, and numpy's weight update made
with the anchored mask."""

from __future__ import annotations

import itertools
import logging
import warnings

import numpy as np
import onnx
import pytest

import popart_kit as pk
from popart_kit._base.names import GRADIENT_PREFIX
from popart_kit._runtime.xla.lowering import UnsupportedModel, lower
from popart_kit._runtime.xla.ops_random import random_scope
from popart_kit._runtime.xla.state import RandomSeed

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")
OFFLINE = {"target": "offline"}


def dropout_model(n: int, ratio: float, w: np.ndarray | None = None):
    """loss = sum(dropout(x * w)); returns the model and the names of x, w, y, mask, loss."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [n]), debugContext="x")
    w = b.addInitializedInputTensor(np.ones(n, np.float32) if w is None else w, "w")
    y, mask = b.aiOnnx.dropout([b.aiOnnx.mul([x, w])], 2, ratio=ratio)
    loss = b.aiOnnx.reducesum([y], keepdims=0)
    return b.getModelProto(), x, w, y, mask, loss


def training(model, loss, anchors, bps=1, acc=1, replicas=1, lr=0.1, seed=None):
    cfg = pk.SessionConfig(mode="training", batches_per_step=bps, device=OFFLINE,
                           accumulation={"factor": acc, "reduction": "sum"},
                           replication={"local_factor": replicas})
    sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(learning_rate=lr),
                              anchors={a: "All" for a in anchors}, backend="xla")
    if seed is not None:
        sess.set_random_seed(seed)
    return sess


def test_training_dropout_drops_the_ratio_and_scales_the_rest():
    n, ratio = 4000, 0.3
    model, x, _, y, mask, loss = dropout_model(n, ratio)
    sess = training(model, loss, [y, mask], seed=1)
    data = (1 + np.random.default_rng(0).random(n)).astype(np.float32)
    out = sess.run({x: data})
    kept = out[mask]
    assert kept.dtype == np.bool_ and kept.shape == (n,)
    assert abs((~kept).mean() - ratio) < 0.03  # 4 standard deviations of the fraction
    np.testing.assert_allclose(out[y][kept], data[kept] / (1 - ratio), rtol=1e-6)
    assert (out[y][~kept] == 0).all()


def test_the_same_seed_gives_the_same_runs_and_another_seed_others():
    model, x, _, y, mask, loss = dropout_model(64, 0.5)
    feed = {x: np.ones(64, np.float32)}
    a, b, c = (training(model, loss, [y, mask], seed=s) for s in (7, 7, 8))
    first, second = [a.run(feed)[mask] for _ in range(2)]
    assert np.array_equal(first, b.run(feed)[mask]) and np.array_equal(second,
                                                                       b.run(feed)[mask])
    assert not np.array_equal(first, second)  # each step draws its own mask
    assert not np.array_equal(first, c.run(feed)[mask])
    a.set_random_seed(7)  # seeding again repeats the runs
    assert np.array_equal(first, a.run(feed)[mask])
    with pytest.raises(pk.ConfigTypeError, match="below 2\\*\\*64") as info:
        a.set_random_seed(-1)
    assert info.value.rule == "K-xla-dropout"


def test_every_micro_batch_step_and_replica_draws_its_own_mask():
    model, x, _, y, mask, loss = dropout_model(32, 0.5)
    sess = training(model, loss, [mask], bps=2, acc=2, replicas=2, seed=3)
    masks = sess.run({x: np.ones(sess.io.input_shape(x), np.float32)})[mask]
    assert masks.shape == (2, 2, 2, 32)  # [steps, micro-batches, replicas, n]
    flat = masks.reshape(8, 32)
    for i, j in itertools.combinations(range(8), 2):
        assert not np.array_equal(flat[i], flat[j]), (i, j)


def test_the_gradient_is_masked_by_the_forward_mask():
    """Two micro-batches' gradients, each masked by its own anchored mask, make numpy's
    update: w - lr * sum_m x_m * mask_m / (1 - ratio)."""
    n, ratio, lr = 16, 0.25, 0.1
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(n).astype(np.float32)
    model, x, w, y, mask, loss = dropout_model(n, ratio, w0)
    sess = training(model, loss, [y, mask], acc=2, lr=lr, seed=9)
    data = rng.standard_normal((2, n)).astype(np.float32)
    out = sess.run({x: data})
    masks = out[mask].astype(np.float32)
    np.testing.assert_allclose(out[y], data * w0 * masks / (1 - ratio), rtol=1e-6)
    want = w0 - lr * (data * masks / (1 - ratio)).sum(0)
    np.testing.assert_allclose(sess.weights()[w], want, rtol=1e-5, atol=1e-6)


def test_inference_runs_dropout_as_the_identity_and_draws_random_operators():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 6]))
    y, mask = b.aiOnnx.dropout([x], 2, ratio=0.5)
    shaped = b.aiGraphcore.shapeddropout([x], shape=[4, 1], ratio=0.5)
    normal = b.aiOnnx.randomnormal(shape=[20000], dtype=onnx.TensorProto.FLOAT16, mean=1.0,
                                   scale=2.0)
    uniform = b.aiOnnx.randomuniform(shape=[20000], low=-1.0, high=3.0)
    normal_like = b.aiOnnx.randomnormallike([x])
    uniform_like = b.aiOnnx.randomuniformlike([x], dtype=onnx.TensorProto.FLOAT16)
    outs = [y, mask, shaped, normal, uniform, normal_like, uniform_like]
    cfg = pk.SessionConfig(mode="inference", batches_per_step=2, device=OFFLINE)
    sess = pk.InferenceSession(b.getModelProto(), cfg, anchors={t: "All" for t in outs},
                               backend="xla")
    sess.set_random_seed(4)
    data = np.random.default_rng(1).standard_normal((2, 4, 6)).astype(np.float32)
    out = sess.run({x: data})
    np.testing.assert_array_equal(out[y], data)
    np.testing.assert_array_equal(out[shaped], data)
    assert out[mask].dtype == np.bool_ and out[mask].all()
    draws = out[normal].astype(np.float64)
    assert out[normal].dtype == np.float16 and draws.shape == (2, 20000)
    assert abs(draws.mean() - 1.0) < 0.05 and abs(draws.std() - 2.0) < 0.05
    u = out[uniform]
    assert u.dtype == np.float32 and u.shape == (2, 20000)
    assert u.min() >= -1.0 and u.max() < 3.0
    assert abs(u.mean() - 1.0) < 0.05 and abs(u.var() - 16 / 12) < 0.05
    assert out[normal_like].shape == (2, 4, 6) and out[normal_like].dtype == np.float32
    assert out[uniform_like].shape == (2, 4, 6) and out[uniform_like].dtype == np.float16
    for t in (normal, uniform, normal_like):  # each micro-batch its own draw
        assert not np.array_equal(out[t][0], out[t][1])
    assert not np.array_equal(out[normal], sess.run({x: data})[normal])  # and each run


def test_shaped_dropout_drops_whole_rows_in_training():
    rows, ratio = 400, 0.5
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [rows, 3]), debugContext="x")
    w = b.addInitializedInputTensor(np.ones((rows, 3), np.float32), "w")
    y = b.aiGraphcore.shapeddropout([b.aiOnnx.mul([x, w])], shape=[rows, 1], ratio=ratio)
    loss = b.aiOnnx.reducesum([y], keepdims=0)
    grad = GRADIENT_PREFIX + x
    sess = training(b.getModelProto(), loss, [y, grad], seed=2)
    out = sess.run({x: np.ones((rows, 3), np.float32)})
    kept = out[y][:, 0] != 0
    want = np.where(kept[:, None], np.float32(1 / (1 - ratio)), np.float32(0))
    np.testing.assert_array_equal(out[y], np.broadcast_to(want, (rows, 3)))
    np.testing.assert_array_equal(out[grad], out[y])  # d loss / dx = mask / (1 - ratio)
    assert abs((~kept).mean() - ratio) < 0.1


def test_a_pipelined_session_draws_what_the_unpipelined_one_draws():
    def model():
        b = pk.Builder()
        pb = pk.PipelineBuilder(b)
        x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 8]), debugContext="x")
        with pb.stage(0):
            h = b.aiOnnx.matmul([x, b.addInitializedInputTensor(np.eye(8, dtype=np.float32),
                                                                "w0")])
            h, m = b.aiOnnx.dropout([h], 2, ratio=0.5)
        with pb.stage(1):
            y = b.aiOnnx.matmul([h, b.addInitializedInputTensor(np.eye(8, dtype=np.float32),
                                                                "w1")])
            loss = b.aiOnnx.reducesumsquare([y], keepdims=0)
        return b.getModelProto(), x, m, loss

    results = []
    for pipelined in (False, True):
        proto, x, m, loss = model()
        cfg = pk.SessionConfig(mode="training", accumulation={"factor": 4},
                               ipus_per_replica=2, pipeline={"enabled": pipelined},
                               device=OFFLINE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sess = pk.TrainingSession(proto, cfg, loss=loss, optimizer=pk.SGD(0.01),
                                      anchors={m: "All"}, backend="xla")
        assert (sess.runtime.pipeline is not None) == pipelined
        sess.set_random_seed(5)
        results.append((sess.run({x: np.ones(sess.io.input_shape(x), np.float32)})[m],
                        sess.weights()))
    (m0, w0), (m1, w1) = results
    np.testing.assert_array_equal(m0, m1)
    assert not m0.all()
    for k in w0:
        np.testing.assert_allclose(w0[k], w1[k], rtol=1e-6)


@pytest.mark.parametrize("training_mode, session_trains, drops", [
    (True, False, True), (False, True, False), (None, True, True), (None, False, False)])
def test_from_opset_12_training_mode_decides_where_given(training_mode, session_trains, drops):
    """ONNX's Dropout-12 input training_mode, when given, says whether it drops; else the
    session does (PopART's rule)."""
    b = pk.Builder(opsets={"ai.onnx": 13, "ai.graphcore": 1})
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [256]))
    args = [x, b.aiOnnx.constant(np.array(0.5, np.float32))]
    if training_mode is not None:
        args.append(b.aiOnnx.constant(np.array(training_mode)))
    y, mask = b.aiOnnx.dropout(args, 2)
    graph = lower(b.getModelProto())
    with random_scope(np.array([1, 2], np.uint32), session_trains):
        out = graph.evaluate({}, {x: np.ones(256, np.float32)}, [y, mask])
    kept = np.asarray(out[mask])
    assert (not kept.all()) == drops
    scale = np.float32(2 if drops else 1)  # 1 / (1 - ratio) when dropping
    np.testing.assert_array_equal(out[y], np.where(kept, scale, np.float32(0)))


def test_the_seed_moves_on_per_step_and_replica_as_on_an_ipu():
    seed = RandomSeed(5 + (7 << 32))
    words = seed.words(3, 2, first_replica=2, global_replicas=4)
    assert words.dtype == np.uint32 and words.shape == (3, 2, 2)
    # step k (from 1) of global replica r: [lo + k * G + r, hi + k]
    np.testing.assert_array_equal(words[1, 1], [5 + 2 * 4 + 3, 7 + 2])
    assert len({tuple(w) for w in words.reshape(-1, 2)}) == 6
    later = seed.advanced(3)
    again = RandomSeed(later.current(4))  # getRandomSeed, then setRandomSeed of it
    np.testing.assert_array_equal(again.words(2, 2, 2, 4), later.words(2, 2, 2, 4))
    wrapped = RandomSeed(2**64 - 1).words(1, 1, 0, 1)  # the words wrap around
    np.testing.assert_array_equal(wrapped[0, 0], [0, 0])


@pytest.mark.parametrize("build, popart_text", [
    (lambda b: b.aiOnnx.randomnormal(shape=[4], seed=1.0),
     "ai.onnx.RandomNormal:1: Optional seed attribute is not supported. Use session::setRandomSeed "
     "instead."),
    (lambda b: b.aiOnnx.randomuniform(shape=[4], dtype=onnx.TensorProto.DOUBLE),
     "The data type DOUBLE is not supported in Poplar"),
    (lambda b: b.aiOnnx.dropout([b.addInputTensor(pk.TensorInfo("FLOAT", [4]))], 1,
                                ratio=1.0)[0],
     "ai.onnx.Dropout:10 ratio value 1 is not valid. Please use a value in the interval [0,1)"),
    (lambda b: b.aiGraphcore.shapeddropout([b.addInputTensor(pk.TensorInfo("FLOAT", [4, 3]))],
                                           shape=[2, 1]),
     "ShapedDropout: incompatible input tensor and dropout shape. ai.graphcore.ShapedDropout:1 "
     "is configured with "
     "shape [2 1] which is not broadcastable to the input tensor with shape [4 3]."),
])
def test_what_the_random_operators_refuse_in_popart_s_words(build, popart_text):
    b = pk.Builder()
    out = build(b)
    b.addOutputTensor(out)
    with pytest.raises(UnsupportedModel) as info:
        graph = lower(b.getModelProto())  # the shape is checked when the node is traced
        graph.evaluate({}, {n: np.zeros(s, d) for n, (s, d) in graph.inputs.items()}, [out])
    assert info.value.popart_text == popart_text and "Fix:" in str(info.value)


def test_popart_set_random_seed_rules(caplog):
    import popart_kit.popart as popart

    def session(random: bool):
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [8]))
        y = b.aiOnnx.dropout([x], 1, ratio=0.5)[0] if random else b.aiOnnx.relu([x])
        loss = b.aiGraphcore.identityloss([y])
        opts = popart.SessionOptions()
        opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, 2
        return popart.TrainingSession(
            fnModel=b.getModelProto(), loss=loss, optimizer=popart.ConstSGD(0.1),
            dataFlow=popart.DataFlow(1, {y: popart.AnchorReturnType("All")}),
            userOptions=opts, deviceInfo=popart.DeviceManager().acquireAvailableDevice(2)), x, y

    plain, _, _ = session(False)
    with caplog.at_level(logging.WARNING):
        plain.setRandomSeed(3)
        assert plain.getRandomSeed() == 0
    assert "has no random behaviour. Doing nothing." in caplog.text
    sess, x, y = session(True)
    with pytest.raises(popart.popart_exception, match="Devicex::prepare\\(\\) must be called "
                                                      "before Devicex::setRandomSeedFromHost"):
        sess.setRandomSeed(3)
    sess.prepareDevice()
    with pytest.raises(TypeError, match="uint64"):
        sess.setRandomSeed(-1)
    sess.setRandomSeed(3)
    sess.weightsFromHost()
    anchors = sess.initAnchorArrays()
    stepio = popart.PyStepIO({x: np.ones((2, 8), np.float32)}, anchors)
    sess.run(stepio)
    # one step on 2 replicas: the words [lo, hi] moved on by [2, 1], as GetRandomSeed does
    assert sess.getRandomSeed() == 3 + 2 + (1 << 32)
    again = sess.getRandomSeed()
    sess.run(stepio)
    second = anchors[y].copy()
    sess.setRandomSeed(again)  # continues the same sequence
    sess.run(stepio)
    np.testing.assert_array_equal(anchors[y], second)
