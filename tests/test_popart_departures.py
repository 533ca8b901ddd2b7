"""The departures of PopART's arithmetic from ONNX / autodiff that the xla backend implements
(popart_kit._runtime.xla.operator_docs.DEPARTURES), each held against numpy written from
PopART's formula at inputs where it differs from the ONNX one; and the account itself."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest

import popart_kit.popart as popart
from popart_kit._model.graphcore import GRAPHCORE_OPS
from popart_kit._runtime.xla import operator_docs as docs
from popart_kit._runtime.xla.lowering import lower
from popart_kit._runtime.xla.op_table import OPS
from popart_kit._runtime.xla.ops import GRAPHCORE, Ctx

f32 = np.float32


def run(op_type: str, *xs, domain: str = "", opset: int = 13, **attrs):
    """The lowering of one node, as the xla backend calls it (drop-in and pk sessions)."""
    ctx = Ctx("n", op_type, opset, attrs, [f"i{i}" for i in range(len(xs))], ["o"],
              [False] * len(xs))
    out = OPS[(domain, op_type)].fn(ctx, *(jnp.asarray(x) for x in xs))
    return out[0] if isinstance(out, (tuple, list)) else out


def grads(op_type: str, *xs, domain: str = "", **attrs):
    """d sum(out) / d each input."""
    return jax.jit(jax.grad(lambda *a: jnp.sum(run(op_type, *a, domain=domain, **attrs)),
                            argnums=tuple(range(len(xs)))))(*(jnp.asarray(x) for x in xs))


def test_relu_gradient_is_zero_at_zero():
    x = np.array([-1.0, 0.0, 2.0, np.nan], f32)
    np.testing.assert_array_equal(run("Relu", x), [0, 0, 2, np.nan])
    np.testing.assert_array_equal(grads("Relu", x[:3])[0], [0, 0, 1])   # relux.cpp: 0 at 0


def test_clip_masks_the_gradient_at_the_bounds_and_clamps_float16_bounds():
    x = np.array([-2.0, -1.0, 0.5, 1.0, 3.0], f32)
    np.testing.assert_array_equal(run("Clip", x, np.float32(-1), np.float32(1)),
                                  [-1, -1, 0.5, 1, 1])
    # clipx.cpp: g (out != min)(out != max) -> 0 at the bounds, where max/min give 0.5
    np.testing.assert_array_equal(grads("Clip", x, f32(-1), f32(1))[0], [0, 0, 1, 0, 0])
    half = np.array([-np.inf, 1.0, np.inf], np.float16)
    np.testing.assert_array_equal(np.asarray(run("Clip", half), f32), [-65504, 1, 65504])
    np.testing.assert_array_equal(
        np.asarray(run("Clip", half, np.float16(-np.inf), np.float16(2)), f32),
        [-65504, 1, 2])


@pytest.mark.parametrize("op_type,alpha,gamma", [("Elu", 0.7, 1.0),
                                                 ("Selu", 1.6732632, 1.050701)])
def test_elu_and_selu_follow_popart_formula_and_gradient(op_type, alpha, gamma):
    attrs = {"alpha": alpha} if op_type == "Elu" else {"alpha": alpha, "gamma": gamma}
    x = np.array([-3.0, -0.5, 0.0, 2.0], f32)
    # elux.cpp / selux.cpp: gamma (min(alpha (exp(x) - 1), 0) + max(0, x))
    want = gamma * (np.minimum(alpha * (np.exp(x) - 1), 0) + np.maximum(0, x))
    np.testing.assert_allclose(run(op_type, x, **attrs), want, rtol=1e-6)
    s = np.sign(x)
    want_grad = gamma * ((1 - s) / 2 * alpha * np.exp(x) + (1 + s) / 2)
    np.testing.assert_allclose(grads(op_type, x, **attrs)[0], want_grad, rtol=1e-6)
    assert math.isclose(float(grads(op_type, x, **attrs)[0][2]), gamma * (1 + alpha) / 2,
                        rel_tol=1e-6)
    # PopART's 0 * exp(x) is NaN where exp overflows: left, the backend gives gamma
    assert grads(op_type, np.array([100.0], f32), **attrs)[0][0] == np.float32(gamma)


def test_shrink_gradient_is_half_at_lambd():
    x = np.array([-2.0, -0.5, 0.0, 0.5, 2.0], f32)
    np.testing.assert_allclose(run("Shrink", x, lambd=0.5, bias=0.1), [-1.9, 0, 0, 0, 1.9],
                               rtol=1e-6)
    want = 0.5 * (1 + np.sign(np.abs(x) - 0.5))   # shrinkx.cpp
    np.testing.assert_array_equal(grads("Shrink", x, lambd=0.5, bias=0.1)[0], want)


@pytest.mark.parametrize("op_type", ["Max", "Min"])
def test_max_min_give_every_tied_input_the_whole_gradient(op_type):
    a = np.array([[1.0, 2.0], [3.0, 0.0]], f32)
    b = np.array([1.0, 0.0], f32)          # broadcast over the rows
    c = np.array([[1.0, 2.0], [3.0, 4.0]], f32)
    pick = np.maximum if op_type == "Max" else np.minimum
    out = pick(pick(a, b), c)
    np.testing.assert_array_equal(run(op_type, a, b, c), out)
    ga, gb, gc = grads(op_type, a, b, c)
    # maxx.cpp / minx.cpp: mask sign(x - out) + 1, one per input
    np.testing.assert_array_equal(ga, (a == out).astype(f32))
    np.testing.assert_array_equal(gb, (np.broadcast_to(b, a.shape) == out).sum(0))
    np.testing.assert_array_equal(gc, (c == out).astype(f32))
    assert ga[0, 0] == gc[0, 0] == 1   # a three-way tie: 1 each, not 1/4 and 1/2


@pytest.mark.parametrize("op_type", ["ReduceMax", "ReduceMin"])
def test_reduce_max_min_give_every_tied_element_the_whole_gradient(op_type):
    x = np.array([[5.0, 5.0, 1.0], [-2.0, -2.0, -2.0]], f32)
    if op_type == "ReduceMin":
        x = -x
    out = run(op_type, x, axes=[1], keepdims=0)
    np.testing.assert_array_equal(out, [5, -2] if op_type == "ReduceMax" else [-5, 2])
    want = (x == np.asarray(out)[:, None]).astype(f32)   # reducemaxx.cpp: sign(x - out) + 1
    np.testing.assert_array_equal(grads(op_type, x, axes=[1], keepdims=0)[0], want)


def test_sinh_cosh_softplus_use_popart_expressions():
    x = np.array([1e-9, 0.5, 100.0], f32)
    with np.errstate(over="ignore"):
        e = np.exp(x)
        np.testing.assert_allclose(run("Sinh", x[:2]), (0.5 * (e - 1 / e))[:2], rtol=1e-6)
        assert run("Sinh", x)[0] == 0                 # sinhx.cpp; sinh(1e-9) is 1e-9
        g = np.asarray(grads("Sinh", x)[0])
        np.testing.assert_allclose(g[:2], (0.5 * (e + 1 / e))[:2], rtol=1e-6)
        assert np.isposinf(g[2])                      # inf, where autodiff gives NaN
    np.testing.assert_allclose(run("Cosh", x[:2]), 0.5 * (np.exp(x[:2]) + np.exp(-x[:2])),
                               rtol=1e-6)
    y = np.array([-20.0, -1.0, 0.0, 3.0], f32)
    want = np.maximum(y, 0) + np.log(f32(1) + np.exp(-np.abs(y)))   # softplusx.cpp
    np.testing.assert_allclose(run("Softplus", y), want, rtol=1e-6)
    assert run("Softplus", y)[0] == 0                 # log(1 + 2e-9) in float32
    np.testing.assert_allclose(grads("Softplus", y)[0], 1 / (1 + np.exp(-y)), rtol=1e-6)


def test_trigonometric_operators_are_popart_decompositions():
    x = np.array([-0.9, -0.3, 0.2, 0.8], f32)
    big = np.array([-1e4, -30.0, 2.0], f32)
    cases = {  # onnxpasses/nodepatterns/trig.cpp
        "Tan": (x, np.sin(x) / np.cos(x)),
        "Acos": (x, f32(np.pi / 2) - np.arcsin(x)),
        "Atanh": (x, 0.5 * np.log((1 + x) / (1 - x))),
        "Acosh": (np.array([1.5, 3.0, 100.0], f32), None),
        "Asinh": (big, None),
    }
    for op_type, (inp, want) in cases.items():
        if want is None:
            sign = 1 if op_type == "Asinh" else -1
            with np.errstate(divide="ignore"):
                want = np.log(inp + np.sqrt(inp.astype(f32) ** 2 + sign))
        np.testing.assert_allclose(run(op_type, inp), want, rtol=2e-6, err_msg=op_type)
    assert np.isneginf(run("Asinh", big)[0])         # x + sqrt(x^2 + 1) cancels to 0


def test_fmod_mod_and_remainder_follow_popart_gradients_and_form():
    a, b = np.array([5.5, -5.5, -1e-8], f32), np.array([2.0, 2.0, 1.0], f32)
    np.testing.assert_allclose(run("Mod", a, b, fmod=1), np.fmod(a, b))
    ga, gb = grads("Mod", a, b, fmod=1)
    np.testing.assert_array_equal(ga, [1, 1, 1])
    np.testing.assert_array_equal(gb, [0, 0, 0])      # fmod.cpp: FmodArg0GradOp only
    ga, gb = grads("Fmod", a, b, domain=GRAPHCORE)
    np.testing.assert_array_equal(gb, [0, 0, 0])
    want = np.fmod(np.fmod(a, b) + b, b)              # binary_ops.cpp: Remainder
    np.testing.assert_array_equal(run("Remainder", a, b, domain=GRAPHCORE), want)
    assert run("Remainder", a, b, domain=GRAPHCORE)[2] == 0   # numpy's remainder gives 1.0
    ga, gb = grads("Remainder", a, b, domain=GRAPHCORE)
    np.testing.assert_array_equal(ga, [1, 1, 1])
    np.testing.assert_array_equal(gb, [1, 1, 1])      # through the Add only
    # ai.onnx Mod (fmod 0) keeps Python's %: PopART's form would make NaN of inf operands
    np.testing.assert_array_equal(run("Mod", a, b), np.remainder(a, b))
    ints = (np.array([-7, 7, -4], np.int32), np.array([3, -3, 2], np.int32))
    np.testing.assert_array_equal(run("Mod", *ints), [2, -2, 0])


def test_graphcore_gelu_is_popnn_tanh_form():
    x = np.array([-3.0, -1.0, 0.5, 2.0], f32)
    c = math.sqrt(2 / math.pi)
    want = 0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x ** 3)))   # gelux.cpp: popnn GELU
    got = run("Gelu", x, domain=GRAPHCORE)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    erf = np.asarray(run("GeluErf", x, domain=GRAPHCORE))
    assert np.max(np.abs(np.asarray(got) - erf)) > 1e-4   # not the erf form
    inner = c * (x + 0.044715 * x ** 3)
    dwant = 0.5 * (1 + np.tanh(inner)) + 0.5 * x * (1 - np.tanh(inner) ** 2) * c * (
        1 + 3 * 0.044715 * x ** 2)
    np.testing.assert_allclose(grads("Gelu", x, domain=GRAPHCORE)[0], dwant, rtol=1e-5)


def test_the_account_reads_every_popart_operator_and_cites_its_source():
    onnx_keys = {f"ai.onnx.{n}" for n in docs.POPART_ONNX}
    graphcore = {e.op_type for e in GRAPHCORE_OPS.values()} | {"L1", "Nll", "IdentityLoss",
                                                                "Gelu", "Call"}
    read = set(docs.DEPARTURES) | set(docs.AGREES) | set(docs.REFUSED)
    assert onnx_keys <= read, sorted(onnx_keys - read)
    assert {f"ai.graphcore.{n}" for n in graphcore} <= read
    assert not set(docs.DEPARTURES) & set(docs.AGREES)
    cited = re.compile(r"[a-z_/0-9]+\.cpp|popx/op/collectives")
    for key, entries in docs.DEPARTURES.items():
        assert isinstance(entries, tuple) and entries, key
        for d in entries:
            assert cited.search(d.source), (key, d.source)
            assert d.status == docs.IMPLEMENTED or d.status.startswith("left: "), key
            if d.status == docs.IMPLEMENTED:   # what the backend implements, it lowers
                domain, op_type = ("", key[8:]) if key.startswith("ai.onnx.") else \
                    (GRAPHCORE, key[len("ai.graphcore."):])
                assert (domain, op_type) in OPS, key
    for key, source in docs.AGREES.items():
        assert cited.search(source), (key, source)
    table = docs.markdown()
    assert "| Relu | 1, 6, 13, 14 | lowers | read: departs |" in table
    assert "| Abs | 1, 6, 13 | lowers | read: departs |" in table
    assert "| Acos | 7, 22 | lowers | read: departs |" in table


def test_abs_and_reducel1_gradients_are_sign_x_zero_at_zero():
    x = np.array([-2.0, 0.0, 3.0], f32)
    np.testing.assert_array_equal(run("Abs", x), [2, 0, 3])
    np.testing.assert_array_equal(grads("Abs", x)[0], [-1, 0, 1])  # absx: g sign(x)
    np.testing.assert_array_equal(grads("ReduceL1", x, opset=11, keepdims=0)[0], [-1, 0, 1])
    np.testing.assert_array_equal(grads("L1", x, domain=GRAPHCORE, reduction="Sum")[0],
                                  [-1, 0, 1])  # l1x.cpp: lambda sign(x)


@pytest.mark.parametrize("op_type,want", [
    ("ReduceSum", lambda x: x), ("ReduceL1", np.abs), ("ReduceLogSum", np.log),
    ("ReduceSumSquare", np.square), ("ReduceLogSumExp", lambda x: x)])
def test_reduce_with_an_explicit_empty_axes_attribute_reduces_nothing(op_type, want):
    data = np.abs(np.random.default_rng(3).standard_normal((2, 3))).astype(f32) + 0.5
    b = popart.Builder(opsets={"ai.onnx": 11, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    method = getattr(b.aiOnnx, op_type.lower())
    empty, default = method([x], axes=[], keepdims=0), method([x], keepdims=0)
    assert b.getTensorShape(empty) == [2, 3] and b.getTensorShape(default) == []
    graph = lower(onnx.load_from_string(b.getModelProto()))
    got = graph.evaluate(graph.weights, {x: data}, [empty, default])
    np.testing.assert_allclose(np.asarray(got[empty]), want(data), rtol=1e-6)  # reduce.cpp
    assert np.asarray(got[default]).shape == ()  # axes not given: every axis


def test_scatter_takes_the_leading_block_of_larger_updates():
    data, updates = np.zeros((3, 5), f32), np.arange(1, 11, dtype=f32).reshape(2, 5)
    indices = np.array([[0, 1, 2, 0]], np.uint32)
    want = data.copy()
    for j in range(4):  # torch's scatter_ and PopART's: updates[:1, :4]
        want[indices[0, j], j] = updates[0, j]
    np.testing.assert_array_equal(run("Scatter", data, indices, updates, opset=9, axis=0), want)


def test_l1_loss_of_float16_accumulates_wider_than_float16():
    x = np.full((100000,), 0.75, np.float16)  # a float16 sum would overflow (65504)
    mean = run("L1", x, domain=GRAPHCORE, reduction="Mean")
    assert mean.dtype == np.float16 and float(mean) == 0.75
    assert float(run("L1", x[:1000], domain=GRAPHCORE, reduction="Sum")) == 750


def test_pow_gradients_are_popart_patterns_at_zero_and_negative_bases():
    """powarg0/1gradoppattern.cpp: d/dx = where(y == 0, 0, y x^(y-1)); d/dy = where(x == 0 and
    y >= 0 (not NaN), 0, x^y log x) - held against numpy of those formulas."""
    x = np.array([0, 0, 0, -0.5, -0.5, 0.5, 2, 0, 3], f32)
    y = np.array([0, 2, -1, 2, 0.5, -2, 0, np.nan, 1.5], f32)
    dx, dy = grads("Pow", x, y)
    with np.errstate(all="ignore"):
        want_dx = np.where(y == 0, 0, y * np.power(x, y - 1))
        want_dy = np.where((x == 0) & ~((y < 0) | np.isnan(y)), 0, np.power(x, y) * np.log(x))
    np.testing.assert_allclose(dx, want_dx.astype(f32), rtol=1e-6)
    np.testing.assert_allclose(dy, want_dy.astype(f32), rtol=1e-6)
    assert dx[0] == 0 and dy[2] == -np.inf   # 0^0's base gradient; 0^-1's exponent gradient


@pytest.mark.parametrize("training", [False, True])
def test_batchnorm_spatial_0_normalises_each_element_over_the_batch(training):
    """batchnormx.cpp:110: spatial=0 (opset 7) normalises X as [N, C*D1*...*Dn, 1]; scale, B,
    mean and var have X's shape but the first dimension (numpy oracle)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 2, 2)).astype(f32)
    scale, bias = (rng.standard_normal((2, 2, 2)).astype(f32) for _ in range(2))
    mean, var = np.zeros((2, 2, 2), f32), np.ones((2, 2, 2), f32)
    outs = ["y", "m", "v", "sm", "sv"] if training else ["y"]
    ctx = Ctx("n", "BatchNormalization", 7, {"spatial": 0, "epsilon": 1e-5, "momentum": 0.9},
              [f"i{i}" for i in range(5)], outs, [False] * 5)
    got = OPS[("", "BatchNormalization")].fn(ctx, *map(jnp.asarray, (x, scale, bias, mean, var)))
    m, v = (x.mean(0), x.var(0)) if training else (mean, var)
    np.testing.assert_allclose(got[0], (x - m) / np.sqrt(v + 1e-5) * scale + bias, rtol=1e-5,
                               atol=1e-6)
    if training:
        np.testing.assert_allclose(got[1], 0.9 * mean + 0.1 * m, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got[2], 0.9 * var + 0.1 * v, rtol=1e-5)
