"""popart.GraphTransformer: the edited models are valid ONNX and compute what the originals
compute (onnxruntime as the oracle), with PopART's refusals."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart_kit.popart as popart


def _run(model_bytes, feeds):
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _model(dtype, values, extra_input=False):
    x = helper.make_tensor_value_info("x", dtype, list(values.shape))
    y = helper.make_tensor_value_info("y", dtype, list(values.shape))
    inputs = [x] + ([helper.make_tensor_value_info("unused", dtype, [1])] if extra_input else [])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g", inputs, [y],
        [numpy_helper.from_array(values, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("method, source, target", [
    ("convertFloatsToHalfs", np.float32, np.float16),
    ("convertDoublesToFloats", np.float64, np.float32),
    ("convertDoublesToHalfs", np.float64, np.float16),
    ("convertINT64ToINT32", np.int64, np.int32),
    ("convertINT16ToINT32", np.int16, np.int32),
    ("convertINT8ToINT32", np.int8, np.int32),
    ("convertUINT8ToINT32", np.uint8, np.int32),
    ("convertUINT16ToINT32", np.uint16, np.int32),
])
def test_conversions_retype_every_tensor_and_keep_the_values(method, source, target):
    values = np.arange(6).reshape(2, 3).astype(source)
    model = _model(helper.np_dtype_to_tensor_dtype(np.dtype(source)), values)
    transformer = popart.GraphTransformer(model.SerializeToString())
    getattr(transformer, method)()
    converted = onnx.load_from_string(transformer.getModelProto())
    onnx.checker.check_model(converted, full_check=True)
    x = (np.arange(6).reshape(2, 3) % 3).astype(source)
    if source in (np.float32, np.float64, np.int64):  # Add types onnxruntime implements
        expected = _run(model.SerializeToString(), {"x": x})[0]
        got = _run(transformer.getModelProto(), {"x": x.astype(target)})[0]
        assert got.dtype == target
        np.testing.assert_allclose(got, expected.astype(target))
    np.testing.assert_array_equal(numpy_helper.to_array(converted.graph.initializer[0]),
                                  values.astype(target), strict=True)
    assert converted.graph.input[0].type.tensor_type.elem_type == \
        helper.np_dtype_to_tensor_dtype(np.dtype(target))


def test_int64_out_of_int32_range_is_refused_unless_clipped():
    values = np.array([2**40, -(2**40), 5], np.int64)
    model = _model(TensorProto.INT64, values).SerializeToString()
    with pytest.raises(popart.popart_exception, match="set 'clip' to 'true'"):
        popart.GraphTransformer(model).convertINT64ToINT32()
    transformer = popart.GraphTransformer(model)
    transformer.convertINT64ToINT32(clip=True)
    got = numpy_helper.to_array(onnx.load_from_string(transformer.getModelProto())
                                .graph.initializer[0])
    np.testing.assert_array_equal(got, [2**31 - 1, -(2**31), 5])


def test_initializers_become_constants_and_unused_inputs_go():
    values = np.arange(3, dtype=np.int32)
    model = _model(TensorProto.INT32, values, extra_input=True)
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.INT32, [3]))
    transformer = popart.GraphTransformer(model.SerializeToString())
    transformer.convertAllFixedPointInitializersToConstants()
    transformer.removeUnusedInputs()
    out = onnx.load_from_string(transformer.getModelProto())
    assert [i.name for i in out.graph.input] == ["x"]
    assert not out.graph.initializer and out.graph.node[0].op_type == "Constant"
    x = np.array([1, 2, 3], np.int32)
    np.testing.assert_array_equal(_run(transformer.getModelProto(), {"x": x})[0], x + values)
    with pytest.raises(popart.popart_exception, match="not in the model initalizers"):
        transformer.convertInitializersToConstants(["nope"])


def test_batch_normalization_gets_its_training_outputs():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3, 4, 4]))
    params = [b.addInitializedInputTensor(np.ones(3, np.float32)) for _ in range(4)]
    (y,) = b.aiOnnx.batchnormalization([x, *params], 1)
    b.addOutputTensor(y)
    transformer = popart.GraphTransformer(b.getModelProto())
    transformer.prepareNodesForTraining()
    node = onnx.load_from_string(transformer.getModelProto()).graph.node[0]
    assert len(node.output) == 5 and node.output[1].startswith("BatchNormalization_")


def test_external_data_is_written_and_read_as_popart_does(tmp_path, monkeypatch):
    """onnxutil.cpp: saveInitializersExternally writes the tensors one after another and keeps
    the location as given; a session reads it as a path from the working directory, whatever
    form the model comes in (here its bytes); a location that is not there is refused in
    PopART's words, and the Builder's loader (onnx's checker) is a RuntimeError."""
    monkeypatch.chdir(tmp_path)
    w = np.array([1.0, -2.0, 3.0], np.float32)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]))
    i1 = b.addInitializedInputTensor(w)
    y = b.aiOnnx.add([x, i1])
    transformer = popart.GraphTransformer(b.getModelProto())
    transformer.saveInitializersExternally([i1], "weights.bin")  # relative to the cwd
    np.testing.assert_array_equal(np.fromfile("weights.bin", np.float32), w)
    with pytest.raises(popart.popart_exception, match="already has an external data_location"):
        transformer.saveInitializersExternally([i1], "weights.bin")
    with pytest.raises(popart.popart_exception, match="is not an initializer"):
        transformer.saveInitializersExternally([y], "other.bin")
    model = transformer.getModelProto()
    session = popart.InferenceSession(model, popart.DataFlow(1, [y]),
                                      popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO({x: np.ones(3, np.float32)}, anchors))
    np.testing.assert_array_equal(anchors[y], w + 1)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(popart.popart_exception) as err:
        popart.InferenceSession(model, popart.DataFlow(1, [y]),
                                popart.DeviceManager().createCpuDevice())
    assert f"Unrecognised file name 'weights.bin' for externally stored tensor '{i1}'" \
        in err.value.args[0]
    with pytest.raises(RuntimeError, match="should be stored in weights.bin, but it doesn't "
                                           "exist or is not accessible"):
        popart.Builder(model)
    # a model file whose data sits beside it (ONNX's exporters' convention) reads from any
    # working directory; its bytes still do not
    onnx.save(model, str(tmp_path / "model.onnx"))
    session = popart.InferenceSession(str(tmp_path / "model.onnx"), popart.DataFlow(1, [y]),
                                      popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    session.run(popart.PyStepIO({x: np.ones(3, np.float32)}, anchors))
    np.testing.assert_array_equal(anchors[y], w + 1)
    with pytest.raises(popart.popart_exception, match="Unrecognised file name 'weights.bin'"):
        popart.InferenceSession((tmp_path / "model.onnx").read_bytes(), popart.DataFlow(1, [y]),
                                popart.DeviceManager().createCpuDevice())


def _external_training(tmp_path, monkeypatch):
    """A TrainingSession (SGD with momentum) over y = x * w whose w is kept in weights.bin."""
    monkeypatch.chdir(tmp_path)
    w = np.array([1.0, -2.0, 3.0], np.float32)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]))
    i1 = b.addInitializedInputTensor(w)
    loss = b.aiGraphcore.identityloss([b.aiOnnx.mul([x, i1])])
    b.saveInitializersExternally([i1], "weights.bin")
    session = popart.TrainingSession(
        b.getModelProto(), popart.DataFlow(1, []), loss,
        popart.SGD({"defaultLearningRate": (0.1, True), "defaultMomentum": (0.5, True)}),
        popart.DeviceManager().createCpuDevice())
    return session, w, x, i1


def test_model_to_host_writes_trained_values_into_the_external_file(tmp_path, monkeypatch):
    """session.cpp:684 modelToHost: an externally saved weight's new values (and its optimizer
    state, appended to the same file when the session is made: ir.cpp:1872) are written into
    the file it came from, and the model written keeps referring to it; a location gone from
    the working directory is refused in PopART's words before anything is written."""
    session, w, x, i1 = _external_training(tmp_path, monkeypatch)
    assert (tmp_path / "weights.bin").stat().st_size == 2 * w.nbytes  # w, then Accl___w
    session.prepareDevice()
    session.weightsFromHost()
    session.run(popart.PyStepIO({x: np.full(3, 2.0, np.float32)}, {}))
    session.modelToHost("model.onnx")
    on_disk = np.fromfile("weights.bin", np.float32)
    # SGD's first step: velocity = gradient (x / 3: identityloss's default reduction is
    # Mean), w -= lr * velocity
    np.testing.assert_allclose(on_disk[:3], w - 0.1 * 2.0 / 3, rtol=1e-6)
    accl = np.zeros(3, np.float32)
    session.readWeights(popart.PyWeightsIO({popart.reservedAcclPrefix() + i1: accl}))
    np.testing.assert_array_equal(on_disk[3:], accl)
    saved = {t.name: t for t in onnx.load("model.onnx", load_external_data=False)
             .graph.initializer}
    info = {e.key: e.value for e in saved[popart.reservedAcclPrefix() + i1].external_data}
    assert saved[i1].data_location == TensorProto.EXTERNAL
    assert info == {"location": "weights.bin", "length": "12", "offset": "12"}
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(popart.popart_exception,
                       match=f"Unrecognised file name 'weights.bin' for externally stored "
                             f"tensor '{i1}'"):
        session.modelToHost("model.onnx")
    assert not (tmp_path / "elsewhere" / "model.onnx").exists()


def test_update_externally_saved_tensor_locations(tmp_path, monkeypatch):
    """session.cpp:621: the tensors of one file move, as that file holds them, to a new file
    that modelToHost then writes; an existing target, a missing source and a file holding
    none of the model's tensors are refused in PopART's words."""
    session, w, x, i1 = _external_training(tmp_path, monkeypatch)
    (tmp_path / "taken.bin").write_bytes(b"")
    with pytest.raises(popart.popart_exception, match="but file 'taken.bin' already exists"):
        session.updateExternallySavedTensorLocations("weights.bin", "taken.bin")
    with pytest.raises(popart.popart_exception, match="but file 'nothing.bin' does not exist"):
        session.updateExternallySavedTensorLocations("nothing.bin", "new.bin")
    with pytest.raises(popart.popart_exception,
                       match="No ONNX model initializers have external location set to "
                             "'taken.bin'"):
        session.updateExternallySavedTensorLocations("taken.bin", "new.bin")
    before = np.fromfile("weights.bin", np.float32)
    session.updateExternallySavedTensorLocations("weights.bin", "new.bin")
    np.testing.assert_array_equal(np.fromfile("new.bin", np.float32), before)
    session.prepareDevice()
    session.weightsFromHost()
    session.run(popart.PyStepIO({x: np.full(3, 2.0, np.float32)}, {}))
    session.modelToHost("model.onnx")
    np.testing.assert_array_equal(np.fromfile("weights.bin", np.float32), before)
    np.testing.assert_allclose(np.fromfile("new.bin", np.float32)[:3], w - 0.2 / 3, rtol=1e-6)
