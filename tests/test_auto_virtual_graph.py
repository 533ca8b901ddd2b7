"""virtual_graph_mode='auto': PopART's AutoVirtualGraph rule placing ops on IPUs by cost."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import popart_kit as pk
import popart_kit.popart as popart
from popart_kit._model.auto_virtual_graph import auto_ipus


def _chain(sizes, dtype=np.float32):
    """input -> MatMul by a weight of each size in turn; returns (builder, input, output)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, sizes[0][0]]))
    y = x
    for k, (rows, cols) in enumerate(sizes):
        y = b.aiOnnx.matmul([y, b.addInitializedInputTensor(
            np.full([rows, cols], 0.01 * (k + 1), dtype))])
    b.addOutputTensor(y)
    return b, x, y


def _ipus(builder, n, training=False, **kw):
    return auto_ipus(onnx.load_from_string(builder.getModelProto()), n, training, **kw)


def test_equal_weights_split_evenly_and_ratios_move_the_split():
    b, _, _ = _chain([(8, 8)] * 4)
    assert _ipus(b, 1) == [0, 0, 0, 0]
    assert _ipus(b, 2) == [0, 0, 1, 1]
    assert _ipus(b, 4) == [0, 1, 2, 3]
    assert _ipus(b, 2, split_ratios=[0.25, 0.75]) == [0, 1, 1, 1]


def test_the_cost_is_the_bytes_of_the_weights_an_op_reads():
    # one weight of 64x64 outweighs three of 8x8: the split comes right after it
    b, _, _ = _chain([(8, 64), (64, 8), (8, 8), (8, 8)])
    assert _ipus(b, 2) == [0, 1, 1, 1]


def test_independent_branches_are_subgraphs_placed_in_order():
    b = popart.Builder()
    x1 = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 8]))
    x2 = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 8]))
    w = [b.addInitializedInputTensor(np.ones([8, 8], np.float32)) for _ in range(3)]
    a = b.aiOnnx.matmul([x1, w[0]])
    c = b.aiOnnx.matmul([x2, w[1]])
    y = b.aiOnnx.matmul([b.aiOnnx.add([a, c]), w[2]])
    b.addOutputTensor(y)
    # subgraphs {a}, {c}, {add, y}: one per IPU with three IPUs
    assert _ipus(b, 3) == [0, 1, 2, 2]


def test_too_few_split_points_are_refused_in_popart_s_words():
    b, x, y = _chain([(8, 8)])
    opts = popart.SessionOptions()
    opts.virtualGraphMode = popart.VirtualGraphMode.Auto
    device = popart.DeviceManager().createIpuModelDevice({"numIPUs": 4})
    with pytest.raises(popart.popart_exception) as err:
        popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), device,
                                userOptions=opts)
    assert err.value.args[0] == "[AutoVirtualGraph] Couldn't find enough splits for 4 IPUs. " \
                                "Only found 1"


def test_an_auto_placed_session_computes_what_an_unplaced_one_does_and_shows_the_placement():
    b, x, y = _chain([(8, 8)] * 4)
    data = np.linspace(-1, 1, 8, dtype=np.float32)[None]
    results = []
    for mode, ipus in (("off", 1), ("auto", 2)):
        cfg = pk.SessionConfig(mode="inference", ipus_per_replica=ipus,
                               virtual_graph_mode=mode, device={"target": "ipu_model"})
        with pk.InferenceSession(b.getModelProto(), cfg, anchors={y: "All"},
                                 backend="xla") as session:
            results.append(session.run({x: data})[y])
            placed = session.layout.ipus_used
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6)
    assert placed == {0, 1}
    opts = popart.SessionOptions()
    opts.virtualGraphMode = popart.VirtualGraphMode.Auto
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                      popart.DeviceManager().createIpuModelDevice(
                                          {"numIPUs": 2}), userOptions=opts)
    ops = json.loads(session._serializeIr(popart.IrSerializationFormat.JSON))["maingraph"]
    assert [op["attributes"]["__ipu_number"] for op in ops] == ["0", "0", "1", "1"]
    assert ops[0]["type"] == "MatMul" and ops[0]["inputs"][0]["shape"] == "[1 8]"
