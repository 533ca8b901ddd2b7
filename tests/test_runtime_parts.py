"""The xla runtime's parts on their own: the session state, the one reduction and update, the
finiteness check, and the executors behind one protocol - not only through sessions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popart_kit as pk
from popart_kit._runtime.xla.executors import HostDrivenExecutor, LoopedExecutor, StepFunctions
from popart_kit._runtime.xla.placement import REPLICA, Placement
from popart_kit._runtime.xla.state import (
    Reduction,
    SessionState,
    apply_update,
    check_finite,
    finite_flags,
    reduce_gradients,
)


def _config(reduction: str, factor: int = 4, replicas: int = 2) -> pk.SessionConfig:
    return pk.SessionConfig(mode="training", accumulation={"factor": factor,
                                                            "reduction": reduction},
                            replication={"local_factor": replicas})


def test_the_state_is_one_frozen_pytree():
    state = SessionState({"w": jnp.ones(3)}, {"m": {"w": jnp.zeros(3)}}, jnp.int32(2))
    leaves = jax.tree.leaves(state)
    assert len(leaves) == 3  # weights, optimizer state and the update count
    doubled = jax.tree.map(lambda a: a * 2, state)
    assert isinstance(doubled, SessionState) and int(doubled.updates) == 4
    with pytest.raises(AttributeError):
        state.weights = {}  # frozen: a new state is made, never this one changed
    assert set(state.with_weights({"v": jnp.zeros(1)}).weights) == {"w", "v"}
    assert set(state.weights) == {"w"}


@pytest.mark.parametrize("reduction,divisor", [("mean", 4 * 2), ("sum", 1)])
def test_the_reduction_follows_the_config(reduction, divisor):
    r = Reduction.of(_config(reduction))
    assert r.divisor == divisor and r.axes == () and not r.flat
    grads = {"w": jnp.full(3, 8.0)}
    np.testing.assert_allclose(reduce_gradients(grads, r)["w"], 8.0 / divisor)


@pytest.mark.parametrize("flat", [False, True])
def test_the_reduction_sums_over_the_mesh_axes_it_names(flat):
    """Inside a program over replicas, every replica's gradient is summed (one all-reduce of
    the flattened gradients when ``flat``), then divided."""
    r = Reduction(axes=(REPLICA,), flat=flat, divisor=2)
    grads = {"a": jnp.arange(3.0)[:, None] * jnp.ones((3, 2)), "b": jnp.arange(3.0)}
    summed = jax.vmap(lambda g: reduce_gradients(g, r), axis_name=REPLICA)(grads)
    np.testing.assert_allclose(summed["a"], np.full((3, 2), 3.0 / 2))
    np.testing.assert_allclose(summed["b"], np.full(3, 3.0 / 2))


def test_an_update_steps_the_trained_weights_only_and_counts():
    opt = pk.SGD(0.5)
    state = SessionState({"w": jnp.ones(2), "frozen": jnp.ones(2)},
                         opt.init({"w": jnp.ones(2)}), jnp.int32(0))
    hyper = {k: np.float32(v) for k, v in opt.hyperparameters().items()}
    new = apply_update(state, {"w": jnp.full(2, 4.0)}, hyper, opt, Reduction(divisor=2))
    np.testing.assert_allclose(new.weights["w"], 1 - 0.5 * 4.0 / 2)
    np.testing.assert_array_equal(new.weights["frozen"], state.weights["frozen"])
    assert int(new.updates) == 1 and int(state.updates) == 0  # the old state is untouched


def test_the_finiteness_check_names_the_update_and_the_weights():
    flags = finite_flags(jnp.array([True, False, True]), {"a": jnp.ones(2),
                                                         "b": jnp.array([1.0, np.nan])},
                         ["a", "b"])
    assert flags.tolist() == [True, False, True, True, False]
    check_finite(np.ones(5, bool), ["a", "b"], 3)  # all finite: nothing raised
    with pytest.raises(pk.NonFiniteUpdate, match=r"update 1 \(of 3\).*'b'") as err:
        check_finite(np.asarray(flags), ["a", "b"], 3)
    assert isinstance(err.value, pk.DataError) and "K-nonfinite-update" in err.value.rules


def _step(updates: int, chunks: int, chunk: int) -> StepFunctions:
    """A toy training step: each chunk of micro-batches adds its inputs' sum to the gradient
    of ``w`` and writes its inputs into an All anchor; an update subtracts the gradient."""
    micro_batches = updates * chunks * chunk

    def work():
        return {"buffers": {"seen": jnp.zeros((micro_batches, 1, 2))},
                "losses_finite": jnp.ones((updates,), bool)}

    def run_chunk(state, work, hyper, inputs, update, index):
        start = (update * chunks + index) * chunk
        x = jax.lax.dynamic_slice_in_dim(inputs["x"], start, chunk, axis=0)
        seen = jax.lax.dynamic_update_slice_in_dim(work["buffers"]["seen"], x, start, axis=0)
        grads = {"w": x.sum(axis=(0, 1)) * state.weights["w"]}
        return grads, {**work, "buffers": {"seen": seen}}

    def apply(state, grads, hyper):
        return SessionState({"w": state.weights["w"] - hyper["lr"] * grads["w"]},
                            state.optimizer, state.updates + 1)

    def flags(state, work):
        return finite_flags(work["losses_finite"], state.weights, ["w"])

    return StepFunctions(
        updates=updates, chunks=chunks, work=work, chunk=run_chunk, apply=apply, flags=flags,
        inputs={"x": jax.ShapeDtypeStruct((micro_batches, 1, 2), jnp.float32)},
        stream_axes={"x": 1}, buffer_axes={"seen": 1})


@pytest.mark.parametrize("updates,chunks,chunk", [(1, 1, 4), (2, 2, 2), (3, 4, 1)])
def test_the_looped_and_host_driven_executors_run_the_same_step_alike(updates, chunks, chunk):
    """The same StepFunctions through both executors: the same anchors, the same new state
    (each update subtracting its chunks' summed gradient), and the committed state as it was."""
    placement = Placement(1)
    state = SessionState({"w": jnp.ones(2)}, (), jnp.int32(0))
    hyper = {"lr": jnp.float32(0.01)}
    x = np.random.default_rng(0).normal(size=(updates * chunks * chunk, 1, 2)).astype(np.float32)
    expected = np.ones(2, np.float32)
    for u in range(updates):
        part = x[u * chunks * chunk:(u + 1) * chunks * chunk]
        expected = expected - 0.01 * part.sum(axis=(0, 1)) * expected
    results = []
    for kind in (LoopedExecutor, HostDrivenExecutor):
        executor = kind(_step(updates, chunks, chunk), placement)
        assert executor.programs == []
        executor.prepare(state, hyper)
        assert executor.programs
        result = executor.run({"x": x}, state, hyper)
        np.testing.assert_array_equal(result.anchors["seen"], x)
        np.testing.assert_allclose(result.state.weights["w"], expected, rtol=1e-6)
        assert int(result.state.updates) == updates
        assert result.flags.all() and result.flags.shape == (updates + 1,)
        np.testing.assert_array_equal(state.weights["w"], np.ones(2))  # nothing committed
        results.append(result)
    np.testing.assert_allclose(results[0].state.weights["w"], results[1].state.weights["w"],
                               rtol=1e-6)


def test_a_stage_is_built_from_its_spec_and_the_model_alone():
    """What a stage worker process gets - the model and its stage's spec, pickled without the
    stage's graph - builds programs that compute what the session's own stage programs do."""
    import dataclasses
    import pickle
    import warnings

    import onnx
    from pipeline_models import mlp

    from popart_kit._runtime.xla.lowering import lower
    from popart_kit._runtime.xla.stages import StagePrograms

    model, x, y, loss, _ = mlp(2)
    cfg = pk.SessionConfig(mode="training", batches_per_step=1, accumulation={"factor": 3},
                           ipus_per_replica=2, pipeline={"enabled": True},
                           device={"target": "offline"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pk.PopartKitWarning)
        sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(0.1), backend="xla")
    pipeline = sess.runtime.pipeline
    spec = pipeline.specs[0]
    sent = pickle.loads(pickle.dumps(spec.portable()))
    assert sent.stage.graph is None and spec.stage.graph is not None
    rebuilt = dataclasses.replace(sent, stage=sent.stage.built(lower(onnx.load_from_string(model))))
    weights = {k: jnp.asarray(v) for k, v in sess.weights().items() if k in spec.stage.weights}
    feed = sess.io.allocate_inputs("random", seed=1)
    streams = {k: jnp.asarray(np.asarray(feed[k]).reshape((3, 1) + np.shape(feed[k])[1:]))
               for k in spec.stage.streams}
    here = pipeline.runner(0).programs.forward(weights, {}, streams, np.int32(1))
    there = StagePrograms(rebuilt).forward(weights, {}, streams, np.int32(1))
    assert jax.tree.structure(here) == jax.tree.structure(there)
    for a, b in zip(jax.tree.leaves(here), jax.tree.leaves(there), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_step_of_one_chunk_stays_one_program_whatever_its_operators():
    """Only a step that loops over chunks is driven from the host on CPU (XLA:CPU's slow
    convolutions inside a loop body); a step of one chunk has no loop."""
    from onnx import helper

    from popart_kit._runtime.xla.steps import loops_on_host

    conv = helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])], "g", [], []))
    assert loops_on_host(conv, "cpu", False, trips=4)
    assert not loops_on_host(conv, "cpu", False, trips=1)
    assert not loops_on_host(conv, "gpu", False, trips=4)
    assert not loops_on_host(conv, "cpu", True, trips=4)
