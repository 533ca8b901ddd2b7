"""Training sessions on the xla backend: PopART's accumulation, replication and update rules,
checked as equivalences between configurations that must give the same weights."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from pydantic import ValidationError

import popart_kit as pk
from popart_kit._runtime.xla import placement

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")
RNG = np.random.default_rng(7)
W1 = RNG.standard_normal((6, 8)).astype(np.float32) / 3
W2 = RNG.standard_normal((8, 3)).astype(np.float32) / 3


def classifier(micro: int, pipelined: bool = False):
    """x [micro, 6] -> relu(x W1) W2 -> softmax -> nll loss (Mean over the micro-batch)."""
    b = pk.Builder()
    pb = pk.PipelineBuilder(b)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [micro, 6]), debugContext="x")
    label = b.addInputTensor(pk.TensorInfo("INT32", [micro]), debugContext="label")
    with pb.stage(0) if pipelined else _nothing():
        w1 = b.addInitializedInputTensor(W1, "w1")
        h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
    with pb.stage(1) if pipelined else _nothing():
        w2 = b.addInitializedInputTensor(W2, "w2")
        probs = b.aiOnnx.softmax([b.aiOnnx.matmul([h, w2])], axis=1)
        loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)
    return b.getModelProto(), loss, probs


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def data(samples: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(samples)
    return (rng.standard_normal((samples, 6)).astype(np.float32),
            rng.integers(0, 3, samples).astype(np.int32))


def train(micro, bps=1, acc=1, local=1, reduction="mean", optimizer=None, pipelined=False,
          x=None, y=None, runs=1, chunk=None):
    model, loss, _ = classifier(micro, pipelined)
    cfg = pk.SessionConfig(
        mode="training", batches_per_step=bps, replication={"local_factor": local},
        accumulation={"factor": acc, "reduction": reduction},
        ipus_per_replica=2 if pipelined else 1, pipeline={"enabled": pipelined},
        device={"target": "offline"})
    sess = pk.TrainingSession(model, cfg, loss=loss,
                              optimizer=optimizer or pk.SGD(learning_rate=0.1),
                              anchors={loss: "All"}, backend="xla",
                              micro_batches_per_chunk=chunk)
    out = []
    for run in range(runs):
        block = slice(run * micro * bps * acc * local, (run + 1) * micro * bps * acc * local)
        out.append(sess.run({"x": x[block].reshape(sess.io.input_shape("x")),
                             "label": y[block].reshape(sess.io.input_shape("label"))}))
    return sess.weights(), out, sess


def close(a: dict, b: dict, rtol: float = 2e-5) -> None:
    for name in ("w1", "w2"):
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize("local", [2, 4])
def test_replicas_are_one_big_micro_batch(local, devices, monkeypatch):
    # replicas vectorised on one device (the CPU default), or over several with a psum
    monkeypatch.setattr(placement, "CPU_REPLICA_DEVICES", devices)
    x, y = data(8 * local)
    big, *_ = train(8 * local, x=x, y=y)
    replicated, *_ = train(8, local=local, x=x, y=y)
    close(big, replicated)


@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("acc", [2, 4])
def test_accumulation_is_one_big_micro_batch(acc, chunk):
    # one accumulator over chunks of 1, 2 or (default) all A micro-batches
    x, y = data(8 * acc)
    big, *_ = train(8 * acc, x=x, y=y)
    accumulated, _, sess = train(8, acc=acc, x=x, y=y, chunk=chunk)
    assert sess.runtime.chunk == (chunk or acc)
    close(big, accumulated)


def test_sum_reduction_scales_as_popart_defines():
    # Sum adds the A micro-batch gradients: A times the mean, so the same step as lr x A.
    x, y = data(32)
    summed, *_ = train(8, acc=4, reduction="sum", x=x, y=y)
    big, *_ = train(32, x=x, y=y, optimizer=pk.SGD(learning_rate=0.4))
    close(big, summed)


@pytest.mark.parametrize("devices", [1, 2])
def test_replicas_accumulation_and_device_iterations_are_sequential_big_batches(
        devices, monkeypatch):
    monkeypatch.setattr(placement, "CPU_REPLICA_DEVICES", devices)
    x, y = data(3 * 2 * 2 * 4)  # bps 3, A 2, R 2, micro-batch 4
    together, *_ = train(4, bps=3, acc=2, local=2, x=x, y=y)
    # the same data as 3 sequential updates of one 16-sample batch, in PopART's order
    order = x.reshape(3, 2, 2, 4, 6), y.reshape(3, 2, 2, 4)
    steps = (order[0].reshape(3, 16, 6), order[1].reshape(3, 16))
    model, loss, _ = classifier(16)
    cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
    sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(learning_rate=0.1),
                              backend="xla")
    for k in range(3):
        sess.run({"x": steps[0][k], "label": steps[1][k]})
    close(sess.weights(), together)


def test_pipelined_training_with_accumulation_equals_unpipelined():
    x, y = data(2 * 4 * 8)
    plain, plain_out, _ = train(8, bps=2, acc=4, x=x, y=y)
    piped, piped_out, _ = train(8, bps=2, acc=4, pipelined=True, x=x, y=y)
    close(plain, piped)
    (loss,) = plain_out[0]
    np.testing.assert_allclose(plain_out[0][loss], piped_out[0][loss], rtol=1e-5)


def test_the_same_run_twice_gives_the_same_weights():
    x, y = data(128)
    a, *_ = train(8, bps=2, acc=2, local=2, x=x, y=y, runs=2,
                  optimizer=pk.Adam(learning_rate=0.01))
    b, *_ = train(8, bps=2, acc=2, local=2, x=x, y=y, runs=2,
                  optimizer=pk.Adam(learning_rate=0.01))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_momentum_and_adam_follow_their_update_rules():
    x, y = data(16)
    for optimizer in (pk.SGD(learning_rate=0.1, momentum=0.9, weight_decay=0.01),
                      pk.Adam(learning_rate=0.01)):
        session_weights, _, sess = train(8, bps=2, x=x, y=y, optimizer=optimizer)
        # the same two updates by hand: gradients from a one-sample-batch session, then apply
        grads_weights = {"w1": W1, "w2": W2}
        import jax

        state = optimizer.init({k: jax.numpy.asarray(v) for k, v in grads_weights.items()})
        weights = {k: jax.numpy.asarray(v) for k, v in grads_weights.items()}
        for step in range(2):
            grads = _gradients(weights, x[step * 8:(step + 1) * 8], y[step * 8:(step + 1) * 8])
            hyper = {k: jax.numpy.asarray(v, jax.numpy.float32)
                     for k, v in optimizer.hyperparameters().items()}
            weights, state = optimizer.apply(hyper, weights, grads, state)
        close(session_weights, {k: np.asarray(v) for k, v in weights.items()}, rtol=1e-4)


def _gradients(weights, x, y):
    import jax
    import jax.numpy as jnp

    def loss(w):
        probs = jax.nn.softmax(jnp.maximum(x @ w["w1"], 0) @ w["w2"], axis=1)
        return -jnp.log(probs[jnp.arange(len(y)), y]).mean()

    return jax.grad(loss)(weights)


# -- anchors in training: an x + w model with a zero-weight loss (reference §2) ----------------


@pytest.mark.parametrize("bps, acc", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_training_anchor_values(bps, acc):
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.array([10.0, 20.0], np.float32))
    s = b.aiOnnx.add([x, w])
    loss = b.aiGraphcore.l1loss([s], 0.0)
    arts = {"All": "All", "Final": "Final", "Sum": "Sum"} | (
        {"EveryN": ("EveryN", 2)} if bps % 2 == 0 else {})
    cfg = pk.SessionConfig(mode="training", batches_per_step=bps,
                           accumulation={"factor": acc}, device={"target": "offline"})
    results = {}
    for label, art in arts.items():
        sess = pk.TrainingSession(b.getModelProto(), cfg, loss=loss,
                                  optimizer=pk.SGD(learning_rate=1.0), anchors={s: art, w: art},
                                  backend="xla")
        inputs = np.arange(bps * acc * 2, dtype=np.float32).reshape(sess.io.input_shape(x))
        results[label] = sess.run({x: inputs})
        np.testing.assert_array_equal(sess.weights()[w], [10.0, 20.0])  # zero gradient
    micro = inputs.reshape(bps * acc, 2) + [10.0, 20.0]
    np.testing.assert_array_equal(results["All"][s].reshape(-1, 2), micro)
    np.testing.assert_array_equal(results["Final"][s], micro[-1])
    np.testing.assert_array_equal(results["Sum"][s], micro.sum(0))
    np.testing.assert_array_equal(results["All"][w].reshape(-1, 2),
                                  np.tile([10.0, 20.0], (bps * acc, 1)))
    if "EveryN" in results:  # micro-batches N-1, 2N-1, ... of the bps x A run
        np.testing.assert_array_equal(results["EveryN"][s].reshape(-1, 2), micro[1::2])


# -- the session's controls -------------------------------------------------------------------


def test_learning_rate_changes_without_recompiling():
    x, y = data(32)
    weights, _, sess = train(8, x=x, y=y)
    program = sess.runtime.programs[0]
    sess.set_learning_rate(1e-12)
    sess.run({"x": x[8:16], "label": y[8:16]})
    assert sess.runtime.programs[0] is program
    close(sess.weights(), weights, rtol=1e-9)  # a learning rate of 1e-12 moves nothing
    with pytest.raises(ValueError, match="not the same kind of optimizer"):
        sess.set_optimizer(pk.SGD(learning_rate=0.1, momentum=0.5))


def test_the_trained_model_carries_the_trained_weights():
    x, y = data(16)
    weights, _, sess = train(8, bps=2, x=x, y=y)
    proto = sess.model_proto()
    onnx.checker.check_model(proto)
    saved = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    for name in ("w1", "w2"):
        np.testing.assert_array_equal(saved[name], weights[name])
    assert not np.allclose(saved["w1"], W1)
    # its forward pass (ai.onnx ops, up to the probabilities) runs in onnxruntime
    _, _, probs = classifier(8)
    proto.graph.node.pop()  # the ai.graphcore loss, and its label input
    label = next(i for i in proto.graph.input if i.name == "label")
    proto.graph.input.remove(label)
    proto.graph.output.clear()
    proto.graph.output.append(onnx.helper.make_tensor_value_info(probs, 1, [8, 3]))
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]
                               ).run([probs], {"x": x[:8]})[0]
    h = np.maximum(x[:8] @ weights["w1"], 0) @ weights["w2"]
    want = np.exp(h) / np.exp(h).sum(1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_refusals():
    model, loss, _ = classifier(4, pipelined=True)
    stale = pk.SessionConfig(mode="training", batches_per_step=4, ipus_per_replica=2,
                             pipeline={"enabled": True}, device={"target": "offline"})
    # stale weights run on the pipeline executor (tests/test_pipeline.py); the plan still warns
    assert any("K-stale-weights" in w for w in stale.warnings)
    sess = pk.TrainingSession(model, stale, loss=loss, optimizer=pk.SGD(0.1), backend="xla")
    assert not sess.schedule.accumulate
    cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
    model, _, probs = classifier(4)
    with pytest.raises(ValidationError, match="loss 'nope' is not a tensor"):
        pk.TrainingSession(model, cfg, loss="nope", optimizer=pk.SGD(0.1),
                           anchors={probs: "All"}, backend="xla")
    with pytest.raises(ValueError, match="needs a config with mode='training'"):
        pk.TrainingSession(classifier(4)[0], pk.SessionConfig(mode="inference"), loss=loss,
                           optimizer=pk.SGD(0.1), backend="xla")


def test_the_main_job_trains():
    script = Path(__file__).parent.parent / "examples" / "train.py"
    result = subprocess.run([sys.executable, str(script), "--runs", "20"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr
    first, last = (float(v) for v in result.stdout.split("loss ")[-1].split(" over")[0]
                   .split(" -> "))
    assert last < first / 2
    accuracy = float(result.stdout.split("held-out accuracy ")[1].split("%")[0])
    assert accuracy > 60


# -- review cases: more combinations, and what must be refused ----------------------------------


@pytest.mark.parametrize("reduction, lr_scale", [("mean", 1.0), ("sum", 6.0)])
def test_replicas_with_accumulation_of_three(reduction, lr_scale):
    # Sum adds A x R micro-batch gradients: the big-batch step at lr x A x R
    x, y = data(3 * 2 * 8)
    spread, *_ = train(8, acc=3, local=2, reduction=reduction, x=x, y=y)
    big, *_ = train(48, x=x.reshape(3, 2, 8, 6).reshape(48, 6), y=y,
                    optimizer=pk.SGD(learning_rate=0.1 * lr_scale))
    close(big, spread, rtol=5e-5)


def test_broadcast_inputs_in_training():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    scale = b.addInputTensor(pk.TensorInfo("FLOAT", [1]),
                             pk.InputSettings(pk.ReplicatedStreamMode.Broadcast))
    w = b.addInitializedInputTensor(np.array([1.0, 1.0], np.float32))
    loss = b.aiGraphcore.identityloss([b.aiOnnx.mul([b.aiOnnx.mul([x, w]), scale])],
                                      pk.ReductionType.Sum)
    cfg = pk.SessionConfig(mode="training", replication={"local_factor": 2},
                           device={"target": "offline"})
    sess = pk.TrainingSession(b.getModelProto(), cfg, loss=loss, optimizer=pk.SGD(0.1),
                              backend="xla")
    sess.run({x: np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
              scale: np.array([2.0], np.float32)})
    # Sum over replicas of d(scale * x.w)/dw = 2 * (x0 + x1)
    np.testing.assert_allclose(sess.weights()[w], [1 - 0.1 * 8, 1 - 0.1 * 12], rtol=1e-6)


def test_weight_anchors_show_the_weight_each_micro_batch_used():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [1]))
    w = b.addInitializedInputTensor(np.array([0.0], np.float32))
    loss = b.aiGraphcore.identityloss([b.aiOnnx.mul([x, w])], pk.ReductionType.Sum)
    cfg = pk.SessionConfig(mode="training", batches_per_step=3, accumulation={"factor": 2},
                           device={"target": "offline"})
    sess = pk.TrainingSession(b.getModelProto(), cfg, loss=loss, optimizer=pk.SGD(1.0),
                              anchors={w: "All"}, backend="xla")
    out = sess.run({x: np.ones((3, 2, 1), np.float32)})
    # each update subtracts the sum of 2 gradients of 1: w is 0, 0 | -2, -2 | -4, -4
    np.testing.assert_array_equal(out[w].reshape(-1), [0, 0, -2, -2, -4, -4])
    np.testing.assert_array_equal(sess.weights()[w], [-6.0])


@pytest.mark.parametrize("acc, on_host", [(1, False), (2, True)])
def test_weight_anchors_after_updates_as_popart_copies_them(acc, on_host, monkeypatch):
    """PopART copies a weight's All and Sum anchors after its update when there is no
    gradient accumulation (with it, in the inner loop: the weight the micro-batch used),
    Final after the step's last update, EveryN as the micro-batch used it; both executors."""
    from popart_kit._runtime.xla import steps

    monkeypatch.setattr(steps, "LOOP_UNFRIENDLY_ON_CPU", frozenset({"Mul"} if on_host else ()))
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [1]))
    w = b.addInitializedInputTensor(np.array([0.0], np.float32))
    loss = b.aiGraphcore.identityloss([b.aiOnnx.mul([x, w])], pk.ReductionType.Sum)
    cfg = pk.SessionConfig(mode="training", batches_per_step=4, accumulation={"factor": acc},
                           device={"target": "offline"})
    micro = 4 * acc
    # every micro-batch's gradient is 1 (x = 1), an update subtracts A of them (lr 1):
    # the weight update u starts from is -u x A
    used = -np.repeat(np.arange(4), acc).astype(np.float32) * acc
    after = used - acc  # the weight once the micro-batch's update has run
    want = {"All": after if acc == 1 else used, "Final": [-4.0 * acc],
            "Sum": (after if acc == 1 else used).sum(), "EveryN": used[1::2]}
    for art, expected in want.items():
        sess = pk.TrainingSession(b.getModelProto(), cfg, loss=loss, optimizer=pk.SGD(1.0),
                                  anchors={w: ("EveryN", 2) if art == "EveryN" else art},
                                  backend="xla", micro_batches_per_chunk=1)
        assert sess.runtime.on_host is on_host
        out = sess.run({x: np.ones((micro, 1), np.float32).reshape(sess.io.input_shape(x))})
        np.testing.assert_array_equal(out[w].reshape(-1), np.reshape(expected, -1), err_msg=art)
        np.testing.assert_array_equal(sess.weights()[w], [-4.0 * acc])


def test_weights_off_the_loss_path_are_not_updated():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    used = b.addInitializedInputTensor(np.ones(2, np.float32))
    unused = b.addInitializedInputTensor(np.full(2, 5.0, np.float32))
    b.aiOnnx.add([x, unused])
    loss = b.aiGraphcore.l1loss([b.aiOnnx.mul([x, used])], 1.0)
    cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
    sess = pk.TrainingSession(b.getModelProto(), cfg, loss=loss,
                              optimizer=pk.SGD(0.1, momentum=0.9, weight_decay=0.1),
                              backend="xla")
    sess.run({x: np.ones(2, np.float32)})
    np.testing.assert_array_equal(sess.weights()[unused], [5.0, 5.0])
    assert not np.array_equal(sess.weights()[used], [1.0, 1.0])


def test_what_training_on_xla_refuses(monkeypatch):
    model, loss, probs = classifier(4)
    distributed = pk.SessionConfig(mode="training", replication={
        "local_factor": 2, "global_factor": 4, "global_offset": 2})
    for name in ("POPART_KIT_COORDINATOR", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    # distributed training runs, but only with the other instance started alongside
    with pytest.raises(pk.ConfigError, match="over 2 instances .* needs the instances started"):
        pk.TrainingSession(model, distributed, loss=loss, optimizer=pk.SGD(0.1), backend="xla")
    cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
    with pytest.raises(ValidationError, match="has shape \\[4, 3\\], 12 elements; PopART: "
                                              "'Loss tensor, '.*', must be a scalar tensor'"):
        pk.TrainingSession(model, cfg, loss=probs, optimizer=pk.SGD(0.1), backend="xla")
    with pytest.raises(TypeError, match="give pk.SGD"):
        pk.TrainingSession(model, cfg, loss=loss, optimizer=0.1, backend="xla")


def test_prepare_compiles_the_training_step():
    x, y = data(8)
    model, loss, _ = classifier(8)
    cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
    sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(0.1), backend="xla")
    sess.prepare()
    compiled = sess.runtime.programs[0]
    sess.run({"x": x, "label": y})
    sess.set_learning_rate(0.5)
    sess.run({"x": x, "label": y})
    assert sess.runtime.programs[0] is compiled  # one compiled executable throughout


# -- gradient anchors and optimizer state -----------------------------------------------------


def test_gradient_anchors_are_per_micro_batch_gradients_of_the_loss():
    bps, acc, local, micro = 2, 2, 2, 4
    x, y = data(bps * acc * local * micro)
    model, loss, probs = classifier(micro)
    g = "Gradient___"
    cfg = pk.SessionConfig(mode="training", batches_per_step=bps, replication={
        "local_factor": local}, accumulation={"factor": acc}, device={"target": "offline"})
    sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(learning_rate=1e-30),
                              anchors={g + "x": "All", g + "w1": "All", g + probs: "Final",
                                       g + loss: "Sum"}, backend="xla")
    assert sess.io.anchor_shape(g + "w1") == (bps, acc, local, 6, 8)
    out = sess.run({"x": x.reshape(sess.io.input_shape("x")),
                    "label": y.reshape(sess.io.input_shape("label"))})

    import jax
    import jax.numpy as jnp

    def micro_loss(w1, x, probs_offset, y):
        probs = jax.nn.softmax(jnp.maximum(x @ w1, 0) @ W2, axis=1) + probs_offset
        return -jnp.log(probs[jnp.arange(micro), y]).mean()

    xs = x.reshape(bps, acc, local, micro, 6)
    ys = y.reshape(bps, acc, local, micro)
    grad = jax.vmap(jax.grad(micro_loss, argnums=(0, 1, 2)), in_axes=(None, 0, None, 0))
    gw, gx, gp = (np.asarray(a).reshape((bps, acc, local) + a.shape[1:]) for a in grad(
        W1, xs.reshape(-1, micro, 6), np.zeros((micro, 3), np.float32), ys.reshape(-1, micro)))
    np.testing.assert_allclose(out[g + "w1"], gw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out[g + "x"], gx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out[g + probs], gp[-1, -1], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out[g + loss], np.full(local, bps * acc), rtol=1e-6)


def test_gradient_anchors_of_integers_and_unknown_tensors_are_refused():
    model, loss, _ = classifier(4)
    cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
    with pytest.raises(ValueError, match="'label' is int32: it has no gradient"):
        pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(0.1), backend="xla",
                           anchors={"Gradient___label": "All"})
    with pytest.raises(ValueError, match="'Gradient___nope' is not a tensor of the model"):
        pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(0.1), backend="xla",
                           anchors={"Gradient___nope": "All"})


@pytest.mark.parametrize("optimizer, keys", [
    (pk.SGD(learning_rate=0.1), set()), (pk.SGD(learning_rate=0.1, momentum=0.9), {"velocity"}),
    (pk.Adam(learning_rate=0.01), {"step", "m", "v"})])
def test_the_optimizer_state_comes_back_as_host_arrays(optimizer, keys):
    x, y = data(8)
    _, _, sess = train(8, x=x, y=y, optimizer=optimizer)
    state = sess.optimizer_state()
    assert set(state) == keys
    if "velocity" in state:
        assert set(state["velocity"]) == {"w1", "w2"}
        assert isinstance(state["velocity"]["w1"], np.ndarray)
    if "step" in state:
        assert float(state["step"]) == 1.0


@pytest.mark.parametrize("optimizer", [pk.SGD(learning_rate=0.1, momentum=0.9),
                                       pk.Adam(learning_rate=0.01)])
def test_a_session_resumes_from_weights_and_optimizer_state(optimizer):
    """optimizer_state() then set_optimizer_state() (with write_weights) in a new session:
    its next run is the uninterrupted session's second run, to the bit."""
    x, y = data(16)
    straight, _, _ = train(8, x=x, y=y, optimizer=optimizer, runs=2)
    weights, _, first = train(8, x=x[:8], y=y[:8], optimizer=optimizer)
    model, loss, _ = classifier(8)
    cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
    again = pk.TrainingSession(model, cfg, loss=loss, optimizer=optimizer,
                               anchors={loss: "All"}, backend="xla")
    again.write_weights(weights)
    again.set_optimizer_state(first.optimizer_state())
    again.run({"x": x[8:].reshape(again.io.input_shape("x")),
               "label": y[8:].reshape(again.io.input_shape("label"))})
    for name in ("w1", "w2"):
        np.testing.assert_array_equal(again.weights()[name], straight[name])
    key = next(k for k, v in first.optimizer_state().items() if isinstance(v, dict))
    with pytest.raises(ValueError, match="has no weight 'nope'"):
        again.set_optimizer_state({key: {"nope": np.zeros(2)}})
    with pytest.raises(ValueError, match="shape"):
        again.set_optimizer_state({key: {"w1": np.zeros(3)}})


def test_a_loss_of_one_element_of_any_rank_trains_as_in_popart():
    """PopART refuses only a loss of more than one element (Ir::setFinalLoss): a [1, 1, 1, 1]
    loss trains as its scalar does."""
    results = []
    for keep in (False, True):
        b = pk.Builder()
        x = b.addInputTensor(pk.TensorInfo("FLOAT", [1, 1, 2, 2]))
        w = b.addInitializedInputTensor(np.full((1, 1, 2, 2), 0.5, np.float32))
        y = b.aiOnnx.mul([x, w])
        loss = (b.aiOnnx.reducesum([y], keepdims=1) if keep
                else b.aiGraphcore.l1loss([y], 1.0, reduction=pk.ReductionType.Sum))
        cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
        sess = pk.TrainingSession(b.getModelProto(), cfg, loss=loss, optimizer=pk.SGD(0.1),
                                  backend="xla")
        assert sess.io.anchor_shape(loss) == ((1, 1, 1, 1) if keep else ())
        sess.run({x: np.ones((1, 1, 2, 2), np.float32)})
        results.append(next(iter(sess.weights().values())))
    np.testing.assert_allclose(results[0], results[1])  # sum(|x*w|) = sum(x*w) here


def _stage(builder, index):
    """Builder scopes putting what is built on pipeline stage and virtual graph ``index``."""
    scopes = contextlib.ExitStack()
    scopes.enter_context(builder.virtualGraph(index))
    scopes.enter_context(builder.pipelineStage(index))
    return scopes


@pytest.mark.parametrize("replicas,accumulation,form", [
    (1, 1, "plain"), (2, 2, "plain"), (1, 2, "conv"), (1, 3, "pipelined")])
def test_batchnorm_running_statistics_advance_as_popart(replicas, accumulation, form):
    """A training BatchNormalization's running mean and var are copied over their weights
    after each micro-batch (PopART's CopyVarUpdate): running = running * momentum + batch *
    (1 - momentum), from replica 0's batch; readWeights returns them, and they get no
    gradient update. ``form``: "conv" puts a Conv first (chunks driven from the host on CPU),
    "pipelined" puts the loss on a second pipeline stage."""
    import popart_kit.popart as popart
    rng = np.random.default_rng(3)
    bps, momentum, shape = 2, 0.8, (2, 3, 2, 2)
    mean0, var0 = rng.standard_normal(3).astype(np.float32), np.ones(3, np.float32) * 2
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", list(shape)), "x")
    ids = [b.addInitializedInputTensor(v, n) for n, v in (
        ("scale", np.ones(3, np.float32)), ("bias", np.zeros(3, np.float32)),
        ("mean", mean0), ("var", var0))]
    h = x
    if form == "conv":  # the identity as a 1x1 convolution
        h = b.aiOnnx.conv([x, b.aiOnnx.constant(np.eye(3, dtype=np.float32).reshape(
            3, 3, 1, 1))])
    pipelined = form == "pipelined"

    def stage(index):
        return contextlib.ExitStack() if not pipelined else _stage(b, index)

    with stage(0):
        outs = b.aiOnnx.batchnormalization([h, *ids], 5, momentum=momentum)
    with stage(1):
        loss = b.aiGraphcore.l1loss([outs[0]], 0.1)
    opts = popart.SessionOptions()
    if pipelined:
        opts.enablePipelining, opts.virtualGraphMode = True, popart.VirtualGraphMode.Manual
    if accumulation > 1:
        opts.enableGradientAccumulation, opts.accumulationFactor = True, accumulation
    if replicas > 1:
        opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, replicas
    device = (popart.DeviceManager().acquireAvailableDevice(replicas) if replicas > 1
              else popart.DeviceManager().createCpuDevice())
    session = popart.TrainingSession(
        fnModel=b.getModelProto(), dataFlow=popart.DataFlow(bps, {loss: popart.AnchorReturnType(
            "All")}), loss=loss, optimizer=popart.SGD({"defaultLearningRate": (0.1, False),
                                                       "defaultWeightDecay": (0.5, False)}),
        deviceInfo=device, userOptions=opts)
    session.prepareDevice()
    session.weightsFromHost()
    data = rng.standard_normal((bps, accumulation, replicas, *shape)).astype(np.float32)
    feed = data.reshape((bps, *(n for n in (accumulation, replicas) if n > 1), *shape))
    session.run(popart.PyStepIO({x: feed}, session.initAnchorArrays()))
    mean, var = mean0.astype(np.float64), var0.astype(np.float64)
    for step in range(bps):
        for micro in range(accumulation):
            batch = data[step, micro, 0].astype(np.float64)
            mean = mean * momentum + batch.mean(axis=(0, 2, 3)) * (1 - momentum)
            var = var * momentum + batch.var(axis=(0, 2, 3)) * (1 - momentum)
    out = {"mean": np.zeros(3, np.float32), "var": np.zeros(3, np.float32)}
    session.weightsToHost()
    session.readWeights(popart.PyWeightsIO(out))
    np.testing.assert_allclose(out["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["var"], var, rtol=1e-5, atol=1e-6)
