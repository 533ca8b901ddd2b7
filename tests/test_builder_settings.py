"""The Builder's per-node settings (recomputation, execution phases, partials, memory
proportions ...) and attribute accessors: each writes the node attribute PopART writes (names,
types and encodings from willow/include/popart/names.hpp, builder.hpp, builder.cpp and
builder_impl.cpp), refuses what PopART refuses with PopART's text, and an annotated model runs
on the xla backend exactly as its plain twin."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import jax
import numpy as np
import onnx
import pytest
from onnx import AttributeProto as A

import popart_kit as pk
import popart_kit.popart as popart
from popart_kit._model import builder_settings as bs
from popart_kit._model.builder import BuilderError
from popart_kit._runtime.xla.lowering import UnsupportedModel, lower
from popart_kit._runtime.xla.ops import partials

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

RNG = np.random.default_rng(3)
W_CONV = (RNG.standard_normal((2, 1, 3, 3)) / 3).astype(np.float32)
W_DENSE = (RNG.standard_normal((32, 3)) / 3).astype(np.float32)


def attribute(b, name: str, outputs) -> onnx.AttributeProto:
    """A node's attribute as the serialised model holds it."""
    wanted = {outputs} if isinstance(outputs, str) else set(outputs)
    node = next(n for n in onnx.load_from_string(b.getModelProto()).graph.node
                if set(n.output) == wanted)
    return next(a for a in node.attribute if a.name == name)


def matmul_builder(cls=pk.Builder):
    b = cls()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]), "x")
    w = b.addInitializedInputTensor(np.ones((3, 4), np.float32), "w")
    return b, x, w, b.aiOnnx.matmul([x, w])


def conv_builder():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [1, 1, 4, 4]))
    w = b.addInitializedInputTensor(np.ones((1, 1, 3, 3), np.float32))
    return b, b.aiOnnx.conv([x, w], pads=[1, 1, 1, 1])


# -- what each setter writes ---------------------------------------------------------------------


@pytest.mark.parametrize("call, name, kind, field, value", [
    (lambda b, y: b.setAvailableMemoryProportion(y, 0.25),
     "__available_memory", A.FLOAT, "f", 0.25),
    (lambda b, y: b.setAvailableMemoryProportion({y}, 1.0),
     "__available_memory", A.FLOAT, "f", 1.0),
    (lambda b, y: b.setPartialsType(y, "Half"), "__partials_type", A.STRING, "s", b"Half"),
    (lambda b, y: b.excludePatterns(y, ["MatMulOp", "OpToIdentity"]), "__exclude_patterns",
     A.STRINGS, "strings", [b"MatMulOp", b"OpToIdentity"]),
    (lambda b, y: b.excludePatterns(y, []), "__exclude_patterns", A.STRINGS, "strings", []),
    (lambda b, y: b.executionPhase(y, 3), "__execution_phase", A.INT, "i", 3),
    (lambda b, y: b.executionPhase({y}), "__execution_phase", A.INT, "i", 0),
    (lambda b, y: b.recomputeOutput(y, 2), "__recompute_output_in_backward_pass", A.INT, "i", 2),
    (lambda b, y: b.recomputeOutput(y), "__recompute_output_in_backward_pass", A.INT, "i", 0),
    (lambda b, y: b.recomputeOutputInBackwardPass(y),
     "__recompute_output_in_backward_pass", A.INT, "i", 2),
    (lambda b, y: b.recomputeOutputInBackwardPass([y], 1),
     "__recompute_output_in_backward_pass", A.INT, "i", 1),
    (lambda b, y: b.outputTensorLocation(y), "__output_tensor_location", A.INTS, "ints",
     [0, 0, 0, 0, 0, 0]),
    (lambda b, y: b.setInplacePreferences(y, {"ReluInplace": 10, "AddLhsInplace": 1.5}),
     "__inplace_op_names", A.STRINGS, "strings", [b"AddLhsInplace", b"ReluInplace"]),
    (lambda b, y: b.setInplacePreferences(y, {"ReluInplace": 10, "AddLhsInplace": 1.5}),
     "__inplace_op_priorities", A.FLOATS, "floats", [1.5, 10.0]),
])
def test_setters_write_popart_s_attribute(call, name, kind, field, value):
    b, _, _, y = matmul_builder()
    call(b, y)
    attr = attribute(b, name, y)
    assert attr.type == kind
    got = getattr(attr, field)
    assert (list(got) if kind in (A.INTS, A.FLOATS, A.STRINGS) else got) == value


def test_serialize_matmul_writes_mode_factor_and_precision_and_none_writes_nothing():
    b, _, _, y = matmul_builder()
    b.setSerializeMatMul({y}, "none", 4)
    assert b.getAllNodeAttributeNames(y) == []
    b.setSerializeMatMul({y}, "output_channels", 2, keep_precision=True)
    assert [(a.name, a.type) for a in onnx.load_from_string(b.getModelProto()).graph.node[0]
            .attribute] == [("__serialize_matmul_mode", A.STRING),
                            ("__serialize_matmul_factor", A.INT),
                            ("__serialize_matmul_precision", A.INT)]
    assert b.getStringNodeAttribute("__serialize_matmul_mode", [y]) == "output_channels"
    assert b.getInt64NodeAttribute("__serialize_matmul_factor", [y]) == 2
    assert b.getInt64NodeAttribute("__serialize_matmul_precision", [y]) == 1
    b2, _, _, y2 = matmul_builder()
    b2.setSerializeMatMul(y2, "reducing_dim")  # factor 0, keep_precision False
    assert b2.getInt64NodeAttribute("__serialize_matmul_factor", y2) == 0
    assert b2.getInt64NodeAttribute("__serialize_matmul_precision", y2) == 0


def test_conv_dithering_and_partials_on_a_conv():
    b, y = conv_builder()
    b.setEnableConvDithering(y, 1)
    b.setPartialsType(y, "float")
    assert attribute(b, "__enable_conv_dithering", y).type == A.INT
    assert b.getInt64NodeAttribute("__enable_conv_dithering", y) == 1
    assert b.getPartialsType(y) == "float"


def test_available_memory_proportion_replaces_and_rounds_to_float32():
    b, _, _, y = matmul_builder()
    b.setAvailableMemoryProportion(y, 0.6)
    b.setAvailableMemoryProportion(nodeOutputNames={y}, availableMemoryProportion=0.1)
    assert b.getAllNodeAttributeNames(y) == ["__available_memory"]
    assert b.getFloatNodeAttribute("__available_memory", y) == np.float32(0.1)
    b.setAvailableMemoryProportion(y, 1.00000001)  # 1.0 as a float, as PopART takes it


def test_partials_type_defaults_to_poplar_s_float():
    b, _, _, y = matmul_builder()
    assert b.getPartialsType(y) == "FLOAT"


# -- scopes ----------------------------------------------------------------------------------------


def test_scopes_annotate_every_node_inside_and_restore_on_exit():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    offchip = popart.TensorLocation(popart.TensorStorage.OffChip)
    assert not b.hasExecutionPhase()
    with b.executionPhase(1), b.recomputeOutput(popart.RecomputeType.Recompute), \
            b.outputTensorLocation(offchip), b.schedulePriority(2.5), \
            b.outlineAttributes({"layer": 0}), b.commGroup(popart.CommGroupType.Consecutive, 4):
        assert b.hasExecutionPhase() and b.getExecutionPhase() == 1
        with b.executionPhase(2), b.outlineAttributes({"layer": 9, "block": "attn"}):
            inner = b.aiOnnx.relu([x])
            assert b.getExecutionPhase() == 2
        outer = b.aiOnnx.relu([inner])
    after = b.aiOnnx.relu([outer])
    assert not b.hasExecutionPhase()
    with pytest.raises(BuilderError, match="^Execution phase not set in current scope.$"):
        b.getExecutionPhase()
    expected = {"__collectiveCommGroup": [1, 4], "__recompute_output_in_backward_pass": 2,
                "__output_tensor_location": [1, 0, 0, 0, 0, 0], "__schedule_priority": 2.5}
    names = ["__collectiveCommGroup", "__execution_phase", "__outline",
             "__output_tensor_location", "__recompute_output_in_backward_pass",
             "__schedule_priority"]
    for node, phase, outline in ((inner, 2, ["block", "attn", "layer", "0"]),
                                 (outer, 1, ["layer", "0"])):
        assert b.getAllNodeAttributeNames(node) == names  # sorted, as PopART's std::map
        assert b.getInt64NodeAttribute("__execution_phase", node) == phase
        # nested outline scopes merge; the enclosing scope's value wins (std::map::insert)
        assert b.getStringVectorNodeAttribute("__outline", node) == outline
        assert b.getInt64VectorNodeAttribute("__collectiveCommGroup", node) == [1, 4]
        assert b.getInt64VectorNodeAttribute("__output_tensor_location", node) == \
            expected["__output_tensor_location"]
        assert b.getFloatNodeAttribute("__schedule_priority", node) == 2.5
        assert b.getRecomputeOutputInBackwardPass(node)
    assert b.getAllNodeAttributeNames(after) == []


def test_scope_forms_and_defaults():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    with b.executionPhase(), b.recomputeOutput(), b.outputTensorLocation(), b.commGroup(), \
            b.outlineAttributes({}):
        y = b.aiOnnx.relu([x])
    assert b.getInt64NodeAttribute("__execution_phase", y) == 0
    assert b.getInt64NodeAttribute("__recompute_output_in_backward_pass", y) == 0
    assert b.getInt64VectorNodeAttribute("__output_tensor_location", y) == [0] * 6
    assert b.getInt64VectorNodeAttribute("__collectiveCommGroup", y) == [0, 0]
    assert attribute(b, "__outline", y).type == A.STRINGS  # empty, but STRINGS
    assert b.getStringVectorNodeAttribute("__outline", y) == []
    with b.pipelineStage(1), b.virtualGraph(1), b.nameScope("s"):
        z = b.aiOnnx.relu([y], "act")
    names = b.getAllNodeAttributeNames(z)
    assert names == ["__ipu_number", "__pipeline_stage"]  # the name scope is no attribute


def test_checkpoint_output_adds_a_checkpointed_identity():
    b, _, _, y = matmul_builder()
    (c,) = b.checkpointOutput([y])
    node = onnx.load_from_string(b.getModelProto()).graph.node[-1]
    assert (node.op_type, node.name, list(node.input), c) == (
        "Identity", "Checkpoint", [y], "Identity:0")
    assert b.getInt64NodeAttribute("__recompute_output_in_backward_pass", c) == 1
    assert b.getStringVectorNodeAttribute("__exclude_patterns", c) == ["PreUniRepl", "PostNRepl"]
    assert b.getRecomputeOutputInBackwardPass(c)  # Checkpoint reads as True, as in PopART
    with pytest.raises(TypeError):
        b.checkpointOutput(y)


# -- accessors -------------------------------------------------------------------------------------


def test_attribute_getters_read_back_and_name_the_wrong_type():
    b, _, _, y = matmul_builder()
    b.addNodeAttribute("f", 0.5, {y})
    b.addNodeAttribute("fs", [0.5, 1.5], {y})
    b.addNodeAttribute("i", 3, {y})
    b.addNodeAttribute("is", [1, 2], {y})
    b.addNodeAttribute("s", "text", {y})
    b.addNodeAttribute("ss", ["a", "b"], {y})
    assert b.getAllNodeAttributeNames({y}) == ["f", "fs", "i", "is", "s", "ss"]
    assert b.getFloatNodeAttribute("f", {y}) == 0.5
    assert b.getFloatVectorNodeAttribute("fs", {y}) == [0.5, 1.5]
    assert b.getInt64VectorNodeAttribute("is", [y]) == [1, 2]
    assert b.getStringNodeAttribute("s", y) == "text"
    assert b.getStringVectorNodeAttribute("ss", y) == ["a", "b"]
    for getter, name, text in ((b.getFloatNodeAttribute, "i", "a float"),
                               (b.getFloatVectorNodeAttribute, "f", "a float vector"),
                               (b.getInt64NodeAttribute, "s", "an integer"),
                               (b.getInt64VectorNodeAttribute, "i", "an integer vector"),
                               (b.getStringNodeAttribute, "ss", "a string"),
                               (b.getStringVectorNodeAttribute, "s", "a string vector"),
                               (b.getRecomputeOutputInBackwardPass, None, "")):
        if name is None:
            with pytest.raises(BuilderError, match="^Node does not have an attribute "
                                                   "__recompute_output_in_backward_pass.$"):
                getter(y)
            continue
        with pytest.raises(BuilderError, match=f"^Attribute {name} is not {text}.$"):
            getter(name, y)
    with pytest.raises(BuilderError, match="^Node does not have an attribute nope.$"):
        b.getFloatNodeAttribute("nope", y)
    b.removeNodeAttribute("fs", {y})
    assert "fs" not in b.getAllNodeAttributeNames(y)
    with pytest.raises(BuilderError, match="^Cannot remove attribute fs as it does not exist.$"):
        b.removeNodeAttribute("fs", [y])
    with pytest.raises(BuilderError, match="Could not find a node"):
        b.getAllNodeAttributeNames(["nope"])


def test_tensor_lists_graph_name_and_replication_factor():
    b, x, w, y = matmul_builder()
    z = b.aiOnnx.relu([y])
    b.addOutputTensor(z)
    assert b.getValueTensorIds() == [y, z]  # every node output, as PopART's value_info
    assert b.getTrainableTensorIds() == [w]
    assert b.isInitializer(w) and not b.isInitializer(x) and not b.isInitializer(y)
    b.setGraphName("encoder")
    b.embedReplicationFactor(4)
    model = onnx.load_from_string(b.getModelProto())
    assert model.graph.name == "encoder"
    assert {p.key: p.value for p in model.metadata_props}["__replicationFactor"] == "4"
    b.setGraphName("")  # PopART makes a unique name
    assert onnx.load_from_string(b.getModelProto()).graph.name.startswith("_")


def test_ai_onnx_opset_version_as_popart_s_python_builder():
    b = pk.Builder()
    b.aiOnnxOpsetVersion(11)  # nothing chosen yet: aiOnnx still picks PopART's default
    assert b.aiOnnx.version == 10
    b = pk.Builder(opsets={"ai.onnx": 10, "ai.graphcore": 1})
    b.aiOnnxOpsetVersion(11)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    b.aiOnnx.relu([x])
    assert onnx.load_from_string(b.getModelProto()).opset_import[0].version == 11
    with pytest.raises(BuilderError, match="^Invalid opset 9 used to add an operation. Opset "
                                           "for domain ai.onnx already defined as 11$"):
        b.aiOnnxOpsetVersion(9)
    with pytest.raises(BuilderError, match="^Unsupported or unrecognized ai.Onnx version: 12$"):
        b.aiOnnxOpsetVersion(12)


# -- PopART's refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("proportion", [0.0, -0.5, 1.5, math.nan])
def test_available_memory_proportion_outside_0_1_is_refused(proportion):
    b, _, _, y = matmul_builder()
    with pytest.raises(BuilderError, match=r"^availableMemoryProportion must be in \(0,1\]$"):
        b.setAvailableMemoryProportion(y, proportion)
    with pytest.raises(TypeError):
        b.setAvailableMemoryProportion(y, "0.5")


def test_partials_type_refusals_are_popart_s():
    b, x, _, y = matmul_builder()
    with pytest.raises(BuilderError, match="^Unable to get option 'partialsTypeMatMul' from "
                                           "string 'double'. Possible values are 'float' and "
                                           "'half' in any letter case.$"):
        b.setPartialsType(y, "double")
    r = b.aiOnnx.relu([x])
    with pytest.raises(BuilderError, match="^Builder::setPartialsType should only be called on "
                                           "operators: Conv, MatMul; but was given: Relu$"):
        b.setPartialsType(r, "half")
    c, conv = conv_builder()
    with pytest.raises(BuilderError, match="^Bad partialsType 'quarter'$"):
        c.setPartialsType(conv, "Quarter")
    b.setPartialsType(y, "HALF")
    with pytest.raises(BuilderError, match="^Node already has attribute __partials_type.$"):
        b.setPartialsType(y, "float")


def test_serialize_matmul_mode_and_conv_dithering_refusals_are_popart_s():
    b, _, _, y = matmul_builder()
    with pytest.raises(BuilderError, match="^Unsupported mat mul serialization mode 'rows'. "
                                           "Supported modes are 'input_channels', "
                                           "'reducing_dim', 'output_channels' or 'none'$"):
        b.setSerializeMatMul({y}, "rows", 2)
    with pytest.raises(BuilderError, match="^enableConvDithering must be a bool value$"):
        b.setEnableConvDithering(y, 2)
    with pytest.raises(BuilderError, match="^Builder::setEnableConvDithering should only be "
                                           "called on convolutions but was given: MatMul$"):
        b.setEnableConvDithering(y, 1)


def test_bad_argument_types_are_type_errors():
    b, _, _, y = matmul_builder()
    for call in (lambda: b.recomputeOutput(y, 7), lambda: b.recomputeOutput("Recompute", 1.5),
                 lambda: b.executionPhase(y, "1"), lambda: b.outputTensorLocation(y, 3),
                 lambda: b.schedulePriority("high"), lambda: b.outlineAttributes([("a", 1)]),
                 lambda: b.setInplacePreferences(y, ["ReluInplace"]),
                 lambda: b.excludePatterns(y, "MatMulOp"), lambda: b.commGroup(1.5)):
        with pytest.raises(TypeError):
            call()


# -- the xla backend -----------------------------------------------------------------------------


def small_net(annotate: bool):
    """Conv -> Relu -> MatMul -> loss, plain or with every annotation (scopes, setters and a
    checkpoint); returns the model, its input, output and loss."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 1, 4, 4]), "x")
    wc = b.addInitializedInputTensor(W_CONV, "wc")
    wd = b.addInitializedInputTensor(W_DENSE, "wd")
    scopes = ([b.executionPhase(0), b.recomputeOutput(popart.RecomputeType.Recompute),
               b.outputTensorLocation(popart.TensorLocation()), b.schedulePriority(1.0),
               b.outlineAttributes({"block": 1}), b.commGroup()] if annotate else [])
    for scope in scopes:
        scope.__enter__()
    conv = b.aiOnnx.conv([x, wc], pads=[1, 1, 1, 1])
    h = b.aiOnnx.relu([conv])
    for scope in reversed(scopes):
        scope.__exit__(None, None, None)
    if annotate:
        (h,) = b.checkpointOutput([h])
    flat = b.reshape_const(b.aiOnnx, [h], [2, 32])
    y = b.aiOnnx.matmul([flat, wd])
    if annotate:
        b.setPartialsType(conv, "float")
        b.setEnableConvDithering(conv, 1)
        b.setAvailableMemoryProportion(conv, 0.4)
        b.setPartialsType(y, "half")  # float32 operands: no change
        b.setSerializeMatMul({y}, "output_channels", 3, True)
        b.setAvailableMemoryProportion({y}, 0.2)
        b.setInplacePreferences(h, {"ReluInplace": 100.0})
        b.excludePatterns(y, ["MatMulOp"])
        b.executionPhase(y, 1)
        b.recomputeOutputInBackwardPass(y, popart.RecomputeType.Checkpoint)
        b.outputTensorLocation(y, popart.TensorLocation(popart.TensorStorage.OnChip))
        b.embedReplicationFactor(1)
        b.setGraphName("annotated")
    loss = b.aiGraphcore.identityloss([y], popart.ReductionType.Mean)
    b.addOutputTensor(y)
    return b.getModelProto(), x, y, loss


def test_an_annotated_model_runs_on_xla_as_its_plain_twin():
    plain, x, y_plain, loss_plain = small_net(False)
    annotated, x2, y_annotated, loss_annotated = small_net(True)
    model = onnx.load_from_string(annotated)
    onnx.checker.check_model(model, full_check=True)
    assert sum(a.name.startswith("__") for n in model.graph.node for a in n.attribute) > 20
    data = RNG.standard_normal((2, 1, 4, 4)).astype(np.float32)
    results = []
    for model, y in ((plain, y_plain), (annotated, y_annotated)):
        sess = pk.InferenceSession(model, pk.SessionConfig(mode="inference"),
                                   anchors={y: "All"}, backend="xla")
        results.append(sess.run({x: data.reshape(sess.io.input_shape(x))})[y])
    np.testing.assert_array_equal(results[0], results[1])
    weights, losses = [], []
    for model, loss in ((plain, loss_plain), (annotated, loss_annotated)):
        sess = pk.TrainingSession(model, pk.SessionConfig(mode="training"), loss=loss,
                                  optimizer=pk.SGD(learning_rate=0.1), anchors={loss: "All"},
                                  backend="xla")
        losses.append(sess.run({x: data.reshape(sess.io.input_shape(x))})[loss])
        weights.append(sess.weights())
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert set(weights[0]) == set(weights[1]) == {"wc", "wd"}
    for name in weights[0]:
        np.testing.assert_allclose(weights[0][name], weights[1][name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("node_kind, session_kind, accumulator", [
    ("half", None, "float16"), ("float", None, "float32"), ("half", "float", "float16"),
    ("FLOAT", "half", "float32"), (None, "half", "float16")])
def test_a_node_s_partials_type_overrides_the_session_s_on_xla(node_kind, session_kind,
                                                               accumulator):
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT16", [2, 64]))
    w = b.addInitializedInputTensor(np.ones((64, 3), np.float16))
    y = b.aiOnnx.matmul([x, w])
    if node_kind:
        b.setPartialsType(y, node_kind)
    graph = lower(b.getModelProto())
    value = np.ones((2, 64), np.float16)
    with partials(session_kind):
        text = str(jax.make_jaxpr(lambda v: graph.evaluate({}, {x: v}, [y]))(value))
    assert f"preferred_element_type={accumulator}" in text


def test_a_bad_partials_type_in_a_model_is_refused_by_the_xla_backend():
    b, _, _, y = matmul_builder()
    b.addNodeAttribute("__partials_type", "double", {y})
    c, conv = conv_builder()
    c.addNodeAttribute("__partials_type", "Quarter", conv)
    with pytest.raises(UnsupportedModel, match="Unable to get option 'partialsTypeMatMul' from "
                                               "string 'double'"):
        lower(b.getModelProto())
    with pytest.raises(UnsupportedModel, match="Bad partialsType 'quarter'"):
        lower(c.getModelProto())


def test_signatures_are_popart_s():
    """Parameter names of every form, against tests/contract/popart_api.json."""
    api = json.loads((Path(__file__).parent / "contract" / "popart_api.json").read_text())
    spec = api["classes"]["Builder"]
    forms = {"executionPhase": bs._EXECUTION_PHASE, "recomputeOutput": bs._RECOMPUTE_OUTPUT,
             "recomputeOutputInBackwardPass": bs._RECOMPUTE_BACKWARD,
             "outputTensorLocation": bs._OUTPUT_LOCATION,
             "setAvailableMemoryProportion": bs._AVAILABLE_MEMORY}
    for name, overloads in forms.items():
        assert sorted(list(s.parameters) for s, _ in overloads) == sorted(spec["overloads"][name])
    b = pk.Builder()
    for name in ("commGroup", "setGraphName", "aiOnnxOpsetVersion", "schedulePriority",
                 "setPartialsType", "getExecutionPhase", "hasExecutionPhase"):
        assert list(inspect.signature(getattr(b, name)).parameters) in spec["overloads"][name]
    methods = set(spec["methods"])
    ours = {n for n in dir(bs.NodeSettings) if not n.startswith("_")}
    assert ours <= methods
    assert methods - set(dir(b)) == set()   # every method PopART's Builder has
