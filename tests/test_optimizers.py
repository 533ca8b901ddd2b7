"""popart_kit._runtime.optimizers against plain-numpy references of PopART's update equations.

The references below are written from the equations in PopART's headers (graphcore/popart
d2f20d78: willow/include/popart/sgd.hpp, adam.hpp, and the test model in
tests/integration/optimizer_tests/get_results.hpp), in float64 numpy, independently of the jnp
code. Hyperparameters change between steps through ``hyper`` inside one jitted ``lax.scan``.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from popart_kit._runtime.optimizers import ADAM_VALUE_KEYS, SGD, SGD_VALUE_KEYS, Adam

API = json.loads((Path(__file__).parent / "contract" / "popart_api.json").read_text())
SHAPES = {"w0": (3, 4), "w1": (5,), "s": ()}
STEPS = 4
HYP = settings(max_examples=30, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def f32(x: float) -> float:
    """The value a float32 ``hyper`` entry holds, so references see the same numbers."""
    return float(np.float32(x))


def arrays(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in SHAPES.items()}


# -- numpy references ---------------------------------------------------------------------------

def ref_sgd(kind: str, nesterov: bool, w0: np.ndarray, grads: list[np.ndarray],
            hypers: list[dict[str, float]], first: dict[str, float]) -> list[np.ndarray]:
    """PopART SGD, sgd.hpp. kind: no_momentum (SGD0), separate (SGD2), combined (SGD1).

    g arrives scaled by ls. ``first``: the constructor's values (Combined's initial velocity)."""
    w = w0.astype(np.float64)
    v = np.zeros_like(w)
    if kind == "combined":  # "Initial v: v = v_0 * mm + (1 - dm) * wd * vs * w_0", v_0 = 0
        v = (1 - first["dampening"]) * first["weight_decay"] * first["velocity_scaling"] * w
    out = []
    for g, h in zip(grads, hypers, strict=True):
        g = g.astype(np.float64)
        lr, dm, wd, ls = (f32(h[k]) for k in ("learning_rate", "dampening", "weight_decay",
                                               "loss_scaling"))
        if kind == "no_momentum":
            # "w <- w * (1 - lr * (1 - dm) * wd) - g * (lr * (1 - dm) / ls)"
            w = w * (1 - lr * (1 - dm) * wd) - g * (lr * (1 - dm) / ls)
        else:
            mm, vs = f32(h["momentum"]), f32(h["velocity_scaling"])
            if kind == "separate":
                v = v * mm + (1 - dm) * vs / ls * g + (1 - dm) * wd * vs * w
            else:
                v = v + (1 - dm) * vs / ls * g
            if nesterov:
                g_t = vs * (1 / ls * g + wd * w) + mm * v
                w = w - lr / vs * g_t
            else:
                w = w - lr / vs * v
            if kind == "combined":
                v = v * mm + (1 - dm) * wd * vs * w
        out.append(w.copy())
    return out


def ref_pytorch_like(w0: np.ndarray, grads: list[np.ndarray], lr: float, mm: float, dm: float,
                     wd: float, ls: float, nesterov: bool) -> list[np.ndarray]:
    """get_results.hpp pytorchUpdate: g = g/ls + wd*w; v = v*mm + (1-dm)*g; w -= lr*v (v0 = 0);
    Nesterov: w -= lr*(g + mm*v)."""
    w, v, out = w0.astype(np.float64), np.zeros(w0.shape), []
    for g in grads:
        g = g.astype(np.float64) / ls + wd * w
        v = v * mm + (1 - dm) * g
        w = w - lr * (g + mm * v if nesterov else v)
        out.append(w.copy())
    return out


def ref_adam(mode: str, decay_mode: str, w0: np.ndarray, grads: list[np.ndarray],
             hypers: list[dict[str, float]]) -> list[np.ndarray]:
    """PopART Adam, adam.hpp (AdaMax: v is not bias corrected, as adamupdaterx.cpp does)."""
    w = w0.astype(np.float64)
    m, v, out = np.zeros_like(w), np.zeros_like(w), []
    for t, (g, h) in enumerate(zip(grads, hypers, strict=True), start=1):
        lr, b1, b2, eps, wd, ls = (f32(h[k]) for k in ("learning_rate", "beta1", "beta2", "eps",
                                                        "weight_decay", "loss_scaling"))
        s = g.astype(np.float64) / ls
        if decay_mode == "l2_regularization":
            s = s + wd * w
        m = b1 * m + (1 - b1) * s
        v = np.maximum(b2 * v, np.abs(s)) if mode == "adamax" else b2 * v + (1 - b2) * s ** 2
        m_t = m / (1 - b1 ** t) if mode in ("adam", "lamb", "adamax") else m
        v_t = v / (1 - b2 ** t) if mode in ("adam", "lamb") else v
        u = m_t / (v_t + eps) if mode == "adamax" else m_t / (np.sqrt(v_t) + eps)
        if decay_mode == "decay":
            u = u + wd * w
        ratio = 1.0
        if mode in ("lamb", "lamb_no_bias"):
            r1, r2, mwn = np.linalg.norm(w), np.linalg.norm(u), f32(h["max_weight_norm"])
            ratio = 1.0 if 0 in (r1, r2, mwn) else min(r1, mwn) / r2
        w = w - ratio * lr * u
        out.append(w.copy())
    return out


# -- running the optimizer: one jitted scan per program, hyper per step as data -----------------

_PROGRAMS: dict[Any, Any] = {}


def run_scan(opt: Any, hypers: list[dict[str, float]], w0: dict[str, np.ndarray],
             grads: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], Any]:
    """Weights after each step, from one compiled program per program_key: the first optimizer
    of that key traced it, later ones only supply other numbers."""
    if opt.program_key not in _PROGRAMS:
        def program(hyper_seq: Any, weights: Any, grads_seq: Any, state: Any) -> Any:
            def step(carry: Any, xs: Any) -> Any:
                w, s = opt.apply(xs[0], carry[0], xs[1], carry[1])
                return (w, s), w
            return jax.lax.scan(step, (weights, state), (hyper_seq, grads_seq))
        _PROGRAMS[opt.program_key] = jax.jit(program)
    hyper_seq = {k: jnp.asarray([h[k] for h in hypers], jnp.float32) for k in hypers[0]}
    grads_seq = {k: jnp.stack([g[k] for g in grads]) for k in w0}
    (_, state), ws = _PROGRAMS[opt.program_key](hyper_seq, w0, grads_seq, opt.init(w0))
    return {k: np.asarray(v) for k, v in ws.items()}, state


def check_close(ws: dict[str, np.ndarray], refs: dict[str, list[np.ndarray]],
                w0: dict[str, np.ndarray], rtol: float, atol: float) -> None:
    """Compare the change of every weight since step 0 (float32 vs float64)."""
    for k in w0:
        for t in range(len(refs[k])):
            np.testing.assert_allclose(ws[k][t] - w0[k], refs[k][t] - w0[k], rtol=rtol,
                                       atol=atol, err_msg=f"weight {k}, step {t + 1}")


# -- SGD ----------------------------------------------------------------------------------------

@st.composite
def sgd_cases(draw: st.DrawFn) -> tuple[SGD, list[dict[str, float]]]:
    momentum = draw(st.sampled_from([0.0, 0.0, 0.5, 0.9, 0.99]))
    nesterov = momentum > 0 and draw(st.booleans())
    strategy = draw(st.sampled_from(["combined", "separate"]))

    def values() -> dict[str, float]:
        v = {"learning_rate": draw(st.floats(0.01, 0.5)),
             "weight_decay": draw(st.sampled_from([0.0, 1e-3, 0.05, 0.3])),
             "dampening": 0.0 if nesterov else draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
             "velocity_scaling": draw(st.sampled_from([1.0, 0.25, 8.0, 1000.0])),
             "loss_scaling": draw(st.sampled_from([1.0, 0.5, 128.0, 1024.0]))}
        if momentum:
            v["momentum"] = draw(st.sampled_from([momentum, 0.3, 0.8]))
        return v

    opt = SGD(momentum=momentum, nesterov=nesterov, accumulator_and_momentum=strategy,
              **{k: v for k, v in values().items() if k != "momentum"})
    hypers = [opt.hyperparameters()]
    for _ in range(STEPS - 1):  # a new optimizer of the same program for some steps
        hypers.append(opt.replace(**values()).hyperparameters() if draw(st.booleans())
                      else hypers[-1])
    return opt, hypers


@HYP
@given(case=sgd_cases(), seed=st.integers(0, 2**32 - 1))
def test_sgd_matches_popart_equations(case: tuple[SGD, list[dict[str, float]]],
                                      seed: int) -> None:
    opt, hypers = case
    rng = np.random.default_rng(seed)
    w0 = arrays(rng)
    # gradients arrive scaled by the loss scaling of their step
    grads = [{k: (g * h["loss_scaling"]).astype(np.float32) for k, g in arrays(rng).items()}
             for h in hypers]
    kind = "no_momentum" if opt.momentum == 0 else opt.accumulator_and_momentum
    ws, _ = run_scan(opt, hypers, w0, grads)
    refs = {k: ref_sgd(kind, opt.nesterov, w0[k], [g[k] for g in grads], hypers,
                       opt.hyperparameters() | {"velocity_scaling": opt.velocity_scaling})
            for k in w0}
    check_close(ws, refs, w0, rtol=2e-4, atol=2e-5)


@HYP
@given(momentum=st.sampled_from([0.0, 0.5, 0.9]), nesterov=st.booleans(),
       strategy=st.sampled_from(["combined", "separate"]),
       lr=st.floats(0.01, 0.5), wd=st.sampled_from([0.0, 0.01, 0.2]),
       dm=st.sampled_from([0.0, 0.25]), vs=st.sampled_from([1.0, 0.125, 64.0]),
       ls=st.sampled_from([1.0, 16.0, 1000.0]), seed=st.integers(0, 2**32 - 1))
def test_sgd_constant_hyperparameters_are_pytorch_like(momentum: float, nesterov: bool,
                                                       strategy: str, lr: float, wd: float,
                                                       dm: float, vs: float, ls: float,
                                                       seed: int) -> None:
    """With fixed numbers, Combined and Separate give the same weights, velocity scaling
    changes nothing and loss scaling is undone: PopART's own PyTorch comparison model."""
    nesterov = nesterov and momentum > 0
    dm = 0.0 if nesterov else dm
    opt = SGD(lr, momentum=momentum, dampening=dm, weight_decay=wd, nesterov=nesterov,
              velocity_scaling=vs, loss_scaling=ls, accumulator_and_momentum=strategy)
    rng = np.random.default_rng(seed)
    w0 = arrays(rng)
    raw = [arrays(rng) for _ in range(STEPS)]
    grads = [{k: (g * ls).astype(np.float32) for k, g in r.items()} for r in raw]
    ws, _ = run_scan(opt, [opt.hyperparameters()] * STEPS, w0, grads)
    refs = {k: ref_pytorch_like(w0[k], [r[k] for r in raw], f32(lr), f32(momentum), f32(dm),
                                f32(wd), 1.0, nesterov) for k in w0}
    check_close(ws, refs, w0, rtol=2e-4, atol=2e-5)


def test_sgd_hand_computed_steps() -> None:
    w, g = {"w": jnp.asarray([1.0, -2.0])}, {"w": jnp.asarray([0.5, 0.25])}
    # plain SGD: the gradient is used as given (no further reduction)
    opt = SGD(0.1)
    new, state = opt.apply(opt.hyperparameters(), w, g, opt.init(w))
    np.testing.assert_allclose(new["w"], [0.95, -2.025], rtol=1e-6)
    assert state == {}
    # dampening applies even without momentum (SGD0's slr0 = lr (1 - dm) / ls)
    opt = SGD(0.1, dampening=0.5, weight_decay=0.1, loss_scaling=2.0)
    new, _ = opt.apply(opt.hyperparameters(), w, g, opt.init(w))
    # w (1 - 0.1 * 0.5 * 0.1) - g * 0.1 * 0.5 / 2
    np.testing.assert_allclose(new["w"], [0.995 - 0.0125, -1.99 - 0.00625], rtol=1e-6)
    # Combined: the velocity starts at (1 - dm) wd vs w0 and holds next step's terms
    opt = SGD(0.1, momentum=0.9, weight_decay=0.01, velocity_scaling=2.0)
    state = opt.init(w)
    np.testing.assert_allclose(state["velocity"]["w"], [0.02, -0.04], rtol=1e-6)
    new, state = opt.apply(opt.hyperparameters(), w, g, state)
    v_full = np.array([0.02 + 2 * 0.5, -0.04 + 2 * 0.25])
    w1 = np.array([1.0, -2.0]) - 0.1 / 2 * v_full
    np.testing.assert_allclose(new["w"], w1, rtol=1e-6)
    np.testing.assert_allclose(state["velocity"]["w"], 0.9 * v_full + 0.01 * 2 * w1, rtol=1e-6)


def test_combined_lags_a_momentum_change_and_separate_does_not() -> None:
    w, g = {"w": jnp.asarray([1.0])}, {"w": jnp.asarray([1.0])}
    results = {}
    for strategy in ("combined", "separate"):
        opt = SGD(1.0, momentum=0.5, accumulator_and_momentum=strategy)
        h2 = opt.replace(momentum=0.25).hyperparameters()
        w1, s1 = opt.apply(opt.hyperparameters(), w, g, opt.init(w))
        w2, _ = opt.apply(h2, w1, g, s1)
        results[strategy] = float(w2["w"][0])
    # v1 = 1, w1 = 0; Separate: v2 = 0.25 * 1 + 1; Combined decayed v1 by the old 0.5
    assert results["separate"] == pytest.approx(-1.25)
    assert results["combined"] == pytest.approx(-1.5)


# -- Adam ---------------------------------------------------------------------------------------

@st.composite
def adam_cases(draw: st.DrawFn) -> tuple[Adam, list[dict[str, float]]]:
    mode = draw(st.sampled_from(["adam", "adam_no_bias", "adamax", "lamb", "lamb_no_bias"]))
    decay_mode = draw(st.sampled_from(["decay", "l2_regularization"]))

    def values() -> dict[str, float]:
        return {"learning_rate": draw(st.floats(0.01, 0.3)),
                "beta1": draw(st.sampled_from([0.0, 0.5, 0.9, 0.95])),
                "beta2": draw(st.sampled_from([0.0, 0.9, 0.99, 0.999])),
                "eps": draw(st.sampled_from([1e-6, 1e-3, 0.1, 1.0])),
                "weight_decay": draw(st.sampled_from([0.0, 0.01, 0.3])),
                "loss_scaling": draw(st.sampled_from([1.0, 4.0, 512.0])),
                "max_weight_norm": draw(st.sampled_from([10.0, 0.5, 0.0]))}

    opt = Adam(mode=mode, weight_decay_mode=decay_mode, **values())
    hypers = [opt.hyperparameters()]
    for _ in range(STEPS - 1):
        hypers.append(opt.replace(**values()).hyperparameters() if draw(st.booleans())
                      else hypers[-1])
    return opt, hypers


@HYP
@given(case=adam_cases(), seed=st.integers(0, 2**32 - 1))
def test_adam_matches_popart_equations(case: tuple[Adam, list[dict[str, float]]],
                                       seed: int) -> None:
    opt, hypers = case
    rng = np.random.default_rng(seed)
    w0 = arrays(rng)
    grads = [{k: (g * h["loss_scaling"]).astype(np.float32) for k, g in arrays(rng).items()}
             for h in hypers]
    ws, state = run_scan(opt, hypers, w0, grads)
    assert float(state["step"]) == STEPS
    refs = {k: ref_adam(opt.mode, opt.weight_decay_mode, w0[k], [g[k] for g in grads], hypers)
            for k in w0}
    check_close(ws, refs, w0, rtol=1e-3, atol=2e-5)


def test_adam_first_step_is_sign_like_and_no_bias_is_not() -> None:
    w, g = {"w": jnp.asarray([1.0, 1.0, 1.0])}, {"w": jnp.asarray([4.0, -0.5, 0.0])}
    opt = Adam(0.1, eps=1e-6, loss_scaling=2.0)
    new, state = opt.apply(opt.hyperparameters(), w, g, opt.init(w))
    s = np.array([2.0, -0.25, 0.0])  # g / ls
    np.testing.assert_allclose(new["w"], 1.0 - 0.1 * s / (np.abs(s) + 1e-6), rtol=1e-6)
    assert float(state["step"]) == 1.0
    nb = Adam(0.1, eps=1e-6, loss_scaling=2.0, mode="adam_no_bias")
    new, _ = nb.apply(nb.hyperparameters(), w, g, nb.init(w))
    m, v = 0.1 * s, 0.001 * s ** 2
    np.testing.assert_allclose(new["w"], 1.0 - 0.1 * m / (np.sqrt(v) + 1e-6), rtol=1e-5)


def test_adam_weight_decay_modes_differ_as_popart_defines() -> None:
    w, g = {"w": jnp.asarray([2.0])}, {"w": jnp.asarray([1.0])}
    decay = Adam(0.1, weight_decay=0.5, eps=1e-6)
    new, _ = decay.apply(decay.hyperparameters(), w, g, decay.init(w))
    assert float(new["w"][0]) == pytest.approx(2.0 - 0.1 * (1.0 + 0.5 * 2.0), rel=1e-5)
    l2 = decay.replace(weight_decay_mode="l2_regularization")
    new, _ = l2.apply(l2.hyperparameters(), w, g, l2.init(w))
    assert float(new["w"][0]) == pytest.approx(2.0 - 0.1, rel=1e-5)  # s = 2: sign step


# -- runtime values: no re-tracing, scan, dtypes --------------------------------------------------

@pytest.mark.parametrize("opt", [
    SGD(0.1), SGD(0.1, momentum=0.9, nesterov=True), SGD(0.1, momentum=0.9, dampening=0.1,
                                                         accumulator_and_momentum="separate"),
    Adam(1e-3), Adam(1e-3, mode="lamb", weight_decay=0.01)], ids=repr)
def test_changing_hyperparameters_does_not_retrace(opt: Any) -> None:
    traces = 0

    def step(hyper: Any, weights: Any, grads: Any, state: Any) -> Any:
        nonlocal traces
        traces += 1
        return opt.apply(hyper, weights, grads, state)

    jstep = jax.jit(step)
    rng = np.random.default_rng(0)
    w, g = arrays(rng), arrays(rng)
    state = opt.init(w)
    changes = [{"learning_rate": 0.05}, {"weight_decay": 0.2, "loss_scaling": 8.0}]
    if isinstance(opt, SGD) and opt.momentum:
        changes.append({"momentum": 0.5, "velocity_scaling": 4.0})
    if isinstance(opt, Adam):
        changes.append({"beta1": 0.5, "beta2": 0.9, "eps": 0.1, "max_weight_norm": 3.0})
    seen = []
    for change in [{}, *changes]:
        new = opt.replace(**change)
        assert new.program_key == opt.program_key
        hyper = {k: jnp.float32(v) for k, v in new.hyperparameters().items()}
        w2, state = jstep(hyper, w, g, state)
        seen.append(np.asarray(w2["w0"]))
    assert traces == 1
    assert not np.allclose(seen[0], seen[1])


@pytest.mark.parametrize("opt", [SGD(0.1, momentum=0.9, weight_decay=0.1), SGD(0.1),
                                 Adam(0.01, weight_decay=0.1), Adam(0.01, mode="lamb")], ids=repr)
def test_float16_weights_keep_their_dtype_through_scan(opt: Any) -> None:
    w = {"a": jnp.ones((4,), jnp.float16), "b": jnp.full((2, 2), -1.0, jnp.bfloat16)}
    grads = {k: jnp.full((3, *v.shape), 0.5, v.dtype) for k, v in w.items()}
    hyper = {k: jnp.full((3,), v, jnp.float32) for k, v in opt.hyperparameters().items()}

    def step(carry: Any, xs: Any) -> Any:
        return opt.apply(xs[0], carry[0], xs[1], carry[1]), None

    (new, state), _ = jax.lax.scan(step, (w, opt.init(w)), (hyper, grads))
    assert {k: v.dtype for k, v in new.items()} == {k: v.dtype for k, v in w.items()}
    assert jax.tree.structure(state) == jax.tree.structure(opt.init(w))
    assert all(float(jnp.max(jnp.abs(new[k].astype(jnp.float32) - w[k].astype(jnp.float32))))
               > 0 for k in w)


def test_apply_refuses_hyper_of_another_program() -> None:
    w = {"w": jnp.zeros(2)}
    opt = SGD(0.1, momentum=0.9)
    hyper = opt.hyperparameters()
    with pytest.raises(ValueError, match="missing \\['momentum'\\].*Fix:"):
        opt.apply({k: v for k, v in hyper.items() if k != "momentum"}, w, w, opt.init(w))
    with pytest.raises(ValueError, match="unexpected \\['beta1'\\]"):
        opt.apply({**hyper, "beta1": 0.9}, w, w, opt.init(w))
    with pytest.raises(ValueError, match="one gradient per weight"):
        opt.apply(hyper, w, {"v": jnp.zeros(2)}, opt.init(w))


def test_program_key_and_hyperparameters() -> None:
    assert SGD(0.1).hyperparameters() == {"learning_rate": 0.1, "dampening": 0.0,
                                          "weight_decay": 0.0, "loss_scaling": 1.0}
    assert SGD(0.1, momentum=0.9).hyperparameters() == {
        "learning_rate": 0.1, "dampening": 0.0, "weight_decay": 0.0, "loss_scaling": 1.0,
        "momentum": 0.9, "velocity_scaling": 1.0}
    assert SGD(0.1).program_key != SGD(0.1, momentum=0.9).program_key
    assert SGD(0.1, momentum=0.9).program_key != SGD(0.1, momentum=0.9,
                                                     nesterov=True).program_key
    assert SGD(0.1, momentum=0.9).program_key == SGD(0.3, momentum=0.5, weight_decay=1.0,
                                                     dampening=0.5).program_key
    assert "max_weight_norm" not in Adam(0.1).hyperparameters()
    assert Adam(0.1, mode="lamb").hyperparameters()["max_weight_norm"] == 10.0
    assert Adam(0.1).program_key != Adam(0.1, mode="adam_no_bias").program_key
    assert Adam(0.1).program_key != Adam(0.1, weight_decay_mode="l2_regularization").program_key


# -- the settings ---------------------------------------------------------------------------------

def test_defaults_are_popart_defaults() -> None:
    sgd_defaults = {k: v for k, v in API["classes"]["SGD"]["value_defaults"].items()}
    s = SGD(0.1)
    assert (s.momentum, s.dampening, s.weight_decay, s.velocity_scaling, s.loss_scaling,
            float(s.nesterov)) == tuple(sgd_defaults[k][0] for k in (
                "defaultMomentum", "defaultDampening", "defaultWeightDecay",
                "defaultVelocityScaling", "lossScaling", "nesterov"))
    adam_defaults = API["classes"]["Adam"]["value_defaults"]
    a = Adam(0.1)
    assert (a.beta1, a.beta2, a.eps, a.weight_decay, a.loss_scaling, a.max_weight_norm) == tuple(
        adam_defaults[k][0] for k in ("defaultBeta1", "defaultBeta2", "defaultEps",
                                      "defaultWeightDecay", "lossScaling",
                                      "defaultMaxWeightNorm"))
    assert (a.mode, a.weight_decay_mode) == ("adam", "decay")
    assert API["classes"]["Adam"]["ctor_defaults"]["mode"] == "AdamMode.Adam"
    assert s.accumulator_and_momentum == "combined"
    assert API["classes"]["SGD"]["ctor_defaults"]["accumulatorAndMomentum"].endswith("Combined")


@pytest.mark.parametrize("cls, kwargs, field, number", [
    (SGD, {"learning_rate": 0.0}, "learning_rate", "0.0"),
    (SGD, {"learning_rate": -0.5}, "learning_rate", "-0.5"),
    (SGD, {"learning_rate": float("nan")}, "learning_rate", "nan"),
    (SGD, {"learning_rate": 0.1, "momentum": 1.0}, "momentum", "1.0"),
    (SGD, {"learning_rate": 0.1, "momentum": -0.1}, "momentum", "-0.1"),
    (SGD, {"learning_rate": 0.1, "dampening": 1.5}, "dampening", "1.5"),
    (SGD, {"learning_rate": 0.1, "weight_decay": -1e-4}, "weight_decay", "-0.0001"),
    (SGD, {"learning_rate": 0.1, "velocity_scaling": 0.0}, "velocity_scaling", "0.0"),
    (SGD, {"learning_rate": 0.1, "loss_scaling": -2.0}, "loss_scaling", "-2.0"),
    (SGD, {"learning_rate": 0.1, "nesterov": True}, "nesterov", "momentum=0.0"),
    (SGD, {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0.2},
     "nesterov", "dampening=0.2"),
    (Adam, {"learning_rate": 0.0}, "learning_rate", "0.0"),
    (Adam, {"learning_rate": 0.1, "beta1": 1.0}, "beta1", "1.0"),
    (Adam, {"learning_rate": 0.1, "beta2": -0.9}, "beta2", "-0.9"),
    (Adam, {"learning_rate": 0.1, "eps": 0.0}, "eps", "0.0"),
    (Adam, {"learning_rate": 0.1, "weight_decay": -0.01}, "weight_decay", "-0.01"),
    (Adam, {"learning_rate": 0.1, "loss_scaling": 0.0}, "loss_scaling", "0.0"),
    (Adam, {"learning_rate": 0.1, "max_weight_norm": -1.0}, "max_weight_norm", "-1.0"),
])
def test_validation_errors_name_field_number_and_fix(cls: Any, kwargs: dict[str, Any],
                                                     field: str, number: str) -> None:
    with pytest.raises(ValidationError) as info:
        cls(**kwargs)
    errors = info.value.errors()
    assert [e["loc"] for e in errors] == [(field,)]
    assert number in errors[0]["msg"] and "Fix:" in errors[0]["msg"]
    assert field in str(info.value)


def test_models_are_frozen_strict_and_closed() -> None:
    opt = SGD(0.1, momentum=0.9)
    with pytest.raises(ValidationError):
        opt.learning_rate = 0.2  # type: ignore[misc]
    with pytest.raises(ValidationError, match="not a field of SGD. Fix: did you mean learning_r"):
        SGD(0.1, lr=0.2)
    with pytest.raises(ValidationError, match="learning_rate"):
        SGD("0.1")
    with pytest.raises(ValidationError, match="mode"):
        Adam(0.1, mode="Adam")
    with pytest.raises(ValidationError, match="learning_rate"):
        SGD()
    with pytest.raises(TypeError, match="once"):
        SGD(0.1, learning_rate=0.2)
    assert SGD(learning_rate=1) == SGD(1.0)


def test_with_learning_rate_returns_a_validated_copy() -> None:
    opt = SGD(0.1, momentum=0.9, weight_decay=1e-4)
    new = opt.with_learning_rate(0.05)
    assert (opt.learning_rate, new.learning_rate) == (0.1, 0.05)
    assert new.model_dump() == {**opt.model_dump(), "learning_rate": 0.05}
    assert new.program_key == opt.program_key
    with pytest.raises(ValidationError, match="learning_rate=-1.0"):
        opt.with_learning_rate(-1.0)
    assert Adam(1e-3, mode="lamb").with_learning_rate(2e-3).mode == "lamb"


# -- to_popart: a recorder built from the confirmed binding facts (the strict recorder in
#    tests/contract/strict_popart.py has no optimizers) ----------------------------------------

class _Enum:
    def __init__(self, name: str, members: list[str]) -> None:
        self._name = name
        for m in members:
            setattr(self, m, f"{name}.{m}")

    def __getattr__(self, item: str) -> Any:
        raise AttributeError(f"popart.{self._name} has no member {item!r}")


class RecordingPopart:
    """popart.SGD / popart.Adam with the binding's parameter names, value keys and enums."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        for cls in ("SGD", "Adam"):
            for name, members in API["classes"][cls]["enums"].items():
                setattr(self, name, _Enum(name, members))

    def _record(self, cls: str, values: Any, kwargs: dict[str, Any]) -> tuple[str, Any]:
        spec = API["classes"][cls]
        params = spec["ctor"][0]
        assert set(kwargs) <= set(params[1:]), f"unknown keyword for popart.{cls}: {kwargs}"
        assert type(values) is dict
        assert set(values) <= set(spec["value_keys"]), set(values) - set(spec["value_keys"])
        for key, pair in values.items():
            # getOptimizerValueDictionary: a py::tuple cast to std::pair<float, bool>
            assert type(pair) is tuple and len(pair) == 2, (key, pair)
            assert type(pair[0]) is float and type(pair[1]) is bool, (key, pair)
        self.calls.append((cls, values, kwargs))
        return cls, values

    def SGD(self, pyd: Any, **kwargs: Any) -> Any:  # noqa: N802
        return self._record("SGD", pyd, kwargs)

    def Adam(self, values: Any, **kwargs: Any) -> Any:  # noqa: N802
        return self._record("Adam", values, kwargs)


def test_value_key_tables_match_manifest() -> None:
    assert list(SGD_VALUE_KEYS) == API["classes"]["SGD"]["value_keys"]
    assert list(ADAM_VALUE_KEYS) == API["classes"]["Adam"]["value_keys"]
    assert API["classes"]["SGD"]["ctor"][0][0] == "pyd"
    assert API["classes"]["Adam"]["ctor"][0][:3] == ["values", "mode", "weight_decay_mode"]


@HYP
@given(case=sgd_cases())
def test_sgd_to_popart(case: tuple[SGD, list[dict[str, float]]]) -> None:
    opt, _ = case
    popart = RecordingPopart()
    opt.to_popart(popart)
    [(cls, values, kwargs)] = popart.calls
    assert cls == "SGD"
    expected = {"defaultLearningRate": opt.learning_rate, "defaultWeightDecay": opt.weight_decay,
                "defaultMomentum": opt.momentum, "defaultDampening": opt.dampening,
                "defaultVelocityScaling": opt.velocity_scaling, "lossScaling": opt.loss_scaling}
    if opt.nesterov:
        expected["nesterov"] = 1.0
    assert {k: v[0] for k, v in values.items()} == expected
    # changeable unless the program depends on it: momentum 0 is const (PopART's SGD0),
    # nesterov is const
    const = {k for k, v in values.items() if v[1]}
    assert const == ({"nesterov"} if opt.nesterov else set()) | (
        set() if opt.momentum else {"defaultMomentum"})
    if opt.accumulator_and_momentum == "separate":
        assert kwargs == {"accumulatorAndMomentum": "SGDAccumulatorAndMomentum.Separate"}
    else:
        assert kwargs == {}  # the binding's default is Combined


@pytest.mark.parametrize("mode, popart_mode", [
    ("adam", "Adam"), ("adam_no_bias", "AdamNoBias"), ("adamax", "AdaMax"), ("lamb", "Lamb"),
    ("lamb_no_bias", "LambNoBias")])
@pytest.mark.parametrize("decay_mode, popart_decay", [
    ("decay", "Decay"), ("l2_regularization", "L2Regularization")])
def test_adam_to_popart(mode: str, popart_mode: str, decay_mode: str, popart_decay: str) -> None:
    opt = Adam(2e-3, beta1=0.8, beta2=0.99, eps=1e-5, weight_decay=0.01, loss_scaling=64.0,
               max_weight_norm=5.0, mode=mode, weight_decay_mode=decay_mode)
    popart = RecordingPopart()
    opt.to_popart(popart)
    [(cls, values, kwargs)] = popart.calls
    assert cls == "Adam"
    assert kwargs == {"mode": f"AdamMode.{popart_mode}",
                      "weight_decay_mode": f"WeightDecayMode.{popart_decay}"}
    expected = {"defaultLearningRate": 2e-3, "defaultBeta1": 0.8, "defaultBeta2": 0.99,
                "defaultEps": 1e-5, "defaultWeightDecay": 0.01, "lossScaling": 64.0}
    if mode.startswith("lamb"):
        expected["defaultMaxWeightNorm"] = 5.0
    assert values == {k: (v, False) for k, v in expected.items()}


def test_to_popart_signature() -> None:
    for cls in (SGD, Adam):
        assert list(inspect.signature(cls.to_popart).parameters) == ["self", "popart"]


# -- per-weight values and clipping groups (PopART's insertSpecific / ClipNormSettings) ----------

def test_specific_values_are_hyperparameters_of_their_own_and_checked() -> None:
    opt = SGD(0.1, specific={"w": {"learning_rate": 0.5, "momentum": 0.9}})
    hyper = opt.hyperparameters()
    assert hyper["learning_rate"] == 0.1 and hyper["learning_rate@w"] == 0.5
    assert hyper["momentum@w"] == 0.9 and "momentum" not in hyper   # only w has a velocity
    w = {"w": jnp.ones(2), "v": jnp.ones(2)}
    assert set(opt.init(w)["velocity"]) == {"w"}
    assert opt.program_key != SGD(0.1).program_key
    assert opt.program_key == SGD(0.2, specific={"w": {"learning_rate": 0.1,
                                                       "momentum": 0.5}}).program_key
    with pytest.raises(ValidationError) as info:
        SGD(0.1, specific={"w": {"momentum": 1.5}})
    assert [e["loc"] for e in info.value.errors()] == [("specific", "w", "momentum")]
    assert "specific['w'].momentum=1.5" in str(info.value)
    with pytest.raises(ValidationError, match="not a per-weight value of Adam"):
        Adam(0.1, specific={"w": {"loss_scaling": 2.0}})


def test_clip_groups_are_static_and_refused_as_popart_refuses() -> None:
    opt = Adam(0.1, clip_norm=((("a",), 1.0),))
    assert opt.program_key != Adam(0.1).program_key
    assert opt.hyperparameters() == Adam(0.1).hyperparameters()
    with pytest.raises(ValueError, match="Could not find a varupdate op for tensor a"):
        opt.init({"b": jnp.ones(2)})
    with pytest.raises(ValueError, match="only one group should be specified"):
        SGD(0.1, clip_norm=((None, 1.0), (("a",), 2.0))).init({"a": jnp.ones(2)})
    with pytest.raises(ValidationError, match="clip_norm"):
        SGD(0.1, clip_norm=((None, float("inf")),))
