"""A PopART training program as Graphcore's examples write it for poprun: ``import popdist``,
``popdist.popart.configureSessionOptions`` and ``popdist.popart.getDevice``. Run it with
``python -m popart_kit.popart popdist_training.py OUT [REPLICAS]`` (REPLICAS: local replicas when
no launcher gives them); it writes its weights to ``OUT/instance<index>.npz``.
"""

import sys

import numpy as np
import popart
import popdist
import popdist.popart

BPS, MICRO, STEPS = 2, 2, 3

builder = popart.Builder()
x = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO, 4]), "x")
t = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO, 3]), "t")
w = builder.addInitializedInputTensor(
    (np.random.default_rng(3).standard_normal((4, 3)) / 2).astype(np.float32), "w")
d = builder.aiOnnx.sub([builder.aiOnnx.matmul([x, w]), t])
loss = builder.aiGraphcore.identityloss([builder.aiOnnx.mul([d, d])])

opts = popart.SessionOptions()
opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
if popdist.isPopdistEnvSet():
    popdist.popart.configureSessionOptions(opts)
    device = popdist.popart.getDevice()
    local, total = popdist.getNumLocalReplicas(), popdist.getNumTotalReplicas()
    offset = popdist.getReplicaIndexOffset()
else:
    local = total = int(sys.argv[2])
    offset = 0
    opts.enableReplicatedGraphs, opts.replicatedGraphCount = local > 1, local
    device = popart.DeviceManager().acquireAvailableDevice(local)

session = popart.TrainingSession(
    fnModel=builder.getModelProto(), loss=loss, deviceInfo=device, userOptions=opts,
    optimizer=popart.ConstSGD(0.1),
    dataFlow=popart.DataFlow(BPS, {loss: popart.AnchorReturnType("All")}))
session.prepareDevice()
session.weightsFromHost()
anchors = session.initAnchorArrays()
for step in range(STEPS):  # the same global data on every instance; each feeds its replicas'
    rng = np.random.default_rng(step)
    xs = rng.standard_normal((BPS, total, MICRO, 4)).astype(np.float32)
    ts = rng.standard_normal((BPS, total, MICRO, 3)).astype(np.float32)
    mine = slice(offset, offset + local)
    feed = {x: xs[:, mine], t: ts[:, mine]}
    if local == 1:  # PopART's host shape has no replica axis for one local replica
        feed = {name: value[:, 0] for name, value in feed.items()}
    session.run(popart.PyStepIO({name: np.ascontiguousarray(value)
                                 for name, value in feed.items()}, anchors))
weights = {w: np.empty((4, 3), np.float32)}
session.weightsToHost()
session.readWeights(popart.PyWeightsIO(weights))
index = popdist.getInstanceIndex() if popdist.isPopdistEnvSet() else 0
np.savez(f"{sys.argv[1]}/instance{index}.npz", w=weights[w])
print(f"instance {index} of {popdist.getNumInstances()}: replicas {offset}..{offset + local - 1}"
      f" of {total}")
