"""Inference sessions on the xla backend: PopART's anchors, replicas, weights and checks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from pydantic import ValidationError

import popart_kit as pk
from popart_kit._runtime.xla import placement

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


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("bps, local", [(1, 1), (3, 2), (2, 4), (2, 16)])
def test_replicated_mlp_agrees_with_onnxruntime(bps, local, devices, monkeypatch):
    # replicas vectorised on one device (the CPU default) or split over up to 8 devices
    monkeypatch.setattr(placement, "CPU_REPLICA_DEVICES", devices)
    model, x, _, y, _ = mlp()
    sess = pk.InferenceSession(model, config(bps, local, device={"target": "offline"}),
                               anchors={y: "All"}, backend="xla")
    assert len(sess.runtime.placement.devices) == min(devices, local)
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
    # the staged model runs XLA's lowering, the plain one onnxruntime's (delegated.py)
    np.testing.assert_allclose(a.run(inputs)[y], b.run(inputs)[y], rtol=1e-6, atol=1e-9)


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
    unique = b.aiOnnx.unique([x], 1)
    nonzero = b.aiOnnx.nonzero([x])  # data-dependent shapes: XLA cannot compile them
    with pytest.raises(ValueError) as info:
        pk.InferenceSession(b.getModelProto(), config(), anchors={nonzero: "All"},
                            backend="xla")
    assert f"{unique[0]} (Unique)" in str(info.value)
    assert f"{nonzero} (NonZero)" in str(info.value)


def test_the_popart_backend_needs_the_sdk(monkeypatch):
    monkeypatch.setitem(sys.modules, "popart", None)  # as where the SDK is not installed
    with pytest.raises(ImportError, match="Poplar SDK"):
        pk.InferenceSession(identity_model(), config(), backend="popart")
    assert pk.InferenceSession(identity_model(), config()).backend == "xla"  # auto


def test_an_inference_session_needs_an_anchor():
    with pytest.raises(ValueError, match="User must specify an anchor tensor"):
        pk.InferenceSession(identity_model(), config(), anchors={}, backend="xla")


def test_double_and_symbolic_shapes_are_refused():
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["d"], ["e"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("d", TensorProto.DOUBLE, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7
    with pytest.raises(ValidationError) as info:  # the model's own problem first
        pk.InferenceSession(model, config(), backend="xla")
    assert "'x' must be specified in InputShapeInfo, as it has shape [batch, 3]" in \
        str(info.value) and "K-static-shape" in str(info.value)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2
    with pytest.raises(ValidationError, match="tensor 'd' is DOUBLE"):
        pk.InferenceSession(model, config(), backend="xla")


# -- devices, dtypes and odd models ---------------------------------------------------------------


def test_a_fresh_process_runs_cpu_replicas_vectorised_without_a_word():
    # No conftest here: the session itself must ask JAX for the devices before it starts JAX.
    script = textwrap.dedent("""
        import warnings, numpy as np, popart_kit as pk
        b = pk.Builder()
        x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
        y = b.aiOnnx.add([x, b.aiOnnx.constant(np.ones(2, np.float32))])
        cfg = pk.SessionConfig(mode="inference", replication={"local_factor": 4},
                               device={"target": "offline"})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sess = pk.InferenceSession(b.getModelProto(), cfg, anchors={y: "All"},
                                       backend="xla")
        import jax
        print(len(sess.runtime.placement.devices), len(jax.devices()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
    # one device runs the 4 replicas; JAX was still given its 8 host devices for what needs them
    assert result.stdout.strip() == "1 8"


@pytest.mark.parametrize("local", [3, 6])
def test_replica_counts_that_are_not_powers_of_two(local):
    model, x, _, y, _ = mlp()
    sess = pk.InferenceSession(model, config(2, local, device={"target": "offline"}),
                               anchors={y: "Sum"}, backend="xla")
    inputs = sess.io.allocate_inputs("random", seed=local)
    got = sess.run(inputs)[y]
    assert got.shape == (local, 4, 3)
    for r in range(local):
        want = sum(onnxruntime_run(model, {x: inputs[x][b, r]})[0] for b in range(2))
        np.testing.assert_allclose(got[r], want, rtol=1e-5)


def test_anchors_keep_their_dtypes_and_are_writable():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("INT8", [3]))
    flag = b.aiOnnx.greater([b.aiOnnx.cast([x], "FLOAT"),
                             b.aiOnnx.constant(np.zeros(1, np.float32))])
    sess = pk.InferenceSession(b.getModelProto(), config(bps=2, local=2),
                               anchors={x: "Sum", flag: "All"}, backend="xla")
    inputs = {x: np.full((2, 2, 3), 100, np.int8)}
    out = sess.run(inputs)
    assert out[x].dtype == np.int8 and out[flag].dtype == np.bool_
    assert (out[x] == np.int8(-56)).all()  # 100 + 100 wraps in int8, as on the device
    sess.io.check_anchors(out)
    out[x] += 1  # writable


def test_models_without_streamed_inputs():
    b = pk.Builder()
    w = b.addInitializedInputTensor(np.arange(3, dtype=np.float32))
    s = b.addInputTensor(pk.TensorInfo("FLOAT", [1]),
                         pk.InputSettings(pk.ReplicatedStreamMode.Broadcast))
    y = b.aiOnnx.mul([w, s])
    sess = pk.InferenceSession(b.getModelProto(), config(bps=2, local=2),
                               anchors={y: "Final", w: "All"}, backend="xla")
    out = sess.run({s: np.array([[1.0], [3.0]], np.float32)})
    np.testing.assert_array_equal(out[y], [[0, 3, 6], [0, 3, 6]])
    assert out[w].shape == (2, 2, 3)


def test_int64_weights_round_trip():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("INT64", [2]))
    w = b.addInitializedInputTensor(np.array([5, 7], np.int64))
    y = b.aiOnnx.add([x, w])
    sess = pk.InferenceSession(b.getModelProto(), config(), anchors={y: "All"}, backend="xla")
    weights = sess.weights()
    assert weights[w].dtype == np.int64
    sess.write_weights(weights)
    onnx.checker.check_model(sess.model_proto())
    np.testing.assert_array_equal(sess.run({x: np.array([1, 2], np.int64)})[y], [6, 9])


def test_prepare_compiles_before_the_first_run():
    model, x, _, y, _ = mlp()
    sess = pk.InferenceSession(model, config(bps=2, local=2), anchors={y: "All"}, backend="xla")
    sess.prepare()
    assert sess.runtime.programs[0] is not None
    first = sess.run(sess.io.allocate_inputs("random"))
    np.testing.assert_array_equal(first[y], sess.run(sess.io.allocate_inputs("random"))[y])


def test_the_model_keeps_how_each_weight_was_stored():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.array([1.5, -2.0], np.float32))
    y = b.aiOnnx.add([x, w])
    model = onnx.load_from_string(b.getModelProto())
    raw = onnx.ModelProto()
    raw.CopyFrom(model)
    raw.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.array([1.5, -2.0],
                                                                            np.float32), w))
    for source, field in ((model, "float_data"), (raw, "raw_data")):
        sess = pk.InferenceSession(source, config(), anchors={y: "All"}, backend="xla")
        sess.write_weights({w: np.array([3.0, 4.0], np.float32)})
        stored = sess.model_proto().graph.initializer[0]
        assert len(getattr(stored, field)) > 0  # the same storage as the source
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(stored), [3.0, 4.0])
