"""Contract tests: the popart backend drives PopART's session API as PopART defines it.

``popart_kit.InferenceSession(..., backend="popart", popart=<strict recorder>)`` builds its
SessionOptions, DataFlow, AnchorReturnTypes, device, InferenceSession, PyStepIO and PyWeightsIO on
``strict_popart`` (written from ``popart_api.json`` and PopART's sources), which raises where
PopART would and records every call, so these tests check names, arguments, order and values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import config_dicts
from strict_popart import (
    MANIFEST,
    DeviceCall,
    EnumMember,
    created_sessions,
    make_popart_module,
    option_mismatches,
    run_pattern,
    session_record,
    stepio_arrays,
    weights_io_arrays,
)

import popart_kit as pk

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

SESSION = MANIFEST["classes"]["InferenceSession"]
ACQUIRE = MANIFEST["device_manager"]["acquireAvailableDevice"]
# PopART's offline-device syncPattern strings (devicemanager.cpp syncPatternFromString), for
# the kit's spellings and PopART's member names alike
OFFLINE_SYNC = {"full": "full", "single_pipeline": "singlePipeline",
                "replica_and_ladder": "replicaAndLadder", "Full": "full",
                "SinglePipeline": "singlePipeline", "ReplicaAndLadder": "replicaAndLadder"}
NO_CONSTANTS = {"constantWeights": False}
W0 = np.arange(12, dtype=np.float32).reshape(3, 4) / 10 - 0.5


# -- models and sessions ---------------------------------------------------------------------------


def mlp() -> tuple[bytes, dict[str, str]]:
    """x[2,3] -> matmul with an initialized w[3,4] -> relu, y an output; and a Broadcast input s
    scaling it (one host value for every replica)."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]))
    s = b.addInputTensor(pk.TensorInfo("FLOAT", [1]),
                         pk.InputSettings(pk.ReplicatedStreamMode.Broadcast))
    w = b.addInitializedInputTensor(W0)
    h = b.aiOnnx.matmul([x, w])
    y = b.aiOnnx.relu([b.aiOnnx.mul([h, s])])
    b.addOutputTensor(y)
    return b.getModelProto(), {"x": x, "s": s, "w": w, "h": h, "y": y}


MODEL, T = mlp()


def config(target: str = "ipu", bps: int = 1, local: int = 1, options: dict | None = None,
           **kw: Any) -> pk.SessionConfig:
    device = kw.pop("device", {})
    return pk.SessionConfig(mode="inference", batches_per_step=bps,
                            replication={"local_factor": local},
                            device={"target": target, **device},
                            popart_options=options or {}, **kw)


def make(cfg: pk.SessionConfig, anchors: dict[str, Any] | None = None, model: bytes = MODEL,
         backend: str = "popart") -> tuple[pk.InferenceSession, Any, Any]:
    popart = make_popart_module()
    sess = pk.InferenceSession(model, cfg, anchors=anchors or {T["y"]: "All"}, backend=backend,
                               popart=popart)
    made = created_sessions(popart)
    assert len(made) == 1, "one PopART InferenceSession per kit session"
    return sess, popart, made[0]


def every_type(bps: int) -> dict[str, Any]:
    """An anchor of every return type (EveryN with the largest proper period of bps)."""
    period = max(d for d in range(1, bps + 1) if bps % d == 0 and (d < bps or bps == 1))
    return {T["y"]: "All", T["h"]: ("EveryN", period), T["x"]: "Final", T["w"]: "Sum"}


CONFIGS = {
    "ipu-default": config(),
    "ipu-replicated": config(bps=4, local=2, device={
        "sync_pattern": "single_pipeline", "connection": "on_demand", "selection": "random",
        "tiles_per_ipu": 1472}),
    "ipu-rounded": config(bps=2, local=2, ipus_per_replica=3,
                          device={"round_to_power_of_two": True}),
    "ipu-ladder": config(bps=6, local=4, device={"sync_pattern": "replica_and_ladder"}),
    "ipu-distributed": pk.SessionConfig(
        mode="inference", batches_per_step=2,
        replication={"local_factor": 2, "global_factor": 4, "global_offset": 2}),
    "ipu_model": config("ipu_model", bps=3),
    "ipu_model-tiles": config("ipu_model", bps=2, ipus_per_replica=2,
                              device={"tiles_per_ipu": 8}),
    "cpu": config("cpu", bps=2),
    "offline-full": config("offline", bps=2),
    "offline-single": config("offline", bps=4, local=2, device={"sync_pattern": "single_pipeline"}),
    "offline-ladder": config("offline", local=4, device={
        "sync_pattern": "replica_and_ladder", "tiles_per_ipu": 1472}),
}
RUNNABLE = {k: v for k, v in CONFIGS.items() if v.device.target != "offline"}
OFFLINE = {k: v for k, v in CONFIGS.items() if v.device.target == "offline"}


# -- what PopART was given -------------------------------------------------------------------------


def check_constructor(cfg: pk.SessionConfig, popart: Any, psess: Any,
                      anchors: dict[str, pk.AnchorReturnType]) -> None:
    record = session_record(psess)
    params = SESSION["ctor"][0]
    # the constructor: PopART's keyword names only, the required ones given
    assert not record.args, "pass InferenceSession's arguments by PopART's keyword names"
    assert set(record.keywords) <= set(params), set(record.keywords) - set(params)
    assert {"fnModel", "dataFlow", "deviceInfo", "userOptions"} <= set(record.keywords)
    fn_model = record.keywords["fnModel"]
    assert isinstance(fn_model, bytes)
    assert onnx.load_from_string(fn_model) == onnx.load_from_string(MODEL)
    assert record.popdist_init == cfg.replication.is_distributed

    # DataFlow(batchesPerStep, {anchor: AnchorReturnType})
    dataflow = record.keywords["dataFlow"]
    assert isinstance(dataflow, popart.DataFlow)
    assert dataflow.batchesPerStep() == cfg.batches_per_step
    assert dataflow.anchors() == sorted(anchors)
    for name, art in anchors.items():
        got = dataflow.art(name)
        assert isinstance(got, popart.AnchorReturnType)
        assert got.id() is getattr(popart.AnchorReturnTypeId, art.name)
        if art.name == "EveryN":
            assert got.rp() == art.period
        else:
            with pytest.raises(popart.popart_exception):
                got.rp()
        assert got.tileSet() is popart.TileSet.Compute
        assert got.exchangeStrategy() is popart.ExchangeStrategy.JustInTime
    assert psess.dataFlow.anchors() == sorted(anchors)

    # userOptions: exactly the config's PopART options
    opts = record.keywords["userOptions"]
    assert isinstance(opts, popart.SessionOptions)
    assert not option_mismatches(opts, cfg.to_popart_dict())
    assert psess.replicationFactor == cfg.replication.local_factor

    check_device(cfg, popart, record.keywords["deviceInfo"])


def check_device(cfg: pk.SessionConfig, popart: Any, device: Any) -> None:
    assert isinstance(device, DeviceCall) and isinstance(device.manager, popart.DeviceManager)
    assert device.manager.calls == [device], "one DeviceManager call, for this session"
    target, plan = cfg.device.target, cfg.plan()
    needed = cfg.replication.local_factor * cfg.ipus_per_replica
    assert plan.ipus_to_request >= needed
    if target == "ipu":
        assert device.method == "acquireAvailableDevice" and device.args == ()
        request = cfg.device_request()
        assert set(device.keywords) == set(request) <= set(ACQUIRE["params"])
        for key, value in request.items():
            default = ACQUIRE["defaults"][key]
            if isinstance(default, str) and "." in default:  # an enum parameter: its member
                member = getattr(getattr(popart, default.split(".")[0]), value)
                assert device.keywords[key] is member, key
                assert isinstance(member, EnumMember)
            else:
                assert device.keywords[key] == value and type(device.keywords[key]) is int
        assert device.keywords["numIpus"] == plan.ipus_to_request
        assert device.keywords["tilesPerIpu"] == cfg.device.tiles_per_ipu
        assert device.num_ipus & (device.num_ipus - 1) == 0
    elif target == "ipu_model":
        assert device.method == "createIpuModelDevice" and device.keywords == {}
        assert device.args == ({"numIPUs": str(plan.ipus_to_request),
                                "tilesPerIPU": str(cfg.device.tiles_per_ipu or 4)},)
    elif target == "cpu":
        assert device.method == "createCpuDevice" and device.args == () and not device.keywords
    else:
        assert device.method == "createOfflineIPUDevice"
        opts = device.kwargs["opts"]  # positionally or as opts=: pybind binds both
        assert opts == {"numIPUs": str(plan.ipus_to_request),
                        "tilesPerIPU": str(cfg.device.tiles_per_ipu),
                        "syncPattern": OFFLINE_SYNC[cfg.device.sync_pattern]}
        assert device.connection_type is popart.DeviceConnectionType.Never


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_constructor_dataflow_options_and_device(name):
    cfg = CONFIGS[name]
    sess, popart, psess = make(cfg, every_type(cfg.batches_per_step))
    assert sess.backend == "popart"
    check_constructor(cfg, popart, psess, sess.anchors)
    assert session_record(psess).calls == [], "nothing runs before it is asked to"


# -- run -------------------------------------------------------------------------------------------


def check_run(sess: pk.InferenceSession, psess: Any, seed: int = 0) -> None:
    record = session_record(psess)
    inputs = sess.io.allocate_inputs("random", seed=seed)
    kept = {k: v.copy() for k, v in inputs.items()}
    out = sess.run(inputs)
    assert record.methods == ["prepareDevice", "weightsFromHost", "run"]
    stepio, = record.runs
    got_in, got_out = stepio_arrays(stepio)
    assert set(got_in) == set(inputs)
    for name, array in got_in.items():
        assert array.shape == sess.io.input_shape(name) and array.dtype == inputs[name].dtype
        np.testing.assert_array_equal(array, kept[name])
    # anchors: fresh arrays of io.anchor_shape, PopART's own (initAnchorArrays) shape, returned
    # as PopART wrote them
    popart_shapes = {k: v.shape for k, v in psess.initAnchorArrays().items()}
    assert set(got_out) == set(out) == set(sess.anchors)
    for name, array in out.items():
        assert array is got_out[name], "run returns the arrays PopART wrote"
        assert array.shape == sess.io.anchor_shape(name) == popart_shapes[name]
        np.testing.assert_array_equal(array.reshape(-1), run_pattern(array.size, array.dtype, 1))
        assert not any(np.shares_memory(array, v) for v in inputs.values())

    again = sess.run(sess.io.allocate_inputs("zeros"))
    assert record.methods[-1] == "run" and record.methods.count("prepareDevice") == 1
    assert record.methods.count("weightsFromHost") == 1
    for name, array in again.items():
        assert array is not out[name] and not np.shares_memory(array, out[name])
        np.testing.assert_array_equal(array.reshape(-1), run_pattern(array.size, array.dtype, 2))
    for array in out.values():  # the first run's anchors are not overwritten by the second
        np.testing.assert_array_equal(array.reshape(-1), run_pattern(array.size, array.dtype, 1))


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_run_prepares_then_runs_a_pystepio_of_checked_arrays(name):
    cfg = RUNNABLE[name]
    sess, popart, psess = make(cfg, every_type(cfg.batches_per_step))
    check_run(sess, psess)
    prepare = session_record(psess).calls[0]
    assert prepare[2].get("loadEngine", True) is True and not prepare[1]


@pytest.mark.parametrize("bad", ["missing", "unknown", "shape", "dtype", "fortran", "list"])
def test_bad_inputs_are_refused_before_popart_runs(bad):
    sess, popart, psess = make(config(bps=2, local=2))
    inputs = sess.io.allocate_inputs("random")
    x = T["x"]
    if bad == "missing":
        del inputs[x]
    elif bad == "unknown":
        inputs["not_an_input"] = inputs[x]
    elif bad == "shape":
        inputs[x] = inputs[x][:1]
    elif bad == "dtype":
        inputs[x] = inputs[x].astype(np.float64)
    elif bad == "fortran":
        inputs[x] = np.asfortranarray(inputs[x])
    else:
        inputs[x] = inputs[x].tolist()
    with pytest.raises(ValueError):
        sess.run(inputs)
    assert "run" not in session_record(psess).methods


def test_auto_backend_with_a_popart_module_is_popart():
    sess, popart, psess = make(config("cpu"), backend="auto")
    assert sess.backend == "popart"
    check_run(sess, psess)


def test_anchor_names_any_case_reach_popart_as_return_types():
    anchors = {T["y"]: "all", T["h"]: ("everyn", 2), T["x"]: "FINAL", T["w"]: "sUm"}
    sess, popart, psess = make(config("cpu", bps=4), anchors)
    dataflow = session_record(psess).keywords["dataFlow"]
    assert {a: dataflow.art(a).id().name for a in dataflow.anchors()} == {
        T["y"]: "All", T["h"]: "EveryN", T["x"]: "Final", T["w"]: "Sum"}
    assert dataflow.art(T["h"]).rp() == 2


# -- weights ---------------------------------------------------------------------------------------


def test_weights_are_read_from_popart_into_initializer_shaped_arrays():
    sess, popart, psess = make(config("cpu", options=NO_CONSTANTS))
    weights = sess.weights()
    record = session_record(psess)
    assert record.methods == ["prepareDevice", "weightsFromHost", "weightsToHost", "readWeights"]
    (io,), _ = record.calls[-1][1:]
    assert isinstance(io, popart.PyWeightsIO)
    assert set(weights_io_arrays(io)) == {T["w"]}
    assert record.read == [[T["w"]]], "every returned weight was filled by readWeights"
    assert weights[T["w"]] is weights_io_arrays(io)[T["w"]]
    np.testing.assert_array_equal(weights[T["w"]], W0)
    assert weights[T["w"]].dtype == np.float32


def test_write_weights_then_weights_round_trips_and_model_proto_holds_them():
    sess, popart, psess = make(config(bps=2, local=2, options=NO_CONSTANTS))
    new = np.full((3, 4), 0.25, np.float32)
    sess.write_weights({T["w"]: new})
    record = session_record(psess)
    assert record.written == [[T["w"]]]
    i = record.methods.index("writeWeights")
    assert record.methods[i + 1] == "weightsFromHost", "written weights are sent to the device"
    np.testing.assert_array_equal(sess.weights()[T["w"]], new)
    proto = sess.model_proto()
    assert isinstance(proto, onnx.ModelProto)
    assert "modelToHost" in record.methods
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    np.testing.assert_array_equal(inits[T["w"]], new)
    check_run(pk.InferenceSession(proto, config("cpu"), anchors={T["y"]: "All"},
                                  backend="popart", popart=popart),
              created_sessions(popart)[1])


def test_model_proto_is_the_model_with_its_weights():
    sess, popart, psess = make(config("ipu_model", options=NO_CONSTANTS))
    proto = sess.model_proto()
    assert isinstance(proto, onnx.ModelProto)
    assert [n.op_type for n in proto.graph.node] == ["MatMul", "Mul", "Relu"]
    w = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}[T["w"]]
    np.testing.assert_array_equal(w, W0)


# -- package bugs the strict recorder finds (see the report) ---------------------------------------


@pytest.mark.parametrize("options", [{}, NO_CONSTANTS], ids=["default", "constantWeights=False"])
def test_weights_under_every_constant_weights_setting(options):
    # PopART's constantWeights defaults to True: an inference session then turns every
    # initializer into a constant (ir.cpp L2330-2336), so readWeights fills nothing
    # (devicex.cpp L534-549) and writeWeights raises (session.cpp L544-550). Whatever the
    # setting, weights() must be the model's values (never an array PopART did not fill), and
    # write_weights must either work or be refused by the kit with a ValueError.
    sess, popart, psess = make(config("cpu", options=options))
    weights = sess.weights()
    record = session_record(psess)
    handed = [weights_io_arrays(args[0]) for name, args, _ in record.calls
              if name == "readWeights"]
    filled = {n for names in record.read for n in names}
    for name, array in weights.items():
        unfilled = [a for io in handed for n, a in io.items() if a is array and n not in filled]
        assert not unfilled, f"weights()[{name!r}] is an array PopART's readWeights never wrote"
    np.testing.assert_array_equal(weights[T["w"]], W0)
    new = np.full((3, 4), 2.0, np.float32)
    try:
        sess.write_weights({T["w"]: new})
    except ValueError:
        assert options.get("constantWeights", True), "refused although PopART can write them"
        assert "writeWeights" not in record.methods
        return
    np.testing.assert_array_equal(sess.weights()[T["w"]], new)


@pytest.mark.parametrize("bad", ["unknown", "shape", "dtype-same-size", "dtype-other-size"])
def test_bad_weights_are_refused_before_popart_writes(bad):
    # PopART's writeWeights ignores names that are not weights and copies raw bytes (a same-size
    # dtype is reinterpreted, devicex.cpp L551-563); the xla backend refuses all of these with a
    # ValueError, so the popart backend must too, before writeWeights.
    sess, popart, psess = make(config("cpu", options=NO_CONSTANTS))
    value = {"unknown": ("not_a_weight", W0), "shape": (T["w"], W0.T.copy()),
             "dtype-same-size": (T["w"], W0.astype(np.int32)),
             "dtype-other-size": (T["w"], W0.astype(np.float64))}[bad]
    with pytest.raises(ValueError):
        sess.write_weights(dict([value]))
    assert "writeWeights" not in session_record(psess).methods
    np.testing.assert_array_equal(sess.weights()[T["w"]], W0)


@pytest.mark.parametrize("name", sorted(OFFLINE))
def test_offline_prepare_compiles_without_loading_an_engine(name):
    # An offline device never attaches (DeviceConnectionType::Never): prepareDevice with the
    # default loadEngine=True raises "Trying to load an engine on an offline device"
    # (devicex.cpp L1307-1311), and so would weightsFromHost. prepare() must compile only.
    sess, popart, psess = make(OFFLINE[name])
    sess.prepare()
    assert "weightsFromHost" not in session_record(psess).methods


# -- property: generated configs and anchors -------------------------------------------------------


@st.composite
def sessions(draw: st.DrawFn) -> tuple[pk.SessionConfig, dict[str, Any]]:
    kwargs = draw(config_dicts().filter(
        lambda k: k["mode"] == "inference" and not k["pipeline"]["enabled"]))
    kwargs.pop("micro_batch_size", None)  # a session checks it against the model's batch of 2
    cfg = pk.SessionConfig.model_validate(kwargs)
    bps = cfg.batches_per_step
    periods = [d for d in range(1, bps + 1) if bps % d == 0]
    kinds = st.one_of(st.sampled_from(["All", "Final", "Sum", "all", "FINAL", "sum"]),
                      st.tuples(st.sampled_from(["EveryN", "everyn"]), st.sampled_from(periods)))
    chosen = draw(st.lists(st.sampled_from(["x", "s", "w", "h", "y"]), min_size=1, max_size=5,
                           unique=True))
    return cfg, {T[k]: draw(kinds) for k in chosen}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.filter_too_much])
@given(sessions())
def test_generated_configs_and_anchors_reach_popart_as_given(case):
    cfg, anchors = case
    sess, popart, psess = make(cfg, anchors)
    check_constructor(cfg, popart, psess, sess.anchors)
    if cfg.device.target != "offline":
        check_run(sess, psess, seed=cfg.batches_per_step)


# -- the recorder is strict, so the tests above can fail -------------------------------------------


def test_recorder_anchor_return_type_and_dataflow_raise_as_popart():
    popart = make_popart_module()
    art = popart.AnchorReturnType
    for args, message in [(("INVALID",), "Invalid anchor return type ID supplied: INVALID"),
                          (("ALL", 2), "A return period should not be supplied"),
                          (("EveryN", 0), "greater than zero"),
                          (("everyn", -1), "greater than zero"),
                          (("EveryN",), "Must specify return period with option 'EVERYN'")]:
        with pytest.raises(popart.popart_exception, match=message):
            art(*args)
    with pytest.raises(TypeError):
        art("All", period=2)  # the keyword is returnPeriod
    with pytest.raises(TypeError):
        art("All", tileSet="IO")
    assert art("eVeRyN", returnPeriod=3).rp() == 3
    assert art("sum").id() is popart.AnchorReturnTypeId.Sum
    assert art("All", tileSet=popart.TileSet.IO).tileSet() is popart.TileSet.IO

    df = popart.DataFlow
    with pytest.raises(popart.popart_exception, match="greater than zero"):
        df(0, {})
    with pytest.raises(popart.popart_exception, match="<= to the number"):
        df(2, {"a": art("EveryN", 4)})
    with pytest.raises(popart.popart_exception, match="factor of the number"):
        df(6, {"a": art("EveryN", 4)})
    with pytest.raises(TypeError):
        df(2, {"a": "All"})  # a name is not an AnchorReturnType
    with pytest.raises(TypeError):
        df(2, {"a": make_popart_module().AnchorReturnType("All")})  # another module's
    with pytest.raises(TypeError):
        df(batches_per_step=2, anchorTensors={})
    flow = df(4, ["b", "a"])
    assert flow.anchors() == ["a", "b"] and flow.art("a").id() is popart.AnchorReturnTypeId.All
    with pytest.raises(popart.popart_exception, match="not an anchor"):
        flow.art("c")


def test_recorder_session_and_devices_raise_as_popart(tmp_path):
    popart = make_popart_module()
    dm = popart.DeviceManager()
    flow = popart.DataFlow(1, {T["y"]: popart.AnchorReturnType("All")})
    cpu = dm.createCpuDevice()
    with pytest.raises(popart.popart_exception, match="power of two"):
        dm.acquireAvailableDevice(numIpus=3)
    with pytest.raises(popart.popart_exception, match="Never"):
        dm.acquireAvailableDevice(connectionType=popart.DeviceConnectionType.Never)
    with pytest.raises(popart.popart_exception, match="Invalid option"):
        dm.createIpuModelDevice({"numIpus": "2"})
    with pytest.raises(popart.popart_exception, match="Unknown syncPattern"):
        dm.createOfflineIPUDevice({"syncPattern": "SinglePipeline"})
    sess = popart.InferenceSession
    with pytest.raises(TypeError):
        sess(fnModel=MODEL, dataFlow=flow, deviceInfo=cpu, options=popart.SessionOptions())
    with pytest.raises(TypeError):
        sess(fnModel=onnx.load_from_string(MODEL), dataFlow=flow, deviceInfo=cpu)
    with pytest.raises(popart.popart_exception, match="ModelProto"):
        sess(fnModel=b"\xff not onnx", dataFlow=flow, deviceInfo=cpu)
    with pytest.raises(popart.popart_exception, match="valid deviceInfo"):
        sess(fnModel=MODEL, dataFlow=flow, deviceInfo=None)
    with pytest.raises(TypeError):
        sess(fnModel=MODEL, dataFlow=flow,
             deviceInfo=make_popart_module().DeviceManager().createCpuDevice())
    with pytest.raises(TypeError):
        sess(fnModel=MODEL, dataFlow=flow, deviceInfo=cpu,
             userOptions=make_popart_module().SessionOptions())
    with pytest.raises(popart.popart_exception, match="must specify an anchor"):
        sess(fnModel=MODEL, dataFlow=popart.DataFlow(1, {}), deviceInfo=cpu)
    with pytest.raises(popart.popart_exception, match="not in Ir Tensors"):
        sess(fnModel=MODEL, dataFlow=popart.DataFlow(1, ["nope"]), deviceInfo=cpu)
    path = tmp_path / "m.onnx"
    path.write_bytes(MODEL)
    opts = popart.SessionOptions()
    opts.constantWeights = False
    s = sess(str(path), flow, cpu, userOptions=opts)  # a path, positionally: PopART's order
    inputs = {T["x"]: np.zeros((2, 3), np.float32), T["s"]: np.zeros(1, np.float32)}
    stepio = popart.PyStepIO(inputs, {T["y"]: np.zeros((2, 4), np.float32)})
    with pytest.raises(popart.popart_exception, match="prepare"):
        s.run(stepio)
    with pytest.raises(popart.popart_exception, match="prepareDevice"):
        s.weightsFromHost()
    with pytest.raises(NotImplementedError, match="getCycleCount"):
        s.getCycleCount()
    with pytest.raises(NotImplementedError, match="fromIr"):
        sess.fromIr(None, cpu)
    s.prepareDevice()
    with pytest.raises(popart.popart_exception, match="Unexpected number of output"):
        s.run(popart.PyStepIO(inputs, {T["y"]: np.zeros((1, 4), np.float32)}))
    with pytest.raises(TypeError):
        s.readWeights(weightsIo=popart.PyWeightsIO({}))  # bound without a keyword name
    with pytest.raises(popart.popart_exception, match="c-contiguous"):
        popart.PyWeightsIO({T["w"]: np.zeros((4, 3), np.float32).T})
    with pytest.raises(popart.popart_exception, match="non-matching size"):
        s.writeWeights(popart.PyWeightsIO({T["w"]: np.zeros((3, 4), np.float64)}))
    s.writeWeights(popart.PyWeightsIO({T["w"]: np.ones((3, 4), np.float32), "other": W0}))
    out = {T["w"]: np.zeros((3, 4), np.float32)}
    s.readWeights(popart.PyWeightsIO(out))
    np.testing.assert_array_equal(out[T["w"]], 1.0)  # host copy, as written
    s.weightsToHost()  # the device still holds the initial weights: never sent
    s.readWeights(popart.PyWeightsIO(out))
    assert not np.array_equal(out[T["w"]], np.ones((3, 4))), "device memory was uninitialised"
    s.run(stepio, debugName="step")
    assert session_record(s).runs == [stepio]
    offline = popart.InferenceSession(MODEL, flow, dm.createOfflineIPUDevice({"numIPUs": "1"}))
    with pytest.raises(popart.popart_exception, match="offline device"):
        offline.prepareDevice()
    offline.prepareDevice(loadEngine=False)
    with pytest.raises(popart.popart_exception, match="not configured for execution"):
        offline.run(stepio)
    constant = popart.InferenceSession(MODEL, flow, cpu)
    constant.prepareDevice()
    with pytest.raises(popart.popart_exception, match="constantWeights"):
        constant.writeWeights(popart.PyWeightsIO({T["w"]: W0.copy()}))
    marker = np.full((3, 4), 7.0, np.float32)
    constant.readWeights(popart.PyWeightsIO({T["w"]: marker}))
    assert session_record(constant).read == [[]] and (marker == 7.0).all()
