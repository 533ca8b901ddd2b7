"""A plain PopART program: recomputation. An 8-layer model trains with
``autoRecomputation = RecomputationType.Standard``; every second layer's output is marked
``Checkpoint`` (kept for the backward pass), the layers between are recomputed from the last
checkpoint instead of being kept. The same program without recomputation gives the same
losses: recomputation trades compute for memory and never changes the numbers.

Run it without an IPU:  popart-kit run examples/popart_recomputation.py
(or on an IPU system with the Poplar SDK:  python examples/popart_recomputation.py)
"""

import json

import numpy as np
import popart

LAYERS, MICRO_BATCH, WIDTH, STEPS = 8, 8, 32, 5


def build():
    builder = popart.Builder()
    x = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO_BATCH, WIDTH]), "x")
    target = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO_BATCH, WIDTH]), "target")
    rng = np.random.default_rng(0)
    h = x
    for layer in range(LAYERS):
        w = builder.addInitializedInputTensor(
            (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
            f"w{layer}")
        h = builder.aiOnnx.tanh([builder.aiOnnx.matmul([h, w])])
        if layer % 2 == 1:
            builder.checkpointOutput([h])   # kept: the next segment restarts from here
    loss = builder.aiGraphcore.l1loss([builder.aiOnnx.sub([h, target])], 1.0)
    return builder, x, target, loss


def train(recomputation):
    builder, x, target, loss = build()
    opts = popart.SessionOptions()
    opts.autoRecomputation = recomputation
    session = popart.TrainingSession(
        fnModel=builder.getModelProto(),
        dataFlow=popart.DataFlow(1, {loss: popart.AnchorReturnType("All")}),
        loss=loss,
        optimizer=popart.SGD({"defaultLearningRate": (0.05, False)}),
        userOptions=opts,
        deviceInfo=popart.DeviceManager().createCpuDevice(),
    )
    if recomputation == popart.RecomputationType.Standard:
        graph = json.loads(session._serializeIr(popart.IrSerializationFormat.JSON))
        kept = [op["inputs"][0]["name"] for op in graph["maingraph"]
                if op["attributes"].get("__recompute_output_in_backward_pass") == "1"]
        print("checkpoints kept for the backward pass:", ", ".join(kept))
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    rng = np.random.default_rng(1)
    inputs = rng.standard_normal((MICRO_BATCH, WIDTH)).astype(np.float32)
    targets = np.tanh(inputs[:, ::-1]).copy()
    losses = []
    for _ in range(STEPS):
        session.run(popart.PyStepIO({x: inputs, target: targets}, anchors))
        losses.append(float(anchors[loss]))
    return losses


recomputed = train(popart.RecomputationType.Standard)
kept = train(popart.RecomputationType.NoRecompute)
for step, (a, b) in enumerate(zip(recomputed, kept, strict=True)):
    print(f"step {step}: loss {a:.5f} recomputing, {b:.5f} keeping every activation")
assert np.allclose(recomputed, kept, rtol=1e-5), "recomputation changed the numbers"
