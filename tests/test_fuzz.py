"""Fuzzing: whatever configs, files, POPDIST_* environments, models and arrays come in, only the
kit's errors come out (or a valid result), each case within a bounded time.

Attack classes and their example counts are in ``EXAMPLES``; each test draws that many cases,
the same ones every run (a gate must not pass or fail by chance); ``POPART_KIT_FUZZ=explore``
draws new ones, to look for what they have not found.
"""

from __future__ import annotations

import contextlib
import os
import string
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper, numpy_helper

import popart_kit as pk
from popart_kit._model import index_check
from popart_kit._model.checks import check_model
from popart_kit._model.index_check import IndexChecks, IndexRange

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

EXAMPLES = {"configs": 300, "files": 200, "environments": 300, "models": 150, "arrays": 200}


def fuzz(kind: str):
    return settings(max_examples=EXAMPLES[kind], deadline=timedelta(seconds=2),
                    derandomize=os.environ.get("POPART_KIT_FUZZ") != "explore",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# -- values -------------------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(-4, 70), st.integers(-2**70, 2**70),
    st.sampled_from([2**31, 2**40, 2**62, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none())
SCALARS = st.one_of(NUMBERS, st.text(max_size=12),
                    st.sampled_from(["ipu", "offline", "manual", "mean", "Mean", "full", "All"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
SECTION_KEYS = {
    "replication": ["local_factor", "global_factor", "global_offset"],
    "accumulation": ["factor", "reduction", "mean_strategy"],
    "pipeline": ["enabled", "stages", "recomputation"],
    "device": ["target", "sync_pattern", "connection", "selection", "tiles_per_ipu",
               "round_to_power_of_two"],
    "precision": ["partials_type", "stochastic_rounding"],
    "profiling": ["auto_report_dir", "cycle_counter"],
}
OPTION_NAMES = ["engineOptions", "virtualGraphSplitRatios", "numIOTiles", "enableStocasticRounding",
                "executionPhaseSettings", "bufferingDepthMap", "gclOptions", "useHostCopyOps",
                "replicatedGraphCount", "batchesPerStep", "x" * 200]


@st.composite
def config_inputs(draw):
    data = {}
    if draw(st.booleans()):
        data["mode"] = draw(st.sampled_from(["training", "inference", "train", 1]))
    for key in ("batches_per_step", "micro_batch_size", "ipus_per_replica", "device_iterations",
                "virtual_graph_mode"):
        if draw(st.booleans()):
            data[key] = draw(SCALARS)
    for section, keys in SECTION_KEYS.items():
        if draw(st.booleans()):
            data[section] = draw(st.one_of(
                st.fixed_dictionaries({}, optional={k: SCALARS for k in keys}), VALUES))
    if draw(st.booleans()):
        data["popart_options"] = draw(st.one_of(
            st.dictionaries(st.sampled_from(OPTION_NAMES), VALUES, max_size=3), VALUES))
    if draw(st.integers(0, 9)) == 0:
        data[draw(st.text(max_size=6))] = draw(VALUES)
    return data


@fuzz("configs")
@given(config_inputs())
def test_configs_give_only_the_kits_errors(data):
    try:
        cfg = pk.SessionConfig(**data) if all(isinstance(k, str) for k in data) else None
    except pk.InvalidConfig as err:
        assert err.errors() and len(str(err)) < 20_000
        return
    except pk.ConfigError:
        return
    if cfg is not None:
        plan = cfg.plan()
        assert plan.global_replicas >= plan.local_replicas
        cfg.to_popart_dict()
        if cfg.device.target == "ipu":
            assert cfg.device_request()["numIpus"] >= 1


# -- files --------------------------------------------------------------------------------------

FILE_TEXT = st.one_of(
    st.text(alphabet=string.printable, max_size=200),
    st.binary(max_size=120).map(lambda b: b.decode("latin-1")),
    st.sampled_from([
        "mode: inference\nmode: training\n", '{"mode": "inference", "mode": "inference"}',
        "a: &a [1, 2]\nb: [*a, *a]\n", "[" * 5000, "{" * 5000, "- " * 3000 + "x",
        "mode = 'inference'\n[replication]\nlocal_factor = 99999999999\n",
        "mode: inference\npopart_options: {engineOptions: {a: 1}}\n",
        '{"mode": "inference", "batches_per_step": 1e999}', "!!python/object:os.system ls\n"]),
    config_inputs().map(repr))


@fuzz("files")
@given(text=FILE_TEXT, suffix=st.sampled_from([".json", ".yaml", ".yml", ".toml", ".ini"]),
       binary=st.booleans())
def test_files_give_only_the_kits_errors(tmp_path_factory, text, suffix, binary):
    path = tmp_path_factory.mktemp("cfg") / f"c{suffix}"
    if binary:
        path.write_bytes(text.encode("utf-8", "surrogatepass") + b"\xff\xfe")
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        pk.SessionConfig.from_file(path)
    except pk.ConfigError as err:
        assert str(path) in str(err) or isinstance(err, pk.InvalidConfig)


# -- environments ------------------------------------------------------------------------------

VARS = ["POPDIST_NUM_TOTAL_REPLICAS", "POPDIST_NUM_LOCAL_REPLICAS",
        "POPDIST_REPLICA_INDEX_OFFSET", "POPDIST_NUM_IPUS_PER_REPLICA",
        "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE", "POPDIST_LOCAL_INSTANCE_INDEX"]
RAW = st.one_of(st.integers(-3, 40).map(str), st.integers(0, 2**80).map(str),
                st.text(max_size=8), st.sampled_from(["1_6", "١٦", "٣", " 8", "8\n", "+8", "0x8",
                                                      "8.0", "", "0" * 30 + "8"]))


@fuzz("environments")
@given(st.dictionaries(st.sampled_from(VARS), RAW, max_size=6))
def test_environments_give_only_the_kits_errors(env):
    try:
        found = pk.PopdistEnv.read(env)
    except pk.ConfigError as err:
        assert "POPDIST" in str(err) or "poprun" in str(err)
        return
    for name in VARS[:4]:
        assert env[name].isascii() and env[name].isdigit()
    cfg = pk.SessionConfig(mode="inference", device={"target": "offline"})
    try:
        out = cfg.with_popdist_env(env)
    except pk.ConfigError:
        return
    assert out.replication.global_replicas == found.total_replicas


# -- models ------------------------------------------------------------------------------------

OPS = ["Relu", "Add", "MatMul", "Softmax", "Reshape", "Gather", "Concat", "Transpose", "Neg",
       "Identity", "NoSuchOp"]
ATTR_VALUES = st.one_of(st.integers(-3, 3), st.floats(-2, 2, allow_nan=False),
                        st.text(max_size=4), st.lists(st.integers(-2, 3), min_size=1, max_size=3))


@st.composite
def models(draw):
    tensors = ["x", "w"]
    nodes = []
    for i in range(draw(st.integers(0, 5))):
        op = draw(st.sampled_from(OPS))
        arity = draw(st.integers(0, 3))
        inputs = [draw(st.sampled_from(tensors + ["", "ghost"])) for _ in range(arity)]
        out = draw(st.sampled_from([f"t{i}", f"t{i}", "x", "w", "y", f"t{max(i - 1, 0)}"]))
        attrs = draw(st.dictionaries(st.sampled_from(["axis", "perm", "bogus", "__pipeline_stage",
                                                      "__ipu_number"]), ATTR_VALUES, max_size=2))
        nodes.append(helper.make_node(op, inputs, [out], name=draw(st.sampled_from(["", f"n{i}"])),
                                      **attrs))
        tensors.append(out)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, draw(st.sampled_from(
        [[2, 3], [2, "n"], None, [0], [3]])))
    inputs = [x] * draw(st.integers(1, 2))
    w = numpy_helper.from_array(np.ones(draw(st.sampled_from([(3, 3), (2, 3), (3,)])), np.float32),
                                "w")
    inits = [w] * draw(st.integers(0, 2))
    out_name = draw(st.sampled_from(tensors + ["y"]))
    outputs = [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", draw(st.sampled_from(
        [13, 17, 21])))])


@fuzz("models")
@given(models())
def test_models_give_only_the_kits_errors(proto):
    from popart_kit._runtime.xla.lowering import lower

    try:
        check_model(proto)
        pk.PipelineLayout.from_model(proto)
        graph = lower(proto)
    except pk.ModelError:
        return
    feeds = {n: np.ones([d or 1 for d in shape], np.float32)
             for n, (shape, _) in graph.inputs.items()}
    with contextlib.suppress(pk.ModelError):
        graph.evaluate({}, feeds, graph.outputs)


# -- arrays ------------------------------------------------------------------------------------

DTYPES = st.sampled_from([np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8,
                          np.bool_])
ARRAYS = st.one_of(
    hnp.arrays(DTYPES, hnp.array_shapes(min_dims=0, max_dims=4, max_side=4)),
    st.lists(st.floats(), max_size=4), st.none(), st.text(max_size=3), st.integers())
IO = pk.StepIOFactory(pk.SessionConfig(mode="inference", batches_per_step=2,
                                       replication={"local_factor": 2}),
                      inputs={"x": pk.TensorSpec((2, 2), "float32"),
                              "i": pk.TensorSpec((2,), "int32")},
                      anchors={"y": (pk.TensorSpec((2,)), "All")})
INDEX = IndexChecks.from_model(helper.make_model(helper.make_graph(
    [helper.make_node("Gather", ["table", "i"], ["y"])], "g",
    [helper.make_tensor_value_info("i", TensorProto.INT32, [2])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    [numpy_helper.from_array(np.ones((5, 3), np.float32), "table")]),
    opset_imports=[helper.make_opsetid("", 13)]))


@fuzz("arrays")
@given(arrays=st.one_of(st.dictionaries(st.sampled_from(["x", "i", "z", 3]), ARRAYS, max_size=3),
                        ARRAYS),
       replica=st.one_of(st.integers(-2, 3), st.floats(), st.text(max_size=2)),
       samples=st.lists(st.one_of(st.dictionaries(st.sampled_from(["x", "i"]), ARRAYS,
                                                  max_size=2), ARRAYS), max_size=20))
def test_arrays_give_only_the_kits_errors(arrays, replica, samples):
    calls = [lambda: IO.check_inputs(arrays), lambda: IO.from_samples(arrays),
             lambda: IO.replica(arrays, replica), lambda: IO.check_anchors(arrays),
             lambda: IO.shard(arrays), lambda: list(IO.batches(samples))]
    if isinstance(arrays, dict):
        calls.append(lambda: INDEX.check(arrays))
    for call in calls:
        try:
            call()
        except pk.PopartKitError as err:
            assert len(str(err)) < 20_000


@fuzz("arrays")
@given(hnp.arrays(st.sampled_from([np.float64, np.int64, np.float32]), 1))
def test_batches_never_turn_a_value_infinite(values):
    io = pk.StepIOFactory(pk.SessionConfig(mode="inference"), inputs={"v": pk.TensorSpec((1,))})
    try:
        got = next(io.batches([values[0]]))["v"]
    except pk.DataError:
        assert np.isfinite(values[0]) and abs(float(values[0])) > float(np.finfo(np.float32).max)
        return
    assert np.isfinite(got).all() == np.isfinite(values).all()
    assert np.isnan(got).all() == np.isnan(values).all()


@fuzz("arrays")
@given(values=st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=8),
       dtype=st.sampled_from(["<i4", ">i4", "<i8", ">i8", "<u4", ">u2", "|i1", "|u1"]),
       size=st.integers(1, 300), negative=st.booleans(), large=st.booleans())
def test_an_index_is_refused_exactly_when_it_lies_outside_its_range(values, dtype, size,
                                                                   negative, large):
    """Whatever the integer type, byte order and length (a small array and a large one are
    reduced differently): refused iff a value is outside low..size-1."""
    info = np.iinfo(np.dtype(dtype))
    array = np.array([min(max(v, info.min), info.max) for v in values], dtype=dtype)
    if large:
        array = np.resize(array, index_check.SMALL + 7).astype(dtype)
    low = -size if negative else 0
    checks = IndexChecks([IndexRange("i", "g", size, low)], narrows=False)
    outside = any(not low <= int(v) < size for v in array)
    assert bool(checks.problems({"i": array})) == outside
