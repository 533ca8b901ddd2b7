"""The Builder types ops as PopART does (popart_kit/_model/popart_types.py) and refuses only what
PopART refuses: ONNX's schemas refuse these inputs, PopART's ops take them."""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import popart_kit.popart as popart
from popart_kit._model.checks import model_problems
from popart_kit._model.popart_types import first_refusal, node_types


def _session(builder, outs, feeds):
    for o in outs:
        builder.addOutputTensor(o)
    flow = popart.DataFlow(1, {o: popart.AnchorReturnType("All") for o in outs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # K-model-onnx-inference: the kit's stricter rule
        session = popart.InferenceSession(builder.getModelProto(), flow,
                                          popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO(feeds, anchors))
    return anchors


def _ort(node, feeds, opset):
    """onnxruntime's result of one node on ``feeds`` (inputs it takes)."""
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                    v.shape) for k, v in feeds.items()],
        [helper.make_value_info(o, onnx.TypeProto()) for o in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)


def test_ops_onnx_refuses_are_typed_and_run_as_in_popart():
    rng = np.random.default_rng(0)
    h = rng.random((2, 1)).astype(np.float16)
    s = np.array([1.5], np.float32)
    f = rng.random((2, 3)).astype(np.float32)
    i = rng.integers(-9, 9, (2, 5)).astype(np.int32)
    b = popart.Builder()
    th, ts, tf, ti = (b.addInputTensor(popart.TensorInfo(v)) for v in (h, s, f, i))
    mul = b.aiOnnx.mul([ts, th])             # FLOAT scalar x FLOAT16: FLOAT16 (mul.cpp)
    eq = b.aiOnnx.equal([tf, tf])            # Equal-7 lists integers only
    both = b.aiOnnx.logical_and([tf, tf])    # And: BOOL only in ONNX
    big = b.aiOnnx.max([ti, ti])             # Max-8: floats only
    values, idx = b.aiOnnx.topk([ti, b.aiOnnx.constant(np.array([2], np.int64))])  # TopK-10
    shape = b.aiOnnx.constant(np.array([3, 2, 3], np.int32))
    wide = b.aiOnnx.expand([tf, shape])      # an INT32 shape: ONNX's inference reads INT64
    typed = {t: (b.getTensorDtypeString(t), b.getTensorShape(t))
             for t in (mul, eq, both, big, values, idx, wide)}
    assert typed == {mul: ("float16", [2, 1]), eq: ("bool", [2, 3]), both: ("bool", [2, 3]),
                     big: ("int32", [2, 5]), values: ("int32", [2, 2]), idx: ("int64", [2, 2]),
                     wide: ("float32", [3, 2, 3])}
    out = _session(b, [mul, eq, both, big, values, wide], {th: h, ts: s, tf: f, ti: i})
    assert out[mul].dtype == np.float16
    np.testing.assert_allclose(out[mul], (h.astype(np.float32) * s).astype(np.float16))
    # onnxruntime, where it runs the op after a cast to types it takes
    (ref_eq,) = _ort(helper.make_node("Equal", ["a", "b"], ["y"]), {"a": f, "b": f}, 11)
    np.testing.assert_array_equal(out[eq], ref_eq)
    np.testing.assert_array_equal(out[both], np.logical_and(f, f))
    (ref_max,) = _ort(helper.make_node("Max", ["a", "b"], ["y"]), {"a": i, "b": i}, 12)
    np.testing.assert_array_equal(out[big], ref_max)
    ref_top, _ = _ort(helper.make_node("TopK", ["a", "k"], ["v", "i"]),
                      {"a": i.astype(np.float32), "k": np.array([2], np.int64)}, 11)
    np.testing.assert_array_equal(out[values], ref_top.astype(np.int32))
    (ref_wide,) = _ort(helper.make_node("Expand", ["a", "s"], ["y"]),
                       {"a": f, "s": np.array([3, 2, 3], np.int64)}, 8)
    np.testing.assert_array_equal(out[wide], ref_wide)


@pytest.mark.parametrize(("shapes", "dtypes", "words"), [
    (([10, 10], [10, 5]), ("FLOAT", "FLOAT"),
     "np broadcasting failed on 'Op C (ai.onnx.Add:10)', frames [10, 10] and [10, 5] are not "
     "aligned"),
    (([2, 2], [2, 2]), ("FLOAT16", "FLOAT"),
     "incompatible types FLOAT16 and FLOAT (shapes [2 2] and [2 2])"),
])
def test_inputs_popart_refuses_build_untyped_and_the_session_refuses_them(shapes, dtypes, words):
    """As PopART: the Builder leaves the output untyped, the op's setup refuses at session
    creation, in its words."""
    b = popart.Builder()
    x, y = (b.addInputTensor(popart.TensorInfo(d, s)) for d, s in zip(dtypes, shapes, strict=True))
    c = b.aiOnnx.add([x, y], "C")
    with pytest.raises(popart.popart_exception, match="not known"):
        b.getTensorShape(c)
    b.addOutputTensor(c)
    flow = popart.DataFlow(1, {c: popart.AnchorReturnType("All")})
    with pytest.raises(popart.popart_exception) as err:
        popart.InferenceSession(b.getModelProto(), flow, popart.DeviceManager().createCpuDevice())
    # PopART's text alone, as PopART raises it (no kit suffix after it)
    assert err.value.args[0].endswith(words) and "K-model-popart-setup" not in err.value.args[0]


def _node_types(node, types, data=None, version=11):
    protos = {k: helper.make_tensor_type_proto(t, s) for k, (t, s) in types.items()}
    data = {k: onnx.numpy_helper.from_array(v, k) for k, v in (data or {}).items()}
    for k, t in data.items():
        protos[k] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
    found = node_types(node, version, protos, data)
    return {k: (v.tensor_type.elem_type, [d.dim_value for d in v.tensor_type.shape.dim])
            for k, v in found.items()}


def test_a_concat_of_no_inputs_is_left_to_onnx_s_checker():
    """Found by the garbage fuzz test: a Concat node with no inputs at all (ONNX's schema
    wants one or more) is refused by ONNX's inference, as node_types says, rather than
    crashing PopART's Concat rule."""
    node = helper.make_node("Concat", [], ["y"], axis=0)
    with pytest.raises(onnx.shape_inference.InferenceError, match="input size 0"):
        _node_types(node, {}, version=13)


def test_popart_s_rules_where_onnx_refuses():
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    # ConstantOfShape reads an INT32 shape (ONNX's inference wants INT64)
    value = helper.make_tensor("v", TensorProto.INT8, [1], [7])
    node = helper.make_node("ConstantOfShape", ["s"], ["y"], value=value)
    assert _node_types(node, {}, {"s": np.array([2, 3], np.int32)}) == {
        "y": (TensorProto.INT8, [2, 3])}
    # ConvTranspose: PopART also takes output_shape as the whole output's shape
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], output_shape=[1, 2, 9])
    assert _node_types(node, {"x": (f32, [1, 1, 5]), "w": (f32, [1, 2, 3])}, version=10) == {
        "y": (f32, [1, 2, 9])}
    # Clip-11 with a FLOAT min on a FLOAT16 input: the input's type (ONNX's inference, lenient)
    node = helper.make_node("Clip", ["x", "lo"], ["y"])
    assert _node_types(node, {"x": (f16, [4])}, {"lo": np.array(0.5, np.float32)}) == {
        "y": (f16, [4])}
    # BatchNormalization-9, training outputs: PopART's own Builder inference
    node = helper.make_node("BatchNormalization", list("xsbmv"), ["y", "m", "v", "sm", "sv"])
    types = {"x": (f16, [1, 3, 2, 2]), **{k: (f32, [3]) for k in "sbmv"}}
    assert _node_types(node, types, version=10) == {
        "y": (f16, [1, 3, 2, 2]), **{k: (f32, [3]) for k in ("m", "v", "sm", "sv")}}


def _model(nodes, inputs, output, opset=11):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info("y", *output)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_model_checks_refuse_what_popart_refuses_and_only_warn_for_what_it_runs():
    runs = _model([helper.make_node("Mul", ["a", "b"], ["y"])],
                  [("a", TensorProto.FLOAT16, [2, 2]), ("b", TensorProto.FLOAT, [])],
                  (TensorProto.FLOAT16, [2, 2]))
    assert first_refusal(runs) is None
    assert [p.rule for p in model_problems(runs)] == ["K-model-onnx-inference"]
    wide = helper.make_tensor("s", TensorProto.INT32, [2], [4, 3])
    broken = _model([helper.make_node("Constant", [], ["s"], value=wide),
                     helper.make_node("Expand", ["a", "s"], ["y"])],
                    [("a", TensorProto.FLOAT, [2, 3])], (TensorProto.FLOAT, [4, 3]))
    assert first_refusal(broken) == ("Expand shape constraint: corresponding dimensions must "
                                     "have the same value or one of them must be 1")
    assert [p.rule for p in model_problems(broken)] == ["K-model-popart-setup"]


def _tile_of_a_stream(b, x):
    return b.aiOnnx.tile([x, b.addInputTensor(popart.TensorInfo("INT64", [2]), "reps")])


def _slice_of_a_stream(b, x):
    starts = b.addInputTensor(popart.TensorInfo("INT32", [2]), "starts")
    return b.aiOnnx.slice([x, starts, b.aiOnnx.constant(np.array([2, 3], np.int32))])


def _reshape_two_unknown(b, x):
    return b.aiOnnx.reshape([x, b.aiOnnx.constant(np.array([-1, -1], np.int64))])


def _tile_short_repeats(b, x):
    return b.aiOnnx.tile([x, b.aiOnnx.constant(np.array([2, 1, 4], np.int64))])


def _matmul_scalar(b, x):
    return b.aiOnnx.matmul([b.aiOnnx.constant(np.array(2, np.float32)), x])


def _transpose_short_perm(b, x):
    return b.aiOnnx.transpose([x], [1])


def _batchnorm_wrong_scale(b, x):
    x4 = b.aiOnnx.reshape([x, b.aiOnnx.constant(np.array([1, 2, 3, 1], np.int64))])
    stats = [b.aiOnnx.constant(np.ones(n, np.float32)) for n in (1, 2, 2, 2)]
    return b.aiOnnx.batchnormalization([x4, *stats], 1)[0]


@pytest.mark.parametrize(("build", "words"), [
    (_tile_of_a_stream, "The 'Repeats' Tensor `reps' must be of type Constant"),
    (_slice_of_a_stream, "Need the value of the ai.onnx.Slice:10 input 'starts' to determine "
     "the output shape, but was unable because [Tensor::getDataViaGraphTraversal] Could not "
     "work out tensor data for starts."),
    (_reshape_two_unknown, "Need the value of the ai.onnx.Reshape:5 input 'shape' to determine "
     "the output shape, but was unable because shape input to ReshapeOp can only use -1 to "
     "specify one unknown dimension"),
    (_tile_short_repeats, "'Repeats' tensor `Constant:0' should have one element for each "
     "dimension of the data tensor"),
    (_matmul_scalar, "Op(ai.onnx.MatMul:9, inputs=[Constant:0, x], outputs=[MatMul:0]) "
     "doesn't support scalar tensor Constant:0 as the lhs input"),
    (_transpose_short_perm, "Rank of permutation tensor [1], rank 1 must be equal to rank of "
     "input tensor, shape [2 3], rank 2."),
    (_batchnorm_wrong_scale, "expected shape of batch norm input tensor scale ([1]) to be [2] "
     "to match dimension 1 of X ([1 2 3 1])"),
])
def test_popart_s_own_refusals_are_raised_in_its_words_alone(build, words):
    """What PopART's ops refuse when the session is made (their connectInTensor / setup, and
    the xla lowering's compile-time inputs), raised by the drop-in as PopART's text alone."""
    b = popart.Builder(opsets={"ai.onnx": 10, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    out = build(b, x)
    b.addOutputTensor(out)
    flow = popart.DataFlow(1, {out: popart.AnchorReturnType("All")})
    with pytest.raises(popart.popart_exception) as err:
        popart.InferenceSession(b.getModelProto(), flow, popart.DeviceManager().createCpuDevice())
    assert err.value.args[0] == words


def test_what_popart_types_and_onnx_does_not_runs():
    """A Reshape to a Shape's value and a Concat-4 of negative axis build and run as PopART
    runs them; the ONNX reference is onnxruntime at opset 11 (which takes the negative axis).
    An output of a negative size and a pool's pads of the wrong length are refused when the op
    is added, in PopART's words."""
    b = popart.Builder(opsets={"ai.onnx": 10, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    like = b.addInputTensor(popart.TensorInfo("FLOAT", [3, 2]), "like")
    r = b.aiOnnx.reshape([x, b.aiOnnx.shape([like])])
    c = b.aiOnnx.concat([r, r], -1)
    assert b.getTensorShape(r) == [3, 2] and b.getTensorShape(c) == [3, 4]
    with pytest.raises(popart.popart_exception, match=r"Output 'Tile:0' .* \[2 -6\]\. Values "
                       r"must be non-negative in each shape dimension\."):
        b.aiOnnx.tile([x, b.aiOnnx.constant(np.array([1, -2], np.int64))])
    with pytest.raises(popart.popart_exception, match=r"^Padding vector \(length 3\) does not "
                       r"have 2 values for each spatial dimension 2"):
        b.aiOnnx.averagepool([b.aiOnnx.unsqueeze([b.aiOnnx.unsqueeze([x], [0])], [0])],
                             kernel_shape=[1, 1], pads=[0, 0, 0])
    flat = b.aiOnnx.flatten([c], -1)
    b.addOutputTensor(flat)
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = _session(b, [flat], {x: data, like: np.zeros((3, 2), np.float32)})[flat]
    (want,) = _ort(helper.make_node("Concat", ["a", "b"], ["c"], axis=-1),
                   {"a": data.reshape(3, 2), "b": data.reshape(3, 2)}, 11)
    np.testing.assert_array_equal(got, want.reshape(3, 4))


def test_supported_operations_definition_describes_each_supported_operator():
    """popart.getSupportedOperationsDefinition: each supported operator (with includePrivate,
    the ai.graphcore ones too) with its inputs' and outputs' tensor types and attributes."""
    public = popart.getSupportedOperationsDefinition(False)
    every = popart.getSupportedOperationsDefinition(True)
    assert set(public) == set(popart.getSupportedOperations(False)) and len(every) > len(public)
    add = next(v for k, v in public.items() if k.type == "Add" and k.version == 7)
    assert [i.name for i in add.inputs] == ["A", "B"] and add.outputs[0].name == "C"
    assert popart.DataType.FLOAT in add.inputs[0].supportedTensors
    flatten = next(v for k, v in public.items() if k.type == "Flatten")
    assert flatten.attributes["axis"].supportedValuesRegex == "*"


def test_an_empty_list_attribute_is_any_list_and_the_op_refuses_it_in_popart_s_words():
    """PopART's addNodeAttribute(name, []) writes an empty INTS that its op reads as the list
    it wants: RNN's empty ``activations`` reaches rnn.cpp readActivations' refusal, not the
    kit's attribute-type check."""
    b = popart.Builder(opsets={"ai.onnx": 10, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 1, 1]), "x")
    w, r = (b.addInitializedInputTensor(np.ones((1, 1, 1), np.float32)) for _ in range(2))
    y = b.aiOnnx.rnn([x, w, r], 1)
    b.addNodeAttribute("activations", [], set(y))
    b.addOutputTensor(y[0])
    flow = popart.DataFlow(1, {y[0]: popart.AnchorReturnType("All")})
    with pytest.raises(popart.popart_exception, match="only supports 1 activation, 0 were "
                       "specified"):
        popart.InferenceSession(b.getModelProto(), flow, popart.DeviceManager().createCpuDevice())
