"""A plain PopART program: phased execution. Each layer of a 4-layer model is its own
execution phase; phases alternate between 2 IPUs (phase % 2), weights live off chip between
their phases, and the program trains.

Run it without an IPU:  popart-kit run examples/popart_execution_phases.py
(or on an IPU system with the Poplar SDK:  python examples/popart_execution_phases.py)
"""

import json

import numpy as np
import popart

PHASES, MICRO_BATCH, WIDTH = 4, 8, 16

builder = popart.Builder()
x = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO_BATCH, WIDTH]), "x")
target = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO_BATCH, WIDTH]), "target")
rng = np.random.default_rng(0)
h = x
for phase in range(PHASES):
    with builder.executionPhase(phase):   # the IPU follows: phase % stages
        w = builder.addInitializedInputTensor(
            (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
            f"w{phase}")
        h = builder.aiOnnx.tanh([builder.aiOnnx.matmul([h, w])])
with builder.executionPhase(PHASES - 1):
    loss = builder.aiGraphcore.l1loss([builder.aiOnnx.sub([h, target])], 1.0)

opts = popart.SessionOptions()
opts.virtualGraphMode = popart.VirtualGraphMode.ExecutionPhases
opts.executionPhaseSettings.phases = PHASES
opts.executionPhaseSettings.stages = 2
opts.weightTensorLocationSettings.location.storage = popart.TensorStorage.OffChip

session = popart.TrainingSession(
    fnModel=builder.getModelProto(),
    dataFlow=popart.DataFlow(1, {loss: popart.AnchorReturnType("All")}),
    loss=loss,
    optimizer=popart.SGD({"defaultLearningRate": (0.05, False)}),
    userOptions=opts,
    deviceInfo=popart.DeviceManager().acquireAvailableDevice(2),
)
for op in json.loads(session._serializeIr(popart.IrSerializationFormat.JSON))["maingraph"]:
    at = op["attributes"]
    print(f"{op['type']:>6} in phase {at['__execution_phase']} on IPU {at['__ipu_number']}")

session.prepareDevice()
session.weightsFromHost()
anchors = session.initAnchorArrays()
inputs = rng.standard_normal((MICRO_BATCH, WIDTH)).astype(np.float32)
targets = np.tanh(inputs[:, ::-1]).copy()
for step in range(8):
    session.run(popart.PyStepIO({x: inputs, target: targets}, anchors))
    print(f"step {step}: loss {float(anchors[loss]):.4f}")
