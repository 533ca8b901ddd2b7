"""popart.Adaptive, insertSpecific, ClipNormSettings and scaled_optimizer_state against numpy
references written from PopART's equations (graphcore/popart d2f20d78:
willow/include/popart/adaptive.hpp "Implements AdaGrad, RMSProp, ..." comment block,
sgd.hpp / adam.hpp, transforms/clipweightgradientsbynorm.cpp), in float64 numpy, independently
of the jnp code; and PopART's refusals in its words (sgd.cpp, adam.cpp, adaptive.cpp,
optimizervaluemap.cpp, clipweightgradientsbynorm.cpp)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import popart_kit.popart as popart

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

RNG = np.random.default_rng(7)
W = {"a": RNG.standard_normal((3, 2)).astype(np.float32),
     "c": RNG.standard_normal((2,)).astype(np.float32)}


def f32(x: float) -> float:
    return float(np.float32(x))


# -- numpy references ---------------------------------------------------------------------------

def ref_adaptive(mode: str, tf: bool, velocity: bool, decay: bool, w: np.ndarray,
                 grads: list[np.ndarray], hypers: list[dict[str, float]]) -> np.ndarray:
    """adaptive.hpp: g arrives scaled by ls; v1 from 1 in TF mode (adaptivedecompose.cpp)."""
    w = w.astype(np.float64)
    v1 = np.ones_like(w) if tf else np.zeros_like(w)
    v2, v3 = np.zeros_like(w), np.zeros_like(w)
    for g, h in zip(grads, hypers, strict=True):
        lr, wd, a, m, eps, ls = (f32(h[k]) for k in ("lr", "wd", "alpha", "m", "eps", "ls"))
        s = g / ls
        if not decay:                                    # L2 regularization
            s = s + wd * w
        v1 = v1 + s ** 2 if mode == "AdaGrad" else a * v1 + (1 - a) * s ** 2
        if mode == "CenteredRMSProp":
            v2 = a * v2 + (1 - a) * s
        if mode == "AdaDelta":
            x = s * np.sqrt(v2 + eps) / np.sqrt(v1 + eps)
            v2 = a * v2 + (1 - a) * x ** 2
        else:
            rms = v1 - v2 ** 2 if mode == "CenteredRMSProp" else v1
            x = s / np.sqrt(rms + eps) if tf else s / (np.sqrt(rms) + eps)
        if velocity:
            v3 = m * v3 + (lr * x if tf else x)
        u = v3 if velocity else x
        wd_var = wd if decay else 0.0
        w = w - (wd_var * w + u) if tf and velocity else w - lr * (wd_var * w + u)
    return w


def run_kit(optimizers: list, grads: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The weights after one update per optimizer (the later ones replace the first's values,
    as updateOptimizerFromHost does), through the kit optimizer's apply."""
    kit = optimizers[0].kit
    w = {k: jnp.asarray(v) for k, v in W.items()}
    state = kit.init(w)
    for opt, g in zip(optimizers, grads, strict=True):
        assert opt.kit.program_key == kit.program_key
        hyper = {k: jnp.float32(v) for k, v in opt.kit.hyperparameters().items()}
        w, state = kit.apply(hyper, w, {k: jnp.asarray(v) for k, v in g.items()}, state)
    return {k: np.asarray(v) for k, v in w.items()}


def grads_seq(n: int, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    return [{k: (RNG.standard_normal(v.shape) * scale).astype(np.float32) for k, v in W.items()}
            for _ in range(n)]


# -- Adaptive -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, tf, momentum_const, decay", [
    ("AdaGrad", False, True, True), ("RMSProp", False, True, False),
    ("RMSProp", False, False, True), ("CenteredRMSProp", False, False, False),
    ("AdaDelta", False, True, False), ("AdaDelta", False, False, True),
    ("RMSProp", True, False, True), ("CenteredRMSProp", True, True, True),
    ("CenteredRMSProp", True, False, False)])
def test_adaptive_modes_match_popart_equations(mode, tf, momentum_const, decay):
    momentum = 0.0 if momentum_const else 0.6   # const 0: no momentum tensor (v3 = x)
    lrs, wds = [0.02, 0.01, 0.005], [0.1, 0.05, 0.2]
    opts = [popart.Adaptive(
        {"defaultLearningRate": (lr, False), "defaultWeightDecay": (wd, False),
         "defaultAlpha": (0.8, False), "defaultMomentum": (momentum, momentum_const),
         "defaultEps": (1e-3, False), "lossScaling": (4.0, False)},
        mode=getattr(popart.AdaptiveMode, mode), rmsprop_tf_variant=tf,
        weight_decay_mode=(popart.WeightDecayMode.Decay if decay else
                           popart.WeightDecayMode.L2Regularization))
        for lr, wd in zip(lrs, wds, strict=True)]
    grads = grads_seq(3, scale=4.0)
    got = run_kit(opts, grads)
    hypers = [{"lr": lr, "wd": wd, "alpha": 0.8, "m": momentum, "eps": 1e-3, "ls": 4.0}
              for lr, wd in zip(lrs, wds, strict=True)]
    for k in W:
        want = ref_adaptive(mode, tf, not momentum_const, decay, W[k],
                            [g[k].astype(np.float64) for g in grads], hypers)
        np.testing.assert_allclose(got[k], want, rtol=2e-5, atol=1e-6)
    assert not np.allclose(got["a"], W["a"])


def test_adaptive_trains_through_a_training_session():
    """Centered RMSProp with momentum, 3 steps of 2 batches on y = x * w + b with an L1 loss
    (mean over the elements): the gradients are sign(y) * x / n and, summed over the rows,
    sign(y) / n."""
    rng = np.random.default_rng(3)
    w0, b0 = rng.standard_normal((2, 3)).astype(np.float32), np.full(3, 0.1, np.float32)
    builder = popart.Builder()
    x = builder.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    w = builder.addInitializedInputTensor(w0, "w")
    b = builder.addInitializedInputTensor(b0, "b")
    loss = builder.aiGraphcore.l1loss([builder.aiOnnx.add([builder.aiOnnx.mul([x, w]), b])], 1.0)
    opt = popart.Adaptive({"defaultLearningRate": (0.01, False), "defaultMomentum": (0.5, True),
                           "defaultAlpha": (0.9, True), "lossScaling": (8.0, True)},
                          mode=popart.AdaptiveMode.CenteredRMSProp)
    session = popart.TrainingSession(builder.getModelProto(), popart.DataFlow(2, {}), loss, opt,
                                     popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    session.weightsFromHost()
    xs = rng.standard_normal((3, 2, 2, 3)).astype(np.float32)
    ww, bb, gw, gb = w0.astype(np.float64), b0.astype(np.float64), [], []
    for step in range(3):
        session.run(popart.PyStepIO({x: xs[step]}, {}))
        for batch in xs[step]:
            sign = np.sign(batch * ww + bb)
            gw.append(8.0 * sign * batch / sign.size)
            gb.append(8.0 * sign.sum(axis=0) / sign.size)
            h = [{"lr": 0.01, "wd": 0.0, "alpha": 0.9, "m": 0.5, "eps": 1e-6, "ls": 8.0}]
            ww = ref_adaptive("CenteredRMSProp", False, True, True, w0, gw, h * len(gw))
            bb = ref_adaptive("CenteredRMSProp", False, True, True, b0, gb, h * len(gb))
    out = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    session.weightsToHost()
    session.readWeights(popart.PyWeightsIO(out))
    np.testing.assert_allclose(out["w"], ww, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["b"], bb, rtol=1e-5, atol=1e-6)
    # the optimizer state under PopART's names: CenteredRMSProp keeps all three accumulators
    ids = session.getAllTensorIds()
    assert {popart.reservedAccl1Prefix() + "w", popart.reservedAccl2Prefix() + "w",
            popart.reservedAccl3Prefix() + "w"} <= ids
    state = {popart.reservedAccl1Prefix() + "w": np.zeros((2, 3), np.float32)}
    session.readWeights(popart.PyWeightsIO(state))
    assert np.all(state[popart.reservedAccl1Prefix() + "w"] > 0)  # running mean of squares


def test_adaptive_defaults_accessors_and_refusals():
    opt = popart.Adaptive({})
    assert opt.kit.mode == "rmsprop" and opt.kit.weight_decay_mode == "decay"
    assert (opt.learningRates().getDefault().val(), opt.alphas().getDefault().val(),
            opt.epss().getDefault().isConst()) == (pytest.approx(0.01), pytest.approx(0.99),
                                                   True)
    with pytest.raises(popart.popart_exception, match="^The rmspropTFVariant parameter is only "
                                                      "valid with the RMSProp and Centered"):
        popart.Adaptive({}, mode=popart.AdaptiveMode.AdaGrad, rmsprop_tf_variant=True)
    with pytest.raises(popart.popart_exception, match=r"^Invalid Adaptive key, defaultBeta1, "
                                                      r"the allowed keys are \( default"):
        popart.Adaptive({"defaultBeta1": (0.9, True)})
    with pytest.raises(popart.popart_exception, match=r"^Negative alpha \(-0.5\) in Adaptive"):
        popart.Adaptive({"defaultAlpha": (-0.5, True)})
    with pytest.raises(popart.popart_exception, match=r"^Non-positive eps \(0\) in Adaptive"):
        popart.Adaptive({"defaultEps": (0.0, True)})


# -- insertSpecific -------------------------------------------------------------------------------

def test_sgd_insert_specific_gives_one_weight_its_values():
    """SGD0 (sgd.hpp): w <- w * (1 - lr * wd) - lr / ls * g, with c's own lr and wd."""
    def sgd(lr_c: float) -> popart.SGD:
        opt = popart.SGD({"defaultLearningRate": (0.1, False), "defaultWeightDecay": (0.01, True),
                          "lossScaling": (2.0, False)})
        opt.insertSpecific("c", {"learningRate": (lr_c, False), "weightDecay": (0.5, True)})
        return opt
    grads = grads_seq(2)
    got = run_kit([sgd(0.3), sgd(0.05)], grads)
    a, c = W["a"].astype(np.float64), W["c"].astype(np.float64)
    for g, lr_c in zip(grads, (0.3, 0.05), strict=True):
        a = a * (1 - f32(0.1) * f32(0.01)) - f32(0.1) / 2.0 * g["a"]
        c = c * (1 - f32(lr_c) * 0.5) - f32(lr_c) / 2.0 * g["c"]
    np.testing.assert_allclose(got["a"], a, rtol=1e-6)
    np.testing.assert_allclose(got["c"], c, rtol=1e-6)


def test_adam_and_adaptive_insert_specific_give_one_weight_its_values():
    grads = grads_seq(2)
    adam = popart.Adam({"defaultLearningRate": (0.01, False), "lossScaling": (1.0, True)},
                       mode=popart.AdamMode.AdamNoBias)
    adam.insertSpecific("c", {"beta1": (0.5, True), "learningRate": (0.1, False)})
    got = run_kit([adam, adam], grads)
    for k, (lr, b1) in {"a": (0.01, 0.9), "c": (0.1, 0.5)}.items():
        w, m, v = W[k].astype(np.float64), 0.0, 0.0
        for g in grads:                                  # adam.hpp, no bias correction
            m = f32(b1) * m + (1 - f32(b1)) * g[k]
            v = f32(0.999) * v + (1 - f32(0.999)) * g[k] ** 2
            w = w - f32(lr) * m / (np.sqrt(v) + f32(1e-6))
        np.testing.assert_allclose(got[k], w, rtol=1e-5)
    ada = popart.Adaptive({"defaultLearningRate": (0.01, False)})
    ada.insertSpecific("a", {"momentum": (0.5, False)})    # a gets a momentum tensor
    assert ada.kit.init({k: jnp.asarray(v) for k, v in W.items()})["accl3"].keys() == {"a"}
    got = run_kit([ada], grads[:1])
    h = [{"lr": 0.01, "wd": 0.0, "alpha": 0.99, "m": 0.5, "eps": 1e-6, "ls": 1.0}]
    np.testing.assert_allclose(got["a"], ref_adaptive("RMSProp", False, True, True, W["a"],
                                                      [grads[0]["a"]], h), rtol=1e-5)


def test_insert_specific_refusals_in_popart_words():
    sgd = popart.SGD({"defaultLearningRate": (0.1, False)})
    with pytest.raises(popart.popart_exception, match=r"^Invalid key beta1 in "
                                                      r"SGD::insertSpecific. Permitted keys are "
                                                      r"\( learningRate weightDecay momentum"):
        sgd.insertSpecific("a", {"beta1": (0.9, True)})
    sgd.insertSpecific("a", {"momentum": (0.9, True)})
    with pytest.raises(popart.popart_exception, match="^Attempt to insert specific value for "
                                                      "optimization Tensor afailed"):
        sgd.insertSpecific("a", {"momentum": (0.5, True)})
    with pytest.raises(popart.popart_exception, match=r"^Negative momentum \(-1\) in SGD"):
        sgd.insertSpecific("c", {"momentum": (-1.0, True)})
    with pytest.raises(popart.popart_exception, match="^Constant, zero learning rate in Adam"):
        popart.Adam({}).insertSpecific("a", {"learningRate": (0.0, True)})
    assert sgd.kit.specific["a"]["momentum"] == pytest.approx(0.9)
    assert sgd.momentums().getDefault().val() == 0.0


def test_changeable_zero_learning_rate_and_momentum_keep_the_program():
    """PopART accepts a changeable lr of 0, and a changeable momentum of 0 keeps the velocity
    (SGD::hasMomentum), so it can become 0.9 later without a new program."""
    a = popart.SGD({"defaultLearningRate": (0.0, False), "defaultMomentum": (0.0, False)})
    b = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, False)})
    assert a.kit.has_velocity and a.kit.program_key == b.kit.program_key
    grads = grads_seq(2)
    got = run_kit([a, b], grads)
    w = W["c"].astype(np.float64)
    v = 0.0                          # Combined, wd 0: v0 = 0; v += g; w -= lr v; v *= mm
    for g, lr, mm in zip(grads, (0.0, 0.1), (0.0, 0.9), strict=True):
        v = v + g["c"]
        w = w - f32(lr) * v
        v = f32(mm) * v
    np.testing.assert_allclose(got["c"], w, rtol=1e-6)
    with pytest.raises(popart.popart_exception, match="^Constant, zero learning rate in SGD"):
        popart.SGD({"defaultLearningRate": (0.0, True)})


# -- gradient clipping ----------------------------------------------------------------------------

def clip(gs: dict[str, np.ndarray], names: list[str], max_norm: float) -> dict[str, np.ndarray]:
    """clipweightgradientsbynorm.cpp: g * max_norm / max(max_norm, sqrt(sum of squares))."""
    norm = np.sqrt(sum(np.sum(gs[n].astype(np.float64) ** 2) for n in names))
    return {n: (g * max_norm / max(max_norm, norm) if n in names else g) for n, g in gs.items()}


def test_sgd_clips_the_gradient_its_update_receives():
    grads = grads_seq(2, scale=3.0)
    opt = popart.SGD({"defaultLearningRate": (0.1, False), "lossScaling": (2.0, True)},
                     clip_norm_settings=[popart.ClipNormSettings.clipWeights(["a"], 0.5),
                                         popart.ClipNormSettings.clipWeights(["c"], 10.0)])
    got = run_kit([opt, opt], grads)
    w = {k: v.astype(np.float64) for k, v in W.items()}
    for g in grads:   # SGD0 clips the loss-scaled gradient (SGD0VarUpdateOp's input)
        g = clip(clip(g, ["a"], 0.5), ["c"], 10.0)
        w = {k: w[k] - f32(0.1) / 2.0 * g[k] for k in w}
    np.testing.assert_allclose(got["a"], w["a"], rtol=1e-6)
    np.testing.assert_allclose(got["c"], w["c"], rtol=1e-6)     # under 10: unclipped


def test_adam_clips_the_unscaled_gradient_of_all_weights():
    grads = grads_seq(1, scale=8.0)
    opt = popart.Adam({"defaultLearningRate": (0.1, False), "lossScaling": (4.0, True)},
                      mode=popart.AdamMode.AdamNoBias,
                      clip_norm_settings=[popart.ClipNormSettings.clipAllWeights(0.2)])
    got = run_kit([opt], grads)
    s = clip({k: g / 4.0 for k, g in grads[0].items()}, ["a", "c"], 0.2)
    for k in W:
        m, v = (1 - f32(0.9)) * s[k], (1 - f32(0.999)) * s[k] ** 2
        np.testing.assert_allclose(got[k], W[k] - f32(0.1) * m / (np.sqrt(v) + f32(1e-6)),
                                   rtol=1e-5)


def test_clipping_trains_through_a_training_session_and_refusals():
    builder = popart.Builder()
    x = builder.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    w = builder.addInitializedInputTensor(np.ones(3, np.float32), "w")
    b = builder.addInitializedInputTensor(np.zeros(3, np.float32), "b")
    loss = builder.aiGraphcore.l1loss([builder.aiOnnx.add([builder.aiOnnx.mul([x, w]), b])], 1.0,
                                      reduction=popart.ReductionType.Sum)

    def session(settings):
        opt = popart.SGD({"defaultLearningRate": (0.5, False)}, clip_norm_settings=settings)
        s = popart.TrainingSession(builder.getModelProto(), popart.DataFlow(1, {}), loss, opt,
                                   popart.DeviceManager().createCpuDevice())
        s.prepareDevice()
        s.weightsFromHost()
        return s

    s = session([popart.ClipNormSettings.clipWeights(["w", "b"], 1.0)])
    xs = np.array([3.0, -4.0, 12.0], np.float32)
    s.run(popart.PyStepIO({x: xs}, {}))
    out = {"w": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)}
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO(out))
    g = clip({"w": np.sign(xs) * xs, "b": np.sign(xs)}, ["w", "b"], 1.0)
    np.testing.assert_allclose(out["w"], 1 - 0.5 * g["w"], rtol=1e-6)
    np.testing.assert_allclose(out["b"], -0.5 * g["b"], rtol=1e-6)
    with pytest.raises(popart.popart_exception, match="^Could not find a varupdate op for tensor "
                                                      "nope$"):
        session([popart.ClipNormSettings.clipWeights(["nope"], 1.0)])
    with pytest.raises(popart.popart_exception, match="^Multiple clip groups specified, but one "
                                                      "has the mode 'ClipAllWeights'"):
        session([popart.ClipNormSettings.clipAllWeights(1.0),
                 popart.ClipNormSettings.clipWeights(["w"], 1.0)])


# -- Adam's scaled optimizer state, and replacing an optimizer ------------------------------------

def test_adam_scaled_optimizer_state_keeps_the_moments_scaled():
    """adamdecompose.cpp / compoundscalarhelper.cpp: with a constant loss scaling the weights
    are those of the unscaled state (L2 term and eps scaled by ls), the moments ls times larger;
    a new loss scaling rescales the moments by ls / previous ls."""
    grads = grads_seq(2, scale=16.0)
    values = {"defaultLearningRate": (0.01, False), "defaultWeightDecay": (0.1, False),
              "lossScaling": (16.0, False)}
    kwargs = {"weight_decay_mode": popart.WeightDecayMode.L2Regularization}
    plain = run_kit([popart.Adam(values, **kwargs)] * 2, grads)
    scaled = popart.Adam(values, scaled_optimizer_state=True, **kwargs)
    got = run_kit([scaled] * 2, grads)
    for k in W:
        np.testing.assert_allclose(got[k], plain[k], rtol=1e-5)
    w = {k: jnp.asarray(v) for k, v in W.items()}
    kit = scaled.kit
    state = kit.init(w)
    hyper = {k: jnp.float32(v) for k, v in kit.hyperparameters().items()}
    _, state = kit.apply(hyper, w, {k: jnp.asarray(v) for k, v in grads[0].items()}, state)
    s = grads[0]["c"] + f32(0.1) * 16.0 * W["c"]       # ls * (g / ls + wd * w)
    np.testing.assert_allclose(state["m"]["c"], (1 - f32(0.9)) * s, rtol=1e-5)
    hyper["loss_scaling"] = jnp.float32(32.0)
    zero = {k: jnp.zeros_like(v) for k, v in w.items()}
    _, state2 = kit.apply(hyper, w, zero, state)
    s = f32(0.1) * 32.0 * W["c"]
    np.testing.assert_allclose(state2["m"]["c"], f32(0.9) * 2.0 * np.asarray(state["m"]["c"])
                               + (1 - f32(0.9)) * s, rtol=1e-5)


def test_update_optimizer_from_host_keeps_popart_s_replacement_rules():
    builder = popart.Builder()
    x = builder.addInputTensor(popart.TensorInfo("FLOAT", [2]), "x")
    w = builder.addInitializedInputTensor(np.ones(2, np.float32), "w")
    loss = builder.aiGraphcore.l1loss([builder.aiOnnx.mul([x, w])], 1.0)

    def adaptive(lr, specific=True, const=True):
        opt = popart.Adaptive({"defaultLearningRate": (lr, False)})
        if specific:
            opt.insertSpecific("w", {"alpha": (0.5, const)})
        return opt

    s = popart.TrainingSession(builder.getModelProto(), popart.DataFlow(1, {}), loss,
                               adaptive(0.1), popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    s.updateOptimizerFromHost(adaptive(0.05))
    s.run(popart.PyStepIO({x: np.array([1.0, -2.0], np.float32)}, {}))
    out = {"w": np.zeros(2, np.float32)}
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO(out))
    g = np.array([1.0, 2.0]) / 2                       # d mean|x w| / dw at w = 1
    h = [{"lr": 0.05, "wd": 0.0, "alpha": 0.5, "m": 0.0, "eps": 1e-6, "ls": 1.0}]
    np.testing.assert_allclose(out["w"], ref_adaptive("RMSProp", False, False, True,
                                                      np.ones(2), [g], h), rtol=1e-5)
    with pytest.raises(popart.popart_exception, match="Could not find tensor w in replacement"):
        s.updateOptimizerFromHost(adaptive(0.05, specific=False))
    with pytest.raises(popart.popart_exception, match="Can not replace a constant value with a "
                                                      "non constant value"):
        s.updateOptimizerFromHost(adaptive(0.05, const=False))
    with pytest.raises(popart.popart_exception):
        s.updateOptimizerFromHost(popart.SGD({"defaultLearningRate": (0.1, False)}))
