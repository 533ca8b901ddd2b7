"""Small PopART programs shared by the tests of popart_kit.popart."""

from __future__ import annotations

import numpy as np

import popart_kit.popart as popart

RNG = np.random.default_rng(3)
W0 = (RNG.standard_normal((4, 3)) / 2).astype(np.float32)


def regression(micro: int = 2, stages: int = 0):
    """y = x @ w; loss = mean((y - t)^2) as PopART code writes it; ``stages`` > 0 splits it in
    two pipeline stages on two IPUs."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [micro, 4]), "x")
    t = b.addInputTensor(popart.TensorInfo("FLOAT", [micro, 3]), "t")
    w = b.addInitializedInputTensor(W0.copy(), "w")
    if stages:
        with b.virtualGraph(0), b.pipelineStage(0):
            y = b.aiOnnx.matmul([x, w])
        with b.virtualGraph(1), b.pipelineStage(1):
            d = b.aiOnnx.sub([y, t])
            loss = b.aiGraphcore.identityloss([b.aiOnnx.mul([d, d])])
    else:
        y = b.aiOnnx.matmul([x, w])
        d = b.aiOnnx.sub([y, t])
        loss = b.aiGraphcore.identityloss([b.aiOnnx.mul([d, d])])
    return b.getModelProto(), x, t, w, y, loss


def options(replicas: int = 1, accumulation: int = 1, pipelining: bool = False):
    opts = popart.SessionOptions()
    if replicas > 1:
        opts.enableReplicatedGraphs = True
        opts.replicatedGraphCount = replicas
    if accumulation > 1:
        opts.enableGradientAccumulation = True
        opts.accumulationFactor = accumulation
        opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
    if pipelining:
        opts.enablePipelining = True
        opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    return opts


def data(bps: int, accumulation: int, replicas: int, micro: int, seed: int = 0):
    """Inputs in PopART's host layout [bps, A, R, micro, ...] (no factor dropped here;
    PopART only counts elements)."""
    rng = np.random.default_rng(seed)
    lead = [bps, accumulation, replicas, micro]
    return (rng.standard_normal(lead + [4]).astype(np.float32),
            rng.standard_normal(lead + [3]).astype(np.float32))


def numpy_training(xs, ts, lr, optimizer="sgd", steps=None, b1=0.9, b2=0.999, eps=1e-6):
    """The weights after each update: gradients of mean((x w - t)^2) averaged over the A
    micro-batches and R replicas of an update (PopART's Mean reduction)."""
    w = W0.astype(np.float64)
    m = v = np.zeros_like(w)
    for step, (xb, tb) in enumerate(zip(xs, ts, strict=True)):  # one update per bps entry
        grads = []
        for xa, ta in zip(xb.reshape(-1, *xb.shape[-2:]), tb.reshape(-1, *tb.shape[-2:]),
                          strict=True):
            d = xa @ w - ta
            grads.append(2 * xa.T @ d / d.size)
        g = np.mean(grads, axis=0)
        if optimizer == "sgd":
            w = w - lr * g
        else:
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            mc, vc = m / (1 - b1 ** (step + 1)), v / (1 - b2 ** (step + 1))
            w = w - lr * mc / (np.sqrt(vc) + eps)
    return w
