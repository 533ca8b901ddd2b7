"""popart_kit.popart's names, signatures, defaults and errors, held against PopART's recorded
API facts (tests/contract/popart_api.json, popart_builder_ops.json)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import popart_kit.popart as popart
from popart_kit._config import catalog
from popart_kit._model.graphcore import GRAPHCORE_OPS

CONTRACT = Path(__file__).parent.parent / "contract"
API = json.loads((CONTRACT / "popart_api.json").read_text())
BUILDER_OPS = json.loads((CONTRACT / "popart_builder_ops.json").read_text())


def test_popart_exception_is_a_value_error():
    assert issubclass(popart.popart_exception, ValueError)
    with pytest.raises(ValueError):
        popart.DataFlow(0, {})


@pytest.mark.parametrize("name", sorted(API["enums"]))
def test_enums_have_popart_members(name):
    members = [m.name for m in getattr(popart, name)]
    assert members == API["enums"][name] or (
        name in ("ReductionType", "ReplicatedStreamMode")
        and set(members) == set(API["enums"][name]))


def test_session_options_have_every_attribute_with_popart_defaults():
    opts = popart.SessionOptions()
    for name in catalog.OPTIONS:  # held against popart_api.json by tests/contract
        assert catalog.plain(name, getattr(opts, name)) == catalog.DEFAULTS[name], name
    assert opts.changed() == {}


def test_session_options_are_typed_like_pybind():
    opts = popart.SessionOptions()
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    opts.executionPhaseSettings.phases = 2
    opts.outlineThreshold = 3
    opts.engineOptions["debug.instrument"] = "true"
    assert opts.outlineThreshold == 3.0 and isinstance(opts.outlineThreshold, float)
    assert opts.changed()["executionPhaseSettings"]["phases"] == 2
    assert opts.changed()["engineOptions"] == {"debug.instrument": "true"}
    with pytest.raises(TypeError, match="VirtualGraphMode"):
        opts.virtualGraphMode = "Manual"
    with pytest.raises(TypeError, match="accumulationFactor"):
        opts.accumulationFactor = 2.5
    with pytest.raises(AttributeError, match="accumulationFactr"):
        opts.accumulationFactr = 2
    assert opts.getGlobalReplicationFactor() == 1


def test_session_options_problems_are_reported_at_once():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    y = b.aiGraphcore.scale([x], 2.0)
    opts = popart.SessionOptions()
    opts.accumulationFactor = 4          # without enableGradientAccumulation
    opts.replicatedGraphCount = 2        # without enableReplicatedGraphs
    with pytest.raises(popart.popart_exception) as err:
        popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                popart.DeviceManager().createCpuDevice(), userOptions=opts)
    assert "enableGradientAccumulation" in str(err.value)
    assert "enableReplicatedGraphs" in str(err.value)
    opts = popart.SessionOptions()
    opts.enableGradientAccumulation = True
    opts.accumulationFactor = 2
    with pytest.raises(popart.popart_exception,
                       match="Gradient Accumulation only available when training"):
        popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                popart.DeviceManager().createCpuDevice(), userOptions=opts)


@pytest.mark.parametrize("args, message", [
    (("INVALID",), "Invalid anchor return type ID supplied: INVALID"),
    (("ALL", 2), "A return period should not be supplied for this anchor return type"),
    (("EveryN", -1), "Anchor return period must be greater than zero"),
    (("EveryN",), "Must specify return period with option 'EVERYN'"),
])
def test_anchor_return_type_errors_are_popart_text(args, message):
    with pytest.raises(popart.popart_exception) as err:
        popart.AnchorReturnType(*args)
    assert err.value.args[0] == message  # exactly: PopART programs compare with ==


def test_anchor_return_type_and_dataflow():
    art = popart.AnchorReturnType("everyn", 2)
    assert art.id() == popart.AnchorReturnTypeId.EveryN and art.rp() == 2
    flow = popart.DataFlow(4, ["a", "b"])
    assert flow.nAnchors() == 2 and flow.isAnchored("a")
    assert flow.art("b").id() == popart.AnchorReturnTypeId.All and flow.batchesPerStep() == 4
    with pytest.raises(popart.popart_exception, match="must be a factor"):
        popart.DataFlow(3, {"a": popart.AnchorReturnType("EveryN", 2)})
    with pytest.raises(popart.popart_exception, match="must be <="):
        popart.DataFlow(1, {"a": popart.AnchorReturnType("EveryN", 2)})


def test_device_manager():
    dm = popart.DeviceManager()
    assert dm.createCpuDevice().type == popart.DeviceType.Cpu
    model = dm.createIpuModelDevice({"numIPUs": 4, "tilesPerIPU": 16})
    assert (model.numIpus, model.tilesPerIPU) == (4, 16)
    offline = dm.createOfflineIPUDevice({"numIPUs": 2, "syncPattern": "singlePipeline"})
    assert offline.numIpus == 2 and offline.syncPattern == popart.SyncPattern.SinglePipeline
    assert dm.acquireAvailableDevice(8).numIpus == 8
    with pytest.raises(popart.popart_exception, match="must be a power of two"):
        dm.acquireAvailableDevice(3)
    with pytest.raises(popart.popart_exception, match="Invalid option `numIpus'"):
        dm.createIpuModelDevice({"numIpus": 2})
    params = list(inspect.signature(dm.acquireAvailableDevice).parameters)
    assert params == API["device_manager"]["acquireAvailableDevice"]["params"]


def test_optimizers_as_popart_spells_them():
    sgd = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, False)},
                     accumulatorAndMomentum=popart.SGDAccumulatorAndMomentum.Separate)
    assert (sgd.kit.learning_rate, sgd.kit.momentum) == (pytest.approx(0.1), pytest.approx(0.9))
    assert sgd.kit.accumulator_and_momentum == "separate"
    assert popart.ConstSGD(0.01).values["defaultLearningRate"] == (pytest.approx(0.01), True)
    adam = popart.Adam({"defaultLearningRate": (1e-3, False)}, mode=popart.AdamMode.Lamb,
                       weight_decay_mode=popart.WeightDecayMode.L2Regularization)
    assert (adam.kit.mode, adam.kit.weight_decay_mode) == ("lamb", "l2_regularization")
    with pytest.raises(popart.popart_exception, match="Invalid SGD key, defaultBeta1"):
        popart.SGD({"defaultBeta1": (0.9, True)})
    with pytest.raises(popart.popart_exception, match="must be a py::tuple"):
        popart.SGD({"defaultLearningRate": 0.1})
    for cls in ("SGD", "ConstSGD", "Adam"):
        params = list(inspect.signature(getattr(popart, cls)).parameters)
        assert params == API["classes"][cls]["ctor"][0], cls


def test_session_constructor_keywords_are_popart_s():
    for cls in ("InferenceSession", "TrainingSession"):
        params = list(inspect.signature(getattr(popart, cls)).parameters)
        assert params == API["classes"][cls]["ctor"][0]
    for cls in ("PyStepIO", "PyStepIOCallback", "PyWeightsIO"):
        params = list(inspect.signature(getattr(popart, cls)).parameters)
        assert params == API["classes"][cls]["ctor"][0]


def test_reserved_prefixes():
    assert popart.reservedGradientPrefix() == "Gradient___"
    assert popart.reservedAcclPrefix() == "Accl___"
    assert popart.reservedAccl1Prefix() == "Accl1___"
    assert popart.reservedAccl2Prefix() == "Accl2___"
    assert popart.reservedStepPrefix() == "Step___"
    assert popart.reservedAccumPrefix() == "Accum___"


@pytest.mark.parametrize("method", sorted(GRAPHCORE_OPS))
def test_graphcore_ops_have_popart_signatures(method):
    spec = BUILDER_OPS["ai_graphcore"][method]
    params = GRAPHCORE_OPS[method].params
    popart_params = [p for p in spec["params"][1:] if p != "debugContext"]
    assert [p[0] for p in params] == popart_params[:len(params)]
    for name, _, default in params:
        if name in spec.get("defaults", {}):
            assert default == spec["defaults"][name], name


def test_graphcore_ops_run_on_xla():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]), "x")
    outs = {
        "scale": b.aiGraphcore.scale([x], 0.5),
        "scaledadd": b.aiGraphcore.scaledadd([x, x], 2.0, 3.0),
        "detach": b.aiGraphcore.detach([x]),
        "swish": b.aiGraphcore.swish([x]),
        "subsample": b.aiGraphcore.subsample([x], [1, 2]),
        "reverse": b.aiGraphcore.reverse([x], [1]),
        "reshape": b.aiGraphcore.reshape(x, [4, 2]),
        "round": b.aiGraphcore.round([x]),
        "const": b.reshape_const(b.aiOnnx, [x], [8]),
        "gemm": b.aiOnnx.gemm([x, b.addInitializedInputTensor(np.eye(4, dtype=np.float32)),
                               b.addInitializedInputTensor(np.ones(4, np.float32))],
                              1, 1, False, False),
    }
    session = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, list(outs.values())),
                                      popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    xs = np.array([[-1.5, -0.5, 0.5, 2.5], [1, 2, 3, 4]], np.float32)
    session.run(popart.PyStepIO({x: xs}, anchors))
    got = {k: anchors[v] for k, v in outs.items()}
    np.testing.assert_allclose(got["scale"], xs / 2)
    np.testing.assert_allclose(got["scaledadd"], 5 * xs)
    np.testing.assert_allclose(got["detach"], xs)
    np.testing.assert_allclose(got["swish"], xs / (1 + np.exp(-xs)), rtol=1e-6)
    np.testing.assert_allclose(got["subsample"], xs[:, ::2])
    np.testing.assert_allclose(got["reverse"], xs[:, ::-1])
    np.testing.assert_allclose(got["reshape"], xs.reshape(4, 2))
    np.testing.assert_allclose(got["round"], [[-2, -1, 1, 3], [1, 2, 3, 4]])
    np.testing.assert_allclose(got["const"], xs.reshape(8))
    np.testing.assert_allclose(got["gemm"], xs + 1)


def test_builder_stores_float_initializers_as_popart_does():
    import onnx

    b = popart.Builder()
    b.addInitializedInputTensor(np.arange(3, dtype=np.float32), "w")
    init = onnx.load_from_string(b.getModelProto()).graph.initializer[0]
    assert list(init.float_data) == [0, 1, 2] and not init.raw_data


def test_auto_backend_never_takes_this_module_for_the_sdk(monkeypatch):
    from popart_kit._config.mapping import import_popart
    from popart_kit._runtime.backend import _sdk_importable

    monkeypatch.setitem(sys.modules, "popart", popart)
    assert not _sdk_importable()
    with pytest.raises(ImportError, match="not the Poplar SDK"):
        import_popart()


def test_popart_kit_run_runs_a_popart_program(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import sys, popart\n"
                      "from popart.session import OutOfMemoryException\n"
                      "assert popart.IS_POPART_KIT\n"
                      "print('args', sys.argv[1:], popart.reservedGradientPrefix())\n")
    for command in ([sys.executable, "-m", "popart_kit.cli", "run"],
                    [sys.executable, "-m", "popart_kit.popart"]):
        done = subprocess.run([*command, str(script), "a", "--b"], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "args ['a', '--b'] Gradient___" in done.stdout


def test_a_failing_program_s_traceback_starts_in_the_program(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import popart\n\ndef f():\n    raise ValueError('boom')\n\nf()\n")
    for command in ([sys.executable, "-m", "popart_kit.cli", "run"],
                    [sys.executable, "-m", "popart_kit.popart"]):
        done = subprocess.run([*command, str(script)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 1 and done.stderr.endswith("ValueError: boom\n")
        frames = [line for line in done.stderr.splitlines() if line.startswith('  File "')]
        assert frames and all(str(script) in line for line in frames), done.stderr


def test_structs_take_popart_s_positional_constructor_forms():
    """PopART's bindings give TensorLocation(storage, replicatedTensorSharding) and
    TensorLocationSettings(storage, minElements..., minElements...) besides the fields in
    order; the form is chosen by the arguments' count and types, as pybind does."""
    loc = popart.TensorLocation(popart.TensorStorage.OffChip, popart.ReplicatedTensorSharding.On)
    assert (loc.storage, loc.replicatedTensorSharding, loc.loadTileSet) == (
        popart.TensorStorage.OffChip, popart.ReplicatedTensorSharding.On, popart.TileSet.Compute)
    full = popart.TensorLocation(popart.TensorStorage.OffChip, popart.TileSet.IO,
                                 popart.TileSet.IO, popart.ReplicatedTensorSharding.Off)
    assert full.loadTileSet == full.storageTileSet == popart.TileSet.IO
    settings = popart.TensorLocationSettings(popart.TensorStorage.OffChip, 2, 3)
    assert settings.location.storage == popart.TensorStorage.OffChip
    assert (settings.minElementsForOffChip, settings.minElementsForReplicatedTensorSharding) == (
        2, 3)
    with pytest.raises(TypeError, match="TensorLocation.storage takes a popart.TensorStorage"):
        popart.TensorLocation(3, 4)


def test_the_optimizer_tensor_prefixes_are_popart_s():
    # tensornames.hpp: reserved{Default,Specific}<Name>Prefix
    assert popart.reservedDefaultScaledLearningRate0Prefix() == \
        "scaledLearningRate0___default___"
    assert popart.reservedSpecificAdamBeta2Prefix() == "adamBeta2___specific___"
    assert popart.reservedAutomaticLossScalePrefix() == "AutomaticLossScaleProxy___"


def test_poplar_debug_info_is_written_with_no_contexts_off_the_ipu(tmp_path):
    target = tmp_path / "debug.json"
    popart.initializePoplarDebugInfo(str(target), "json")
    popart.closePoplarDebugInfo()
    assert json.loads(target.read_text()) == {"contexts": [], "stringTable": []}
    assert popart.versionNumber() == (3, 4, 0) and popart.versionString().startswith("3.4.0")


def test_data_type_members_convert_to_popart_s_cpp_values():
    # datatype.hpp: UINT8 = 0, INT8, FLOAT8_143, FLOAT8_152, UINT16, ..., BOOL, FLOAT (11), ...
    assert int(popart.DataType.UINT8) == 0 and int(popart.DataType.FLOAT8_143) == 2
    assert int(popart.DataType.FLOAT) == 11 and int(popart.DataType.FLOAT16) == 12
    assert int(popart.DataType.UNDEFINED) == 18


def test_a_builder_extends_an_existing_model_given_as_bytes_or_a_path(tmp_path):
    b = popart.Builder(opsets={"ai.onnx": 11})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    y = b.aiOnnx.matmul([x, b.addInitializedInputTensor(np.ones((3, 4), np.float32))])
    b.addOutputTensor(y)
    b.saveModelProto(str(tmp_path / "m.onnx"))
    for source in (b.getModelProto(), str(tmp_path / "m.onnx")):
        more = popart.Builder(source)
        z = more.aiOnnx.relu([y])
        assert more.getTensorShape(z) == [2, 4] and more.getInputTensorIds()[0] == x
        with pytest.raises(popart.popart_exception, match="already defined as 11"):
            more.aiOnnxOpset10.relu([z])
        more.addOutputTensor(z)
        session = popart.InferenceSession(more.getModelProto(), popart.DataFlow(1, [z]),
                                          popart.DeviceManager().createCpuDevice())
        session.prepareDevice()
        anchors = session.initAnchorArrays()
        session.run(popart.PyStepIO({x: np.full((2, 3), -1.0, np.float32)}, anchors))
        np.testing.assert_array_equal(anchors[z], np.zeros((2, 4), np.float32))
    with pytest.raises(popart.popart_exception, match="builderCore"):
        popart.Builder(builderCore=object())


def test_ai_onnx_calls_are_checked_as_popart_s_binding_checks_them():
    """popart_core's AiOnnxN methods are pybind11 overloads: wrong argument types or counts are
    a TypeError naming the one signature; the opset object prints as PopART's AiOnnxN class;
    a second opset is builder.py's RuntimeError."""
    b = popart.Builder(opsets={"ai.onnx": 6, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    assert str(b.aiOnnx) == "AiOnnx6"
    b.aiOnnx.add([x, x], 1, 0, "add_v6")  # Add-6's axis and broadcast, positionally
    with pytest.raises(TypeError) as err:
        b.aiOnnx.add([x, x], "add_v9")  # a name where Add-6 takes the int axis
    assert err.value.args[0].startswith(
        "add(): incompatible function arguments. The following argument types are supported:\n"
        "    1. (self: popart_core.AiOnnxOpset6, args: List[str], axis: Optional[int] = None, "
        "broadcast: int = 0, debugContext: popart_core.DebugContext = '') -> str\n\nInvoked "
        "with: ")
    for call in (lambda: b.aiOnnx.add(0, 0), lambda: b.aiOnnx.conv(),
                 lambda: b.aiOnnx.cast([x], 1)):  # Cast takes the DataType's name
        with pytest.raises(TypeError, match=r"^\w+\(\): incompatible function arguments"):
            call()
    assert b.getTensorDtypeString(b.aiOnnx.cast([x], "INT32")) == "int32"
    with pytest.raises(RuntimeError, match="^Invalid opset 'aiOnnxOpset8' selected. Opset for "
                                           "domain ai.onnx already defined as 6$"):
        b.aiOnnxOpset8.add([x, x])


def test_a_deprecated_option_alias_logs_popart_s_warning_on_stderr(capfd):
    """popart.cpp: setting defaultPrefetchBufferingDepth or prefetchBufferingDepthMap logs
    PopART's deprecation warning (on stderr) and sets the current option."""
    opts = popart.SessionOptions()
    with pytest.warns(DeprecationWarning):
        opts.prefetchBufferingDepthMap = {"t": 3}
    assert opts.bufferingDepthMap == {"t": 3}
    assert ("The session option prefetchBufferingDepthMap has been deprecated and will be "
            "removed in a future release. Please use the alias bufferingDepthMap instead."
            in capfd.readouterr().err)
