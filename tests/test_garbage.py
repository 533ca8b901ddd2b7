"""Garbage in, the kit's errors out: generated config files, StepIO inputs, bench specs, profiling
reports, bench results and ONNX files, from random bytes to valid ones with a value spoilt.
Whatever comes in, only a PopartKitError escapes the API, and the CLI (run in-process) exits 0
or 2 without a traceback. Example counts are bounded (``EXAMPLES``) to keep the file quick.
Every run draws the same examples (a gate must not pass or fail by chance);
``POPART_KIT_FUZZ=explore`` draws new ones, to look for what they have not found.
"""

from __future__ import annotations

import copy
import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import onnx
import pytest
import tomli_w
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto
from strategies import config_dicts
from test_fuzz import ARRAYS, FILE_TEXT, IO, VALUES, models

import popart_kit as pk
from popart_kit._model.layout import load_model
from popart_kit._runtime.xla.profiling import REPORT, summary
from popart_kit.bench import AXES, MAX_VARIANTS
from popart_kit.bench._variants import OPTIONS, SETTINGS
from popart_kit.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning",
                                        "ignore::DeprecationWarning")

EXAMPLES = {"configs": 200, "arrays": 200, "specs": 300, "reports": 200, "results": 200,
            "plots": 25, "models": 300, "names": 100}


def garbage(kind: str):
    return settings(max_examples=EXAMPLES[kind], deadline=None, database=None,
                    derandomize=os.environ.get("POPART_KIT_FUZZ") != "explore",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("garbage")


def cli(*argv: str) -> int:
    """``popart-kit ARGV`` in-process: its exit status, after checking it refused (2) or
    succeeded (0) without a traceback. Anything it raises escapes to the test."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(list(argv))
    assert status in (0, 2), (status, err.getvalue()[-2000:])
    assert "Traceback" not in out.getvalue() + err.getvalue()
    return status


def kit_errors_only(call: Any, *args: Any) -> Any:
    """``call(*args)``, or None where it refused with the kit's own error."""
    try:
        return call(*args)
    except pk.PopartKitError as err:
        assert len(str(err)) < 50_000
    return None


# -- spoiling valid data -------------------------------------------------------------------------

SPOILERS = st.one_of(VALUES, st.sampled_from([
    float("nan"), float("inf"), -1, 0, 10**8, 2**63, 10**400, "", "\ud800", [], {}, [[[]]],
    True])
).map(copy.deepcopy)  # a fresh [] each time: spoiling one never spoils the next


@st.composite
def spoilt(draw: st.DrawFn, valid: Any, keys: list[str] = ()) -> Any:
    """``valid`` (a JSON-like tree) with one to three values replaced, dropped or added, at
    any depth; ``keys`` are names worth adding."""
    data = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        parent, key = _somewhere(draw, data)
        if parent is None:
            return draw(SPOILERS)
        action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if action == "replace":
            parent[key] = draw(SPOILERS)
        elif action == "drop":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from([*keys, "bogus"]))] = draw(SPOILERS)
        else:
            parent.append(draw(SPOILERS))
    return data


def _somewhere(draw: st.DrawFn, data: Any) -> tuple[Any, Any]:
    """A (container, key) pair at a random depth of ``data``; (None, None) at the top."""
    parent, key = None, None
    node = data
    while isinstance(node, dict | list) and node:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = node[key]
        if not draw(st.booleans()):
            break
    return parent, key


def serialised(data: Any, fmt: str) -> str:
    """``data`` as ``fmt`` text (JSON where TOML cannot say it: garbage of another kind)."""
    if fmt == "toml":
        try:
            return tomli_w.dumps(data)
        except (TypeError, ValueError, AttributeError):  # AttributeError: not a table
            return json.dumps(data)
    if fmt == "yaml":
        return yaml.safe_dump(data, allow_unicode=True)
    return json.dumps(data)


def write(path: Path, text: str, binary: bool) -> Path:
    """``text`` into ``path`` as UTF-8 (lone surrogates written as their bytes), followed by
    bytes that are not UTF-8 when ``binary``."""
    if binary:
        path.write_bytes(text.encode("utf-8", "surrogatepass") + b"\xff\xfe")
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return path


FORMATS = st.sampled_from(["json", "yaml", "toml"])


# -- config files --------------------------------------------------------------------------------

CONFIG_TEXT = st.one_of(
    st.tuples(FORMATS, FILE_TEXT),
    st.tuples(FORMATS, config_dicts().flatmap(spoilt)).map(lambda f: (f[0], serialised(*f[::-1]))))


@garbage("configs")
@given(config=CONFIG_TEXT, binary=st.booleans())
def test_config_files(workdir, config, binary):
    fmt, text = config
    path = write(workdir / f"config.{fmt}", text, binary)
    kit_errors_only(pk.SessionConfig.from_file, path)
    cli("plan", str(path))
    cli("plan", "--json", str(path))


# -- StepIO inputs -------------------------------------------------------------------------------

def _readonly() -> np.ndarray:
    a = np.ones((2, 2), np.float32)
    a.setflags(write=False)
    return a


ODD = st.one_of(
    hnp.arrays(st.sampled_from([np.complex64, np.uint64, np.int8, np.dtype("U2"), np.dtype("S2"),
                                np.dtype("M8[s]"), np.dtype([("a", "f4")])]),
               hnp.array_shapes(min_dims=0, max_dims=3, max_side=3)),
    st.sampled_from([object(), np.array([None, 1], dtype=object), b"bytes",
                     memoryview(b"ab"), [[1, 2], [3]], 10**400, float("nan"),
                     np.ones((2, 4), np.float32)[:, ::2], _readonly(),
                     np.full((2, 2), 1e39), np.full(2, 2**40, np.int64)]))
INPUTS = st.one_of(ARRAYS, ODD)
NAMES = st.sampled_from(["x", "i", "z", 3, None, "\ud800"])


@pytest.fixture(scope="module")
def session():
    return tiny_session()


def tiny_session() -> pk.InferenceSession:
    """An xla session of a relu over ``x`` (2 x 2 floats), 2 batches per step."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 2]), "x")
    y = b.aiOnnx.relu([x])
    b.addOutputTensor(y)
    return pk.InferenceSession(b.getModelProto(), pk.SessionConfig(
        mode="inference", batches_per_step=2), anchors={y: "All"}, backend="xla")


@garbage("arrays")
@given(arrays=st.one_of(st.dictionaries(NAMES, INPUTS, max_size=3), INPUTS),
       replica=st.one_of(st.integers(-2, 3), st.floats(), st.text(max_size=2), st.none()),
       samples=st.one_of(st.lists(st.one_of(st.dictionaries(NAMES, INPUTS, max_size=2), INPUTS),
                                  max_size=6), INPUTS))
def test_stepio_inputs(session, arrays, replica, samples):
    for io_ in (IO, session.io):
        kit_errors_only(io_.check_inputs, arrays)
        kit_errors_only(io_.from_samples, arrays)
        kit_errors_only(io_.replica, arrays, replica)
        kit_errors_only(io_.check_anchors, arrays)
        kit_errors_only(io_.shard, arrays)
        kit_errors_only(lambda io_=io_: list(io_.batches(samples)))
    kit_errors_only(session.run, arrays)


# -- bench specs ---------------------------------------------------------------------------------

AXIS_VALUES = st.one_of(st.lists(st.integers(-1, 4), max_size=4), st.integers(-1, 4),
                        st.text(alphabet="0123456789,x ", max_size=8), SPOILERS)
SIZE_VALUES = st.one_of(st.integers(-1, 8), st.sampled_from([2**40, 10**400, "abc", 1.5]),
                        SPOILERS)
BENCHMARK = st.fixed_dictionaries({}, optional={
    **{a: AXIS_VALUES for a in AXES}, **{s: SIZE_VALUES for s in SETTINGS},
    "model": st.sampled_from(["mlp", "convnet", "encoder", "resnet", 3]),
    "mode": st.sampled_from(["inference", "training", "train", None])})
SPEC = st.fixed_dictionaries(
    {"benchmarks": st.one_of(st.dictionaries(st.text(max_size=5), BENCHMARK, min_size=1,
                                             max_size=3), SPOILERS)},
    optional={"defaults": st.one_of(st.fixed_dictionaries({}, optional={
        **{o: SPOILERS for o in OPTIONS}, "repeat": st.integers(-1, 3),
        "backend": st.sampled_from(["xla", "popart", "tpu"]), "bogus": SPOILERS}), SPOILERS)})


SPEC_OK = {"defaults": {"model": "mlp", "width": 8, "micro_batch": 2, "repeat": 1},
           "benchmarks": {"a": {"replication": [1, 2], "batches_per_step": "1,2"},
                          "b": {"model": "encoder", "layers": 2, "heads": 2, "seq": 4,
                                "stages": [1, 2], "batches_per_step": [4]}}}
NEAR_SPEC = spoilt(SPEC_OK, [*AXES, *SETTINGS, *OPTIONS])
SPECS = st.one_of(SPEC, NEAR_SPEC, NEAR_SPEC, FILE_TEXT)  # near-valid ones twice as often


class _WouldRun(Exception):
    """The sweep was valid and would start running (not in a test of refusals)."""


@garbage("specs")
@given(spec=SPECS, fmt=st.sampled_from(["yaml", "toml"]))
def test_bench_specs(workdir, spec, fmt):
    path = workdir / f"spec.{fmt}"
    path.write_text(spec if isinstance(spec, str) else serialised(spec, fmt), encoding="utf-8",
                    errors="surrogatepass")
    found = kit_errors_only(pk.bench.from_spec, path)
    if found is not None:
        assert len(found[0]) <= MAX_VARIANTS
    with mock.patch("popart_kit.bench._run", side_effect=_WouldRun):
        try:
            cli("bench", "--spec", str(path), "--no-progress", "--no-baselines",
                "--out", str(workdir / "bench-out"))
        except _WouldRun:
            assert found is not None


# -- profiling reports ---------------------------------------------------------------------------

REPORT_OK = {"backend": "XlaBackend", "compile_seconds": 1.5, "run_seconds": [0.5, 0.25],
             "programs": [{"cost": {"flops": 100.0, "bytes accessed": 64.0},
                           "memory": {"temp_size_in_bytes": 2048, "argument_size_in_bytes": 8}}]}


@garbage("reports")
@given(report=st.one_of(spoilt(REPORT_OK, list(REPORT_OK)).map(json.dumps), FILE_TEXT),
       binary=st.booleans())
def test_profiling_reports(workdir, report, binary):
    write(workdir / REPORT, report, binary)
    kit_errors_only(summary, workdir)
    cli("report", str(workdir))


# -- bench results -------------------------------------------------------------------------------

ROW = {"name": "mlp_r1", "benchmark": "mlp", "model": "mlp", "mode": "inference",
       "backend": "xla", "replication": 1, "instances": 1, "batches_per_step": 4,
       "accumulation": 1, "stages": 2, "micro_batch": 4, "status": "ok", "note": "",
       "samples_per_step": 16, "step_ms": 2.0, "samples_per_s": 8000.0, "efficiency": 1.0,
       "bubble_planned": 0.2, "bubble_measured": 0.25}
RESULTS_OK = {"machine": {"cpu": "x", "cores_usable": 2, "backend": "xla",
                          "libraries": {"jax": "0.4"}, "devices": {"count": 1, "platform": "cpu"},
                          "load_start": 0.5, "load_end": 0.7, "commit": None},
              "options": {"repeat": 2}, "columns": {},
              "variants": [ROW, {**ROW, "name": "mlp_r2", "replication": 2,
                                 "batches_per_step": 8}, {"name": "skipped", "status": "skipped"}]}
RESULTS = st.one_of(spoilt(RESULTS_OK, ["variants", "machine"]).map(json.dumps), FILE_TEXT)


@garbage("results")
@given(results=RESULTS, binary=st.booleans())
def test_bench_results_compared(workdir, results, binary):
    path = write(workdir / "results.json", results, binary)
    loaded = kit_errors_only(pk.bench.load, path)
    if loaded is not None:
        kit_errors_only(pk.bench.compare, loaded, loaded)
    cli("bench", "--compare", str(path), str(path))


@garbage("plots")
@given(results=RESULTS)
def test_bench_results_plotted(workdir, results):
    path = write(workdir / "plotted.json", results, False)
    cli("bench", "--plot", str(path), "--out", str(workdir / "plots"))


# -- ONNX model files ----------------------------------------------------------------------------

def _valid_model() -> onnx.ModelProto:
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]), "x")
    with b.pipelineStage(0), b.virtualGraph(0):
        h = b.aiOnnx.matmul([x, b.addInitializedInputTensor(np.ones((3, 3), np.float32))])
    with b.pipelineStage(1), b.virtualGraph(1):
        y = b.aiOnnx.relu([h])
    b.addOutputTensor(y)
    return onnx.load_from_string(b.getModelProto())


VALID = _valid_model()
INTS = st.one_of(st.integers(-3, 40), st.sampled_from([-2**63, 2**31, 2**62, 2**63 - 1]))


@st.composite
def spoilt_models(draw: st.DrawFn) -> onnx.ModelProto:
    """The valid model with a field set to garbage (what a broken exporter might write)."""
    m = copy.deepcopy(VALID)
    g = m.graph
    field = draw(st.sampled_from(["ir", "opset", "elem", "dim", "attr", "init", "node",
                                  "external", "names"]))
    if field == "ir":
        m.ir_version = draw(INTS)
    elif field == "opset":
        m.opset_import[0].version = draw(INTS)
        m.opset_import[0].domain = draw(st.sampled_from(["", "ai.graphcore", "x" * 300, "é"]))
    elif field == "elem":
        g.input[0].type.tensor_type.elem_type = draw(st.integers(-1, 40))
    elif field == "dim":
        g.input[0].type.tensor_type.shape.dim[0].dim_value = draw(INTS)
    elif field == "attr":
        node = g.node[draw(st.integers(0, len(g.node) - 1))]
        attr = node.attribute[draw(st.integers(0, len(node.attribute) - 1))]
        attr.type = draw(st.integers(0, 14))
        attr.i = draw(INTS)
    elif field == "init":
        init = g.initializer[0]
        init.data_type = draw(st.integers(0, 25))
        dims = draw(st.lists(INTS, max_size=3))
        del init.dims[:]
        init.dims.extend(dims)
        init.raw_data = draw(st.binary(max_size=40))
    elif field == "node":
        node = g.node[draw(st.integers(0, len(g.node) - 1))]
        node.op_type = draw(st.sampled_from(["", "NoSuchOp", "Relu", "If", "Loop", "Scan"]))
        node.domain = draw(st.sampled_from(["", "ai.graphcore", "com.microsoft", "bogus"]))
    elif field == "external":
        init = g.initializer[0]
        init.data_location = TensorProto.EXTERNAL
        init.ClearField("float_data")
        for key, value in (("location", draw(st.sampled_from(
                ["../../etc/passwd", "/dev/zero", "missing.bin", ""]))),
                ("offset", str(draw(INTS))), ("length", str(draw(INTS)))):
            init.external_data.add(key=key, value=value)
    else:
        g.node[0].output[0] = draw(st.sampled_from(["", "x", g.node[1].output[0]]))
    return m


VALID_BYTES = VALID.SerializeToString()
MODEL_BYTES = st.one_of(
    st.binary(max_size=300),
    st.integers(0, len(VALID_BYTES) - 1).map(lambda n: VALID_BYTES[:n]),
    st.tuples(st.integers(0, len(VALID_BYTES) - 1), st.integers(0, 255)).map(
        lambda p: VALID_BYTES[:p[0]] + bytes([p[1]]) + VALID_BYTES[p[0] + 1:]),
    spoilt_models().map(lambda m: m.SerializeToString()),
    models().map(lambda m: m.SerializeToString()))


@pytest.fixture(scope="module")
def pipelined_config(workdir) -> Path:
    """A config the valid model fits: two stages on two IPUs."""
    path = workdir / "pipelined.yaml"
    path.write_text("mode: inference\nipus_per_replica: 2\nbatches_per_step: 4\n"
                    "pipeline: {enabled: true}\n")
    return path


@garbage("models")
@given(data=MODEL_BYTES, with_config=st.booleans())
def test_onnx_model_files(workdir, pipelined_config, data, with_config):
    path = workdir / "model.onnx"
    path.write_bytes(data)
    model = kit_errors_only(load_model, path)
    kit_errors_only(load_model, data)
    if model is not None:
        kit_errors_only(pk.PipelineLayout.from_model, model)
    cli("check", str(path), *(["--config", str(pipelined_config)] if with_config else []))


# -- Builder debug contexts -----------------------------------------------------------------------

ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=6)  # lone surrogates too


@garbage("names")
@given(scope=ANY_TEXT, name=st.one_of(ANY_TEXT, st.integers(), st.none()))
def test_builder_debug_contexts(scope, name):
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    try:
        with b.nameScope(scope):
            b.addOutputTensor(b.aiOnnx.relu([x], name))
    except pk.ModelError:
        return
    pk.PipelineLayout.from_model(b.getModelProto())  # whatever was accepted serialises


# -- escapes found by the tests above, each the smallest input -----------------------------------

def _with_bytes(old: bytes, new: bytes) -> bytes:
    """VALID_BYTES with ``old`` replaced by ``new`` (as long) everywhere: a continuation byte
    (0x9a) in a string field parses, as invalid UTF-8 that protobuf returns as bytes."""
    assert old in VALID_BYTES and len(old) == len(new)
    return VALID_BYTES.replace(old, new)


_STAGE = b"__pipeline_stage"
_BROKEN_STAGE = b"__pipel\x9ane_stage"
_SECOND_STAGE = VALID_BYTES.index(_STAGE, VALID_BYTES.index(_STAGE) + 1)


def test_batches_of_a_non_iterable_is_refused():
    with pytest.raises(pk.PopartKitError):
        IO.batches(5)


def test_batches_of_a_ragged_sample_is_refused():
    with pytest.raises(pk.PopartKitError):
        list(tiny_session().io.batches([[[1.0, 2.0], [3.0]]] * 4))


@pytest.mark.parametrize("odd", [np.array((3.6e16,), dtype=[("a", "<f4")]), "", None,
                                 np.array(["ab", "cd"])])
def test_batches_of_samples_that_are_not_numbers_are_refused(odd):
    samples = [np.ones(2, np.float32), odd, np.ones(2, np.float32), np.ones(2, np.float32)]
    with pytest.raises(pk.DataTypeError, match="sample 1 of this run is of dtype"):
        list(tiny_session().io.batches(samples))


def test_layout_of_names_that_are_not_text_is_refused():
    data = _with_bytes(b"Relu:0", b"Rel\x9a:0")
    data = data[:_SECOND_STAGE] + _BROKEN_STAGE + data[_SECOND_STAGE + len(_STAGE):]
    with pytest.raises(pk.PopartKitError):
        pk.PipelineLayout.from_model(data)


@pytest.mark.parametrize("swap", [(_STAGE, _BROKEN_STAGE), (b'"\x04Relu', b'"\x04R\x9alu'),
                                  (b"Relu:0", b"Rel\x9a:0")],
                         ids=["attribute-name", "op-type", "output-name"])
def test_check_of_names_that_are_not_text_is_refused(tmp_path, swap):
    path = tmp_path / "model.onnx"
    path.write_bytes(_with_bytes(*swap))
    assert main(["check", str(path)]) == 2


@pytest.mark.parametrize("version", [0, -1, 2**63 - 1])
def test_check_of_an_opset_version_out_of_range_is_refused(tmp_path, version):
    model = onnx.load_from_string(VALID_BYTES)
    model.opset_import[0].version = version
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    assert main(["check", str(path)]) == 2
    with pytest.raises(pk.InvalidModel) as info:
        pk.InferenceSession(model.SerializeToString(),
                            pk.SessionConfig(mode="inference", batches_per_step=1),
                            anchors={}, backend="xla")
    assert "K-model-opset" in info.value.rules
