"""Recomputation on the xla backend: PopART's autoRecomputation modes and the Builder's
per-node marks change what the backward keeps, never the numbers."""

from __future__ import annotations

import numpy as np
import pytest

import popart_kit as pk
import popart_kit.popart as popart


def _model(mark=None):
    rng = np.random.default_rng(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 16]))
    h = x
    for k in range(6):
        w = b.addInitializedInputTensor(
            (rng.standard_normal((16, 16)) / 4).astype(np.float32))
        h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, w])])
        if mark is not None and k % 2 == 0:
            b.recomputeOutputInBackwardPass(h, mark)
    loss = b.aiGraphcore.l1loss([h], 0.1)
    return b, x, loss


def _train(builder, x, loss, mode):
    cfg = pk.SessionConfig(mode="training", batches_per_step=2, device={"target": "cpu"},
                           pipeline={"recomputation": mode})
    with pk.TrainingSession(builder.getModelProto(), cfg, loss=loss, optimizer=pk.SGD(0.1),
                            backend="xla") as session:
        data = np.linspace(-1, 1, 2 * 4 * 16, dtype=np.float32).reshape(2, 4, 16)
        for _ in range(2):
            session.run({x: data})
        return session.weights()


@pytest.mark.parametrize("mode", ["standard", "recompute_all", "norm_only"])
def test_each_mode_trains_as_without_recomputation(mode):
    b, x, loss = _model()
    plain, again = _train(b, x, loss, "none"), _train(b, x, loss, mode)
    for name, value in plain.items():
        np.testing.assert_allclose(again[name], value, rtol=1e-6, atol=1e-7)


def test_nodes_marked_recompute_train_as_unmarked_ones():
    plain = _train(*_model(), "none")
    marked = _train(*_model(popart.RecomputeType.Recompute), "none")
    for name, value in plain.items():
        np.testing.assert_allclose(marked[name], value, rtol=1e-6, atol=1e-7)


def test_a_recomputing_step_keeps_fewer_tensors_for_its_backward(capsys):
    """The backward's saved residuals (JAX's print_saved_residuals): with recompute_all and
    three nodes marked Checkpoint, the segments between them are recomputed, so fewer
    activations are saved than without recomputation; the gradient is the same."""
    import jax
    from jax import ad_checkpoint

    from popart_kit._runtime.xla.lowering import lower, recomputation

    b, x, loss = _model(popart.RecomputeType.Checkpoint)
    graph = lower(b.getModelProto())
    data = np.ones((4, 16), np.float32)

    def loss_of(weights):
        return graph.evaluate(weights, {x: data}, [loss])[loss]

    with recomputation("recompute_all"):
        ad_checkpoint.print_saved_residuals(loss_of, graph.weights)
        recomputed = jax.grad(loss_of)(graph.weights)
    kept = capsys.readouterr().out.strip().splitlines()
    ad_checkpoint.print_saved_residuals(loss_of, graph.weights)
    everything = capsys.readouterr().out.strip().splitlines()
    assert len(kept) < len(everything)
    for name, value in jax.grad(loss_of)(graph.weights).items():
        np.testing.assert_allclose(recomputed[name], value, rtol=1e-6)
