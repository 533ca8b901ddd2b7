"""A plain PopART program: a linear classifier trained with 2 replicas and gradient
accumulation of 4, written as PopART's documentation writes programs.

Run it without an IPU:  popart-kit run examples/popart_replicated_training.py
(or on an IPU system with the Poplar SDK:  python examples/popart_replicated_training.py)
"""

import numpy as np
import popart

BATCHES_PER_STEP, ACCUMULATION, REPLICAS, MICRO_BATCH = 2, 4, 2, 8

builder = popart.Builder()
x = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO_BATCH, 4]), "x")
label = builder.addInputTensor(popart.TensorInfo("INT32", [MICRO_BATCH]), "label")
w = builder.addInitializedInputTensor(np.zeros((4, 3), np.float32), "w")
b = builder.addInitializedInputTensor(np.zeros((3,), np.float32), "b")
logits = builder.aiOnnx.add([builder.aiOnnx.matmul([x, w]), b])
probs = builder.aiOnnx.softmax([logits], axis=1)
loss = builder.aiGraphcore.nllloss([probs, label], popart.ReductionType.Mean)

opts = popart.SessionOptions()
opts.enableReplicatedGraphs = True
opts.replicatedGraphCount = REPLICAS
opts.enableGradientAccumulation = True
opts.accumulationFactor = ACCUMULATION
opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean

device = popart.DeviceManager().acquireAvailableDevice(REPLICAS)
session = popart.TrainingSession(
    fnModel=builder.getModelProto(),
    dataFlow=popart.DataFlow(BATCHES_PER_STEP, {loss: popart.AnchorReturnType("All")}),
    loss=loss,
    optimizer=popart.SGD({"defaultLearningRate": (0.5, False)}),
    userOptions=opts,
    deviceInfo=device,
)
session.prepareDevice()
session.weightsFromHost()
anchors = session.initAnchorArrays()

rng = np.random.default_rng(0)
centres = rng.standard_normal((3, 4)).astype(np.float32) * 3
host = [BATCHES_PER_STEP, ACCUMULATION, REPLICAS, MICRO_BATCH]
for step in range(10):
    y = rng.integers(0, 3, host).astype(np.int32)
    xs = (centres[y] + rng.standard_normal(host + [4])).astype(np.float32)
    session.run(popart.PyStepIO({x: xs, label: y}, anchors))
    print(f"step {step}: loss {anchors[loss].mean():.4f}  (anchor shape {anchors[loss].shape})")

weights = {w: np.zeros((4, 3), np.float32), b: np.zeros((3,), np.float32)}
session.weightsToHost()
session.readWeights(popart.PyWeightsIO(weights))
print("trained bias:", weights[b])
