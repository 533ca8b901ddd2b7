"""Each defect of the adversarial pass, reproduced: the kit refuses it with its own error, fast.

Bounds of one second are for checks that take microseconds to milliseconds; they only fail when a
check's cost grows with the magnitude of a number.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart_kit as pk
from popart_kit.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")


@contextmanager
def within(seconds: float = 1.0):
    start = time.perf_counter()
    yield
    took = time.perf_counter() - start
    assert took < seconds, f"took {took:.2f} s"


def refused(kind: type[pk.PopartKitError], fn, *args, **kwargs) -> pk.PopartKitError:
    with within(), pytest.raises(kind) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, pk.PopartKitError)
    str(info.value)  # printing it is bounded too
    return info.value


# -- 1. huge but well-typed integers --------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {"replication": {"local_factor": 2**40}},
    {"replication": {"local_factor": 2**26}},
    {"replication": {"local_factor": 2, "global_factor": 2**40}},
    {"replication": {"local_factor": 2, "global_factor": 2**30, "global_offset": 1}},
    {"batches_per_step": 2**40},
    {"ipus_per_replica": 10**4000},
])
def test_huge_counts_are_refused_quickly(kw):
    err = refused(pk.InvalidConfig, pk.SessionConfig, mode="inference", **kw)
    assert len(str(err)) < 5000


def test_the_largest_valid_numbers_are_bounded_by_hardware():
    err = refused(pk.InvalidConfig, pk.SessionConfig, mode="inference",
                  replication={"local_factor": 1, "global_factor": 2**20})
    assert "K-max-global-ipus" in err.rules


def test_offset_suggestions_are_few():
    err = refused(pk.InvalidConfig, pk.Replication, local_factor=2, global_factor=2**30,
                  global_offset=1)
    assert "use one of 0, 2, 4, 6, 8, …, 1073741822" in str(err)


def test_everyn_suggestions_are_few():
    cfg = pk.SessionConfig(mode="inference", batches_per_step=2**30)
    with within(), pytest.raises(pk.InvalidData,
                                 match=r"one of \[1, 2, 4, 8, 16, 32, 64, …, 1073741824\]"):
        pk.StepIOFactory(cfg, anchors={"y": ((2,), ("EveryN", 3))})


def test_plan_and_device_request_do_not_grow_with_the_global_replica_count():
    cfg = pk.SessionConfig(mode="inference", ipus_per_replica=1,
                           replication={"local_factor": 2, "global_factor": 32000,
                                        "global_offset": 31998})
    with within():
        plan = cfg.plan()
        request = cfg.device_request()
    assert request["numIpus"] == 2
    assert [r.global_id for r in plan.local_replica_placements] == [31998, 31999]
    assert len(plan.replicas) == 32000 and plan.replicas[-1].instance == 15999


def test_a_huge_pipeline_stage_is_refused_quickly():
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    y = b.aiOnnx.relu([x])
    b.pipelineStage(y, 2**62) if hasattr(b, "pipelineStage") else None
    model = onnx.load_from_string(b.getModelProto())
    for node in model.graph.node:
        node.attribute.append(helper.make_attribute("__pipeline_stage", 2**62))
    layout = pk.PipelineLayout.from_model(model)  # judged against a session, not alone
    cfg = pk.SessionConfig(mode="training", ipus_per_replica=2, accumulation={"factor": 4},
                           pipeline={"enabled": True})
    err = refused(pk.InvalidModel, layout.check, cfg)
    assert "stage 0 is missing" in str(err)


# -- 2. values printed whole, files -----------------------------------------------------------

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True))


def test_a_yaml_bomb_is_refused(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text("mode: inference\npopart_options:\n  engineOptions:\n    " +
                    BOMB.replace("\n", "\n    ") + "\n")
    err = refused(pk.ConfigError, pk.SessionConfig.from_file, path)
    assert str(path) in str(err) and err.rule == "K-file-size"


def test_deep_nesting_is_refused(tmp_path):
    for suffix, text in ((".json", "[" * 100_000 + "]" * 100_000),
                         (".yaml", "[" * 100_000 + "]" * 100_000),
                         (".json", json.dumps({"mode": "inference", "popart_options": {
                             "engineOptions": {"a": json.loads("[" * 40 + "]" * 40)}}}))):
        path = tmp_path / f"deep{suffix}"
        path.write_text(text)
        err = refused(pk.ConfigError, pk.SessionConfig.from_file, path)
        assert str(path) in str(err)


def test_a_bomb_given_in_python_prints_quickly():
    bomb: list = ["x"]
    for _ in range(60):
        bomb = [bomb, bomb]
    err = refused(pk.InvalidConfig, pk.SessionConfig, mode="inference",
                  popart_options={"notAnOption": bomb, "engineOptions": {"k": bomb}})
    assert len(str(err)) < 3000


@pytest.mark.parametrize("suffix, text", [
    (".json", '{"mode": "inference", "mode": "training"}'),
    (".yaml", "mode: inference\nmode: training\n"),
    (".toml", 'mode = "inference"\nmode = "training"\n'),
])
def test_duplicate_keys_are_reported(tmp_path, suffix, text):
    path = tmp_path / f"dup{suffix}"
    path.write_text(text)
    err = refused(pk.ConfigError, pk.SessionConfig.from_file, path)
    assert str(path) in str(err)
    if suffix != ".toml":
        assert "given twice" in str(err)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"mode: \xe9\n")
    for path in (tmp_path / "missing.toml", tmp_path, bad):
        target = path if path != tmp_path else tmp_path / "dir.json"
        if path == tmp_path:
            target.mkdir()
        err = refused(pk.ConfigError, pk.SessionConfig.from_file, target)
        assert str(target) in str(err)


def test_invalid_values_in_a_file_name_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"mode": "inference", "batches_per_step": 0}')
    err = refused(pk.InvalidConfig, pk.SessionConfig.from_file, path)
    assert str(path) in str(err) and err.errors()[0]["loc"] == ("batches_per_step",)


def test_cli_refuses_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({"mode": "inference", "replication": {"local_factor": 2**40}}))
    assert main(["plan", str(path)]) == 2
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("mode: inference\npopart_options:\n  engineOptions:\n    "
                    + BOMB.replace("\n", "\n    ") + "\n")
    assert main(["plan", str(bomb)]) == 2
    assert "Traceback" not in capsys.readouterr().err


# -- 3. POPDIST_* ------------------------------------------------------------------------------

def env(total="8", local="2", offset="2", ipus="1"):
    return {"POPDIST_NUM_TOTAL_REPLICAS": total, "POPDIST_NUM_LOCAL_REPLICAS": local,
            "POPDIST_REPLICA_INDEX_OFFSET": offset, "POPDIST_NUM_IPUS_PER_REPLICA": ipus}


def test_a_missing_variable_is_named():
    e = env()
    del e["POPDIST_NUM_LOCAL_REPLICAS"]
    cfg = pk.SessionConfig(mode="inference")
    err = refused(pk.ConfigError, cfg.with_popdist_env, e)
    assert "POPDIST_NUM_LOCAL_REPLICAS is missing" in str(err)


@pytest.mark.parametrize("raw", ["1_6", "١٦", " 16", "+16", "16.0", "0x10", "1" * 40])
def test_only_ascii_decimal_integers_are_read(raw):
    err = refused(pk.ConfigError, pk.PopdistEnv.read, env(total=raw))
    assert "POPDIST_NUM_TOTAL_REPLICAS" in str(err) and "not an integer" in str(err)


def test_a_huge_total_replica_count_is_refused():
    err = refused(pk.ConfigError, pk.PopdistEnv.read, env(total=str(2**31 - 2), local="1",
                                                           offset="0"))
    assert "IPUs" in str(err)


# -- 4. invalid models ------------------------------------------------------------------------

X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])


def model(nodes, inputs=(X,), outputs=(Y,), inits=()):
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


W = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
W_WRONG = numpy_helper.from_array(np.ones((2, 2, 5), np.float32), "w")
INVALID = {
    "duplicate initializer": (model([helper.make_node("Add", ["x", "w"], ["y"])],
                                    inits=[W, W_WRONG]), "K-model-duplicate-initializer"),
    "two producers": (model([helper.make_node("Relu", ["x"], ["y"], name="a"),
                             helper.make_node("Neg", ["x"], ["y"], name="b")]),
                      "K-model-duplicate-producer"),
    "duplicate inputs": (model([helper.make_node("Relu", ["x"], ["y"])], inputs=(X, X)),
                         "K-model-duplicate-input"),
    "float for int attribute": (model([helper.make_node("Softmax", ["x"], ["y"], axis=1.0)]),
                                "K-model-attribute-type"),
    "unknown attribute": (model([helper.make_node("Relu", ["x"], ["y"], bogus=3)]),
                          "K-model-attribute-unknown"),
    "cycle": (model([helper.make_node("Add", ["x", "z"], ["t"], name="a"),
                     helper.make_node("Relu", ["t"], ["z"], name="b"),
                     helper.make_node("Relu", ["t"], ["y"], name="c")]), "K-model-cycle"),
    "dangling input": (model([helper.make_node("Relu", ["q"], ["y"])]),
                       "K-model-undefined-input"),
    "shape mistake": (model([helper.make_node("MatMul", ["x", "x"], ["y"], name="mm")]),
                      "K-model-popart-setup"),  # PopART's MatMul refuses it, in its words
}


@pytest.mark.parametrize("name", INVALID)
def test_invalid_models_are_refused_before_lowering(name):
    proto, rule = INVALID[name]
    cfg = pk.SessionConfig(mode="inference", device={"target": "offline"})
    err = refused(pk.InvalidModel, pk.InferenceSession, proto, cfg, anchors={"y": "All"},
                  backend="xla")
    assert rule in err.rules, str(err)


@pytest.mark.parametrize("name", INVALID)
def test_check_refuses_invalid_models(name, tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(INVALID[name][0], path)
    assert main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    assert INVALID[name][1] in captured.err and "Traceback" not in captured.err


def test_every_graph_problem_is_reported_at_once():
    proto = model([helper.make_node("Relu", ["q"], ["y"], name="a"),
                   helper.make_node("Neg", ["x"], ["y"], name="b", bogus=1)],
                  inputs=(X, X), inits=[W, W])
    err = refused(pk.InvalidModel, pk.InferenceSession, proto,
                  pk.SessionConfig(mode="inference"), backend="xla")
    assert set(err.rules) >= {"K-model-duplicate-input", "K-model-duplicate-initializer",
                              "K-model-duplicate-producer", "K-model-undefined-input",
                              "K-model-attribute-unknown"}


def test_a_lowering_failure_names_the_node_and_its_input_shapes():
    from popart_kit._runtime.xla.lowering import NodeFailed, lower

    # unknown input dimensions pass the checker; the mismatch shows when the sizes are known
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, "n"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["m", 5])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    proto = model([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")], (a, b), (out,))
    graph = lower(proto)
    with pytest.raises(NodeFailed) as info:
        graph.evaluate({}, {"a": np.ones((2, 3), np.float32), "b": np.ones((4, 5), np.float32)},
                       ["y"])
    msg = str(info.value)
    assert "mm (MatMul)" in msg and "(2, 3)" in msg and "(4, 5)" in msg
    assert isinstance(info.value, pk.ModelError)


def test_an_input_of_unknown_rank_is_refused():
    from popart_kit._runtime.xla.lowering import UnsupportedModel, lower

    unknown = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    proto = model([helper.make_node("Relu", ["x"], ["y"])], inputs=(unknown,))
    err = refused(pk.ModelError, pk.InferenceSession, proto, pk.SessionConfig(mode="inference"),
                  backend="xla")
    assert "shape" in str(err)
    err = refused(UnsupportedModel, lower, proto)
    assert "rank is unknown" in str(err)


def test_bad_external_data_is_refused(tmp_path, capsys):
    proto = model([helper.make_node("Add", ["x", "w"], ["y"])], inits=[W])
    onnx.save_model(proto, tmp_path / "m.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    (tmp_path / "weights.bin").unlink()
    refused(pk.ModelError, pk.PipelineLayout.from_model, tmp_path / "m.onnx")
    assert main(["check", str(tmp_path / "m.onnx")]) == 2
    assert "Traceback" not in capsys.readouterr().err


# -- 5. training inputs -----------------------------------------------------------------------

def classifier_session(**kw):
    from test_training import classifier

    proto, loss, _ = classifier(4)
    cfg = pk.SessionConfig(mode="training", device={"target": "offline"})
    return pk.TrainingSession(proto, cfg, loss=loss, optimizer=pk.SGD(learning_rate=0.1),
                              backend="xla", **kw)


@pytest.mark.parametrize("bad", [7, -5, 3])
def test_labels_out_of_range_are_refused_and_weights_kept(bad):
    sess = classifier_session()
    before = sess.weights()
    x = np.ones((4, 6), np.float32)
    label = np.array([0, 1, bad, 2], np.int32)
    err = refused(pk.InvalidData, sess.run, {"x": x, "label": label})
    assert "label" in str(err) and f"{bad} at (2,)" in str(err) and "0..2" in str(err)
    for name, value in sess.weights().items():
        np.testing.assert_array_equal(value, before[name])


def test_int64_labels_that_do_not_fit_int32_are_refused():
    sess = classifier_session()
    label = np.array([0, 1, 2**32 + 1, 2], np.int64)
    err = refused(pk.InvalidData, sess.run, {"x": np.ones((4, 6), np.float32), "label": label})
    assert "K-int64-range" in err.rules and str(2**32 + 1) in str(err)


def test_int64_values_for_an_int32_input_that_indexes_nothing_are_still_range_checked():
    """Only a model no run's values can fail (no index input, no integer input) skips the
    checks: an int32 input that is not an index still refuses int64 values that wrap."""
    n = helper.make_tensor_value_info("n", onnx.TensorProto.INT32, [2])
    m = helper.make_tensor_value_info("m", onnx.TensorProto.INT32, [2])
    proto = model([helper.make_node("Add", ["n", "n"], ["m"])], inputs=(n,), outputs=(m,))
    cfg = pk.SessionConfig(mode="inference", device={"target": "offline"})
    sess = pk.InferenceSession(proto.SerializeToString(), cfg, backend="xla")
    err = refused(pk.InvalidData, sess.run, {"n": np.array([1, 2**33], np.int64)})
    assert "K-int64-range" in err.rules
    floats = pk.InferenceSession(model([helper.make_node("Add", ["x", "w"], ["y"])],
                                       inits=[W]).SerializeToString(), cfg, backend="xla")
    assert floats._indices is None and sess._indices is not None


def test_index_checks_can_be_turned_off():
    sess = classifier_session(check_indices=False)
    sess.run({"x": np.ones((4, 6), np.float32), "label": np.array([0, 1, 7, 2], np.int32)})


def test_gather_indices_are_checked():
    table = numpy_helper.from_array(np.ones((5, 3), np.float32), "table")
    ids = helper.make_tensor_value_info("ids", TensorProto.INT32, [4])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])
    proto = model([helper.make_node("Gather", ["table", "ids"], ["y"], name="embed")], (ids,),
                  (out,), [table])
    sess = pk.InferenceSession(proto, pk.SessionConfig(mode="inference"), backend="xla")
    sess.run({"ids": np.array([0, -5, 4, 1], np.int32)})  # negative indices count from the end
    err = refused(pk.InvalidData, sess.run, {"ids": np.array([0, 5, -6, 1], np.int32)})
    assert "embed (Gather)" in str(err) and "5 at (1,)" in str(err) and "-6 at (2,)" in str(err)


def test_a_learning_rate_that_overflows_float32_is_refused():
    sess = classifier_session()
    err = refused(pk.InvalidConfig, sess.set_learning_rate, 1e308)
    assert "float32" in str(err)
    assert sess.optimizer.learning_rate == 0.1


# -- 6. host data -------------------------------------------------------------------------------

CFG = pk.SessionConfig(mode="inference", replication={"local_factor": 2})


def test_stepio_refuses_wrong_types():
    refused(pk.DataTypeError, pk.StepIOFactory, CFG, inputs={1: pk.TensorSpec((2,))})
    refused(pk.DataTypeError, pk.StepIOFactory, {"mode": "inference"}, inputs={})
    io = pk.StepIOFactory(CFG, inputs={"x": pk.TensorSpec((2,))})
    refused(pk.DataError, io.replica, {"x": np.zeros((2, 2), np.float32)}, 1.0)


def test_batches_refuse_a_sample_missing_a_key():
    io = pk.StepIOFactory(pk.SessionConfig(mode="inference"),
                          inputs={"x": pk.TensorSpec((1, 2)), "y": pk.TensorSpec((1,))})
    run = io.batches([{"x": np.zeros(2, np.float32)}])
    err = refused(pk.DataError, next, run)
    assert "'y'" in str(err)
    assert run.dropped == 1


def test_a_cast_that_overflows_is_refused():
    io = pk.StepIOFactory(pk.SessionConfig(mode="inference"), inputs={"x": pk.TensorSpec((1,))})
    run = io.batches([np.float64(1e300)])
    err = refused(pk.DataError, next, run)
    assert "1e+300" in str(err)


def test_samples_taken_before_the_dataset_raises_are_counted():
    io = pk.StepIOFactory(pk.SessionConfig(mode="inference", batches_per_step=4),
                          inputs={"x": pk.TensorSpec((1,))})

    def samples():
        yield from (np.zeros(1, np.float32) for _ in range(3))
        raise OSError("disk gone")

    run = io.batches(samples())
    with pytest.raises(OSError):
        next(run)
    assert run.dropped == 3


def test_sessions_refuse_wrong_types():
    proto = model([helper.make_node("Relu", ["x"], ["y"])])
    refused(pk.ConfigTypeError, pk.InferenceSession, proto, {"mode": "inference"})
    sess = pk.InferenceSession(proto, pk.SessionConfig(mode="inference"), backend="xla")
    refused(pk.DataTypeError, sess.write_weights, [np.zeros(3)])
    refused(pk.DataTypeError, sess.run, [np.zeros((2, 3), np.float32)])
    refused(pk.ModelTypeError, pk.InferenceSession, 3, pk.SessionConfig(mode="inference"))


# -- 7. one hierarchy -----------------------------------------------------------------------------

def test_every_refusal_is_a_popart_kit_error_and_a_value_error():
    for cls in (pk.ConfigError, pk.ModelError, pk.DataError, pk.InvalidConfig, pk.InvalidModel,
                pk.InvalidData, pk.ConfigTypeError, pk.ModelTypeError, pk.DataTypeError):
        assert issubclass(cls, pk.PopartKitError) and issubclass(cls, ValueError)
    from popart_kit._runtime.xla.lowering import UnsupportedModel

    assert issubclass(UnsupportedModel, pk.ModelError)


def test_a_failing_rule_keeps_its_id():
    err = refused(pk.InvalidConfig, pk.SessionConfig, mode="inference",
                  accumulation={"factor": 2})
    assert err.rules == ("V18",)
    assert err.errors()[0]["type"] == "popart_kit.V18"


# -- 8. the defects left after the last pass ------------------------------------------------------

POPDIST = {"POPDIST_NUM_TOTAL_REPLICAS": "4", "POPDIST_NUM_LOCAL_REPLICAS": "2",
           "POPDIST_REPLICA_INDEX_OFFSET": "2", "POPDIST_NUM_IPUS_PER_REPLICA": "1"}


@pytest.mark.parametrize("blank", [None, ""])
def test_popdist_variables_set_to_none_or_empty_are_named_as_missing(blank):
    env = {**POPDIST, "POPDIST_NUM_TOTAL_REPLICAS": blank,
           "POPDIST_REPLICA_INDEX_OFFSET": blank}  # as a mapping built from os.environ.get
    err = refused(pk.ConfigError, pk.SessionConfig(mode="inference").with_popdist_env, env)
    assert err.rule == "K-popdist-env"
    assert "POPDIST_NUM_TOTAL_REPLICAS" in str(err) and "POPDIST_REPLICA_INDEX_OFFSET" in str(err)
    refused(pk.ConfigError, pk.Replication.from_popdist_env, {k: None for k in POPDIST})


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_closed_session_refuses_every_method_and_closes_again_quietly(workers):
    from pipeline_models import session

    sess, feed = session(2, 1, True, True, bps=3, workers=workers)
    sess.run(feed)
    with sess:
        pass
    for method, args in [("run", (feed,)), ("prepare", ()), ("weights", ()),
                         ("write_weights", ({},)), ("model_proto", ()),
                         ("optimizer_state", ()), ("set_learning_rate", (0.1,)),
                         ("set_random_seed", (1,))]:
        with pytest.raises(pk.SessionClosedError, match="closed") as info:
            getattr(sess, method)(*args)
        assert info.value.rule == "K-session-closed" and "Fix:" in str(info.value)
    with pytest.raises(pk.SessionClosedError):
        sess.io  # noqa: B018 - the property refuses too
    sess.close()  # idempotent


def test_the_drop_in_reports_a_model_that_is_not_one_as_popart_exception():
    import popart_kit.popart as popart

    for given in (b"garbage", "not a path nor a model", 3):
        with pytest.raises((popart.popart_exception, TypeError)) as info:
            popart.InferenceSession(given, popart.DataFlow(1, ["y"]),
                                    popart.DeviceManager().createCpuDevice())
        assert isinstance(info.value, popart.popart_exception) or given == 3
