"""Subgraphs and control flow: ONNX If, Loop and Scan models on the xla backend against
onnxruntime, PopART-style programs (sub-builders with Call, If, Loop and Scan) through
popart_kit.popart sessions - forward, and a training step against the same model written
without the control flow - and what is refused."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import jax
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart_kit.popart as popart
from popart_kit._runtime.xla.lowering import UnsupportedModel, lower

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

F, B, I64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64
OPS = json.loads((Path(__file__).parent / "contract" / "popart_builder_ops.json").read_text())
RNG = np.random.default_rng(7)


def _model(nodes, inputs, outputs, initializers=(), opset=13, check=True):
    graph = helper.make_graph(nodes, "main", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    if check:
        onnx.checker.check_model(model)
    return model


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _const(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
        np.asarray(value)))


def _both(model, feeds):
    """The model's outputs by onnxruntime and by the xla backend (jitted)."""
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    graph, names = lower(model), [o.name for o in model.graph.output]
    got = jax.jit(lambda f: graph.evaluate({}, f, names))(feeds)
    return [np.asarray(got[n]) for n in names], want


# -- ONNX models against onnxruntime --------------------------------------------------------

def _if_model():
    """y = x * 2 where c, else x - w (the branches read x and the weight w from outside)."""
    then = helper.make_graph([_const("two", np.float32(2)), helper.make_node(
        "Mul", ["x", "two"], ["y_then"])], "then", [], [_vi("y_then", F, [3])])
    other = helper.make_graph([helper.make_node("Sub", ["x", "w"], ["y_else"])], "else", [],
                              [_vi("y_else", F, [3])])
    return _model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                  [_vi("c", B, []), _vi("x", F, [3])], [_vi("y", F, [3])],
                  [numpy_helper.from_array(np.array([1, 2, 3], np.float32), "w")])


@pytest.mark.parametrize("cond", [True, False])
def test_if_matches_onnxruntime_for_a_condition_known_only_when_running(cond):
    feeds = {"c": np.array(cond), "x": RNG.normal(size=3).astype(np.float32)}
    (got,), (want,) = _both(_if_model(), feeds)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _loop_body(stop_at=None, scan=True):
    """acc += x * i each iteration; a scan output of acc; stops once sum(acc) > stop_at."""
    nodes = [helper.make_node("Cast", ["i"], ["fi"], to=F),
             helper.make_node("Mul", ["x", "fi"], ["step"]),
             helper.make_node("Add", ["acc", "step"], ["acc_out"])]
    if stop_at is None:
        nodes.append(helper.make_node("Identity", ["c"], ["c_out"]))
    else:
        nodes += [helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
                  _const("limit", np.float32(stop_at)),
                  helper.make_node("Less", ["total", "limit"], ["c_out"])]
    outputs = [_vi("c_out", B, []), _vi("acc_out", F, [2])]
    if scan:
        nodes.append(helper.make_node("Identity", ["acc_out"], ["row"]))
        outputs.append(_vi("row", F, [2]))
    return helper.make_graph(nodes, "body", [_vi("i", I64, []), _vi("c", B, []),
                                             _vi("acc", F, [2])], outputs)


def test_loop_with_scan_outputs_matches_onnxruntime():
    model = _model([_const("M", np.int64(4)), _const("go", np.array(True)),
                    helper.make_node("Loop", ["M", "go", "a"], ["final", "rows"],
                                     body=_loop_body())],
                   [_vi("a", F, [2]), _vi("x", F, [2])],
                   [_vi("final", F, [2]), _vi("rows", F, [4, 2])])
    feeds = {"a": np.array([1, -1], np.float32), "x": np.array([0.5, 2], np.float32)}
    got, want = _both(model, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_loop_stops_when_its_condition_turns_false_as_onnxruntime():
    model = _model([_const("M", np.int64(50)), _const("go", np.array(True)),
                    helper.make_node("Loop", ["M", "go", "a"], ["final"],
                                     body=_loop_body(stop_at=20.0, scan=False))],
                   [_vi("a", F, [2]), _vi("x", F, [2])], [_vi("final", F, [2])])
    feeds = {"a": np.zeros(2, np.float32), "x": np.array([1, 2], np.float32)}
    (got,), (want,) = _both(model, feeds)
    np.testing.assert_allclose(got, want)
    assert 20 <= got.sum() < 50 * 3  # it stopped early


def test_scan_matches_onnxruntime_with_axes_and_directions():
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "row"], ["s_out"]),
         helper.make_node("Mul", ["s_out", "k"], ["y"])], "body",
        [_vi("s", F, [2]), _vi("row", F, [2])], [_vi("s_out", F, [2]), _vi("y", F, [2])])
    model = _model([helper.make_node("Scan", ["s0", "xs"], ["s_final", "ys"], body=body,
                                     num_scan_inputs=1, scan_input_axes=[1],
                                     scan_input_directions=[1], scan_output_axes=[1])],
                   [_vi("s0", F, [2]), _vi("xs", F, [2, 5])],
                   [_vi("s_final", F, [2]), _vi("ys", F, [2, 5])],
                   [numpy_helper.from_array(np.array([1, -2], np.float32), "k")], opset=11)
    feeds = {"s0": np.array([0.5, 1], np.float32),
             "xs": RNG.normal(size=(2, 5)).astype(np.float32)}
    got, want = _both(model, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5)


# -- PopART programs through popart_kit.popart ------------------------------------------------

X = RNG.normal(size=(2, 3)).astype(np.float32)
W = RNG.normal(size=(3, 3)).astype(np.float32)


def _run(builder, outputs, feeds, loss=None, steps=1):
    """The anchors of ``outputs`` after ``steps`` runs (SGD steps, lr 0.1, when ``loss``) and
    the weights then."""
    flow = popart.DataFlow(1, list(outputs))
    device = popart.DeviceManager().createCpuDevice()
    proto = builder.getModelProto()
    if loss is None:
        session = popart.InferenceSession(proto, flow, device)
    else:
        session = popart.TrainingSession(fnModel=proto, dataFlow=flow, loss=loss,
                                         optimizer=popart.ConstSGD(0.1), deviceInfo=device)
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    for _ in range(steps):
        session.run(popart.PyStepIO(feeds, anchors))
    weights = {w: np.zeros(builder.getTensorShape(w), np.float32)
               for w in builder.getTrainableTensorIds()}
    session.weightsToHost()
    session.readWeights(popart.PyWeightsIO(weights))
    return [np.array(anchors[o]) for o in outputs], list(weights.values())


def _layer(b, a, w):
    return b.aiOnnx.relu([b.aiOnnx.matmul([a, w])])


def test_call_trains_as_the_same_layers_written_inline():
    results = []
    for use_call in (True, False):
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
        w = b.addInitializedInputTensor(W)
        if use_call:
            sub = b.createSubgraphBuilder()
            a, k = sub.addUntypedInputTensor(), sub.addUntypedInputTensor()
            sub.addOutputTensor(_layer(sub, a, k))
            y = b.aiGraphcore.call([x, w], 1, sub)[0]
            y = b.aiGraphcore.call([y, w], 1, sub)[0]
            assert b.getTensorShape(y) == [2, 3]
        else:
            y = _layer(b, _layer(b, x, w), w)
        loss = b.aiGraphcore.l1loss([y], 0.5)
        results.append(_run(b, [y, popart.reservedGradientPrefix() + w], {x: X}, loss))
    (call_out, call_w), (inline_out, inline_w) = results
    np.testing.assert_allclose(call_out[0], inline_out[0], rtol=1e-6)
    np.testing.assert_allclose(call_out[1], inline_out[1], rtol=1e-5)
    assert np.abs(call_out[1]).sum() > 0  # a gradient flowed through the calls
    np.testing.assert_allclose(call_w[0], inline_w[0], rtol=1e-6)


@pytest.mark.parametrize("cond", [True, False])
def test_if_trains_as_the_branch_it_takes(cond):
    def branches(b, x, w):
        return _layer(b, x, w), b.aiOnnx.mul([b.aiOnnx.matmul([x, w]), x])

    results = []
    for use_if in (True, False):
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
        c = b.addInputTensor(popart.TensorInfo("BOOL", []))
        w = b.addInitializedInputTensor(W)
        if use_if:
            then, other = b.createSubgraphBuilder(), b.createSubgraphBuilder()
            then.addInputTensorFromParentGraph(x)   # declared (PopART's way) or read as is
            then.addInputTensorFromParentGraph(w)
            then.addOutputTensor(branches(then, x, w)[0])
            other.addOutputTensor(branches(other, x, w)[1])
            y = b.aiOnnx.logical_if([c], 1, other, then)[0]
        else:
            y = branches(b, x, w)[0 if cond else 1]
        loss = b.aiGraphcore.l1loss([y], 0.5)
        results.append(_run(b, [y], {x: X, c: np.array(cond)}, loss))
    (if_out, if_w), (plain_out, plain_w) = results
    np.testing.assert_allclose(if_out[0], plain_out[0], rtol=1e-6)
    np.testing.assert_allclose(if_w[0], plain_w[0], rtol=1e-6)
    assert not np.allclose(if_w[0], W)


def _loop_program(b, x, w, v, use_loop):
    """((x * w) doubled three times, by a Loop) * v; PopART gives a Loop's inputs no
    gradient, so the plain form detaches the doubled value."""
    a = b.aiOnnx.mul([x, w])
    if use_loop:
        body = b.createSubgraphBuilder()
        body.addInputTensor(popart.TensorInfo("INT64", []))
        keep = body.addInputTensor(popart.TensorInfo("BOOL", []))
        acc = body.addUntypedInputTensor(a)
        body.addOutputTensor(keep)
        body.addOutputTensor(body.aiOnnx.add([acc, acc]))
        trips = b.aiOnnx.constant(np.array(3, np.int64))
        go = b.aiOnnx.constant(np.array(True))
        a = b.aiOnnx.loop([trips, go, a], 1, body)[0]
    else:
        a = b.aiGraphcore.detach([b.aiGraphcore.scale([a], 8.0)])
    return b.aiOnnx.mul([a, v])


def test_loop_runs_and_trains_as_popart_does_without_a_gradient_through_it():
    results = []
    for use_loop in (True, False):
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]))
        w = b.addInitializedInputTensor(np.array([1, 2, 3], np.float32))
        v = b.addInitializedInputTensor(np.array([0.5, -1, 2], np.float32))
        y = _loop_program(b, x, w, v, use_loop)
        loss = b.aiGraphcore.l1loss([y], 1.0, popart.ReductionType.Sum)
        results.append(_run(b, [y], {x: np.array([1, -1, 0.5], np.float32)}, loss))
    (loop_out, loop_w), (plain_out, plain_w) = results
    np.testing.assert_allclose(loop_out[0], np.array([4, 16, 24], np.float32))
    np.testing.assert_allclose(loop_out[0], plain_out[0])
    for got, want in zip(loop_w, plain_w, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(loop_w[0], [1, 2, 3])  # w: no gradient through the Loop


def test_loop_scan_outputs_and_early_stop_from_the_builder():
    b = popart.Builder()
    a = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    body = b.createSubgraphBuilder()
    body.addInputTensor(popart.TensorInfo("INT64", []))
    body.addUntypedInputTensor()
    acc = body.addUntypedInputTensor()
    doubled = body.aiOnnx.add([acc, acc])
    limit = body.aiOnnx.constant(np.array(10, np.float32))
    body.addOutputTensor(body.aiOnnx.less([body.aiOnnx.reducesum([doubled], keepdims=0),
                                           limit]))
    body.addOutputTensor(doubled)
    body.addOutputTensor(doubled)
    trips = b.aiOnnx.constant(np.array(5, np.int64))
    go = b.aiOnnx.constant(np.array(True))
    final, rows = b.aiOnnx.loop([trips, go, a], 2, body)
    assert b.getTensorShape(rows) == [5, 2]
    (got_final, got_rows), _ = _run(b, [final, rows], {a: np.array([1, 0.5], np.float32)})
    # 1.5 -> 3 -> 6 -> 12: the sum passes 10 in the third iteration, which still runs
    np.testing.assert_allclose(got_final, [8, 4])
    np.testing.assert_allclose(got_rows, [[2, 1], [4, 2], [8, 4], [0, 0], [0, 0]])


def test_scan_follows_popart_s_scan_op():
    """PopART's ScanOp: rank-1 scan inputs sliced to [1], scan outputs concatenated along
    their axis; a reversed output direction reverses the iterations."""
    d0, d1 = np.array([0, 2, 4, 6], np.float32), np.array([1, 3, 5, 7], np.float32)
    b = popart.Builder()
    t0, t1 = b.addInputTensor(popart.TensorInfo(d0)), b.addInputTensor(popart.TensorInfo(d1))
    body = b.createSubgraphBuilder()
    s0, s1 = body.addUntypedInputTensor(), body.addUntypedInputTensor()
    body.addOutputTensor(body.aiOnnx.concat([s0, s1], 0))
    zipped = b.aiOnnx.scan([t0, t1], 1, body, 2, scan_input_directions=[0, 1],
                           scan_output_directions=[1])[0]
    assert b.getTensorShape(zipped) == [8]
    (got,), _ = _run(b, [zipped], {t0: d0, t1: d1})
    np.testing.assert_allclose(got, np.stack([d0, d1[::-1]], 1)[::-1].reshape(-1))


def test_nested_subgraphs_read_every_enclosing_graph():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    k = b.aiOnnx.constant(np.array([10, 20], np.float32))
    outer = b.createSubgraphBuilder()
    inner = outer.createSubgraphBuilder()
    y = outer.aiOnnx.mul([x, x])
    inner.addOutputTensor(inner.aiOnnx.add([y, k]))  # reads its parent's y and the root's k
    other = outer.createSubgraphBuilder()
    other.addOutputTensor(other.aiOnnx.neg([y]))
    c = outer.aiOnnx.constant(np.array(True))
    outer.addOutputTensor(outer.aiOnnx.logical_if([c], 1, other, inner)[0])
    out = b.aiGraphcore.call([], 1, outer)[0]
    (got,), _ = _run(b, [out], {x: np.array([2, 3], np.float32)})
    np.testing.assert_allclose(got, [14, 29])
    taken = {n for n in b.getValueTensorIds()} | set(outer.getValueTensorIds())
    assert len(taken) == len(b.getValueTensorIds()) + len(outer.getValueTensorIds())


# -- the Builder's API ------------------------------------------------------------------------

def test_subgraph_methods_have_popart_s_signatures():
    b = popart.Builder(opsets={"ai.onnx": 9, "ai.graphcore": 1})
    cases = [(b.aiOnnx.logical_if, OPS["ai_onnx"]["9"]["logical_if"]),
             (b.aiOnnx.loop, OPS["ai_onnx"]["9"]["loop"]),
             (b.aiOnnx.scan, OPS["ai_onnx"]["9"]["scan"]),
             (popart.Builder(opsets={"ai.onnx": 8, "ai.graphcore": 1}).aiOnnx.scan,
              OPS["ai_onnx"]["8"]["scan"]),
             (b.aiGraphcore.call, OPS["ai_graphcore"]["call"])]
    for method, spec in cases:
        params = inspect.signature(method).parameters
        assert list(params) == spec["params"]
        for name, default in spec["defaults"].items():
            assert params[name].default == default
    assert "scan" not in dir(popart.Builder(opsets={"ai.onnx": 7, "ai.graphcore": 1}).aiOnnx)


def test_builder_refusals_use_popart_s_words():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    sub = b.createSubgraphBuilder()
    sub.addOutputTensor(sub.aiOnnx.relu([sub.addUntypedInputTensor()]))
    with pytest.raises(popart.popart_exception, match=r"^For CallOp 'c', number of inputs \(2\) "
                       r"does not match that of the callee subgraph \(1\)$"):
        b.aiGraphcore.call([x, x], 1, sub, "c")
    with pytest.raises(popart.popart_exception, match=r"number of outputs \(2\) does not match"):
        b.aiGraphcore.call([x], 2, sub)
    with pytest.raises(popart.popart_exception, match="Can not add untyped tensors to the "
                       "top-level graph"):
        b.addUntypedInputTensor()
    with pytest.raises(popart.popart_exception, match="Failed to add unrecognised Tensor nope"):
        sub.addInputTensorFromParentGraph("nope")


# -- refusals of the xla backend --------------------------------------------------------------

def test_if_with_branches_of_different_shapes_needs_a_known_condition():
    then = helper.make_graph([_const("t", np.zeros(2, np.float32))], "then", [],
                             [_vi("t", F, [2])])
    other = helper.make_graph([_const("e", np.zeros(3, np.float32))], "else", [],
                              [_vi("e", F, [3])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    graph = lower(_model([node], [_vi("c", B, [])], [_vi("y", F, None)], check=False))
    with pytest.raises(UnsupportedModel, match="branches give outputs of different shapes"):
        jax.jit(lambda c: graph.evaluate({}, {"c": c}, ["y"]))(np.array(True))
    known = lower(_model([_const("c", np.array(False)), node], [], [_vi("y", F, None)],
                         check=False))  # a constant condition: the branch is picked
    np.testing.assert_array_equal(known.evaluate({}, {}, ["y"])["y"], np.zeros(3))


def test_loop_refusals_name_the_node_and_the_fix():
    body = _loop_body()
    runtime_m = _model([_const("go", np.array(True)),
                        helper.make_node("Loop", ["M", "go", "a"], ["f", "r"], body=body)],
                       [_vi("M", I64, []), _vi("a", F, [2]), _vi("x", F, [2])],
                       [_vi("f", F, [2]), _vi("r", F, None)], check=False)
    with pytest.raises(UnsupportedModel, match=r"input 0 \('M'\) must be a compile-time"):
        lower(runtime_m)
    no_m = _model([_const("go", np.array(True)),
                   helper.make_node("Loop", ["", "go", "a"], ["f", "r"], body=body)],
                  [_vi("a", F, [2]), _vi("x", F, [2])], [_vi("f", F, [2]), _vi("r", F, None)],
                  check=False)
    graph = lower(no_m)
    with pytest.raises(UnsupportedModel, match="needs its trip count M"):
        graph.evaluate({}, {"a": np.ones(2, np.float32), "x": np.ones(2, np.float32)}, ["r"])
    growing = helper.make_graph(
        [helper.make_node("Concat", ["acc", "acc"], ["more"], axis=0),
         helper.make_node("Identity", ["c"], ["c_out"])], "grow",
        [_vi("i", I64, []), _vi("c", B, []), _vi("acc", F, None)],
        [_vi("c_out", B, []), _vi("more", F, None)])
    grows = _model([_const("M", np.int64(2)), _const("go", np.array(True)),
                    helper.make_node("Loop", ["M", "go", "a"], ["f"], body=growing)],
                   [_vi("a", F, [2])], [_vi("f", F, None)], check=False)
    with pytest.raises(UnsupportedModel, match="changes from .*keep their shape"):
        lower(grows).evaluate({}, {"a": np.ones(2, np.float32)}, ["f"])


def test_an_unsupported_operator_in_a_subgraph_is_reported_with_its_path():
    then = helper.make_graph([helper.make_node("StringNormalizer", ["s"], ["t"])], "then_g", [],
                             [_vi("t", F, [1])])
    other = helper.make_graph([_const("e", np.zeros(1, np.float32))], "else_g", [],
                              [_vi("e", F, [1])])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "m",
        [_vi("c", B, []), _vi("s", F, [1])], [_vi("y", F, [1])]))
    with pytest.raises(UnsupportedModel) as err:
        lower(model)
    assert err.value.problems == ["y (If): subgraph then_branch (then_g): t (StringNormalizer): "
                                  "operator ai.onnx.StringNormalizer is not supported"]


def test_the_kit_s_checks_take_popart_s_if_branches_and_calls():
    """PopART's builder declares the tensors an If branch reads as its inputs; the kit's
    checks (onnx.checker, strict inference) read them as ONNX does, from the enclosing graph."""
    import popart_kit as pk

    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    c = b.addInputTensor(pk.TensorInfo("BOOL", []))
    then, other = b.createSubgraphBuilder(), b.createSubgraphBuilder()
    then.addInputTensorFromParentGraph(x)
    then.addOutputTensor(then.aiOnnx.add([x, x]))
    other.addOutputTensor(other.aiOnnx.neg([x]))
    y = b.aiOnnx.logical_if([c], 1, other, then)[0]
    sub = b.createSubgraphBuilder()
    sub.addOutputTensor(sub.aiGraphcore.scale([sub.addUntypedInputTensor()], 3.0))
    z = b.aiGraphcore.call([y], 1, sub)[0]
    session = pk.InferenceSession(b.getModelProto(), pk.SessionConfig(
        mode="inference", device={"target": "offline"}), anchors={z: "All"})
    for cond, want in ((True, [6, 12]), (False, [-3, -6])):
        got = session.run({x: np.array([1, 2], np.float32), c: np.array(cond)})[z]
        np.testing.assert_allclose(got.reshape(-1), want)


def test_a_pipeline_stage_s_if_branch_reads_a_tensor_an_earlier_stage_made():
    """The pipeline split counts what a stage's subgraphs read from the enclosing graph as
    that stage's reads, so the tensor crosses stages like any input does: the pipelined If
    trains as the same pipeline with the branch written inline."""
    losses, weights = [], []
    for use_if in (True, False):
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
        c = b.addInputTensor(popart.TensorInfo("BOOL", []))
        w0, w1 = b.addInitializedInputTensor(W), b.addInitializedInputTensor(W / 2)
        with b.virtualGraph(0), b.pipelineStage(0):
            a = b.aiOnnx.tanh([b.aiOnnx.matmul([x, w0])])
        with b.virtualGraph(1), b.pipelineStage(1):
            if use_if:
                then, other = b.createSubgraphBuilder(), b.createSubgraphBuilder()
                then.addOutputTensor(then.aiOnnx.matmul([a, w1]))   # reads a from stage 0
                other.addOutputTensor(other.aiOnnx.neg([a]))
                y = b.aiOnnx.logical_if([c], 1, other, then)[0]
            else:
                y = b.aiOnnx.matmul([a, w1])
            loss = b.aiGraphcore.l1loss([y], 0.5)
        opts = popart.SessionOptions()
        opts.enablePipelining, opts.enableGradientAccumulation = True, True
        opts.virtualGraphMode, opts.accumulationFactor = popart.VirtualGraphMode.Manual, 4
        session = popart.TrainingSession(
            fnModel=b.getModelProto(), loss=loss, optimizer=popart.ConstSGD(0.1),
            dataFlow=popart.DataFlow(1, {loss: popart.AnchorReturnType("All")}),
            userOptions=opts,
            deviceInfo=popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}))
        session.prepareDevice()
        session.weightsFromHost()
        anchors = session.initAnchorArrays()
        data = np.stack([X * k for k in (1, -1, 2, 0.5)])
        session.run(popart.PyStepIO({x: data, c: np.ones(4, bool)}, anchors))
        losses.append(anchors[loss].copy())
        read = {w0: np.empty_like(W), w1: np.empty_like(W)}
        session.weightsToHost()
        session.readWeights(popart.PyWeightsIO(read))
        weights.append(read[w1])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    np.testing.assert_allclose(weights[0], weights[1], rtol=1e-6)
    assert not np.allclose(weights[0], W / 2)
