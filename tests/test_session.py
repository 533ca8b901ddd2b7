"""Inference sessions on the xla backend: PopART's anchors, replicas, weights and checks."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from pydantic import ValidationError

import popart_kit as pk

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")


def config(bps=1, local=1, **kw) -> pk.SessionConfig:
    return pk.SessionConfig(mode="inference", batches_per_step=bps,
                            replication={"local_factor": local}, **kw)


def identity_model(shape=(2, 3)) -> bytes:
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", list(shape)))
    y = b.aiOnnx.identity([x])
    b.addOutputTensor(y)
    return b.getModelProto()


def mlp(pipelined: bool = False, broadcast_scale: bool = False):
    rng = np.random.default_rng(1)
    b = pk.Builder()
    pb = pk.PipelineBuilder(b)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 8]))
    w1 = b.addInitializedInputTensor(rng.standard_normal((8, 16)).astype(np.float32))
    w2 = b.addInitializedInputTensor(rng.standard_normal((16, 3)).astype(np.float32))
    first = pb.stage(0) if pipelined else _nothing()
    with first:
        h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
    with pb.stage(1) if pipelined else _nothing():
        y = b.aiOnnx.softmax([b.aiOnnx.matmul([h, w2])], axis=1)
    b.addOutputTensor(y)
    return b.getModelProto(), x, h, y, w1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def onnxruntime_run(model: bytes, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


# -- anchors: PopART's return types, values on identity models -----------------------------------


@pytest.mark.parametrize("bps", [1, 2, 4])
@pytest.mark.parametrize("local", [1, 2, 4])
def test_anchor_values_on_an_identity_model(bps, local):
    model = identity_model()
    arts = {"All": "All", "Final": "Final", "Sum": "Sum"} | (
        {"EveryN": ("EveryN", 2)} if bps % 2 == 0 else {})
    outputs = {}
    for label, art in arts.items():
        sess = pk.InferenceSession(model, config(bps, local), anchors={"Identity:0": art},
                                   backend="xla")
        x = np.arange(np.prod(sess.io.input_shape("input")), dtype=np.float32).reshape(
            sess.io.input_shape("input"))
        outputs[label] = sess.run({"input": x})["Identity:0"]
        assert outputs[label].shape == sess.io.anchor_shape("Identity:0")
    full = x.reshape(bps, local, 2, 3)  # [bps, R, *S] whatever was left out
    np.testing.assert_array_equal(outputs["All"], x)
    np.testing.assert_array_equal(outputs["Final"].reshape(local, 2, 3), full[-1])
    np.testing.assert_array_equal(outputs["Sum"].reshape(local, 2, 3), full.sum(0))
    if "EveryN" in outputs:  # micro-batches N-1, 2N-1, ...
        np.testing.assert_array_equal(outputs["EveryN"].reshape(-1, local, 2, 3), full[1::2])


def test_anchors_of_inputs_activations_and_weights():
    model, x, h, y, w1 = mlp()
    sess = pk.InferenceSession(model, config(bps=3, local=2),
                               anchors={x: "All", h: "Final", y: "Sum", w1: "Final"},
                               backend="xla")
    inputs = sess.io.allocate_inputs("random", seed=2)
    out = sess.run(inputs)
    np.testing.assert_array_equal(out[x], inputs[x])
    assert out[h].shape == (2, 4, 16) and out[y].shape == (2, 4, 3)
    np.testing.assert_array_equal(out[w1], np.stack([sess.weights()[w1]] * 2))
    np.testing.assert_allclose(out[y].sum(-1), np.full((2, 4), 3.0), rtol=1e-5)


def test_default_anchors_are_the_outputs_with_all():
    sess = pk.InferenceSession(identity_model(), config(bps=2), backend="xla")
    assert sess.anchors == {"Identity:0": pk.AnchorReturnType("All")}
    assert sess.backend == "xla"


# -- replicas and batches -------------------------------------------------------------------------


@pytest.mark.parametrize("bps, local", [(1, 1), (3, 2), (2, 4), (2, 16)])
def test_replicated_mlp_agrees_with_onnxruntime(bps, local):
    model, x, _, y, _ = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = pk.InferenceSession(model, config(bps, local, device={"target": "offline"}),
                                   anchors={y: "All"}, backend="xla")
    vectorised = [w for w in caught if "vectorised per device" in str(w.message)]
    assert bool(vectorised) == (local > 8)  # 8 host devices: 16 replicas share them
    inputs = sess.io.allocate_inputs("random", seed=local)
    got = sess.run(inputs)[y].reshape(bps * local, 4, 3)
    blocks = inputs[x].reshape(bps * local, 4, 8)
    for k, block in enumerate(blocks):
        want, = onnxruntime_run(model, {x: block})
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6)


def test_broadcast_inputs_reach_every_replica():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [3]))
    s = b.addInputTensor(pk.TensorInfo("FLOAT", [1]),
                         pk.InputSettings(pk.ReplicatedStreamMode.Broadcast))
    y = b.aiOnnx.mul([x, s])
    sess = pk.InferenceSession(b.getModelProto(), config(bps=2, local=2), anchors={y: "All"},
                               backend="xla")
    assert sess.io.input_shape(s) == (2, 1)
    xs = np.ones((2, 2, 3), np.float32)
    scale = np.array([[2.0], [5.0]], np.float32)
    out = sess.run({x: xs, s: scale})[y]
    np.testing.assert_array_equal(out[:, 0], [[2.0] * 3, [5.0] * 3])
    np.testing.assert_array_equal(out[:, 1], out[:, 0])


def test_pipelined_model_runs_like_the_unannotated_one():
    plain, x, _, y, _ = mlp()
    staged, *_ = mlp(pipelined=True)
    cfg = config(bps=4, local=2, ipus_per_replica=2, pipeline={"enabled": True})
    a = pk.InferenceSession(staged, cfg, anchors={y: "All"}, backend="xla")
    b = pk.InferenceSession(plain, config(bps=4, local=2), anchors={y: "All"}, backend="xla")
    inputs = a.io.allocate_inputs("random", seed=5)
    np.testing.assert_allclose(a.run(inputs)[y], b.run(inputs)[y], rtol=1e-6)


def test_pipeline_rules_are_enforced_before_compiling():
    staged, *_ = mlp(pipelined=True)
    with pytest.raises(ValidationError, match="below the pipeline depth 2"):
        pk.InferenceSession(staged, config(bps=1, ipus_per_replica=2,
                                           pipeline={"enabled": True}), backend="xla")


# -- weights --------------------------------------------------------------------------------------


def test_weights_can_be_read_written_and_saved():
    model, x, _, y, w1 = mlp()
    sess = pk.InferenceSession(model, config(bps=2), anchors={y: "All"}, backend="xla")
    inputs = sess.io.allocate_inputs("random", seed=3)
    before = sess.run(inputs)[y]
    weights = sess.weights()
    weights[w1] = weights[w1] * 0  # all hidden units dead: uniform softmax
    sess.write_weights({w1: weights[w1]})
    after = sess.run(inputs)[y]
    np.testing.assert_allclose(after, np.full_like(before, 1 / 3), rtol=1e-6)
    saved = sess.model_proto()
    onnx.checker.check_model(saved)
    want, = onnxruntime_run(saved.SerializeToString(), {x: inputs[x][0]})
    np.testing.assert_allclose(after[0], want, rtol=1e-6)
    with pytest.raises(ValidationError) as info:
        sess.write_weights({w1: np.zeros((2, 2), np.float32), "nope": np.zeros(1)})
    assert len(info.value.errors()) == 2


# -- refusals -------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_before_anything_runs():
    model, x, _, y, _ = mlp()
    sess = pk.InferenceSession(model, config(bps=2, local=2), anchors={y: "All"}, backend="xla")
    with pytest.raises(ValidationError, match="the batches_per_step \\(2\\) or the "
                                              "replication_factor \\(2\\) axis is missing"):
        sess.run({x: np.zeros((2, 4, 8), np.float32)})


def test_unknown_anchors_and_modes_are_refused():
    with pytest.raises(ValidationError, match="anchor 'nope' is not a tensor of the model"):
        pk.InferenceSession(identity_model(), config(), anchors={"nope": "All"}, backend="xla")
    with pytest.raises(ValueError, match="mode='inference'"):
        pk.InferenceSession(identity_model(), pk.SessionConfig(mode="training"), backend="xla")
    with pytest.raises(ValueError, match="backend='tpu'"):
        pk.InferenceSession(identity_model(), config(), backend="tpu")


def test_unsupported_operators_are_refused_at_construction():
    b = pk.Builder(opsets={"ai.onnx": 11})
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 4]))
    b.aiOnnx.unique([x], 1)
    b.aiOnnx.nonzero([x])  # data-dependent shapes: XLA cannot compile them
    with pytest.raises(ValueError) as info:
        pk.InferenceSession(b.getModelProto(), config(), backend="xla")
    assert "Unique" in str(info.value) and "NonZero" in str(info.value)


def test_the_popart_backend_needs_the_sdk():
    with pytest.raises(ImportError, match="Poplar SDK"):
        pk.InferenceSession(identity_model(), config(), backend="popart")
