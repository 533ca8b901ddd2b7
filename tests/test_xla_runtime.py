"""The xla runtime core: chunked steps, both loop drivers, the memory check, atomic and
serialised training runs, non-finite updates, a light import and the compilation cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import popart_kit as pk
from popart_kit import NonFiniteUpdate
from popart_kit._runtime.xla import compilation_cache, steps
from popart_kit._runtime.xla import runtime as xla_runtime
from popart_kit._runtime.xla.anchors import chunk_size
from popart_kit._runtime.xla.compilation_cache import MIN_SECONDS_VARIABLE

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")
RNG = np.random.default_rng(3)
K = (RNG.standard_normal((4, 2, 3, 3)) / 3).astype(np.float32)
W = (RNG.standard_normal((4, 3)) / 2).astype(np.float32)


def convnet(micro: int = 2):
    """x [micro, 2, 6, 6] -> conv -> relu -> global mean -> matmul -> softmax -> nll loss."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [micro, 2, 6, 6]), debugContext="x")
    label = b.addInputTensor(pk.TensorInfo("INT32", [micro]), debugContext="label")
    k = b.addInitializedInputTensor(K, "k")
    w = b.addInitializedInputTensor(W, "w")
    h = b.aiOnnx.relu([b.aiOnnx.conv([x, k], pads=[1, 1, 1, 1])])
    h = b.aiOnnx.flatten([b.aiOnnx.globalaveragepool([h])], axis=1)
    probs = b.aiOnnx.softmax([b.aiOnnx.matmul([h, w])], axis=1)
    loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)
    return b.getModelProto(), x, label, probs, loss


def cfg(mode="inference", bps=4, acc=1, local=1):
    return pk.SessionConfig(mode=mode, batches_per_step=bps, accumulation={"factor": acc},
                            replication={"local_factor": local}, device={"target": "offline"})


def inputs_for(sess, seed=0):
    rng = np.random.default_rng(seed)
    out = sess.io.allocate_inputs("random", seed=seed)
    out["label"] = rng.integers(0, 3, out["label"].shape).astype(np.int32)
    return out


# -- chunks and drivers ---------------------------------------------------------------------------


@pytest.mark.parametrize("micro, target, periods, want", [
    (16, 4, set(), 4), (16, 100, set(), 16), (12, 5, set(), 4), (12, 8, {3}, 6),
    (16, 8, {2, 16}, 8), (8, 3, {4}, 2), (7, 4, set(), 1), (6, 4, {3}, 3)])
def test_chunks_divide_the_step_and_line_up_with_every_period(micro, target, periods, want):
    c = chunk_size(micro, target, periods)
    assert c == want
    assert micro % c == 0 and all(c % n == 0 or n % c == 0 for n in periods)


ANCHORS = {"All": "All", "Final": "Final", "Sum": "Sum", "Every2": ("EveryN", 2),
           "Every4": ("EveryN", 4)}


@pytest.mark.parametrize("on_host", [False, True])
@pytest.mark.parametrize("chunk", [1, 2, 8])
def test_inference_anchors_are_the_same_for_every_chunk_and_driver(chunk, on_host, monkeypatch):
    monkeypatch.setattr(steps, "LOOP_UNFRIENDLY_ON_CPU",
                        steps.LOOP_UNFRIENDLY_ON_CPU if on_host else frozenset())
    model, x, _, probs, _ = convnet()
    results = {}
    for label, art in ANCHORS.items():
        whole = pk.InferenceSession(model, cfg(bps=8, local=2), anchors={probs: art},
                                    backend="xla", micro_batches_per_chunk=8)
        chunked = pk.InferenceSession(model, cfg(bps=8, local=2), anchors={probs: art},
                                      backend="xla", micro_batches_per_chunk=chunk)
        assert chunked.runtime.on_host is (on_host and chunk < 8)  # one chunk: no loop
        inputs = inputs_for(whole)
        results[label] = whole.run(inputs)[probs]
        np.testing.assert_allclose(chunked.run(inputs)[probs], results[label], rtol=1e-6,
                                   atol=1e-7)
    every = results["All"]  # [bps, R, micro, 3]
    np.testing.assert_array_equal(results["Final"], every[-1])
    np.testing.assert_allclose(results["Sum"], every.sum(0), rtol=1e-5)
    np.testing.assert_array_equal(results["Every2"], every[1::2])
    np.testing.assert_array_equal(results["Every4"], every[3::4])


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_training_drivers_and_chunks_give_the_same_weights(chunk, monkeypatch):
    model, x, _, probs, loss = convnet()
    results = []
    for unfriendly in (frozenset(), steps.LOOP_UNFRIENDLY_ON_CPU):
        monkeypatch.setattr(steps, "LOOP_UNFRIENDLY_ON_CPU", unfriendly)
        sess = pk.TrainingSession(model, cfg("training", bps=2, acc=4, local=2), loss=loss,
                                  optimizer=pk.SGD(0.5, momentum=0.9),
                                  anchors={loss: "All", probs: ("EveryN", 2)}, backend="xla",
                                  micro_batches_per_chunk=chunk)
        assert sess.runtime.on_host is bool(unfriendly)
        out = [sess.run(inputs_for(sess, seed)) for seed in range(2)]
        results.append((sess.weights(), out))
    (w_loop, out_loop), (w_host, out_host) = results
    for name in w_loop:
        np.testing.assert_allclose(w_host[name], w_loop[name], rtol=1e-5, atol=1e-6)
    for a, b in zip(out_loop, out_host, strict=True):
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)


# -- memory ---------------------------------------------------------------------------------------


def test_a_step_that_cannot_fit_is_refused_before_anything_is_allocated():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [1, 1]))
    big = b.aiOnnx.expand([x, b.aiOnnx.constant(np.array([1024, 1024], np.int64))])
    # 4 MiB per micro-batch x 2**18 micro-batches = 1 TiB anchored All
    sess = pk.InferenceSession(b.getModelProto(), cfg(bps=2 ** 18), anchors={big: "All"},
                               backend="xla")
    with pytest.raises(ValueError, match=r"needs about 2\.0 TiB.*anchor.*Fix: run fewer "
                                         r"micro-batches per step.*Final, Sum or EveryN") as err:
        sess.prepare()
    assert "K-memory" in str(err.value)
    assert sess.runtime.programs == []  # nothing compiled


def test_the_memory_check_counts_a_host_driven_steps_gradient_accumulator(monkeypatch):
    # host-driven chunks carry the accumulator between calls as an argument, which XLA's
    # temporaries leave out; a looped step's accumulator is where the new weights go
    model, _, _, _, loss = convnet()
    for unfriendly in (frozenset(), steps.LOOP_UNFRIENDLY_ON_CPU):
        monkeypatch.setattr(steps, "LOOP_UNFRIENDLY_ON_CPU", unfriendly)
        sess = pk.TrainingSession(model, cfg("training", bps=1, acc=2), loss=loss,
                                  optimizer=pk.SGD(0.1), backend="xla", check_finite=False,
                                  micro_batches_per_chunk=1)  # two chunks: a loop
        sess.prepare()
        parts = sess.runtime.memory
        assert parts["weights"] == 2 * (K.nbytes + W.nbytes)
        if unfriendly:
            assert parts["gradient accumulator"] == K.nbytes + W.nbytes
        else:
            assert "gradient accumulator" not in parts


# -- atomic, serialised and finite training runs --------------------------------------------------


def _session(**options):
    model, x, label, probs, loss = convnet()
    return pk.TrainingSession(model, cfg("training", bps=2, acc=2), loss=loss,
                              optimizer=pk.Adam(learning_rate=0.05), backend="xla", **options)


@pytest.mark.parametrize("stage", ["transfer", "execute", "fetch", "check"])
def test_an_exception_at_any_stage_of_a_run_leaves_the_session_as_it_was(stage, monkeypatch):
    sess, reference = _session(), _session()
    inputs = inputs_for(sess)
    backend = sess.runtime
    sess.run(inputs), reference.run(inputs)
    before = sess.weights()
    target = {"transfer": (backend.placement, "put"), "execute": (backend.executor, "run"),
              "fetch": (xla_runtime, "_host"), "check": (xla_runtime, "check_finite")}
    owner, attribute = target[stage]
    original = getattr(owner, attribute)

    class Interrupted(dict):  # a function or a mapping that stops the run where it is used
        def __call__(self, *args, **kwargs):
            raise KeyboardInterrupt

        def __getitem__(self, key):
            raise KeyboardInterrupt

    monkeypatch.setattr(owner, attribute, Interrupted())
    with pytest.raises(KeyboardInterrupt):
        sess.run(inputs)
    monkeypatch.setattr(owner, attribute, original)
    after = sess.weights()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])  # bit-identical
    # and the session goes on exactly as one that was never interrupted
    np.testing.assert_array_equal(sess.run(inputs)[sess.loss], reference.run(inputs)[sess.loss])
    for name, value in reference.weights().items():
        np.testing.assert_array_equal(sess.weights()[name], value)


def test_threads_hammering_one_session_end_as_the_same_runs_in_sequence():
    shared, sequential = _session(), _session()
    batches = [inputs_for(shared)] * 4  # the same run from every thread: any order is right
    shared.prepare()
    errors = []

    def worker(inputs):
        try:
            for _ in range(3):
                shared.run(inputs)
        except Exception as err:  # pragma: no cover - the assertion below reports it
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    for inputs in batches:  # twelve runs in sequence: a lost or torn update would show
        for _ in range(3):
            sequential.run(inputs)
    for name, value in sequential.weights().items():
        np.testing.assert_array_equal(shared.weights()[name], value)


def test_a_non_finite_update_is_refused_and_nothing_is_applied():
    sess = _session()
    inputs = inputs_for(sess)
    sess.run(inputs)
    before = sess.weights()
    poisoned = {k: v.copy() for k, v in inputs.items()}
    poisoned["x"][1, 0, 0, 0, 0, 0] = np.nan  # update 1 of 2
    with pytest.raises(pk.DataError, match=r"NaN or Inf in the loss of weight update 1 "
                                              r"\(of 2\) and in the updated weight\(s\) 'k', "
                                              r"'w'.*no update of the run was applied"):
        sess.run(poisoned)
    for name, value in before.items():
        np.testing.assert_array_equal(sess.weights()[name], value)
    with pytest.raises(NonFiniteUpdate) as err:
        sess.run(poisoned)
    assert err.value.rule == "K-nonfinite-update"
    unchecked = _session(check_finite=False)
    unchecked.run(poisoned)
    assert np.isnan(unchecked.weights()["k"]).all()


def test_new_hyperparameters_reach_the_next_run_without_recompiling():
    sess = _session()
    inputs = inputs_for(sess)
    sess.run(inputs)
    program = sess.runtime.programs[0]
    before = sess.weights()
    sess.set_learning_rate(1e-30)  # too small to move a float32 weight
    sess.run(inputs)
    assert sess.runtime.programs[0] is program
    for name, value in before.items():
        np.testing.assert_array_equal(sess.weights()[name], value)


def test_xla_options_are_refused_by_the_popart_backend():
    model, _, _, probs, _ = convnet()
    with pytest.raises(ValueError, match="micro_batches_per_chunk=2: only the xla backend"):
        pk.InferenceSession(model, cfg(), anchors={probs: "All"}, backend="popart",
                            popart=object(), micro_batches_per_chunk=2)


def test_optimizer_refusals_are_the_kits_errors():
    with pytest.raises(pk.PopartKitError, match="learning_rate=inf is not a finite number"):
        pk.SGD(learning_rate=float("inf"))
    with pytest.raises(pk.ConfigTypeError, match="given both by position and by keyword"):
        pk.Adam(0.1, learning_rate=0.2)


def test_a_bad_chunk_is_refused():
    model, _, _, probs, _ = convnet()
    with pytest.raises(ValueError, match="micro_batches_per_chunk=0 is not a positive"):
        pk.InferenceSession(model, cfg(), anchors={probs: "All"}, backend="xla",
                            micro_batches_per_chunk=0)


# -- processes ------------------------------------------------------------------------------------


def test_configuration_alone_does_not_import_jax_or_onnx():
    script = ("import sys, popart_kit as pk; pk.SessionConfig(mode='inference').plan(); "
              "print('jax' in sys.modules, 'onnx' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.split() == ["False", "False"]


def test_a_second_process_reuses_the_compiled_step(tmp_path):
    script = textwrap.dedent("""
        import numpy as np, popart_kit as pk
        b = pk.Builder()
        x = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 3]))
        w = b.addInitializedInputTensor(np.eye(3, dtype=np.float32))
        y = b.aiOnnx.relu([b.aiOnnx.matmul([x, w])])
        cfg = pk.SessionConfig(mode="inference", batches_per_step=3,
                               device={"target": "offline"})
        sess = pk.InferenceSession(b.getModelProto(), cfg, anchors={y: "Sum"}, backend="xla")
        print(float(sess.run(sess.io.allocate_inputs("zeros"))[y].sum()))
    """)
    env = {**os.environ, compilation_cache.CACHE_VARIABLE: str(tmp_path / "cache"),
           MIN_SECONDS_VARIABLE: "0"}  # so tiny a step compiles faster than the default
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                text=True, env=env, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "0.0"
    assert any((tmp_path / "cache").iterdir())  # the step was written for the next process
    env[compilation_cache.CACHE_VARIABLE] = "off"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
