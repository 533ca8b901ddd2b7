"""A plain PopART program: PopART splits a 4-layer model over 2 IPUs itself
(VirtualGraphMode.Auto: each IPU gets about half of the weight bytes), then trains it pipelined
with gradient accumulation.

Run it without an IPU:  popart-kit run examples/popart_auto_virtual_graph.py
(or on an IPU system with the Poplar SDK:  python examples/popart_auto_virtual_graph.py)
"""

import json

import numpy as np
import popart

IPUS, ACCUMULATION, MICRO_BATCH, WIDTH = 2, 4, 8, 16

builder = popart.Builder()
x = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO_BATCH, WIDTH]), "x")
target = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO_BATCH, WIDTH]), "target")
rng = np.random.default_rng(0)
h = x
for layer in range(4):
    w = builder.addInitializedInputTensor(
        (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), f"w{layer}")
    h = builder.aiOnnx.matmul([h, w])
    if layer < 3:
        h = builder.aiOnnx.tanh([h])
loss = builder.aiGraphcore.l1loss([builder.aiOnnx.sub([h, target])], 1.0)

opts = popart.SessionOptions()
opts.virtualGraphMode = popart.VirtualGraphMode.Auto   # no IPU annotations in the model
opts.enablePipelining = True
opts.enableGradientAccumulation = True
opts.accumulationFactor = ACCUMULATION

session = popart.TrainingSession(
    fnModel=builder.getModelProto(),
    dataFlow=popart.DataFlow(1, {loss: popart.AnchorReturnType("All")}),
    loss=loss,
    optimizer=popart.SGD({"defaultLearningRate": (0.05, False)}),
    userOptions=opts,
    deviceInfo=popart.DeviceManager().acquireAvailableDevice(IPUS),
)
for op in json.loads(session._serializeIr(popart.IrSerializationFormat.JSON))["maingraph"]:
    ipu = op["attributes"]["__ipu_number"]
    print(f"{op['type']:>8} {op['outputs'][0]['name']:<14} on IPU {ipu}")

session.prepareDevice()
session.weightsFromHost()
anchors = session.initAnchorArrays()
inputs = rng.standard_normal((ACCUMULATION, MICRO_BATCH, WIDTH)).astype(np.float32)
targets = np.tanh(inputs[..., ::-1]).copy()
for step in range(8):
    session.run(popart.PyStepIO({x: inputs, target: targets}, anchors))
    print(f"step {step}: loss {anchors[loss].mean():.4f}")
