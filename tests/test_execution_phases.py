"""virtual_graph_mode='execution_phases': PopART's phase and IPU placement, its refusals, and
the same numbers as the unphased program."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import popart_kit.popart as popart
from popart_kit._model.execution_phases import phase_placement


def _chain(phases=(None, None, None, None)):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 8]))
    y = x
    for k, phase in enumerate(phases):
        w = b.addInitializedInputTensor(np.full([8, 8], 0.05 * (k + 1), np.float32))
        if phase is None:
            y = b.aiOnnx.matmul([y, w])
        else:
            with b.executionPhase(phase):
                y = b.aiOnnx.matmul([y, w])
    loss = b.aiGraphcore.l1loss([y], 0.1)
    return b, x, loss


def _placement(builder, phases, stages=2):
    return phase_placement(onnx.load_from_string(builder.getModelProto()), phases, stages)


def test_unannotated_ops_split_the_weight_bytes_into_phases_on_alternating_ipus():
    b, _, _ = _chain()
    placed, refused = _placement(b, 4)
    assert not refused
    assert placed == [(0, 0), (1, 1), (2, 0), (3, 1), (3, 1)]  # the loss joins the last phase


def test_annotated_phases_are_kept_and_no_op_runs_before_what_feeds_it():
    b, _, _ = _chain((0, 2, 1, 3))   # the third layer says phase 1 but reads phase 2
    placed, refused = _placement(b, 4)
    assert not refused and [p for p, _ in placed[:4]] == [0, 2, 2, 3]
    assert [ipu for _, ipu in placed[:4]] == [0, 0, 0, 1]


def test_popart_s_refusals_in_its_words():
    b, _, _ = _chain((0, 1, 2, 5))
    _, refused = _placement(b, 4)
    assert refused == ["[StreamingMemory] Maximum phase is 3, but op MatMul:0/3 has phase 5."]
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 8]))
    with b.executionPhase(1), b.virtualGraph(0):
        b.aiOnnx.relu([x])
    _, refused = _placement(b, 2)
    assert refused == ["[StreamingMemory] Op Relu:0 inconsistent execution phase 1 and "
                       "virtual graph ID 0"]


def _train(builder, x, loss, phased):
    opts = popart.SessionOptions()
    if phased:
        opts.virtualGraphMode = popart.VirtualGraphMode.ExecutionPhases
        opts.executionPhaseSettings.phases = 4
        opts.executionPhaseSettings.stages = 2
    device = popart.DeviceManager().createIpuModelDevice({"numIPUs": 2 if phased else 1})
    session = popart.TrainingSession(builder.getModelProto(), popart.DataFlow(1, [loss]), loss,
                                     popart.SGD({"defaultLearningRate": (0.1, True)}), device,
                                     userOptions=opts)
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    data = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    losses = []
    for _ in range(3):
        session.run(popart.PyStepIO({x: data}, anchors))
        losses.append(float(anchors[loss]))
    return session, losses


def test_a_phased_program_trains_as_the_unphased_one_and_shows_its_phases():
    b, x, loss = _chain((0, 1, 2, 3))
    phased, with_phases = _train(b, x, loss, True)
    _, without = _train(b, x, loss, False)
    np.testing.assert_allclose(with_phases, without, rtol=1e-6)
    assert with_phases[-1] < with_phases[0]
    table = phased._kit.layout.allocation_table()
    assert "4 execution phases" in table and "MatMul:0/3 … L1:0" in table
    with pytest.raises(popart.popart_exception, match="Maximum phase is 1"):
        opts = popart.SessionOptions()
        opts.virtualGraphMode = popart.VirtualGraphMode.ExecutionPhases
        opts.executionPhaseSettings.phases = 2
        popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.SGD({"defaultLearningRate": (0.1, True)}),
                               popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                               userOptions=opts)
