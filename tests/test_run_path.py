"""The per-run path: inputs checked in full once per layout, anchors handed over once.

A layout accepted once is only looked up on later runs, but whatever was refused is refused
again, with the same error; values (indices) are checked on every run; the anchors a run
returns are its own arrays, and PopART's PyStepIO arrays are written in place.
"""

from __future__ import annotations

import numpy as np
import pytest

import popart_kit as pk
import popart_kit.popart as popart

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")


def _classifier():
    """x [2, 3] -> softmax(x @ w) and an Nll loss against an INT32 label [2] (3 classes)."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]))
    label = b.addInputTensor(pk.TensorInfo("INT32", [2]))
    w = b.addInitializedInputTensor(np.arange(9, dtype=np.float32).reshape(3, 3) / 10)
    probs = b.aiOnnx.softmax([b.aiOnnx.matmul([x, w])], axis=1)
    loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)
    b.addOutputTensor(probs)
    return b.getModelProto(), x, label, w, probs, loss


def _inference(bps=2):
    model, x, label, w, probs, _ = _classifier()
    config = pk.SessionConfig(mode="inference", batches_per_step=bps)
    sess = pk.InferenceSession(model, config, anchors={probs: "All"}, backend="xla")
    return sess, model, x, label, probs


def _message(fn):
    with pytest.raises(ValueError) as err:
        fn()
    return str(err.value)


def _inputs(sess, x, label, seed=0):
    rng = np.random.default_rng(seed)
    return {x: rng.standard_normal(sess.io.input_shape(x)).astype(np.float32),
            label: rng.integers(0, 3, sess.io.input_shape(label)).astype(np.int32)}


def test_a_refused_layout_is_refused_again_with_the_same_error_after_accepted_runs():
    sess, _, x, label, _ = _inference()
    fresh, *_ = _inference()
    good = _inputs(sess, x, label)
    wrong = {
        "shape": {**good, x: good[x].reshape(4, 3)},
        "dtype": {**good, x: good[x].astype(np.float16)},
        "layout": {**good, x: np.asfortranarray(good[x])},
        "missing": {x: good[x]},
        "unknown": {**good, "other": good[x]},
        "type": {**good, x: good[x].tolist()},
    }
    first = {kind: _message(lambda i=inputs: fresh.run(i)) for kind, inputs in wrong.items()}
    for _ in range(2):
        sess.run(good)  # accepted, and remembered
        for kind, inputs in wrong.items():
            assert _message(lambda i=inputs: sess.run(i)) == first[kind], kind
    assert "has shape (4, 3)" in first["shape"] and "float16" in first["dtype"]
    assert "C-contiguous" in first["layout"] and "missing" in first["missing"]


def test_a_remembered_layout_still_has_its_values_checked_every_run():
    sess, _, x, label, _ = _inference()
    inputs = _inputs(sess, x, label)
    sess.run(inputs)
    bad = {**inputs, label: inputs[label].copy()}
    bad[label][1, 0] = 7  # the same layout, a label outside 0..2
    for _ in range(2):
        with pytest.raises(ValueError, match=r"outside 0\.\.2: 7 at \(1, 0\)"):
            sess.run(bad)
    sess.run(inputs)


def test_the_factory_remembers_only_accepted_layouts():
    sess, _, x, label, _ = _inference()
    io = sess.io
    good = _inputs(sess, x, label)
    io.check_inputs(good)
    io.check_inputs(good)
    assert len(io._accepted) == 1
    with pytest.raises(ValueError):
        io.check_inputs({**good, x: good[x][:1]})
    assert len(io._accepted) == 1
    # a subclass of ndarray is checked in full every time, never remembered
    io.check_inputs({**good, x: good[x].view(np.memmap)})
    assert len(io._accepted) == 1


def test_each_run_returns_anchors_of_its_own():
    sess, model, x, label, probs = _inference()
    a, b = _inputs(sess, x, label, 1), _inputs(sess, x, label, 2)
    first = sess.run(a)[probs]
    kept = first.copy()
    second = sess.run(b)[probs]
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)  # the second run did not write into the first's
    assert first.flags.writeable and second.flags.writeable
    weights = np.arange(9, dtype=np.float32).reshape(3, 3) / 10
    for inputs, got in ((a, first), (b, second)):
        np.testing.assert_allclose(got, _softmax(inputs[x] @ weights), rtol=1e-5, atol=1e-6)


def test_a_run_without_copies_gives_read_only_views_of_the_same_values():
    """(The first run is always the compiled program's; later ones of this model are one
    onnxruntime call from the host, whose anchors are arrays of their own either way.)"""
    sess, _, x, label, probs = _inference()
    inputs = _inputs(sess, x, label)
    viewed = sess.runtime.run(inputs, copy=False)[probs]
    copied = sess.run(inputs)[probs]
    np.testing.assert_array_equal(viewed, copied)
    assert viewed.shape == copied.shape == sess.io.anchor_shape(probs)
    assert copied.flags.writeable and not viewed.flags.writeable


def _dropin(training: bool):
    model, x, label, w, probs, loss = _classifier()
    flow = popart.DataFlow(1, {probs: popart.AnchorReturnType("All")})
    device = popart.DeviceManager().createCpuDevice()
    if training:
        session = popart.TrainingSession(model, flow, loss, popart.ConstSGD(0.5), device)
    else:
        session = popart.InferenceSession(model, flow, device)
    session.prepareDevice()
    session.weightsFromHost()
    return session, model, x, label, w, probs


def _softmax(v):
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_pystepio_anchor_arrays_are_written_in_place_run_after_run():
    session, model, x, label, w, probs = _dropin(training=False)
    anchors = session.initAnchorArrays()
    target = anchors[probs]
    weights = np.arange(9, dtype=np.float32).reshape(3, 3) / 10
    rng = np.random.default_rng(0)
    for _ in range(2):
        feed = {x: rng.standard_normal((2, 3)).astype(np.float32),
                label: np.array([0, 2], np.int32)}
        session.run(popart.PyStepIO(feed, anchors))
        assert anchors[probs] is target  # PopART writes the user's arrays in place
        np.testing.assert_allclose(target, _softmax(feed[x] @ weights), rtol=1e-5)


def test_a_refused_pystepio_output_array_changes_nothing():
    session, model, x, label, w, probs = _dropin(training=True)
    feed = {x: np.ones((2, 3), np.float32), label: np.array([0, 2], np.int32)}

    def weights():
        out = {w: np.zeros((3, 3), np.float32)}
        session.weightsToHost()
        session.readWeights(popart.PyWeightsIO(out))
        return out[w]

    before = weights()
    read_only = session.initAnchorArrays()
    read_only[probs].flags.writeable = False
    for outputs, match in ((read_only, "read-only"), ({}, "No tensor"),
                           ({probs: np.zeros((3, 3), np.float32)}, "number of output")):
        with pytest.raises(popart.popart_exception, match=match):
            session.run(popart.PyStepIO(feed, outputs))
        np.testing.assert_array_equal(weights(), before)  # no update was applied
    session.run(popart.PyStepIO(feed, session.initAnchorArrays()))
    assert not np.array_equal(weights(), before)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(256, 512), (3, 5, 7), (13, 256), (1,), ()])
def test_the_finite_check_finds_every_nan_and_inf_and_nothing_else(shape, dtype):
    import jax

    from popart_kit._runtime.xla.state import all_finite

    check = jax.jit(all_finite)
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    assert bool(check(x))
    assert bool(check(np.full(shape, np.finfo(dtype).max, dtype)))  # huge is still finite
    assert bool(check(np.full(shape, -np.finfo(dtype).max, dtype)))
    for value in (np.nan, np.inf, -np.inf):
        for at in (0, -1, x.size // 2):
            y = x.copy()
            y.reshape(-1)[at] = value
            assert not bool(check(y)), (value, at)
