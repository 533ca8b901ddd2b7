"""ai.graphcore PrintTensor on the xla backend: poplar's text on stderr, as the step runs, and
its gradient printed as PopART's grad op names it."""

from __future__ import annotations

import numpy as np

import popart_kit as pk
from popart_kit._runtime.xla.ops_print import poplar_text

CFG = dict(device={"target": "offline"})


def test_poplar_text_formats_as_poplars_default():
    assert poplar_text("a", np.array([6, 9, 12], np.int32)) == "a: [ 6  9 12]"
    assert poplar_text("b", np.array([[1.0, -2.5]], np.float32)) == \
        "b: [[ 1.0000000 -2.5000000]]"
    assert poplar_text("c", np.float16(0.5)) == "c: 0.5000000"
    assert "..." in poplar_text("d", np.arange(2000))  # summarised past 1000 elements


def test_printed_as_the_step_runs_read_or_not(capfd):
    b = pk.Builder()
    i1 = b.addInputTensor(pk.TensorInfo("INT32", [3]))
    i2 = b.addInputTensor(pk.TensorInfo("INT32", [3]))
    a1 = b.aiOnnx.add([i1, i2])
    b.aiGraphcore.printtensor([a1])  # its output read by nothing: printed all the same
    a2 = b.aiOnnx.add([i1, a1])
    out = b.aiGraphcore.printtensor([a2], title="sum")
    sess = pk.InferenceSession(b.getModelProto(), pk.SessionConfig(mode="inference", **CFG),
                               anchors={out: "All"}, backend="xla")
    capfd.readouterr()
    got = sess.run({i1: np.array([1, 2, 3], np.int32), i2: np.array([4, 5, 6], np.int32)})
    err = capfd.readouterr().err
    np.testing.assert_array_equal(got[out], [6, 9, 12])
    assert f"{a1}: [5 7 9]" in err and "sum: [ 6  9 12]" in err


def test_gradients_printed_under_popart_names(capfd):
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.array([1.0, -2.0], np.float32))
    pw = b.aiGraphcore.printtensor([w])  # gradient: Gradient___<w>
    y = b.aiOnnx.mul([x, pw])
    py = b.aiGraphcore.printtensor([y], title="y")  # gradient: y_gradient
    pz = b.aiGraphcore.printtensor([py], print_gradient=0, title="z")  # no gradient printed
    loss = b.aiGraphcore.l1loss([pz], 0.5, reduction=pk.ReductionType.Sum)
    sess = pk.TrainingSession(b.getModelProto(), pk.SessionConfig(mode="training", **CFG),
                              loss=loss, optimizer=pk.SGD(0.1), backend="xla")
    capfd.readouterr()
    sess.run({x: np.array([3.0, 4.0], np.float32)})
    lines = [line for line in capfd.readouterr().err.splitlines() if ": [" in line]
    # d loss / d y = 0.5 sign(y); d loss / d w = x * 0.5 sign(y)
    assert lines == [f"{w}: [ 1.0000000 -2.0000000]", "y: [ 3.0000000 -8.0000000]",
                     "z: [ 3.0000000 -8.0000000]", "y_gradient: [ 0.5000000 -0.5000000]",
                     f"Gradient___{w}: [ 1.5000000 -2.0000000]"]
