"""Pipelined execution on the xla backend: stages on their own devices, run by the schedule."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from pipeline_models import LR, MICRO, WIDTH, mlp, session, simulate_continuous

import popart_kit as pk
from popart_kit._runtime.xla import pipeline


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipelined_equals_unpipelined(stages, replicas):
    depth = 2 * stages - 1
    # inference
    piped, feed = session(stages, replicas, False, True, bps=stages + 1)
    plain, _ = session(stages, replicas, False, False, bps=stages + 1)
    assert piped.runtime.pipeline is not None and plain.runtime.pipeline is None
    a, b = piped.run(feed), plain.run(feed)
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=1e-6)
    # training with accumulation: two updates per run, two runs
    piped, feed = session(stages, replicas, True, True, bps=2, acc=depth)
    plain, _ = session(stages, replicas, True, False, bps=2, acc=depth)
    for _ in range(2):
        a, b = piped.run(feed), plain.run(feed)
        for name in b:
            np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=1e-6)
    wa, wb = piped.weights(), plain.weights()
    assert any(not np.allclose(wa[k], mlp(stages)[4][k]) for k in wa)  # it trained
    for name in wb:
        np.testing.assert_allclose(wa[name], wb[name], rtol=2e-5, atol=1e-6)


def test_a_three_stage_session_shows_its_schedule_and_placement():
    sess, feed = session(3, 2, True, True, bps=1, acc=5)
    grid = sess.schedule.render()
    assert "stage 2 fwd+bwd" in grid and grid.splitlines()[-1].split()[:3] == ["stage", "0",
                                                                                "bwd"]
    placement = sess.placement
    assert set(placement) == {(r, s) for r in range(2) for s in range(3)}
    assert len({placement[(0, s)] for s in range(3)}) == 3  # a replica's stages: own devices
    sess.run(feed)
    executor = sess.runtime.pipeline
    assert {(a.kind, a.stage, a.micro_batch) for a, *_ in executor.trace} == {
        (a.kind, a.stage, a.micro_batch) for a in sess.schedule.actions if a.kind != "U"}
    assert 0.0 <= executor.measured_bubble < 1.0
    events = json.loads(json.dumps(executor.chrome_trace()))["traceEvents"]  # JSON as saved
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(executor.trace) and min(e["ts"] for e in spans) == 0
    assert {e["tid"] for e in spans} == {d for _, d, _, _ in executor.trace}
    assert all(e["dur"] >= 0 and e["cat"] in ("forward", "backward", "update") for e in spans)


def test_dispatch_from_one_thread_gives_the_same_numbers():
    a, feed = session(3, 1, True, True, bps=2, acc=5)
    b, _ = session(3, 1, True, True, bps=2, acc=5)
    b.runtime.pipeline.threads = False
    out_a, out_b = a.run(feed), b.run(feed)
    for name in out_a:
        np.testing.assert_allclose(out_a[name], out_b[name], rtol=1e-6)
    assert not b.runtime.pipeline.trace


def sequential_sgd(weights, xs, stages, lr):
    """The same updates with no pipeline (no staleness)."""
    import jax
    import jax.numpy as jnp

    def loss(w, x):
        h = x
        for s in range(stages - 1):
            h = jnp.tanh(h @ w[s])
        return ((h @ w[-1]) ** 2).sum()

    w = [jnp.asarray(weights[f"w{s}"]) for s in range(stages)]
    for x in xs:
        g = jax.grad(loss)(w, x)
        w = [a - lr * b for a, b in zip(w, g, strict=True)]
    return {f"w{s}": np.asarray(w[s]) for s in range(stages)}


@pytest.mark.parametrize("stages", [2, 3])
def test_without_accumulation_the_weights_are_stale_as_in_popart(stages):
    sess, feed = session(stages, 1, True, True, bps=8)
    initial = mlp(stages)[4]
    xs = next(iter(feed.values())).astype(np.float64)
    out = sess.run(feed)
    want, losses = simulate_continuous(initial, xs, stages, LR)
    got = sess.weights()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
    loss_anchor = next(k for k, v in out.items() if v.shape == (8,))
    np.testing.assert_allclose(out[loss_anchor], losses, rtol=1e-4)
    # staleness matters here: plain sequential SGD ends elsewhere
    fresh = sequential_sgd(initial, xs, stages, LR)
    assert max(np.abs(fresh[k] - want[k]).max() for k in want) > 1e-3


def test_without_accumulation_a_weight_s_anchor_follows_each_update():
    """Stale weights (no accumulation): a weight's All anchor is the weight once its
    micro-batch's update has run (PopART copies it after the VarUpdate), stage by stage."""
    model, x, _, loss, initial = mlp(2)
    with warnings.catch_warnings():  # stale weights: the config and the session warn
        warnings.simplefilter("ignore", pk.PopartKitWarning)
        cfg = pk.SessionConfig(mode="training", batches_per_step=4, ipus_per_replica=2,
                               pipeline={"enabled": True}, device={"target": "offline"})
        sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(learning_rate=LR),
                                  anchors={"w0": "All", "w1": "All"}, backend="xla")
    assert sess.runtime.pipeline is not None
    xs = np.random.default_rng(5).standard_normal((4, MICRO, WIDTH)).astype(np.float32)
    out = sess.run({x: xs})
    history: dict = {}
    simulate_continuous(initial, xs.astype(np.float64), 2, LR, history)
    for name in ("w0", "w1"):
        want = np.stack([history[(name, m)] for m in range(4)])
        np.testing.assert_allclose(out[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


def test_recomputation_gives_the_same_numbers_and_stashes_less():
    a, feed = session(3, 2, True, True, bps=1, acc=5)
    b, _ = session(3, 2, True, True, bps=1, acc=5, recompute="standard")
    out_a, out_b = a.run(feed), b.run(feed)
    for name in out_a:
        np.testing.assert_allclose(out_a[name], out_b[name], rtol=1e-6)
    for name, value in a.weights().items():
        np.testing.assert_allclose(value, b.weights()[name], rtol=1e-6)
    sizes = a.runtime.pipeline.stash_bytes()
    assert all(r < s for r, s in zip(sizes["recomputed"], sizes["stashed"], strict=True))


def test_norm_only_recomputation_is_refused():
    with pytest.raises(pk.ConfigError, match="norm_only"):
        session(2, 1, True, True, bps=1, acc=3, recompute="norm_only")


def test_stages_take_turns_on_a_host_with_fewer_devices_than_stages(monkeypatch):
    """One device (a one-GPU host) and three stages: the pipeline keeps its schedule, every
    stage on that device, and computes what it computes on devices of their own - stale
    weights (training without accumulation) included."""
    import jax

    def trained(sess, feed):
        outs = [sess.run(feed) for _ in range(2)]
        return outs, sess.weights()

    own = session(3, 1, True, True, bps=5)
    want = trained(*own)
    one = jax.local_devices()[:1]
    monkeypatch.setattr(pipeline.jax, "local_devices", lambda *a, **k: one)
    shared = session(3, 1, True, True, bps=5)
    sess = shared[0]
    assert sess.runtime.pipeline is not None and sess.schedule is not None
    assert len(set(sess.placement.values())) == 1
    got = trained(*shared)
    for a, b in zip(got[0], want[0], strict=True):
        for name in b:
            np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=1e-6)
    for name, value in want[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=2e-5, atol=1e-6)


def test_replicas_of_a_stage_on_devices_of_their_own(monkeypatch):
    """R replicas x K stages on R x K devices, where the unpipelined placement gives each
    replica a device (CPU does only when asked: its virtual devices share one thread pool)."""
    from popart_kit._runtime.xla import placement

    monkeypatch.setattr(placement, "CPU_REPLICA_DEVICES", 8)
    for training in (False, True):
        piped, feed = session(2, 4, training, True, bps=2, acc=3 if training else 1)
        plain, _ = session(2, 4, training, False, bps=2, acc=3 if training else 1)
        where = piped.placement
        assert len(set(where.values())) == 8  # every (replica, stage) on its own device
        assert {where[(r, 0)] for r in range(4)}.isdisjoint({where[(r, 1)] for r in range(4)})
        for _ in range(2):
            a, b = piped.run(feed), plain.run(feed)
            for name in b:
                np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=1e-6)
        for name, value in plain.weights().items():
            np.testing.assert_allclose(piped.weights()[name], value, rtol=2e-5, atol=1e-6)


def test_a_pipelined_step_that_cannot_fit_is_refused_naming_its_stash(monkeypatch):
    from popart_kit._runtime.xla import memory

    sess, feed = session(3, 2, True, True, bps=1, acc=5)
    parts = sess.runtime.pipeline.memory_parts()
    # stage 0 holds the most micro-batches between forward and backward: 2(K-1) + 1
    assert [sess.runtime.pipeline.in_flight(s) for s in range(3)] == [5, 3, 0]
    assert parts[0]["stashed activations"] > parts[1]["stashed activations"] > 0
    recomputed, _ = session(3, 2, True, True, bps=1, acc=5, recompute="standard")
    assert (recomputed.runtime.pipeline.memory_parts()[0]["stashed activations"]
            < parts[0]["stashed activations"])
    need = sum(sum(p.values()) for p in parts)
    monkeypatch.setattr(memory, "available_bytes", lambda device: (need // 2, "host RAM"))
    with pytest.raises(pk.PopartKitError, match=r"needs about .*stashed activations.*Fix: run "
                                                r"fewer micro-batches.*recomputation") as err:
        sess.run(feed)
    assert "K-memory" in str(err.value)
    assert not sess.runtime.pipeline.trace  # nothing ran


def test_gradient_and_weight_anchors_are_computed_by_the_stages():
    """Gradients of an input, a weight, an activation sent on, one kept inside its stage and
    the loss, and a weight's value, as the unpipelined run gives them, micro-batch by
    micro-batch and replica by replica."""
    b = pk.Builder()
    pb = pk.PipelineBuilder(b)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [MICRO, WIDTH]), debugContext="x")
    rng = np.random.default_rng(7)
    with pb.stage(0):
        w0 = b.addInitializedInputTensor(rng.standard_normal((WIDTH, WIDTH)).astype("f4"), "w0")
        inner = b.aiOnnx.matmul([x, w0])
        h = b.aiOnnx.tanh([inner])
    with pb.stage(1):
        w1_init = rng.standard_normal((WIDTH, 3)).astype("f4")
        w1 = b.addInitializedInputTensor(w1_init, "w1")
        loss = b.aiOnnx.reducesumsquare([b.aiOnnx.matmul([h, w1])], keepdims=0)
    anchors = {loss: "All", w0: "All", w1: "Final", **{"Gradient___" + t: "All"
                                          for t in (x, w0, inner, h, w1, loss)}}
    out, trained = {}, {}
    for pipelined in (True, False):
        cfg = pk.SessionConfig(mode="training", batches_per_step=2, accumulation={"factor": 3},
                               replication={"local_factor": 2}, ipus_per_replica=2,
                               pipeline={"enabled": pipelined}, device={"target": "offline"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pk.PopartKitWarning)
            sess = pk.TrainingSession(b.getModelProto(), cfg, loss=loss, anchors=anchors,
                                      optimizer=pk.SGD(learning_rate=LR), backend="xla")
        assert (sess.schedule is not None) == pipelined
        feed = {x: np.random.default_rng(3).standard_normal(sess.io.input_shape(x))
                .astype(np.float32)}
        out[pipelined] = sess.run(feed)
        trained[pipelined] = sess.weights()[w1]
    assert out[True].keys() == out[False].keys() == set(anchors)
    for name, want in out[False].items():
        np.testing.assert_allclose(out[True][name], want, rtol=2e-5, atol=1e-5, err_msg=name)
    assert np.abs(out[True]["Gradient___" + inner]).max() > 0
    # Final: after the step's last update (PopART's end-of-step copy), not what it used
    np.testing.assert_array_equal(out[True][w1][0], trained[True])
    assert not np.allclose(trained[True], w1_init, atol=1e-3)


@pytest.mark.parametrize("pipelined", [True, False])
def test_restored_activations_equal_the_forward_ones(pipelined):
    """PopART's Restored___ anchor: a stashed activation as the backward reads it back (also
    when gradient clipping, which the stages' separate updates cannot see, makes the session
    run unpipelined)."""
    model, x, y, loss, _ = mlp(2)
    h = next(n.output[0] for n in onnx.load_from_string(model).graph.node if n.op_type == "Tanh")
    cfg = pk.SessionConfig(mode="training", batches_per_step=1, accumulation={"factor": 3},
                           ipus_per_replica=2, pipeline={"enabled": True},
                           device={"target": "offline"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pk.PopartKitWarning)
        clip = () if pipelined else ((None, 1e6),)
        sess = pk.TrainingSession(model, cfg, loss=loss, backend="xla",
                                  optimizer=pk.SGD(LR, clip_norm=clip),
                                  anchors={h: "All", "Restored___" + h: "All"})
    assert (sess.schedule is not None) == pipelined
    out = sess.run(sess.io.allocate_inputs("random"))
    np.testing.assert_array_equal(out["Restored___" + h], out[h])


def test_a_pipelined_session_writes_its_profiling_report(tmp_path):
    """Every run goes through the same wrapper: a pipelined session's runs are timed and
    traced into profiling.auto_report_dir as an unpipelined session's are."""
    from popart_kit._runtime.xla import profiling

    model, x, y, loss, _ = mlp(2)
    cfg = pk.SessionConfig(mode="training", batches_per_step=1, accumulation={"factor": 3},
                           ipus_per_replica=2, pipeline={"enabled": True},
                           profiling={"auto_report_dir": str(tmp_path)},
                           device={"target": "offline"})
    sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(LR), backend="xla")
    assert sess.schedule is not None
    feed = sess.io.allocate_inputs("random")
    for _ in range(2):
        sess.run(feed)
    rows = dict(profiling.summary(tmp_path))  # the report is well-formed
    assert rows["backend"] == "XlaTrainingBackend" and rows["runs"] == "2", rows
    assert (tmp_path / "trace").is_dir()


@pytest.mark.parametrize("acc, bps, per_run", [(3, 2, 2), (1, 4, 4)])
def test_the_state_counts_a_pipelined_run_s_weight_updates(acc, bps, per_run):
    """With accumulation a run makes bps updates; without, one per micro-batch - counted in
    the committed state as the unpipelined paths count them."""
    model, x, y, loss, _ = mlp(2)
    cfg = pk.SessionConfig(mode="training", batches_per_step=bps, accumulation={"factor": acc},
                           ipus_per_replica=2, pipeline={"enabled": True},
                           device={"target": "offline"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pk.PopartKitWarning)
        sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(LR), backend="xla")
    assert sess.schedule is not None
    feed = sess.io.allocate_inputs("random")
    for _ in range(2):
        sess.run(feed)
    assert int(sess.runtime.state.updates) == 2 * per_run
