"""What PopART refuses, the drop-in refuses before anything runs, with PopART's exception and
message (rules V51-V67 and others of docs/rules.md); what only PopART refuses stays runnable for a
pk.SessionConfig user."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import popart_kit as pk
import popart_kit.popart as popart
from popart_kit._model.checks import model_problems

GRAD = popart.reservedGradientPrefix()


def _refusal(builder, anchors, loss=None, patterns=None, options=None):
    """The popart_exception text a session of ``builder``'s model raises (None if none)."""
    flow = popart.DataFlow(1, {a: popart.AnchorReturnType("All") for a in anchors})
    device = popart.DeviceManager().createCpuDevice()
    try:
        if loss is None:
            popart.InferenceSession(builder.getModelProto(), flow, device, patterns=patterns,
                                    userOptions=options)
        else:
            popart.TrainingSession(builder.getModelProto(), flow, loss, popart.ConstSGD(0.1),
                                   device, patterns=patterns, userOptions=options)
    except popart.popart_exception as err:
        return err.args[0]
    return None


@pytest.mark.parametrize(("op", "axis"), [("reducesum", -3), ("reducemean", 2),
                                          ("reducel2", -3)])
def test_reduce_axes_out_of_range_are_refused_in_popart_s_words(op, axis):
    """util.cpp validateReduceAxis: axes lie in [-rank, rank - 1]; a pk user meets the same
    rule (ONNX's too) as V51."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    y = getattr(b.aiOnnx, op)([x], axes=[axis])
    assert _refusal(b, [y]) == f"Axis {axis} is out of acceptable range [-2, 1]"
    problems = model_problems(onnx.load_from_string(b.getModelProto()))
    assert [p.rule for p in problems] == ["V51"]


def test_opset_6_mean_takes_one_shape_and_opset_8_broadcasts():
    """variadic.cpp: version 6 of Mean does not broadcast (ONNX's Mean-6 neither)."""
    def model(opset):
        b = popart.Builder(opsets={"ai.onnx": opset, "ai.graphcore": 1})
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
        y = b.addInputTensor(popart.TensorInfo("FLOAT", [3]))
        return b, b.aiOnnx.mean([x, y])

    b, out = model(7)
    assert _refusal(b, [out]) == ("Inputs to ai.onnx.Mean:6 do not all the same type & shape, "
                                  "with opid.version = 6")
    assert not model_problems(onnx.load_from_string(model(8)[0].getModelProto()))


@pytest.mark.parametrize(("dims", "text"), [
    ([2, -2], "invalid dimension '-2'. Only positive dimensions are supported"),
    ([1, 1], "Dimension 1 appears multiple times in the list of dimensions of ReverseOp"),
    ([3], "invalid dimension '3' for input tensor of rank 3")])
def test_graphcore_reverse_dimensions_are_checked_as_popart_does(dims, text):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 1, 3]))
    assert text in _refusal(b, [b.aiGraphcore.reverse([x], dims)])


def test_a_gradient_op_left_by_a_disabled_pattern_is_refused():
    """irlowering.cpp createOpx: CosGrad has no Opx; with its (mandatory) pattern disabled and
    runtime asserts off PopART refuses it. Default patterns, or no gradient, run."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.ones(2, np.float32))
    y = b.aiOnnx.cos([b.aiOnnx.add([x, w])])
    loss = b.aiGraphcore.identityloss([y])
    off = popart.Patterns([]).enableRuntimeAsserts(False)
    assert _refusal(b, [y], loss, off) == (
        "Could not create opx for 'ai.graphcore.CosGrad:1'. This op should have been removed "
        "by pattern CosGradOp")
    # runtime asserts on: the mandatory patterns are checked first
    assert "must be enabled" in _refusal(b, [y], loss, popart.Patterns([]))
    assert _refusal(b, [y], loss, popart.Patterns([]).enableRuntimeAsserts(False)
                    .enablePattern("CosGradOp", True)) is None
    assert _refusal(b, [y], None, off) is None  # inference: no gradient op


def test_clip_takes_constant_bounds_in_popart_and_any_bounds_in_pk():
    """clip.cpp: Clip-11's min and max must have data; the xla backend runs computed ones."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    lo = b.addInputTensor(popart.TensorInfo("FLOAT", []), "lo")
    hi = b.aiOnnxOpset11.constant(np.array(1.0, np.float32), False)
    y = b.aiOnnxOpset11.clip([x, lo, hi])
    assert _refusal(b, [y]) == ("Op (ai.onnx.Clip:11), inputs=[x] currently only supports "
                                "constant min/max parameters. Input 'min' (lo) has no data.")
    cfg = pk.SessionConfig(mode="inference", device={"target": "cpu"})
    with pk.InferenceSession(b.getModelProto(), cfg, anchors={y: "All"}, backend="xla") as session:
        got = session.run({x: np.array([-2.0, 0.0, 2.0], np.float32),
                           lo: np.array(-1.0, np.float32)})
    np.testing.assert_array_equal(got[y].reshape(-1), [-1.0, 0.0, 1.0])


def test_pooling_attributes_poplibs_lacks_are_refused():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 1, 8, 8]))
    (m,) = b.aiOnnxOpset10.maxpool([x], num_outputs=1, kernel_shape=[2, 2], dilations=[2, 2])
    assert _refusal(b, [m]) == ("MaxPool has dilations [2 2]. Dilations of value other than 1 "
                                "are currently not supported.")
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 1, 8, 8]))
    a = b.aiOnnx.averagepool([x], kernel_shape=[3, 3], count_include_pad=1, pads=[1, 1, 1, 1])
    assert _refusal(b, [a]) == "`count_include_pad` is not supported"


def test_annotations_are_checked_as_popart_reads_them():
    """excludePatterns names (op.cpp) and setSerializeMatMul factors (matmul.cpp)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]))
    y = b.aiOnnx.identity([x])
    b.excludePatterns(y, ["NoSuchPattern"])
    assert _refusal(b, [y]) == "Invalid pattern name 'NoSuchPattern' in Op::excludePatterns"
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]))
    w = b.addInitializedInputTensor(np.ones([4, 4], np.float32))
    y = b.aiOnnx.matmul([x, w])
    b.setSerializeMatMul({y}, "output_channels", 3)
    assert _refusal(b, [y]).startswith("Invalid serialisation factor 3 for output channels "
                                       "dim 4. output_channels dim should be a multiple")
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]))
    y = b.aiOnnx.matmul([x, b.addInitializedInputTensor(np.ones([4, 4], np.float32))])
    b.setSerializeMatMul({y}, "output_channels", 2)
    assert _refusal(b, [y]) is None


def test_what_prunes_to_nothing_or_anchors_a_missing_gradient_is_refused():
    """prune.cpp (nothing an anchor needs) and ir.cpp validateAnchors (a gradient that is
    never computed: its tensor reaches the loss only through Detach)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    y = b.aiOnnx.sqrt([x])
    assert _refusal(b, [x]) == "All operations in the main graph were pruned, nothing to compute"
    assert _refusal(b, [x, y]) is None
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.ones(2, np.float32))
    loss = b.aiGraphcore.l1loss([b.aiOnnx.mul([b.aiGraphcore.detach([x]), w])], 1.0)
    assert _refusal(b, [loss, GRAD + x], loss).startswith(
        f"Anchor tensor `{GRAD + x}' not in Ir Tensors.")


def test_inference_without_anchors_and_undecodable_models_are_refused_in_popart_s_words(
        tmp_path):
    """ir.cpp:416 (an inference session needs an anchor); filereader.cpp:285 and :265 (bytes
    that are no ModelProto, shown as formatModelProtoString shows them; a file that is not
    one)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    b.addOutputTensor(b.aiOnnx.sqrt([x]))
    assert _refusal(b, []) == "User must specify an anchor tensor when doing inference."
    device = popart.DeviceManager().createCpuDevice()
    with pytest.raises(popart.popart_exception) as err:
        popart.InferenceSession("no\\thing'\x01", popart.DataFlow(1, [x]), device)
    assert err.value.args[0] == (
        "Failed to load a ModelProto from the string 'no\\\\thing\\'\\x01'.\nCheck that it "
        "is either a valid path to an existing onnx model file, or is a valid onnx ModelProto "
        "string.")
    with pytest.raises(popart.popart_exception, match=r"string '(\\xff){101}\.\.\.'"):
        popart.Builder(b"\xff" * 300)
    (tmp_path / "bad.onnx").write_bytes(b"\xff" * 8)
    with pytest.raises(popart.popart_exception,
                       match="^Failed to parse ModelProto from file .*bad.onnx$"):
        popart.InferenceSession(str(tmp_path / "bad.onnx"), popart.DataFlow(1, [x]), device)


@pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")  # K-stale-weights
def test_session_option_combinations_popart_refuses():
    """ir.cpp (auto and manual recomputation mixed); pipeline.cpp (accumulation enabled with a
    factor below the pipeline depth, factor 1 included)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.ones(2, np.float32))
    r = b.aiOnnx.relu([b.aiOnnx.mul([x, w])])
    b.recomputeOutputInBackwardPass(r)
    loss = b.aiGraphcore.l1loss([r], 1.0)
    opts = popart.SessionOptions()
    opts.autoRecomputation = popart.RecomputationType.Standard
    assert _refusal(b, [loss], loss, options=opts) == (
        "A mixture of auto and manual recomputation is not supported")

    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    h = x
    for ipu in range(2):
        with b.virtualGraph(ipu), b.pipelineStage(ipu):
            h = b.aiOnnx.mul([h, b.addInitializedInputTensor(np.ones(2, np.float32))])
    with b.virtualGraph(1), b.pipelineStage(1):
        loss = b.aiGraphcore.l1loss([h], 1.0)
    opts = popart.SessionOptions()
    opts.enablePipelining = opts.enableGradientAccumulation = True
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    assert _refusal(b, [loss], loss, options=opts) == (
        "For pipelining, depth (gradient accumulation factor) must equal at least the number "
        "of pipeline stages (3)")


def test_called_subgraph_ops_sit_on_the_calling_op_s_ipu_when_pipelining():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    sub = b.createSubgraphBuilder()
    a = sub.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    sub.addOutputTensor(sub.aiOnnx.neg([a]))
    with b.virtualGraph(0), b.pipelineStage(0):
        y = b.aiGraphcore.call([x], 1, sub)[0]
    with b.virtualGraph(1), b.pipelineStage(1):
        z = b.aiOnnx.relu([y])
    opts = popart.SessionOptions()
    opts.enablePipelining = True
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    assert "does not have a virtual graph id. When pipelining, subgraph ops must have a " \
           "virtual graph id set." in _refusal(b, [z], options=opts)


def test_reset_host_weights_is_refused_with_constant_weights(tmp_path):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    y = b.aiOnnx.mul([x, b.addInitializedInputTensor(np.ones(2, np.float32))])
    opts = popart.SessionOptions()
    opts.constantWeights = True
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                      popart.DeviceManager().createCpuDevice(),
                                      userOptions=opts)
    path = tmp_path / "m.onnx"
    path.write_bytes(b.getModelProto())
    with pytest.raises(popart.popart_exception,
                       match="Cannot call resetHostWeights when constantWeights is set"):
        session.resetHostWeights(str(path))
    # executablex.cpp:263: a weight of the model the session does not have, unless ignored
    opts.constantWeights = False
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                      popart.DeviceManager().createCpuDevice(),
                                      userOptions=opts)
    other = popart.Builder()
    other.addInitializedInputTensor(np.ones(2, np.float32), "extra")
    path.write_bytes(other.getModelProto())
    with pytest.raises(popart.popart_exception) as err:
        session.resetHostWeights(str(path))
    assert err.value.args[0] == "resetWeights, no tensor 'extra' in tensors"
    session.resetHostWeights(str(path), True)


def test_sparse_constants_are_refused_in_popart_s_words():
    """onnxpasses/nodepatterns/constfoldops.cpp:98."""
    sparse = onnx.helper.make_sparse_tensor(
        onnx.helper.make_tensor("v", onnx.TensorProto.FLOAT, [2], [1.0, 2.0]),
        onnx.helper.make_tensor("i", onnx.TensorProto.INT64, [2], [0, 3]), [4])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Constant", [], ["c"], sparse_value=sparse),
         onnx.helper.make_node("Identity", ["c"], ["y"])], "g", [],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 11)])
    with pytest.raises(popart.popart_exception) as err:
        popart.InferenceSession(model.SerializeToString(), popart.DataFlow(1, ["y"]),
                                popart.DeviceManager().createCpuDevice())
    assert err.value.args[0] == "The Constant op attribute 'sparse_value' is not supported."


def test_a_cpu_device_has_no_summary_report_as_in_poplar():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    y = b.aiOnnx.relu([x])
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                      popart.DeviceManager().createCpuDevice())
    with pytest.raises(popart.poplar_exception) as err:
        session.getSummaryReport()
    assert err.value.args[0].endswith("Profiling is disabled for current device type.")


def _pipelined(stages, ipus, batches=10, training=False, **options):
    """The refusal of a pipelined session of sin -> exp -> mul with these stages and IPUs."""
    b = popart.Builder()
    d0 = b.addInputTensor(popart.TensorInfo("FLOAT", [4]))
    d1 = b.addInputTensor(popart.TensorInfo("FLOAT", [4]))
    outs = [b.aiOnnx.sin([d0], "s0"), b.aiOnnx.exp([d1], "e0")]
    outs.append(b.aiOnnx.mul(outs, "m0"))
    for out, stage, ipu in zip(outs, stages, ipus, strict=True):
        if stage is not None:
            b.pipelineStage(out, stage)
        b.virtualGraph(out, ipu)
    opts = popart.SessionOptions()
    opts.enablePipelining = True
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    for name, value in options.items():
        setattr(opts, name, value)
    flow = popart.DataFlow(batches, [outs[-1]])
    device = popart.DeviceManager().createIpuModelDevice({"numIPUs": max(ipus) + 1})
    try:
        if training:
            popart.TrainingSession(b.getModelProto(), flow, outs[-1], popart.ConstSGD(0.1),
                                   device, userOptions=opts)
        else:
            popart.InferenceSession(b.getModelProto(), flow, device, userOptions=opts)
    except popart.popart_exception as err:
        return err.args[0]
    return None


def test_pipelining_refusals_speak_popart_s_words():
    """ir.cpp verifyPipelineSettings, pipeline.cpp and inferpipelinestages.cpp checkOrder: the
    drop-in raises PopART's texts for the kit's rules V1, V4, V5, V7 and P10."""
    assert _pipelined([0, 0, 1], [0, 0, 0]) == (
        "Pipelining requires more than 1 IPU (currently 1) and the 'virtualGraphMode' session "
        "option to not be VirtualGraphMode::Off (currently VirtualGraphMode::Manual).")
    assert _pipelined([0, 1, 2], [0, 1, 2], batches=2) == (
        "For pipelining, depth (batchesPerStep) must equal at least the number of pipeline "
        "stages (3)")
    assert _pipelined([0, 1, 1], [0, 1, 0]) == (
        "Ops [Op(e0 (ai.onnx.Exp:6), inputs=[input/1], outputs=[Exp:0]) Op(m0 (ai.onnx.Mul:7), "
        "inputs=[Sin:0, Exp:0], outputs=[Mul:0])] have the same pipeline stage 1, but different "
        "virtual graph ids [0 1]. All ops with the same pipeline stage must also have the same "
        "virtual graph id")
    assert _pipelined([0, None, 1], [0, 1, 1]) == (
        "Only some ops have had their pipeline stage set. Ops missing the pipeline stage:\n"
        "  Op(e0 (ai.onnx.Exp:6), inputs=[input/1], outputs=[Exp:0])")
    assert _pipelined([0, 1, 0], [0, 1, 0]) == (
        "Tensor Exp:0 is consumed in an earlier pipeline stage than it is produced\n"
        "Producer Op(e0 (ai.onnx.Exp:6), inputs=[input/1], outputs=[Exp:0]) has pipeline stage "
        "1\n"
        "Consumer Op(m0 (ai.onnx.Mul:7), inputs=[Sin:0, Exp:0], outputs=[Mul:0]) has pipeline "
        "stage 0")
    with pytest.raises(pk.ConfigError, match="pipelining needs at least 2 IPUs"):  # the kit's
        pk.SessionConfig(mode="inference", pipeline={"enabled": True}, ipus_per_replica=1)


@pytest.mark.parametrize(("options", "why"), [
    ({"enablePipelining": False}, "without implicit pipelining"),
    ({"useHostCopyOps": True, "enableExplicitMainLoops": True, "explicitRecomputation": True},
     "with explicit pipelining"),
    ({"enableGradientAccumulation": False, "accumulationFactor": 1},
     "without gradient accumulation")])
def test_implicit_pipelining_forward_only_program_refusals(options, why):
    """ir.cpp:674-687: the deprecated forward-only program needs implicit pipelining with
    gradient accumulation; PopART checks explicit pipelining first."""
    options = {"enableGradientAccumulation": True, "accumulationFactor": 5,
               "createImplicitPipeliningFwdOnlyProgram": True, **options}
    text = _pipelined([0, 1, 2], [0, 1, 2], training=True, **options)
    assert text == f"Implicit pipelining forward-only program is not supported {why}."


def test_accumulation_factor_without_accumulation_is_refused_in_popart_s_words():
    """sessionoptions.cpp:257 getAccumulationFactor: a factor above 1 needs
    enableGradientAccumulation (rule V19)."""
    b = popart.Builder()
    x = b.addInitializedInputTensor(np.ones(2, np.float32))
    loss = b.aiGraphcore.identityloss([b.aiOnnx.relu([x])])
    opts = popart.SessionOptions()
    opts.accumulationFactor = 4
    assert _refusal(b, [loss], loss=loss, options=opts) == (
        "enableGradientAccumulation is false, but accumulationFactor > 1. Either enable "
        "gradient accumulation, or set the accumulation factor to 1")


def test_virtual_graph_annotations_popart_refuses():
    """ir.cpp:1974 (some ops on a virtual graph, some not: the count per id, -1 for none, and
    the ops without one); irlowering.cpp:2979 (an IPU Model with 3 IPUs: an op on virtual
    graph 10 is refused by prepareDevice, its inputs from IPU 0 named as their copies)."""
    def model(ipus):
        b = popart.Builder()
        i1 = b.addInputTensor(popart.TensorInfo("FLOAT", [1]))
        i2 = b.addInputTensor(popart.TensorInfo("FLOAT", [1]))
        o1, o2 = b.aiOnnx.add([i1, i2]), b.aiOnnx.add([i1, i2])
        o = b.aiOnnx.add([o1, o2])
        for tensor, ipu in zip((o1, o2, o), ipus, strict=True):
            if ipu is not None:
                b.virtualGraph(tensor, ipu)
        return b, o1, o2, o

    opts = popart.SessionOptions()
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    b, o1, o2, o = model([0, 1, None])
    assert _refusal(b, [o], options=opts) == (
        "Either all Ops must have their virtual graph ids set, or none must. Op count per "
        "virtual graph id\n  -1 : 1\n  0 : 1\n  1 : 1\nOps with no virtual graph id :  \n"
        "  2 (ai.onnx.Add:7)\n")
    b, o1, o2, o = model([0, 0, 10])
    session = popart.InferenceSession(
        b.getModelProto(), popart.DataFlow(1, [o]),
        popart.DeviceManager().createIpuModelDevice({"numIPUs": 3}), userOptions=opts)
    with pytest.raises(popart.popart_exception) as err:
        session.prepareDevice()
    assert err.value.args[0] == (
        f"Op(ai.onnx.Add:7, inputs=[{o1}_c10, {o2}_c10], outputs=[{o}]) has been assigned "
        f"to an invalid virtual graph 10. numIPUs = 3.")


@pytest.mark.parametrize("domain", ["aiOnnx", "aiGraphcore"])
def test_an_inference_batch_norm_on_the_loss_path_is_refused_unless_detached(domain):
    """batchnorm.cpp BatchNormGradOp: a one-output (inference-mode) BatchNormalization on the
    loss's path is refused in training; detached, it trains what precedes nothing."""
    def build(detach):
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 2, 2, 2]), "x")
        w = b.addInitializedInputTensor(np.ones((2, 2, 2, 2), np.float32), "w")
        ids = [b.addInitializedInputTensor(np.full(2, i + 1.0, np.float32)) for i in range(4)]
        (y,) = getattr(b, domain).batchnormalization([x, *ids], 1)
        if detach:
            y = b.aiGraphcore.detach([y])
        loss = b.aiGraphcore.l1loss([b.aiOnnx.add([y, w])], 0.1)
        return b, loss

    b, loss = build(detach=False)
    text = _refusal(b, [loss], loss=loss)
    assert text is not None and "it has to be detached first." in text
    assert "has 1 output(s) which means it is in inference mode" in text
    b, loss = build(detach=True)
    assert _refusal(b, [loss], loss=loss) is None
