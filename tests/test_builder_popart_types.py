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
    assert words in err.value.args[0] and "K-model-popart-setup" in err.value.args[0]


def _node_types(node, types, data=None, version=11):
    protos = {k: helper.make_tensor_type_proto(t, s) for k, (t, s) in types.items()}
    data = {k: onnx.numpy_helper.from_array(v, k) for k, v in (data or {}).items()}
    for k, t in data.items():
        protos[k] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
    found = node_types(node, version, protos, data)
    return {k: (v.tensor_type.elem_type, [d.dim_value for d in v.tensor_type.shape.dim])
            for k, v in found.items()}


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
