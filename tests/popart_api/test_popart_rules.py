"""A PopART program meets PopART's refusals and no others: what PopART runs, the drop-in runs
(the kit's stricter checks only warn there), and what it refuses, it refuses in its words."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

import popart_kit as pk
import popart_kit.popart as popart


def _cpu():
    return popart.DeviceManager().createCpuDevice()


def _train(builder, loss, anchors, optimizer=None):
    flow = popart.DataFlow(1, {a: popart.AnchorReturnType("All") for a in anchors})
    session = popart.TrainingSession(fnModel=builder.getModelProto(), dataFlow=flow, loss=loss,
                                     optimizer=optimizer or popart.ConstSGD(0.1),
                                     deviceInfo=_cpu())
    session.prepareDevice()
    session.weightsFromHost()
    return session, session.initAnchorArrays()


def test_a_loss_on_no_weight_trains_with_a_warning_and_gives_input_gradients():
    """PopART trains a loss that depends on inputs only (their gradients anchored): the kit's
    K-no-weights is a warning here, and an error for a pk.TrainingSession."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    loss = b.aiGraphcore.l1loss([b.aiOnnx.mul([x, x])], 0.5,
                                reduction=popart.ReductionType.Sum)
    grad = popart.reservedGradientPrefix() + x
    with pytest.warns(pk.PopartKitWarning, match="K-no-weights"):
        session, anchors = _train(b, loss, [loss, grad])
    data = np.array([[1.0, -2.0, 3.0], [0.5, 0.0, -1.0]], np.float32)
    session.run(popart.PyStepIO({x: data}, anchors))
    np.testing.assert_allclose(anchors[loss], 0.5 * np.sum(data * data), rtol=1e-6)
    np.testing.assert_allclose(anchors[grad], 0.5 * 2 * data, rtol=1e-6)  # d|x*x|/dx
    cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
    with pytest.raises(pk.InvalidModel, match="K-no-weights"):
        pk.TrainingSession(b.getModelProto(), cfg, loss=loss, optimizer=pk.SGD(0.1),
                           backend="xla")


def test_a_run_whose_loss_is_not_finite_completes_as_in_popart():
    """PopART completes the run (its weights take the NaN); a pk session refuses and rolls
    back (K-nonfinite-update)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.ones(2, np.float32))
    loss = b.aiGraphcore.l1loss([b.aiOnnx.mul([x, w])], 1.0)
    session, anchors = _train(b, loss, [loss])
    session.run(popart.PyStepIO({x: np.array([np.nan, 1.0], np.float32)}, anchors))
    assert np.isnan(anchors[loss])
    weights = {w: np.zeros(2, np.float32)}
    session.weightsToHost()
    session.readWeights(popart.PyWeightsIO(weights))
    assert np.isnan(weights[w][0]) and weights[w][1] != 1.0  # the update was applied


def test_a_model_sharded_without_pipelining_may_send_data_back_to_an_earlier_ipu():
    """Without pipelining PopART applies no stage-order rule: ops on IPU 1 feeding ops on
    IPU 0 run (on the xla backend, as one program)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    with b.virtualGraph(1):
        y = b.aiOnnx.relu([x])
    with b.virtualGraph(0):
        z = b.aiOnnx.neg([y])
    opts = popart.SessionOptions()
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    flow = popart.DataFlow(1, {z: popart.AnchorReturnType("All")})
    session = popart.InferenceSession(fnModel=b.getModelProto(), dataFlow=flow,
                                      userOptions=opts,
                                      deviceInfo=popart.DeviceManager().createIpuModelDevice(
                                          {"numIPUs": 2}))
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO({x: np.array([1.0, -1.0], np.float32)}, anchors))
    np.testing.assert_array_equal(anchors[z], [-1.0, 0.0])


def test_a_loss_of_shape_1_1_trains_and_a_loss_of_two_elements_is_refused_in_popart_words():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 2]))
    w = b.addInitializedInputTensor(np.ones((1, 2), np.float32))
    y = b.aiOnnx.mul([x, w])
    one = b.aiOnnx.reducesum([y], axes=[1], keepdims=1)  # [1, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", pk.PopartKitWarning)  # nothing to warn about
        session, anchors = _train(b, one, [one])
    session.run(popart.PyStepIO({x: np.ones((1, 2), np.float32)}, anchors))
    assert anchors[one].shape == (1, 1)
    with pytest.raises(popart.popart_exception) as err:
        _train(b, y, [y])
    assert str(err.value) == f"Loss tensor, '{y}', must be a scalar tensor"  # PopART's words


def test_patterns_levels_and_names_are_popart_s():
    default, none = popart.Patterns(), popart.Patterns(popart.PatternsLevel.NoPatterns)
    assert default.PreUniRepl and default.PostNRepl and default.SoftMaxGradDirect
    assert default.InPlace and not default.isPatternEnabled("TiedGather")  # off by default
    assert not any([none.PreUniRepl, none.PostNRepl, none.MatMulOp, none.InPlace])
    minimal = popart.Patterns(popart.PatternsLevel.Minimal)
    assert minimal.MatMulOp and not minimal.PreUniRepl and not minimal.InPlace  # mandatory only
    assert popart.Patterns(popart.PatternsLevel.All).isPatternEnabled("TiedGather")
    listed = popart.Patterns(["PostNRepl", "InPlace"])
    assert listed.PostNRepl and listed.InPlace and not listed.PreUniRepl
    default.PostNRepl = False
    assert not default.PostNRepl and not default.isPatternEnabled("PostNRepl")


@pytest.mark.parametrize("make, words", [
    (lambda: popart.Patterns(["NoSuchPattern"]), "Unknown pattern NoSuchPattern"),
    (lambda: popart.Patterns(["Inplace"]), "Unknown pattern Inplace, did you mean InPlace?"),
    (lambda: popart.Patterns().enablePattern("MatMulOp", False),
     "Pattern 'MatMulOp' is mandatory and cannot be disabled"),
])
def test_patterns_refuse_what_popart_refuses(make, words):
    with pytest.raises(popart.popart_exception, match=words):
        make()


def test_a_session_needs_the_mandatory_patterns_unless_runtime_asserts_are_off():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    y = b.aiOnnx.relu([x])
    flow = popart.DataFlow(1, {y: popart.AnchorReturnType("All")})

    def session(patterns):
        return popart.InferenceSession(fnModel=b.getModelProto(), dataFlow=flow,
                                       deviceInfo=_cpu(), patterns=patterns)

    with pytest.raises(popart.popart_exception, match="Pattern '.*' must be enabled"):
        session(popart.Patterns(popart.PatternsLevel.NoPatterns))
    relaxed = popart.Patterns(popart.PatternsLevel.NoPatterns)
    relaxed.enableRuntimeAsserts(False)
    session(relaxed).prepareDevice()


def test_supported_and_unsupported_operations_are_the_xla_backend_s_and_disjoint():
    supported = popart.getSupportedOperations(False)
    names = {op.type for op in supported}
    assert {"Constant", "Shape", "ConstantOfShape", "Add", "Conv"} <= names
    assert all(op.domain == "ai.onnx" for op in supported)
    unsupported = popart.getUnsupportedOperations(10)
    assert unsupported and not {(o.type, o.version) for o in unsupported} & {
        (o.type, o.version) for o in supported}
    internal = {(op.domain, op.type) for op in popart.getSupportedOperations(True)}
    assert {("ai.graphcore", "Atan2"), ("ai.graphcore", "Detach")} <= internal
    assert ("ai.graphcore", "Atan2") not in {(o.domain, o.type) for o in supported}


def test_the_order_popart_requires_prepare_weights_from_host_run():
    """PopART's Session and Devicex: a training session with weights runs only after
    weightsFromHost, any session only after prepareDevice; weights go to the host only after
    prepareDevice; an inference session with constant weights (the default) takes none."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.ones(2, np.float32))
    y = b.aiOnnx.mul([x, w])
    loss = b.aiGraphcore.l1loss([y], 1.0)
    flow = popart.DataFlow(1, {loss: popart.AnchorReturnType("All")})
    session = popart.TrainingSession(fnModel=b.getModelProto(), dataFlow=flow, loss=loss,
                                     optimizer=popart.ConstSGD(0.1), deviceInfo=_cpu())
    anchors = session.initAnchorArrays()
    step = popart.PyStepIO({x: np.ones(2, np.float32)}, anchors)
    with pytest.raises(popart.popart_exception, match="Must call weightsFromHost before run"):
        session.run(step)
    with pytest.raises(popart.popart_exception, match="must be called before "
                                                      "Devicex::weightsToHost"):
        session.modelToHost("unused.onnx")
    session.setRandomSeed(1)  # no random behaviour: PopART warns and ignores it
    session.prepareDevice()
    session.weightsFromHost()
    session.run(step)
    inference = popart.InferenceSession(fnModel=b.getModelProto(), dataFlow=popart.DataFlow(
        1, {y: popart.AnchorReturnType("All")}), deviceInfo=_cpu())
    inference.prepareDevice()
    with pytest.raises(popart.popart_exception, match="Cannot call writeWeights when "
                                                      "constantWeights is set"):
        inference.writeWeights(popart.PyWeightsIO({w: np.zeros(2, np.float32)}))
    opts = popart.SessionOptions()
    opts.constantWeights = False
    writable = popart.InferenceSession(fnModel=b.getModelProto(), dataFlow=popart.DataFlow(
        1, {y: popart.AnchorReturnType("All")}), deviceInfo=_cpu(), userOptions=opts)
    writable.prepareDevice()
    writable.writeWeights(popart.PyWeightsIO({w: np.zeros(2, np.float32)}))


def test_the_builder_s_refusals_are_popart_exceptions_in_popart_s_words():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 64, 56, 56]))
    w = b.addInputTensor(popart.TensorInfo("FLOAT", [256, 64, 1, 1]))
    with pytest.raises(popart.popart_exception) as err:
        b.aiOnnx.conv([x, w], dilations=[1, 1], kernel_shape=[64, 64], strides=[1, 1],
                      pads=[0, 0, 0, 0])
    assert err.value.args[0] == (f"kernel_shape, [64 64], does not match inferred shape from "
                                 f"weight input '{w}', [1 1]")
    assert isinstance(err.value, pk.BuilderError) and isinstance(err.value, ValueError)


def test_a_random_session_takes_a_seed_only_after_prepare_device():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.ones(2, np.float32))
    y = b.aiOnnx.dropout([b.aiOnnx.mul([x, w])], 1, ratio=0.5)[0]
    flow = popart.DataFlow(1, {y: popart.AnchorReturnType("All")})
    session = popart.InferenceSession(fnModel=b.getModelProto(), dataFlow=flow,
                                      deviceInfo=_cpu())
    with pytest.raises(popart.popart_exception, match="must be called before "
                                                      "Devicex::setRandomSeedFromHost"):
        session.setRandomSeed(1)
    session.prepareDevice()
    session.setRandomSeed(1)
    assert session.getRandomSeed() == 1


def test_uint32_indices_build_and_run_as_in_popart_and_a_pk_session_refuses_them():
    """ONNX's schema lists int32/int64 indices only; PopART's Builder infers leniently and its
    Gather takes UINT32 indices. The drop-in runs the model (warning K-model-onnx-inference),
    a pk session refuses it."""
    b = popart.Builder()
    data = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 3]))
    idx = b.addInputTensor(popart.TensorInfo("UINT32", [2]))
    out = b.aiOnnx.gather([data, idx], axis=0)
    assert b.getTensorShape(out) == [2, 3] and b.getTensorDtypeString(out) == "float32"
    flow = popart.DataFlow(1, {out: popart.AnchorReturnType("All")})
    with pytest.warns(pk.PopartKitWarning, match="K-model-onnx-inference"):
        session = popart.InferenceSession(b.getModelProto(), flow, _cpu())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    session.run(popart.PyStepIO({data: table, idx: np.array([3, 1], np.uint32)}, anchors))
    np.testing.assert_array_equal(anchors[out], table[[3, 1]])
    cfg = pk.SessionConfig(mode="inference", device={"target": "offline"})
    with pytest.raises(pk.InvalidModel, match="K-model-onnx-inference"):
        pk.InferenceSession(b.getModelProto(), cfg, anchors={out: "All"}, backend="xla")


def test_a_symbolic_input_size_needs_input_shape_info_in_popart_s_words():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 3]), "x")
    y = b.aiOnnx.relu([x])
    b.addOutputTensor(y)
    model = onnx.load_from_string(b.getModelProto())
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    flow = popart.DataFlow(1, {y: popart.AnchorReturnType("All")})
    with pytest.raises(popart.popart_exception) as err:
        popart.InferenceSession(model.SerializeToString(), flow, _cpu())
    assert err.value.args[0] == ("Input tensor 'x' must be specified in InputShapeInfo, as it "
                                 "has shape [batch, 3], which uses an unknown value 'batch'.")
    shapes = popart.InputShapeInfo()
    shapes.add("x", popart.TensorInfo("FLOAT", [2, 3]))
    session = popart.InferenceSession(model.SerializeToString(), flow, _cpu(),
                                      inputShapeInfo=shapes)
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    data = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    session.run(popart.PyStepIO({x: data}, anchors))
    np.testing.assert_array_equal(anchors[y], np.maximum(data, 0))


def test_an_every_n_anchor_of_a_pipelined_session_is_refused_in_popart_s_words():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 8]))
    with b.virtualGraph(0), b.pipelineStage(0):
        h = b.aiOnnx.relu([x])
    with b.virtualGraph(1), b.pipelineStage(1):
        y = b.aiOnnx.relu([h])
    opts = popart.SessionOptions()
    opts.enablePipelining = True
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    flow = popart.DataFlow(4, {y: popart.AnchorReturnType("EveryN", 2)})
    with pytest.raises(popart.popart_exception) as err:
        popart.InferenceSession(b.getModelProto(), flow,
                                popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                                userOptions=opts)
    assert err.value.args[0] == "AnchorReturnType::EVERYN is not valid for pipelined models"


def test_a_program_that_cannot_fit_raises_popart_s_out_of_memory_exception_at_prepare():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4096, 4 * 1024 * 1024]))  # 64 GiB
    y = b.aiOnnx.relu([x])
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), _cpu())
    with pytest.raises(popart.OutOfMemoryException) as err:
        session.prepareDevice()
    assert isinstance(err.value, popart.popart_exception) and "GiB" in str(err.value)
    assert err.value.getProfilePath() == "" and "K-memory" in err.value.getSummaryReport()
    from popart_kit.popart import session as popart_session  # PopART's popart.session

    assert popart_session.OutOfMemoryException is popart.OutOfMemoryException


def test_model_to_host_writes_half_weights_as_popart_packs_them_and_they_load_back(tmp_path):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [1, 3]))
    w = b.addInitializedInputTensor(np.array([[0.5, -1.0, 2.0]] * 3, np.float16))
    y = b.aiOnnx.matmul([x, w])
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), _cpu())
    session.prepareDevice()
    path = tmp_path / "model.onnx"
    session.modelToHost(str(path))
    stored = next(t for t in onnx.load(str(path)).graph.initializer if t.name == w)
    assert len(stored.int32_data) == 5  # 9 halves, two to an int32 (builder_impl.cpp)
    halves = np.asarray(stored.int32_data, np.int32).view(np.float16)[:9].reshape(3, 3)
    np.testing.assert_array_equal(halves, np.array([[0.5, -1.0, 2.0]] * 3, np.float16))
    again = popart.InferenceSession(str(path), popart.DataFlow(1, [y]), _cpu())
    again.prepareDevice()
    anchors = again.initAnchorArrays()
    again.run(popart.PyStepIO({x: np.ones([1, 3], np.float16)}, anchors))
    np.testing.assert_array_equal(anchors[y], np.array([[1.5, -3.0, 6.0]], np.float16))


def test_opening_a_session_leaves_the_program_s_numpy_random_state_alone():
    """Importing JAX draws from numpy's global generator; a program that seeds numpy, opens
    its first session and then draws its data gets the data it gets on PopART."""
    import subprocess
    import sys

    program = (
        "import numpy as np, popart_kit.popart as popart\n"
        "b = popart.Builder()\n"
        "x = b.addInputTensor(popart.TensorInfo('FLOAT', [2]))\n"
        "y = b.aiOnnx.relu([x])\n"
        "np.random.seed(1234)\n"
        "popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),\n"
        "                        popart.DeviceManager().createCpuDevice())\n"
        "print(np.random.randint(0, 1000, 4).tolist())\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    np.random.seed(1234)
    assert done.stdout.strip() == str(np.random.randint(0, 1000, 4).tolist())


def test_automatic_loss_scaling_settings_are_taken_and_checked_as_popart_does():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [2, 4]))
    w = b.addInitializedInputTensor(np.ones((4, 4), np.float16))
    loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([x, w])], 0.1)
    opts = popart.SessionOptions()
    opts.automaticLossScalingSettings.toTrackTensors = [w]   # an optional list of names
    optimizer = popart.SGD({"defaultLearningRate": (0.1, False), "lossScaling": (8.0, False)})
    _train_opts = dict(fnModel=b.getModelProto(), dataFlow=popart.DataFlow(1, [loss]),
                       loss=loss, optimizer=optimizer, deviceInfo=_cpu(), userOptions=opts)
    popart.TrainingSession(**_train_opts)   # settings alone, ALS off: runs
    opts.automaticLossScalingSettings.enabled = True
    with pytest.raises(popart.popart_exception, match="toTrackTensors has been set"):
        popart.TrainingSession(**_train_opts)   # not with the default tracking method
    opts.automaticLossScalingSettings.gradientTensorTrackingMethod = \
        popart.GradientTensorTrackingMethod.GradientsOfUserSpecifiedTensors
    popart.TrainingSession(**_train_opts)   # tests/test_auto_loss_scaling.py runs it
