"""Contract tests: the popart backend trains through PopART's TrainingSession as PopART defines it.

``popart_kit.TrainingSession(..., loss=..., optimizer=pk.SGD(...) | pk.Adam(...),
backend="popart", popart=<strict recorder>)`` builds its optimizer, TrainingSession, PyStepIO and
PyWeightsIO on ``strict_popart`` (written from ``popart_api.json`` and PopART's sources:
popart.cpp L829-957 and L2199-2330, sgd.cpp, adam.cpp, optimizer.cpp, session.cpp), which
raises where PopART would and records every call, so these tests check keyword names, the loss
id, the optimizer's class and ``(value, isConst)`` pairs, updateOptimizerFromHost,
setRandomSeed and runs.

``(value, isConst)``: every number the kit's optimizer lists in ``hyperparameters()`` can change
between runs, so PopART must hold it as a non-constant OptimizerValue (updateOptimizerFromHost
refuses to change a constant one); what the kit treats as static (momentum 0: no velocity
tensor; nesterov) must be constant. Values are compared as the C++ ``float`` holds them.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strict_popart import (
    MANIFEST,
    RANDOM_OPS,
    DeviceCall,
    created_sessions,
    make_popart_module,
    optimizer_record,
    option_mismatches,
    run_pattern,
    session_record,
    stepio_arrays,
    trained_pattern,
    weights_io_arrays,
)

import popart_kit as pk

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

SESSION = MANIFEST["classes"]["TrainingSession"]
SGD_SPEC, ADAM_SPEC = MANIFEST["classes"]["SGD"], MANIFEST["classes"]["Adam"]
W0 = np.arange(12, dtype=np.float32).reshape(3, 4) / 10 - 0.5
ADAM_MODES = {"adam": "Adam", "adam_no_bias": "AdamNoBias", "adamax": "AdaMax",
              "lamb": "Lamb", "lamb_no_bias": "LambNoBias"}
DECAY_MODES = {"decay": "Decay", "l2_regularization": "L2Regularization"}


def f32(value: float) -> float:
    return float(np.float32(value))


# -- models, configs, sessions ----------------------------------------------------------------


def classifier(dropout: bool = False) -> tuple[bytes, dict[str, str]]:
    """x[2,3] @ w[3,4] (initialized) -> relu [-> dropout] -> softmax -> nll loss with label[2]."""
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2, 3]))
    label = b.addInputTensor(pk.TensorInfo("INT32", [2]))
    w = b.addInitializedInputTensor(W0)
    h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w])])
    if dropout:
        h = b.aiOnnx.dropout([h], 1, 0.25)[0]
    probs = b.aiOnnx.softmax([h], axis=1)
    loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)
    return b.getModelProto(), {"x": x, "label": label, "w": w, "h": h, "probs": probs,
                               "loss": loss}


MODEL, T = classifier()


def config(target: str = "cpu", bps: int = 1, local: int = 1, factor: int = 1,
           reduction: str = "sum", **kw: Any) -> pk.SessionConfig:
    device = kw.pop("device", {})
    return pk.SessionConfig(mode="training", batches_per_step=bps,
                            replication={"local_factor": local},
                            accumulation={"factor": factor, "reduction": reduction},
                            device={"target": target, **device}, **kw)


CONFIGS = {
    "cpu": config(),
    "cpu-bps": config(bps=3),
    "ipu-replicated-accumulated": config("ipu", bps=2, local=2, factor=4, reduction="mean"),
    "ipu_model-accumulated": config("ipu_model", bps=2, factor=2),
    "ipu-stochastic-rounding": config("ipu", precision={"stochastic_rounding": True}),
}

OPTIMIZERS = {
    "sgd": pk.SGD(0.05),
    "sgd-momentum": pk.SGD(learning_rate=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-4,
                           velocity_scaling=2.0, loss_scaling=128.0),
    "sgd-nesterov-separate": pk.SGD(0.01, momentum=0.8, nesterov=True,
                                    accumulator_and_momentum="separate"),
    "adam": pk.Adam(1e-3),
    "adamw-l2": pk.Adam(3e-4, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.01,
                        weight_decay_mode="l2_regularization", loss_scaling=8.0),
    "lamb": pk.Adam(2e-3, mode="lamb", max_weight_norm=5.0, weight_decay=0.1),
    "adamax": pk.Adam(1e-2, mode="adamax"),
}


def make(cfg: pk.SessionConfig, optimizer: Any, anchors: dict[str, Any] | None = None,
         model: bytes = MODEL, loss: str = T["loss"]) -> tuple[pk.TrainingSession, Any, Any]:
    popart = make_popart_module()
    sess = pk.TrainingSession(model, cfg, loss=loss, optimizer=optimizer, anchors=anchors,
                              backend="popart", popart=popart)
    made = created_sessions(popart)
    assert len(made) == 1, "one PopART session per kit session"
    assert isinstance(made[0], popart.TrainingSession), "a TrainingSession, not inference"
    return sess, popart, made[0]


# -- what PopART's optimizer must hold ---------------------------------------------------------


def expected_popart_optimizer(opt: Any) -> tuple[str, dict[str, tuple[float, bool]],
                                                 dict[str, str]]:
    """(popart class, complete {key: (value, isConst)}, settings by member name) for a kit
    optimizer, from its fields and PopART's getUnset* defaults."""
    if isinstance(opt, pk.SGD):
        values = {k: (f32(v), c) for k, (v, c) in SGD_SPEC["value_defaults"].items()}
        values.update({
            "defaultLearningRate": (f32(opt.learning_rate), False),
            "defaultWeightDecay": (f32(opt.weight_decay), False),
            "defaultDampening": (f32(opt.dampening), False),
            "defaultVelocityScaling": (f32(opt.velocity_scaling), False),
            "lossScaling": (f32(opt.loss_scaling), False),
            # momentum 0 must be a constant 0 (SGD::hasMomentum), else changeable
            "defaultMomentum": (f32(opt.momentum), False) if opt.momentum else (0.0, True),
        })
        if opt.nesterov:
            values["nesterov"] = (1.0, True)
        accmm = "Separate" if opt.accumulator_and_momentum == "separate" else "Combined"
        return "SGD", values, {"accumulatorAndMomentum": accmm, "accumType": "UNDEFINED",
                               "accl1Type": "UNDEFINED"}
    values = {k: (f32(v), c) for k, (v, c) in ADAM_SPEC["value_defaults"].items()}
    values.update({
        "defaultLearningRate": (f32(opt.learning_rate), False),
        "defaultWeightDecay": (f32(opt.weight_decay), False),
        "defaultBeta1": (f32(opt.beta1), False), "defaultBeta2": (f32(opt.beta2), False),
        "defaultEps": (f32(opt.eps), False), "lossScaling": (f32(opt.loss_scaling), False),
    })
    if opt.mode in ("lamb", "lamb_no_bias"):  # only Lamb reads the max weight norm
        values["defaultMaxWeightNorm"] = (f32(opt.max_weight_norm), False)
    return "Adam", values, {"mode": ADAM_MODES[opt.mode],
                            "weight_decay_mode": DECAY_MODES[opt.weight_decay_mode],
                            "accum_type": "UNDEFINED", "accl1_type": "FLOAT",
                            "accl2_type": "FLOAT", "scaled_optimizer_state": False}


def check_optimizer(popart: Any, popart_opt: Any, opt: Any) -> None:
    cls, values, settings_ = expected_popart_optimizer(opt)
    assert type(popart_opt) is getattr(popart, cls), (type(popart_opt), cls)
    rec = optimizer_record(popart_opt)
    assert rec.values == values
    plain = {k: (v.name if hasattr(v, "name") else v) for k, v in rec.settings.items()}
    assert plain == settings_
    # by PopART's parameter names: the values dict first (positionally or as pyd=/values=)
    params = MANIFEST["classes"][cls]["ctor"][0]
    assert set(rec.keywords) <= set(params[1:]) and len(rec.args) <= 1


# -- the constructor ---------------------------------------------------------------------------


def check_constructor(cfg: pk.SessionConfig, popart: Any, psess: Any, opt: Any,
                      anchors: dict[str, pk.AnchorReturnType], loss: str = T["loss"],
                      model: bytes = MODEL) -> None:
    record = session_record(psess)
    params = SESSION["ctor"][0]
    assert not record.args, "pass TrainingSession's arguments by PopART's keyword names"
    assert set(record.keywords) <= set(params), set(record.keywords) - set(params)
    assert {"fnModel", "dataFlow", "loss", "optimizer", "deviceInfo", "userOptions"} <= set(
        record.keywords)
    assert isinstance(record.keywords["fnModel"], bytes)
    assert onnx.load_from_string(record.keywords["fnModel"]) == onnx.load_from_string(model)
    assert record.keywords["loss"] == loss and type(record.keywords["loss"]) is str
    check_optimizer(popart, record.keywords["optimizer"], opt)

    dataflow = record.keywords["dataFlow"]
    assert isinstance(dataflow, popart.DataFlow)
    assert dataflow.batchesPerStep() == cfg.batches_per_step
    assert dataflow.anchors() == sorted(anchors)
    for name, art in anchors.items():
        assert dataflow.art(name).id() is getattr(popart.AnchorReturnTypeId, art.name)
        if art.name == "EveryN":
            assert dataflow.art(name).rp() == art.period

    opts = record.keywords["userOptions"]
    assert isinstance(opts, popart.SessionOptions)
    assert not option_mismatches(opts, cfg.to_popart_dict())
    assert psess.replicationFactor == cfg.replication.local_factor
    assert psess.accumulationFactor == cfg.accumulation.factor

    device = record.keywords["deviceInfo"]
    assert isinstance(device, DeviceCall) and device.manager.calls == [device]
    method = {"ipu": "acquireAvailableDevice", "ipu_model": "createIpuModelDevice",
              "cpu": "createCpuDevice", "offline": "createOfflineIPUDevice"}
    assert device.method == method[cfg.device.target]


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_constructor_gets_keyword_names_loss_and_optimizer(cfg_name, opt_name):
    cfg, opt = CONFIGS[cfg_name], OPTIMIZERS[opt_name]
    sess, popart, psess = make(cfg, opt)
    assert sess.backend == "popart" and sess.loss == T["loss"]
    assert sess.anchors == {T["loss"]: pk.AnchorReturnType.of("Final")}, "default: the loss"
    check_constructor(cfg, popart, psess, opt, sess.anchors)
    assert session_record(psess).calls == [], "nothing runs before it is asked to"


def test_anchors_of_every_return_type_reach_popart():
    anchors = {T["loss"]: "All", T["h"]: ("EveryN", 2), T["w"]: "Final", T["probs"]: "Sum"}
    cfg = config("ipu", bps=4, local=2, factor=2)
    sess, popart, psess = make(cfg, OPTIMIZERS["sgd-momentum"], anchors)
    check_constructor(cfg, popart, psess, OPTIMIZERS["sgd-momentum"], sess.anchors)
    check_run(sess, psess)


# -- run ---------------------------------------------------------------------------------------


def check_run(sess: pk.TrainingSession, psess: Any, seed: int = 0) -> None:
    record = session_record(psess)
    inputs = sess.io.allocate_inputs("random", seed=seed)
    kept = {k: v.copy() for k, v in inputs.items()}
    out = sess.run(inputs)
    assert record.methods == ["prepareDevice", "weightsFromHost", "run"]
    assert record.calls[0][2].get("loadEngine", True) is True and not record.calls[0][1]
    stepio, = record.runs
    got_in, got_out = stepio_arrays(stepio)
    assert set(got_in) == set(inputs) == {T["x"], T["label"]}
    for name, array in got_in.items():
        assert array.shape == sess.io.input_shape(name) and array.dtype == inputs[name].dtype
        np.testing.assert_array_equal(array, kept[name])
    assert set(got_out) == set(out) == set(sess.anchors)
    for name, array in out.items():
        assert array is got_out[name], "run returns the arrays PopART wrote"
        assert array.shape == sess.io.anchor_shape(name)
        np.testing.assert_array_equal(array.reshape(-1), run_pattern(array.size, array.dtype, 1))

    again = sess.run(sess.io.allocate_inputs("zeros"))
    assert record.methods == ["prepareDevice", "weightsFromHost", "run", "run"]
    for name, array in again.items():
        assert not np.shares_memory(array, out[name])
        np.testing.assert_array_equal(array.reshape(-1), run_pattern(array.size, array.dtype, 2))
    # PopART's own anchor shapes (python_files/session.py _initAnchorArrays)
    for name, array in psess.initAnchorArrays().items():
        assert array.shape == sess.io.anchor_shape(name)


@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_run_prepares_then_runs_a_pystepio_of_checked_arrays(cfg_name):
    sess, popart, psess = make(CONFIGS[cfg_name], OPTIMIZERS["adam"])
    check_run(sess, psess)


def test_bad_inputs_are_refused_before_popart_runs():
    sess, popart, psess = make(config(bps=2), OPTIMIZERS["sgd"])
    inputs = sess.io.allocate_inputs("random")
    inputs[T["label"]] = inputs[T["label"]].astype(np.float32)
    with pytest.raises(ValueError):
        sess.run(inputs)
    assert "run" not in session_record(psess).methods


def test_weights_after_training_are_the_devices():
    sess, popart, psess = make(config(), OPTIMIZERS["sgd-momentum"])
    np.testing.assert_array_equal(sess.weights()[T["w"]], W0)
    sess.run(sess.io.allocate_inputs("random"))
    record = session_record(psess)
    weights = sess.weights()
    assert record.methods[-2:] == ["weightsToHost", "readWeights"]
    assert record.read[-1] == [T["w"]]
    io = record.calls[-1][1][0]
    assert weights[T["w"]] is weights_io_arrays(io)[T["w"]]
    np.testing.assert_array_equal(weights[T["w"]], trained_pattern((3, 4), np.float32, 1))
    new = np.full((3, 4), 0.25, np.float32)
    sess.write_weights({T["w"]: new})
    assert record.written[-1] == [T["w"]]
    assert record.methods[-2:] == ["writeWeights", "weightsFromHost"]
    np.testing.assert_array_equal(sess.weights()[T["w"]], new)
    proto = sess.model_proto()
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    np.testing.assert_array_equal(inits[T["w"]], new)


# -- updateOptimizerFromHost -------------------------------------------------------------------


def update_calls(psess: Any) -> list[Any]:
    """The optimizer of each updateOptimizerFromHost, checked as bound (one positional)."""
    out = []
    for name, args, kwargs in session_record(psess).calls:
        if name == "updateOptimizerFromHost":
            assert not kwargs and len(args) == 1
            out.append(args[0])
    return out


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_set_learning_rate_updates_the_optimizer_from_host(opt_name):
    opt = OPTIMIZERS[opt_name]
    sess, popart, psess = make(config(), opt)
    new_lr = opt.learning_rate * 0.5
    sess.set_learning_rate(new_lr)
    record = session_record(psess)
    assert record.methods == ["prepareDevice", "weightsFromHost", "updateOptimizerFromHost"]
    given, = update_calls(psess)
    expected = opt.with_learning_rate(new_lr)
    check_optimizer(popart, given, expected)
    assert given is not record.keywords["optimizer"], "a new PopART optimizer"
    installed, = record.optimizers
    assert optimizer_record(installed).values["defaultLearningRate"] == (f32(new_lr), False)
    assert sess.optimizer == expected
    # the next run uses it, without preparing again
    sess.run(sess.io.allocate_inputs("zeros"))
    assert record.methods[3:] == ["run"]


SGD_CHANGES = [dict(learning_rate=0.2, momentum=0.5, dampening=0.0, weight_decay=0.01,
                    velocity_scaling=4.0, loss_scaling=16.0),
               dict(momentum=0.95), dict(weight_decay=0.0, loss_scaling=1.0)]
ADAM_CHANGES = [dict(learning_rate=5e-4, beta1=0.5, beta2=0.9, eps=1e-5, weight_decay=0.2,
                     loss_scaling=2.0, max_weight_norm=1.0), dict(eps=1e-3)]


@pytest.mark.parametrize("opt_name,changes", [
    *[("sgd-momentum", c) for c in SGD_CHANGES], ("sgd", dict(learning_rate=0.3)),
    ("sgd-nesterov-separate", dict(momentum=0.5, learning_rate=0.02)),
    *[(name, c) for name in ("adam", "adamw-l2", "lamb", "adamax") for c in ADAM_CHANGES]])
def test_set_optimizer_sends_the_new_values(opt_name, changes):
    opt = OPTIMIZERS[opt_name]
    sess, popart, psess = make(config("ipu", bps=2, local=2, factor=2), opt)
    sess.run(sess.io.allocate_inputs("random"))
    new = opt.replace(**changes)
    sess.set_optimizer(new)
    record = session_record(psess)
    assert record.methods == ["prepareDevice", "weightsFromHost", "run",
                              "updateOptimizerFromHost"]
    given, = update_calls(psess)
    check_optimizer(popart, given, new)
    assert [optimizer_record(o).values for o in record.optimizers] == [
        optimizer_record(given).values]
    assert sess.optimizer == new
    # and back again: every change is a valid PopART replacement
    sess.set_optimizer(opt)
    check_optimizer(popart, update_calls(psess)[-1], opt)
    assert len(record.optimizers) == 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_generated_optimizers_reach_popart_and_update(data):
    unit = st.floats(0.0, 0.99, allow_nan=False)
    positive = st.floats(1e-6, 10.0, allow_nan=False)
    if data.draw(st.booleans(), "sgd"):
        nesterov = data.draw(st.booleans(), "nesterov")
        fields = {"momentum": data.draw(st.floats(0.01, 0.99) if nesterov else unit),
                  "dampening": 0.0 if nesterov else data.draw(unit),
                  "weight_decay": data.draw(unit), "nesterov": nesterov,
                  "velocity_scaling": data.draw(positive), "loss_scaling": data.draw(positive),
                  "accumulator_and_momentum": data.draw(st.sampled_from(["combined",
                                                                         "separate"]))}
        opt = pk.SGD(data.draw(positive, "lr"), **fields)
        later = {"learning_rate": data.draw(positive)}
        if not nesterov:
            later["dampening"] = data.draw(unit)
        if opt.momentum:
            later["momentum"] = data.draw(st.floats(0.01, 0.99))
    else:
        opt = pk.Adam(data.draw(positive, "lr"), beta1=data.draw(unit), beta2=data.draw(unit),
                      eps=data.draw(positive), weight_decay=data.draw(unit),
                      mode=data.draw(st.sampled_from(sorted(ADAM_MODES))),
                      weight_decay_mode=data.draw(st.sampled_from(sorted(DECAY_MODES))),
                      loss_scaling=data.draw(positive), max_weight_norm=data.draw(unit))
        later = {"learning_rate": data.draw(positive), "beta2": data.draw(unit),
                 "loss_scaling": data.draw(positive)}
    sess, popart, psess = make(config(), opt)
    check_optimizer(popart, session_record(psess).keywords["optimizer"], opt)
    new = opt.replace(**later)
    sess.set_optimizer(new)
    check_optimizer(popart, update_calls(psess)[-1], new)


# -- setRandomSeed -----------------------------------------------------------------------------


def seed_calls(psess: Any) -> list[int]:
    out = []
    for name, args, kwargs in session_record(psess).calls:
        if name == "setRandomSeed":
            (seed,) = list(args) + list(kwargs.values())
            assert set(kwargs) <= {"seedValue"}
            out.append(seed)
    return out


@pytest.mark.parametrize("case", ["plain", "dropout", "stochastic-rounding"])
def test_set_random_seed_calls_set_random_seed(case):
    model, t = classifier(dropout=case == "dropout")
    cfg = config("ipu", precision={"stochastic_rounding": case == "stochastic-rounding"})
    sess, popart, psess = make(cfg, OPTIMIZERS["sgd"], model=model, loss=t["loss"])
    sess.set_random_seed(1234)
    record = session_record(psess)
    assert record.methods[-1] == "setRandomSeed"
    assert seed_calls(psess) == [1234] and type(seed_calls(psess)[0]) is int
    # PopART seeds only a session with random behaviour (else it warns and does nothing)
    has_random_ops = bool({n.op_type for n in onnx.load_from_string(model).graph.node}
                          & RANDOM_OPS)
    assert has_random_ops == (case == "dropout")
    assert record.seeds == [(1234, case != "plain")]
    sess.run(sess.io.allocate_inputs("zeros"))
    sess.set_random_seed(0)
    assert seed_calls(psess) == [1234, 0]
    assert record.methods.count("prepareDevice") == 1


# -- package bugs the strict recorder finds (see the report) ---------------------------------------


@pytest.mark.parametrize("opt_name,new", [
    ("sgd", pk.Adam(0.01)),                                      # another optimizer type
    ("adam", pk.SGD(0.01)),
    ("sgd", pk.SGD(0.05, momentum=0.9)),                         # adds a velocity tensor
    ("sgd-momentum", pk.SGD(0.1)),                               # drops it
    ("sgd-momentum", OPTIMIZERS["sgd-momentum"].replace(accumulator_and_momentum="separate")),
    ("sgd-nesterov-separate", OPTIMIZERS["sgd-nesterov-separate"].replace(nesterov=False)),
    ("adam", pk.Adam(1e-3, mode="lamb")),                        # another Adam mode
    ("adam", pk.Adam(1e-3, weight_decay_mode="l2_regularization")),
])
def test_set_optimizer_of_another_kind_is_refused_by_the_kit(opt_name, new):
    # PopART cannot swap in an optimizer that needs another program: updateOptimizerFromHost
    # raises popart_runtime_error (Optimizer/SGD/Adam::validReplacement). The xla backend
    # refuses these with a ValueError before touching its session; the popart backend must too,
    # instead of letting PopART's error through after preparing the device.
    sess, popart, psess = make(config(), OPTIMIZERS[opt_name])
    with pytest.raises(ValueError):
        sess.set_optimizer(new)
    assert "updateOptimizerFromHost" not in session_record(psess).methods
    assert sess.optimizer == OPTIMIZERS[opt_name]


@pytest.mark.parametrize("change", ["set_learning_rate", "set_optimizer"])
def test_offline_optimizer_changes_are_refused_by_the_kit(change):
    # An offline device never attaches: updateOptimizerFromHost writes the optimizer to the
    # device (Devicex::optimizerFromHost runs a program, loading the engine), which raises
    # "Trying to load an engine on an offline device". run/weights are refused by the kit with
    # a ValueError on target='offline'; optimizer changes must be too.
    sess, popart, psess = make(config("offline", bps=2), OPTIMIZERS["sgd-momentum"])
    with pytest.raises(ValueError):
        if change == "set_learning_rate":
            sess.set_learning_rate(0.01)
        else:
            sess.set_optimizer(OPTIMIZERS["sgd-momentum"].replace(momentum=0.5))
    assert "updateOptimizerFromHost" not in session_record(psess).methods


def test_offline_random_seed_does_not_reach_an_offline_device():
    # With random behaviour (here stochastic rounding) setRandomSeed streams the seed to the
    # device (Devicex::setRandomSeedFromHost runs a program), which an offline device cannot:
    # PopART raises "Trying to load an engine on an offline device". The kit must refuse it
    # with a ValueError (as it does run) or keep the seed without calling PopART.
    cfg = config("offline", precision={"stochastic_rounding": True})
    sess, popart, psess = make(cfg, OPTIMIZERS["sgd"])
    with contextlib.suppress(ValueError):
        sess.set_random_seed(5)
    assert session_record(psess).seeds in ([], [(5, True)])


# -- the recorder is strict, so the tests above can fail -----------------------------------------


def test_recorder_optimizers_raise_as_popart():
    popart = make_popart_module()
    sgd, adam = popart.SGD, popart.Adam
    for make_it, error, message in [
        (lambda: sgd({"learningRate": (0.1, False)}), popart.popart_exception,
         "Invalid SGD key, learningRate"),
        (lambda: adam({"defaultMomentum": (0.1, False)}), popart.popart_exception,
         "Invalid Adam key, defaultMomentum"),
        (lambda: sgd({"defaultLearningRate": 0.1}), popart.popart_exception, "py::tuple"),
        (lambda: sgd({"defaultLearningRate": [0.1, False]}), popart.popart_exception,
         "py::tuple"),
        (lambda: sgd({"defaultLearningRate": (0.1,)}), RuntimeError, "Unable to cast"),
        (lambda: sgd({"defaultLearningRate": ("0.1", False)}), RuntimeError, "Unable to cast"),
        (lambda: sgd({"lossScaling": (0.0, False)}), popart.popart_exception,
         "Loss scaling cannot be 0"),
        (lambda: sgd({"defaultLearningRate": (-0.1, False)}), popart.popart_exception,
         "Negative learning rate"),
        (lambda: sgd({"defaultLearningRate": (0.0, True)}), popart.popart_exception,
         "Constant, zero learning rate"),
        (lambda: sgd({"defaultVelocityScaling": (0.0, False)}), popart.popart_exception,
         "Non-positive velocity scaling"),
        (lambda: sgd({"nesterov": (1.0, True), "defaultDampening": (0.5, False)}),
         popart.popart_exception, "dampening"),
        (lambda: adam({"defaultEps": (0.0, False)}), popart.popart_exception,
         "Non-positive eps"),
        (lambda: adam({"defaultBeta2": (-0.5, False)}), popart.popart_exception,
         "Negative beta2"),
        (lambda: popart.ConstSGD(0.0), popart.popart_exception, "Constant, zero learning"),
    ]:
        with pytest.raises(error, match=message):
            make_it()
    for bad in [lambda: sgd(values={}), lambda: adam(pyd={}),
                lambda: sgd({}, accumulatorAndMomentum="Separate"),
                lambda: adam({}, mode=popart.WeightDecayMode.Decay),
                lambda: adam({}, mode=make_popart_module().AdamMode.Lamb),
                lambda: adam({}, scaled_optimizer_state=1),
                lambda: sgd({}, clip_norm_settings=[object()]),
                lambda: popart.ConstSGD(learningRate=0.1), lambda: sgd([("a", (1.0, True))])]:
        with pytest.raises(TypeError):
            bad()
    # defaults and aliases as PopART's getComplete
    rec = optimizer_record(adam({"maxWeightNorm": (2.0, False)}, popart.AdamMode.Lamb))
    assert rec.values["defaultMaxWeightNorm"] == (2.0, False)
    assert rec.values["defaultBeta2"] == (f32(0.999), True)
    assert rec.settings["mode"] is popart.AdamMode.Lamb
    assert popart.AdamMode.AdaMax.value == 2, "the C++ value (adam.hpp), not the binding order"
    const = popart.ConstSGD(0.5, loss_scaling=4)
    assert isinstance(const, popart.SGD) and const.getLossScalingVal() == 4.0
    assert optimizer_record(const).values["defaultLearningRate"] == (0.5, True)
    with pytest.raises(NotImplementedError):
        const.learningRates()
    with pytest.raises(AttributeError):
        const.lr = 1.0


def test_recorder_training_session_raises_as_popart():
    popart = make_popart_module()
    cpu = popart.DeviceManager().createCpuDevice()
    flow = popart.DataFlow(1, {})  # a training session needs no anchor
    sgd = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, False)})
    sess = popart.TrainingSession
    for loss, message in [("nope", "Could not find loss tensor 'nope'"),
                          (T["probs"], "must be a scalar tensor"),
                          (T["label"], "must be a scalar tensor")]:
        with pytest.raises(popart.popart_exception, match=message):
            sess(fnModel=MODEL, dataFlow=flow, loss=loss, optimizer=sgd, deviceInfo=cpu)
    with pytest.raises(popart.popart_exception, match="TrainingSession::createFromOnnxModel"):
        sess(fnModel=MODEL, dataFlow=flow, loss=T["loss"], optimizer=sgd, deviceInfo=None)
    for kwargs in [{"optimizer": None}, {"optimizer": pk.SGD(0.1)},
                   {"optimizer": make_popart_module().SGD({})}, {"loss": None},
                   {"optimiser": sgd}]:
        args = {"fnModel": MODEL, "dataFlow": flow, "loss": T["loss"], "optimizer": sgd,
                "deviceInfo": cpu, **kwargs}
        if "optimiser" in kwargs:
            del args["optimizer"]
        with pytest.raises(TypeError):
            sess(**args)
    s = sess(MODEL, flow, T["loss"], sgd, cpu)  # PopART's positional order
    assert session_record(s).given["name"] == "training"
    with pytest.raises(popart.popart_runtime_error, match="prepare"):  # a valid replacement
        s.updateOptimizerFromHost(popart.SGD({"defaultLearningRate": (0.2, False),
                                              "defaultMomentum": (0.5, False)}))
    s.prepareDevice()
    for new, message in [
        (popart.Adam({}), "Can not replace optimizer of type SGD with new optimizer of type Adam"),
        (popart.SGD({"defaultLearningRate": (0.1, True), "defaultMomentum": (0.9, False)}),
         "Problem with learning rates"),
        (popart.SGD({"defaultLearningRate": (0.1, False)}), "Problem with momentums"),
        (popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, False)},
                    accumulatorAndMomentum=popart.SGDAccumulatorAndMomentum.Separate),
         "SGDAccumulatorAndMomentum"),
        (popart.ConstSGD(0.1), "Problem with"),
    ]:
        with pytest.raises(popart.popart_runtime_error, match=message):
            s.updateOptimizerFromHost(new)
    with pytest.raises(TypeError):
        s.updateOptimizerFromHost(optimizer=sgd)  # bound without a keyword name
    with pytest.raises(TypeError):
        s.updateOptimizerFromHost(None)
    # dampening is not checked by SGD::validReplacement, constant or not
    s.updateOptimizerFromHost(popart.SGD({"defaultLearningRate": (0.3, False),
                                          "defaultMomentum": (0.5, False),
                                          "defaultDampening": (0.5, True)}))
    assert [optimizer_record(o).values["defaultLearningRate"]
            for o in session_record(s).optimizers] == [(f32(0.3), False)]
    for seed in (-1, 2 ** 64, True, 1.0, "1"):
        with pytest.raises(TypeError):
            s.setRandomSeed(seed)
    s.setRandomSeed(seedValue=2 ** 64 - 1)
    assert session_record(s).seeds == [(2 ** 64 - 1, False)]
    adam = popart.Adam({}, mode=popart.AdamMode.Lamb, scaled_optimizer_state=True)
    opts = popart.SessionOptions()
    opts.automaticLossScalingSettings.enabled = True
    with pytest.raises(popart.popart_exception, match="scaledOptimizerState"):
        sess(MODEL, flow, T["loss"], adam, cpu, userOptions=opts)
    a = sess(MODEL, flow, T["loss"], popart.Adam({}, mode=popart.AdamMode.Lamb), cpu)
    a.prepareDevice()
    with pytest.raises(popart.popart_runtime_error, match="Adam modes do not match"):
        a.updateOptimizerFromHost(popart.Adam({}))
    model, t = classifier(dropout=True)
    r = sess(model, flow, t["loss"], sgd, cpu)
    with pytest.raises(popart.popart_runtime_error, match="prepare"):
        r.setRandomSeed(3)
    offline = sess(MODEL, flow, T["loss"], sgd,
                   popart.DeviceManager().createOfflineIPUDevice({"numIPUs": "1"}))
    offline.prepareDevice(loadEngine=False)
    with pytest.raises(popart.popart_runtime_error, match="offline device"):
        offline.updateOptimizerFromHost(sgd)
    assert len(created_sessions(popart)) == 4
    assert math.isclose(sgd.getLossScalingVal(), 1.0)
