"""Models and sessions the pipeline tests share: a K-stage MLP and PopART's continuous
pipelining simulated by hand."""

from __future__ import annotations

import warnings

import numpy as np

import popart_kit as pk

MICRO, WIDTH, LR = 2, 4, 0.02


def mlp(stages: int):
    """x [MICRO, WIDTH] -> tanh(h W_s) per stage but the last -> y = h W_last, loss sum(y^2)."""
    rng = np.random.default_rng(stages)
    b = pk.Builder()
    pb = pk.PipelineBuilder(b)
    h = x = b.addInputTensor(pk.TensorInfo("FLOAT", [MICRO, WIDTH]), debugContext="x")
    weights = {}
    for s in range(stages):
        w = (rng.standard_normal((WIDTH, WIDTH)) * 0.5).astype(np.float32)
        with pb.stage(s):
            weights[f"w{s}"] = w
            h = b.aiOnnx.matmul([h, b.addInitializedInputTensor(w, f"w{s}")])
            if s < stages - 1:
                h = b.aiOnnx.tanh([h])
            else:
                loss = b.aiOnnx.reducesumsquare([h], keepdims=0)
    return b.getModelProto(), x, h, loss, weights


def session(stages, replicas, training, pipelined, bps, acc=1, recompute="none", seed=0,
            workers="threads", sum_anchor=False):
    model, x, y, loss, _ = mlp(stages)
    cfg = pk.SessionConfig(
        mode="training" if training else "inference", batches_per_step=bps,
        accumulation={"factor": acc}, replication={"local_factor": replicas},
        ipus_per_replica=stages, pipeline={"enabled": pipelined, "recomputation": recompute},
        device={"target": "offline"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pk.PopartKitWarning)
        if training:
            sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=pk.SGD(learning_rate=LR),
                                      anchors={loss: "All", y: "All"}, backend="xla",
                                      pipeline_workers=workers)
        else:
            anchors = {y: "Sum" if sum_anchor else "All"}
            sess = pk.InferenceSession(model, cfg, anchors=anchors, backend="xla",
                                       pipeline_workers=workers)
    rng = np.random.default_rng(seed)
    feed = {x: rng.standard_normal(sess.io.input_shape(x)).astype(np.float32)}
    return sess, feed


def simulate_continuous(weights: dict, xs: np.ndarray, stages: int, lr: float,
                        history: dict | None = None):
    """PopART's continuous pipelining by hand: cycle t runs pipeline stage p on micro-batch
    t - p, stages in order; a backward reads the weight as it is then and the activations its
    forward stashed, and its stage's weight update follows it at once. ``history``, given, gets
    ``{(weight, m): value}`` once micro-batch m's update has made it."""
    w = [weights[f"w{s}"].astype(np.float64).copy() for s in range(stages)]
    m_count, depth = len(xs), 2 * stages - 1
    act, stash, grad, losses = {}, {}, {}, {}
    for t in range(m_count + depth - 1):
        for p in range(depth):
            m = t - p
            if not 0 <= m < m_count:
                continue
            if p < stages - 1:  # a forward stage
                a_in = xs[m] if p == 0 else act.pop((p - 1, m))
                out = np.tanh(a_in @ w[p])
                act[(p, m)], stash[(p, m)] = out, (a_in, out)
            elif p == stages - 1:  # the loss stage: forward and backward
                a_in = act.pop((p - 1, m))
                y = a_in @ w[p]
                losses[m] = (y * y).sum()
                g = 2 * y
                grad[(p, m)] = g @ w[p].T
                w[p] -= lr * a_in.T @ g
                if history is not None:
                    history[(f"w{p}", m)] = w[p].copy()
            else:
                s = depth - 1 - p
                a_in, out = stash.pop((s, m))
                g = grad.pop((s + 1, m)) * (1 - out * out)
                grad[(s, m)] = g @ w[s].T  # the current weight, before its update
                w[s] -= lr * a_in.T @ g
                if history is not None:
                    history[(f"w{s}", m)] = w[s].copy()
    return {f"w{s}": w[s] for s in range(stages)}, np.array([losses[m] for m in range(m_count)])
