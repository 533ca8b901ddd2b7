"""Builder and PipelineBuilder: models that check, run in onnxruntime, and carry PopART's
annotations exactly as PopART writes them."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import popart_kit as pk
from popart_kit._model.layout import PipelineLayout

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

RNG = np.random.default_rng(0)


def run(b: pk.Builder, outputs: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a Builder-made model in onnxruntime (weights come from its initializers)."""
    for o in outputs:
        b.addOutputTensor(o)
    model = onnx.load_from_string(b.getModelProto())
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- ids, inputs and the model ---------------------------------------------------------------------


def test_tensor_ids_follow_popart():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    y = b.addInputTensor("FLOAT", [2])
    w = b.addInitializedInputTensor(np.zeros(2, np.float32))
    named = b.addInputTensor(pk.TensorInfo(np.float32, [2]), debugContext="data")
    positional = b.addInputTensor(pk.TensorInfo("FLOAT", [2]), "data")  # (tensorInfo, name)
    r1, r2 = b.aiOnnx.relu([x]), b.aiOnnx.relu([y])
    a = b.aiOnnx.add([r1, w], "sum")  # a debugContext names the node, not its outputs
    assert (x, y, w, named, positional, r1, r2, a) == (
        "input", "input/1", "init_input", "data", "data/1", "Relu:0", "Relu:0/1", "Add:0")
    assert b.getInputTensorIds() == ["input", "input/1", "init_input", "data", "data/1"]
    with b.nameScope("encoder"):
        with b.nameScope("layer0"):
            assert b.getNameScope("x") == "encoder/layer0/x"
            inner = b.aiOnnx.relu([a])
            w2 = b.addInitializedInputTensor(np.zeros(2, np.float32), "w")
        outer = b.aiOnnx.relu([inner], "act")
    assert (inner, w2, outer) == ("encoder/layer0/Relu:0", "encoder/layer0/w", "encoder/Relu:0")
    names = [n.name for n in onnx.load_from_string(b.getModelProto()).graph.node]
    assert names == ["", "", "sum", "encoder/layer0/Relu", "encoder/act"]
    with pytest.raises(TypeError, match="no overload takes these arguments"):
        b.addInputTensor(pk.TensorInfo("FLOAT", [2]), 3)


def test_model_is_valid_onnx_with_popart_s_opsets():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]))
    loss = b.aiGraphcore.identityloss([b.aiOnnx.relu([x])])
    b.addOutputTensor(loss)
    model = onnx.load_from_string(b.getModelProto())
    onnx.checker.check_model(model)
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 10),
                                                                   ("ai.graphcore", 1)}
    assert b.getTensorShape(loss) == [] and b.getTensorDtypeString(loss) == "float32"


def test_mlp_runs_in_onnxruntime():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 8]))
    w1, b1 = f32(8, 16), f32(16)
    w2, b2 = f32(16, 3), f32(3)
    h = b.aiOnnx.relu([b.aiOnnx.add([b.aiOnnx.matmul([x, b.addInitializedInputTensor(w1)]),
                                     b.addInitializedInputTensor(b1)])])
    logits = b.aiOnnx.gemm([h, b.addInitializedInputTensor(w2), b.addInitializedInputTensor(b2)],
                           alpha=2.0)
    probs = b.aiOnnx.softmax([logits], axis=1)
    assert b.getTensorShape(probs) == [4, 3]
    data = f32(4, 8)
    got, = run(b, [probs], {x: data})
    hidden = np.maximum(data @ w1 + b1, 0)
    z = 2.0 * hidden @ w2 + b2
    want = np.exp(z - z.max(1, keepdims=True))
    np.testing.assert_allclose(got, want / want.sum(1, keepdims=True), rtol=1e-5)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x).astype(np.float32)


# (op, input shapes, kwargs, numpy reference or None to check shape only)
OPS = [
    ("add", [(2, 3), (2, 3)], {}, lambda a, b: a + b),
    ("sub", [(2, 3), (3,)], {}, lambda a, b: a - b),
    ("mul", [(2, 3), (2, 3)], {}, lambda a, b: a * b),
    ("div", [(2, 3), (2, 3)], {}, lambda a, b: a / b),
    ("matmul", [(2, 3), (3, 4)], {}, lambda a, b: a @ b),
    ("gemm", [(2, 3), (4, 3), (4,)], {"transB": 1, "beta": 0.5},
     lambda a, b, c: a @ b.T + 0.5 * c),
    ("relu", [(5,)], {}, lambda a: np.maximum(a, 0)),
    ("sigmoid", [(5,)], {}, lambda a: 1 / (1 + np.exp(-a))),
    ("tanh", [(5,)], {}, np.tanh),
    ("erf", [(5,)], {}, _erf),
    ("softmax", [(2, 5)], {"axis": 1}, lambda a: np.exp(a) / np.exp(a).sum(1, keepdims=True)),
    ("logsoftmax", [(2, 5)], {"axis": 1},
     lambda a: a - np.log(np.exp(a).sum(1, keepdims=True))),
    ("transpose", [(2, 3, 4)], {"perm": [2, 0, 1]}, lambda a: a.transpose(2, 0, 1)),
    ("concat", [(2, 3), (2, 1)], {"axis": 1}, lambda a, b: np.concatenate([a, b], 1)),
    ("flatten", [(2, 3, 4)], {"axis": 1}, lambda a: a.reshape(2, 12)),
    ("identity", [(3,)], {}, lambda a: a),
    ("reducemean", [(2, 3, 4)], {"axes": [1], "keepdims": 0}, lambda a: a.mean(1)),
    ("reducesum", [(2, 3, 4)], {}, lambda a: a.sum(keepdims=True)),
    ("exp", [(3,)], {}, np.exp),
    ("neg", [(3,)], {}, np.negative),
    ("abs", [(3,)], {}, np.abs),
    ("pow", [(3,), (3,)], {}, None),
    ("max", [(3,), (3,), (3,)], {}, lambda a, b, c: np.maximum(np.maximum(a, b), c)),
    ("min", [(3,), (3,)], {}, np.minimum),
    ("clip", [(6,)], {"min": -0.5, "max": 0.5}, lambda a: np.clip(a, -0.5, 0.5)),
    ("squeeze", [(2, 1, 3)], {"axes": [1]}, lambda a: a.squeeze(1)),
    ("unsqueeze", [(2, 3)], {"axes": [0]}, lambda a: a[None]),
    ("globalaveragepool", [(1, 2, 4, 4)], {}, lambda a: a.mean((2, 3), keepdims=True)),
    ("averagepool", [(1, 2, 4, 4)], {"kernel_shape": [2, 2], "strides": [2, 2]},
     lambda a: a.reshape(1, 2, 2, 2, 2, 2).mean((3, 5))),
    ("conv", [(1, 2, 5, 5), (3, 2, 3, 3)], {"pads": [1, 1, 1, 1]}, None),
]


@pytest.mark.parametrize("op, shapes, kwargs, reference", OPS, ids=[o[0] for o in OPS])
def test_onnx_ops_run_in_onnxruntime(op, shapes, kwargs, reference):
    b = pk.Builder()
    ids = [b.addInputTensor(pk.TensorInfo("FLOAT", list(s))) for s in shapes]
    out = getattr(b.aiOnnx, op)(ids, **kwargs)
    arrays = [np.abs(f32(*s)) + 0.5 if op in ("div", "pow") else f32(*s) for s in shapes]
    got, = run(b, [out], dict(zip(ids, arrays, strict=True)))
    assert list(got.shape) == b.getTensorShape(out)
    if reference is not None:
        np.testing.assert_allclose(got, reference(*arrays), rtol=1e-5, atol=1e-6)


def test_ops_with_constants_and_integer_inputs():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 6]))
    shape = b.aiOnnx.constant(np.array([3, 4], np.int64))
    reshaped = b.aiOnnx.reshape([x, shape])
    idx = b.addInputTensor(pk.TensorInfo("INT32", [2]))
    gathered = b.aiOnnx.gather([reshaped, idx], axis=0)
    half = b.aiOnnx.cast([gathered], "FLOAT16")
    starts = b.aiOnnx.constant(np.array([1], np.int64))
    ends = b.aiOnnx.constant(np.array([3], np.int64))
    axes = b.aiOnnx.constant(np.array([1], np.int64))
    sliced = b.aiOnnx.slice([gathered, starts, ends, axes])
    mask = b.aiOnnx.greater([gathered, b.aiOnnx.constant(np.zeros(1, np.float32))])
    chosen = b.aiOnnx.where([mask, gathered, b.aiOnnx.neg([gathered])])
    same = b.aiOnnx.equal([idx, idx])
    less = b.aiOnnx.less([gathered, gathered])
    data, index = f32(2, 6), np.array([2, 0], np.int32)
    got = run(b, [half, sliced, chosen, same, less], {x: data, idx: index})
    rows = data.reshape(3, 4)[index]
    assert got[0].dtype == np.float16 and np.allclose(got[0], rows, atol=1e-2)
    np.testing.assert_allclose(got[1], rows[:, 1:3])
    np.testing.assert_allclose(got[2], np.abs(rows))
    assert got[3].all() and not got[4].any()
    assert b.getTensorDtypeString(half) == "float16"


def test_multi_output_ops_return_lists():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [1, 2, 4, 4]))
    scale, bias, mean, var = (b.addInitializedInputTensor(np.ones(2, np.float32)),
                              b.addInitializedInputTensor(np.zeros(2, np.float32)),
                              b.addInitializedInputTensor(np.zeros(2, np.float32)),
                              b.addInitializedInputTensor(np.ones(2, np.float32)))
    bn = b.aiOnnx.batchnormalization([x, scale, bias, mean, var], 1, epsilon=1e-3)
    pooled = b.aiOnnx.maxpool([bn[0]], 1, [2, 2], strides=[2, 2])
    dropped = b.aiOnnx.dropout([pooled[0]], 1, ratio=0.3)
    assert isinstance(bn, list) and len(bn) == 1 and isinstance(dropped, list)
    data = f32(1, 2, 4, 4)
    got, = run(b, [dropped[0]], {x: data})
    want = (data / np.sqrt(1 + 1e-3)).reshape(1, 2, 2, 2, 2, 2).max((3, 5))
    np.testing.assert_allclose(got, want, rtol=1e-5)  # inference: dropout is the identity


def test_layer_normalization_where_the_opset_has_it():
    with pytest.raises(AttributeError, match="opset 10 has no operator 'layernormalization'"):
        getattr(pk.Builder().aiOnnx, "layernormalization")  # noqa: B009 - the lookup fails
    b = pk.Builder(opsets={"ai.onnx": 17, "ai.graphcore": 1})
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 4]))
    g = b.addInitializedInputTensor(np.ones(4, np.float32))
    y = b.aiOnnx.layernormalization([x, g], 1, epsilon=1e-5)
    assert b.aiOnnxOpset17 is b.aiOnnx
    data = f32(2, 4)
    got, = run(b, [y[0]], {x: data})
    want = (data - data.mean(1, keepdims=True)) / np.sqrt(data.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_first_ai_onnx_opset_used_is_the_builders_as_in_popart():
    """PopART's rule: the version Builder(opsets=...) gives, else the first aiOnnx or
    aiOnnxOpsetN the program uses; any other version after that is refused."""
    b = pk.Builder()
    assert b.aiOnnxOpset10 is b.aiOnnx
    with pytest.raises(pk.BuilderError, match="Invalid opset 'aiOnnxOpset11' selected. Opset "
                                              "for domain ai.onnx already defined as 10"):
        getattr(b, "aiOnnxOpset11")  # noqa: B009 - the lookup fails
    assert pk.Builder(opsets={"ai.onnx": 11}).aiOnnxOpset11.version == 11
    fresh = pk.Builder()  # a fresh builder's first op may come from opset 11
    x = fresh.addInputTensor(pk.TensorInfo("FLOAT", [1, 2, 3, 3]))
    w = fresh.addInitializedInputTensor(np.ones((2, 1, 2, 2), np.float32))
    y = fresh.aiOnnxOpset11.convtranspose([x, w])
    assert fresh.aiOnnx is fresh.aiOnnxOpset11
    model = onnx.load_from_string(fresh.getModelProto())
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [11]
    assert fresh.getTensorShape(y) == [1, 1, 4, 4]


def test_opsets_for_other_domains_are_accepted_and_unused():
    b = pk.Builder(opsets={"ai.onnx": 9, "ai.onnx.ml": 1, "ai.graphcore": 1})
    assert b.aiOnnx.version == 9
    with pytest.raises(pk.BuilderError, match="'ai.graphcore' \\(1\\)"):
        pk.Builder(opsets={"ai.onnx": 9, "ai.graphcore": 2})


def test_wrong_arguments_fail_like_python_calls():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    with pytest.raises(TypeError):
        b.aiOnnx.softmax([x], axes=1)
    with pytest.raises(TypeError):
        b.aiOnnx.conv()
    with pytest.raises(pk.BuilderError, match=r"unknown tensor\(s\) \['nope'\]"):
        b.aiOnnx.relu(["nope"])
    with pytest.raises(pk.BuilderError, match="input 0 is marked single but has an empty string"):
        b.aiOnnx.relu([""])


def test_shape_mistakes_fail_when_the_op_is_created():
    """builder_impl.cpp addOp: an output of a negative size is refused at once, in PopART's
    words (a Tile of negative repeats); the refused op's ids are not used."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]))
    repeats = b.aiOnnx.constant(np.array([1, -4], np.int64))
    with pytest.raises(pk.BuilderError, match=r"Output 'Tile:0' of node 'Tile' has invalid "
                       r"shape, \[2 -12\]. Values must be non-negative"):
        b.aiOnnx.tile([x, repeats])
    assert b.aiOnnx.tile([x, b.aiOnnx.constant(np.array([1, 2], np.int64))]) == "Tile:0"


def test_matmul_mistakes_leave_the_output_untyped_and_the_model_is_refused():
    """As PopART: the Builder leaves a MatMul PopART's op refuses untyped; the model check
    refuses it in the words of matmul.cpp npMatMulOut."""
    from popart_kit._model.checks import check_model

    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]), "x")
    y = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 5]), "y")
    m = b.aiOnnx.matmul([x, y])
    with pytest.raises(pk.BuilderError, match="not known"):
        b.getTensorShape(m)
    b.addOutputTensor(m)
    with pytest.raises(pk.ModelError, match=r"Op\(ai.onnx.MatMul:9, inputs=\[x, y\], "
                       r"outputs=\[MatMul:0\]\) contracting dimensions unequal: lhs 'x' "
                       r"\[2 3\], rhs 'y' \[4 5\]"):
        check_model(onnx.load_from_string(b.getModelProto()))


def test_scalars_stay_scalars():
    b = pk.Builder()
    c = b.aiOnnx.constant(np.array(2.0, np.float32))
    w = b.addInitializedInputTensor(np.array(3, np.int32))
    assert b.getTensorShape(c) == [] and b.getTensorShape(w) == []
    got = run(b, [b.aiOnnx.mul([c, c])], {})
    assert got[0].shape == () and got[0] == 4.0


def test_gelu_keeps_its_input_type():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT16", [3, 4]))
    g = b.aiGraphcore.gelu([x])
    y = b.aiOnnx.relu([g])
    assert b.getTensorShape(y) == [3, 4] and b.getTensorDtypeString(g) == "float16"
    b.addOutputTensor(y)
    onnx.checker.check_model(onnx.load_from_string(b.getModelProto()), full_check=True)


def test_building_is_linear_in_the_number_of_ops():
    b = pk.Builder()
    t = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 4]))
    for _ in range(400):
        t = b.aiOnnx.relu([t])
        assert b.getTensorShape(t) == [4, 4]  # no re-inference of the whole model per call


@pytest.mark.parametrize("reduction, shape", [(pk.ReductionType.Mean, []),
                                              (pk.ReductionType.Sum, []),
                                              (pk.ReductionType.NoReduction, [4, 3])])
def test_losses_are_popart_s_nodes(reduction, shape):
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [4, 3]))
    label = b.addInputTensor(pk.TensorInfo("INT32", [4]))
    l1 = b.aiGraphcore.l1loss([x], 0.1, reduction=reduction)
    nll = b.aiGraphcore.nllloss([b.aiOnnx.softmax([x]), label], reduction, ignoreIndex=2)
    ident = b.aiGraphcore.identityloss([x], reduction)
    assert b.getTensorShape(l1) == shape and b.getTensorShape(ident) == shape
    assert b.getTensorShape(nll) == ([] if shape == [] else [4])
    model = onnx.load_from_string(b.getModelProto())
    onnx.checker.check_model(model)
    nodes = {n.op_type: n for n in model.graph.node}
    assert nodes["L1"].domain == "ai.graphcore"
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes["Nll"].attribute}
    assert attrs == {"reduction": {pk.ReductionType.Mean: b"Mean", pk.ReductionType.Sum: b"Sum",
                                   pk.ReductionType.NoReduction: b"None"}[reduction],
                     "ignoreIndex": 2, "inputIsLogProbability": 0}
    assert math.isclose(helper.get_attribute_value(nodes["L1"].attribute[0]), 0.1,
                        rel_tol=1e-6)


def test_broadcast_inputs_are_stored_as_popart_stores_them():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]),
                         pk.InputSettings(pk.ReplicatedStreamMode.Broadcast))
    y = b.addInputTensor(pk.TensorInfo("FLOAT", [2]), settings=pk.InputSettings())
    # PopART's (dataType, shape, settings) overload drops the settings
    z = b.addInputTensor("FLOAT", [2], pk.InputSettings(pk.ReplicatedStreamMode.Broadcast))
    props = {p.key: p.value for p in onnx.load_from_string(b.getModelProto()).metadata_props}
    assert props == {f"__replicated_stream_mode/{x}": "0",
                     f"__replicated_stream_mode/{y}": "1",
                     f"__replicated_stream_mode/{z}": "1"}


# -- the scope API ------------------------------------------------------------------------------


def _attrs(b: pk.Builder, tensor: str) -> dict[str, int]:
    model = onnx.load_from_string(b.getModelProto())
    node = next(n for n in model.graph.node if tensor in n.output)
    for a in node.attribute:
        if a.name.startswith("__"):
            assert a.type == onnx.AttributeProto.INT  # as PopART writes them
    return {a.name: a.i for a in node.attribute if a.name.startswith("__")}


def test_contexts_nest_as_a_stack():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    assert not b.hasPipelineStage()
    with pytest.raises(pk.BuilderError, match="Pipeline stage not set in current scope."):
        b.getPipelineStage()
    with b.pipelineStage(0), b.virtualGraph(0):
        a = b.aiOnnx.relu([x])
        with b.pipelineStage(1):
            assert b.getPipelineStage() == 1 and b.getVirtualGraph() == 0
            c = b.aiOnnx.relu([a])
        assert b.getPipelineStage() == 0
        d = b.aiOnnx.relu([c])
    e = b.aiOnnx.relu([d])
    assert not b.hasPipelineStage() and not b.hasVirtualGraph()
    assert _attrs(b, a) == {"__pipeline_stage": 0, "__ipu_number": 0}
    assert _attrs(b, c) == {"__pipeline_stage": 1, "__ipu_number": 0}
    assert _attrs(b, d) == {"__pipeline_stage": 0, "__ipu_number": 0}
    assert _attrs(b, e) == {}
    assert b.getVirtualGraph(c) == 0


def test_setters_and_attributes_fail_as_popart_fails():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    with b.pipelineStage(0):
        a = b.aiOnnx.relu([x])
    with pytest.raises(pk.BuilderError, match="Node already has attribute __pipeline_stage."):
        b.pipelineStage(a, 1)
    c = b.aiOnnx.relu([a])
    b.pipelineStage(c, 1)
    b.virtualGraph(c, 1)
    assert b.getInt64NodeAttribute("__pipeline_stage", c) == 1 and b.getVirtualGraph(c) == 1
    b.addNodeAttribute("custom", 3, {c})
    assert b.nodeHasAttribute("custom", [c]) and not b.nodeHasAttribute("other", c)
    with pytest.raises(pk.BuilderError, match="Node already has attribute custom."):
        b.addNodeAttribute("custom", 4, c)
    with pytest.raises(pk.BuilderError, match="Node does not have an attribute missing."):
        b.getInt64NodeAttribute("missing", c)
    outs = b.aiOnnx.dropout([c], 2, ratio=0.1)
    with pytest.raises(pk.BuilderError, match="Must specify all outputs of a node"):
        b.pipelineStage(outs[0], 2)
    b.addNodeAttribute("__pipeline_stage", 2, outs)
    with pytest.raises(TypeError, match="no overload"):
        b.pipelineStage([c], 1)  # PopART's setter takes one tensor id
    b.addNodeAttribute("empty", [], c)
    assert [a.ints for a in b._node(c).attribute if a.name == "empty"] == [[]]


def test_scope_values_accept_numpy_integers():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    with b.virtualGraph(np.int64(2)), b.pipelineStage(np.int32(1)):
        y = b.aiOnnx.relu([x])
    assert _attrs(b, y) == {"__pipeline_stage": 1, "__ipu_number": 2}


# -- PipelineBuilder -------------------------------------------------------------------------------


def _staged_chain(stage_to_ipu=None):
    b = pk.Builder()
    pb = pk.PipelineBuilder(b, stage_to_ipu)
    t = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    for _ in range(3):
        with pb.next_stage():
            t = b.aiOnnx.relu([t])
    return b, pb


def test_pipeline_builder_annotates_stage_and_ipu():
    b, pb = _staged_chain()
    assert pb.layout().stage_ipu == {0: 0, 1: 1, 2: 2}
    b, pb = _staged_chain(stage_to_ipu=[0, 0, 1])
    layout = pb.layout()
    assert layout.stage_ipu == {0: 0, 1: 0, 2: 1}
    assert (layout.depth(training=False), layout.depth(training=True)) == (2, 3)
    with pytest.raises(pk.BuilderError, match="count from 0"), pb.stage(-1):
        pass


def test_builder_model_and_hand_made_model_give_the_same_layout():
    b = pk.Builder()
    pb = pk.PipelineBuilder(b)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    with pb.stage(0):
        t = b.aiOnnx.relu([x])
    with pb.stage(1, ipu=0):
        t = b.aiOnnx.relu([t])
    with pb.stage(2, ipu=1):
        b.aiOnnx.relu([t])
    nodes = [helper.make_node("Relu", [i], [o], __pipeline_stage=s, __ipu_number=p)
             for i, o, s, p in (("x", "a", 0, 0), ("a", "b", 1, 0), ("b", "c", 2, 1))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        [2])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])])
    by_hand = PipelineLayout.from_model(helper.make_model(graph))
    built = pb.layout()
    assert built.stage_ipu == by_hand.stage_ipu
    assert built.depth(True) == by_hand.depth(True) == 3
    assert [(s, i, len(n)) for s, i, n in built.allocation()] == [
        (s, i, len(n)) for s, i, n in by_hand.allocation()]


def test_a_conv_is_checked_as_popart_checks_it_when_added():
    """PopART's builder_helper.cpp: kernel_shape must match the weights, and the window must
    give a spatial output of no negative size - in PopART's words."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [1, 64, 56, 56]))
    w = b.addInputTensor(pk.TensorInfo("FLOAT", [256, 64, 1, 1]))
    with pytest.raises(pk.BuilderError) as err:
        b.aiOnnx.conv([x, w], dilations=[1, 1], kernel_shape=[64, 64], strides=[1, 1],
                      pads=[0, 0, 0, 0])
    assert str(err.value) == (f"kernel_shape, [64 64], does not match inferred shape from "
                              f"weight input '{w}', [1 1]")
    big = b.addInputTensor(pk.TensorInfo("FLOAT", [256, 64, 64, 64]))
    with pytest.raises(pk.BuilderError) as err:
        b.aiOnnx.conv([x, big], dilations=[1, 1], strides=[1, 1], pads=[0, 0, 0, 0])
    assert str(err.value) == ("Window parameter values combine to give invalid spatial "
                              "output shape: [-7 -7]")
    with pytest.raises(pk.BuilderError, match="Length of strides vector 1 != number of "
                                              "spatial dimensions 2"):
        b.aiOnnx.conv([x, w], strides=[1])
    assert b.getTensorShape(b.aiOnnx.conv([x, w], strides=[2, 2])) == [1, 256, 28, 28]


def test_list_attributes_take_any_sequence_as_popart_s_bindings_do():
    """A tuple or a range is a list attribute; an empty one is left out (PopART then uses the
    operator's default: a reduction over every axis)."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3, 4]))
    assert b.getTensorShape(b.aiOnnx.reducesum([x], axes=range(2), keepdims=0)) == [4]
    assert b.getTensorShape(b.aiOnnx.reducesum([x], axes=(1,), keepdims=1)) == [2, 1, 4]
    scalar = b.aiOnnx.reducesum([x], keepdims=0)
    assert b.getTensorShape(b.aiOnnx.reducesum([scalar], axes=range(0), keepdims=0)) == []


def test_float_and_string_attributes_at_their_default_are_not_written_as_popart_does():
    """builder.gen.cpp writes a float or string attribute only when it is not the schema's
    default (ints always), so addNodeAttribute can still set it afterwards."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]))
    default, other = b.aiOnnx.leakyrelu([x]), b.aiOnnx.leakyrelu([x], alpha=0.2)
    assert not b.nodeHasAttribute("alpha", [default]) and b.nodeHasAttribute("alpha", [other])
    b.addNodeAttribute("alpha", 0.3, {default})
    padded = b.aiOnnx.pad([x], pads=[0, 1, 0, 1])  # mode "constant" is the default
    assert not b.nodeHasAttribute("mode", [padded])
    flat = b.aiOnnx.flatten([x])                    # an int attribute: always written
    assert b.getInt64NodeAttribute("axis", [flat]) == 1


def test_initializers_saved_externally_load_from_the_model_s_folder(tmp_path, monkeypatch):
    import popart_kit.popart as popart

    monkeypatch.chdir(tmp_path)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 3]))
    w = b.addInitializedInputTensor(np.arange(9, dtype=np.float32).reshape(3, 3))
    y = b.aiOnnx.matmul([x, w])
    b.saveInitializersExternally([w], "weights.bin")
    assert (tmp_path / "weights.bin").read_bytes() == np.arange(9, dtype=np.float32).tobytes()
    stored = onnx.load_from_string(b.getModelProto())
    assert stored.graph.initializer[0].data_location == onnx.TensorProto.EXTERNAL
    b.saveModelProto(str(tmp_path / "model.onnx"))
    session = popart.InferenceSession(str(tmp_path / "model.onnx"), popart.DataFlow(1, [y]),
                                      popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO({x: np.ones((1, 3), np.float32)}, anchors))
    np.testing.assert_allclose(anchors[y], [[9.0, 12.0, 15.0]])
    with pytest.raises(popart.popart_exception, match="is not an initializer"):
        b.saveInitializersExternally([x], "other.bin")


def test_saving_initializers_externally_is_all_or_nothing(tmp_path, monkeypatch):
    """A refusal (PopART's words) leaves the model and the file system as they were: a tensor
    named twice, after one that would have moved; the same through the GraphTransformer."""
    import popart_kit.popart as popart

    monkeypatch.chdir(tmp_path)
    b = popart.Builder()
    b.addInputTensor(popart.TensorInfo("FLOAT", [1, 3]))
    w = b.addInitializedInputTensor(np.ones((3, 3), np.float32))
    v = b.addInitializedInputTensor(np.zeros((3,), np.float32))
    before = b.getModelProto()
    with pytest.raises(popart.popart_exception,
                       match=f"Tensor '{v}' already has an external data_location"):
        b.saveInitializersExternally([w, v, v], "weights.bin")
    assert b.getModelProto() == before and not (tmp_path / "weights.bin").exists()
    transformer = popart.GraphTransformer(before)
    with pytest.raises(popart.popart_exception, match="parent directory does not exist"):
        transformer.saveInitializersExternally([w], "missing/weights.bin")
    assert transformer.getModelProto() == before


def test_a_constant_of_any_type_is_typed_by_its_value_at_every_opset():
    """PopART's ConstantOp takes any tensor: an INT64 constant under opset 8, where ONNX's
    Constant-1 lists float types only, is typed INT64 with the value's shape."""
    import popart_kit.popart as popart

    b = popart.Builder(opsets={"ai.onnx": 8, "ai.graphcore": 1})
    c = b.aiOnnx.constant(np.array([[2, 1, 6]], dtype=np.int64))
    assert b.getTensorDtypeString(c) == "int64"
    assert b.getTensorShape(c) == [1, 3]
