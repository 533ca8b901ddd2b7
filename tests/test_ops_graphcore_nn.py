"""PopART's ai.graphcore network operators (popart_kit/_model/graphcore/nn_ops.py, lowered by
popart_kit/_runtime/xla/ops_graphcore_nn.py): built with popart.Builder, run through the
lowering and held against onnxruntime (MultiConv), a numpy CTC alpha recursion and prefix beam
search, numpy transcriptions of PopART's and PopLibs' documented formulas, finite differences
for the gradients, and the refusals."""

from __future__ import annotations

import collections
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import popart_kit.popart as popart
from popart_kit._model.builder_base import BuilderError
from popart_kit._runtime.xla.lowering import UnsupportedModel, lower
from popart_kit._runtime.xla.steps import LOCAL_REPLICA

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

RNG = np.random.default_rng(11)
NP_TYPES = {np.float32: "FLOAT", np.float16: "FLOAT16", np.int32: "INT32", np.uint32: "UINT32",
            np.uint8: "UINT8"}


def inputs(b: popart.Builder, **arrays: np.ndarray) -> list[str]:
    return [b.addInputTensor(popart.TensorInfo(NP_TYPES[a.dtype.type], list(a.shape)), name)
            for name, a in arrays.items()]


def run(b: popart.Builder, outputs: list[str], feeds: dict[str, np.ndarray],
        weights: dict[str, np.ndarray | float] | None = None, wrt: tuple[str, ...] = ()
        ) -> list[np.ndarray]:
    """The ``outputs``, then (one compilation) d sum_o sum(o * weights[o]) / d each of
    ``wrt``, through the lowered graph."""
    graph = lower(onnx.load_from_string(b.getModelProto()))

    def forward(vary: dict, fixed: dict) -> tuple[jax.Array, dict]:
        got = graph.evaluate(graph.weights, {**fixed, **vary},
                             list(dict.fromkeys([*outputs, *(weights or {})])))
        return sum(jnp.sum(got[o] * w) for o, w in (weights or {}).items()), got

    def both(feeds: dict) -> tuple[dict, dict]:
        vary = {k: v for k, v in feeds.items() if k in wrt}
        fixed = {k: v for k, v in feeds.items() if k not in wrt}
        if not wrt:
            return forward(vary, fixed)[1], {}
        grads, got = jax.grad(forward, has_aux=True)(vary, fixed)
        return got, grads
    got, grads = jax.jit(both)(feeds)
    return [np.asarray(got[o]) for o in outputs] + [np.asarray(grads[w]) for w in wrt]


def numeric_grad(fn, x: np.ndarray, step: float = 1e-5) -> np.ndarray:
    """Central differences of the scalar ``fn`` at ``x`` (float64)."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += step
        down[i] -= step
        out[i] = (fn(up) - fn(down)) / (2 * step)
    return out


def refused(b: popart.Builder, match: str) -> None:
    with pytest.raises(UnsupportedModel, match=match):
        lower(onnx.load_from_string(b.getModelProto()))


# -- multiconv ----------------------------------------------------------------------------------

def ort_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, **attrs):
    """onnxruntime's Conv of these shapes and attributes, as a function of (x, w[, b])."""
    names = ["x", "w"] + (["b"] if b is not None else [])
    node = helper.make_node("Conv", names, ["y"], **attrs)
    graph = helper.make_graph(
        [node], "conv",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape))
         for n, a in zip(names, (x, w, b), strict=False)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda *arrays: session.run(None, {n: np.asarray(a, np.float32)
                                              for n, a in zip(names, arrays, strict=True)})[0]


def test_multiconv_is_independent_convolutions_as_onnxruntime_computes_them():
    x0, w0 = RNG.random((1, 4, 5, 4), np.float32), RNG.random((6, 2, 3, 2), np.float32)
    x1, w1 = RNG.random((2, 3, 5), np.float32), RNG.random((2, 3, 2), np.float32)
    b1 = RNG.random(2, np.float32)
    b = popart.Builder()
    i = inputs(b, x0=x0, w0=w0, x1=x1, w1=w1, b1=b1)
    c0, c1 = b.aiGraphcore.multiconv([i[:2], i[2:]], dilations=[[1, 2], [2]],
                                     pads=[[1, 0, 1, 1], [0, 1]], strides=[[2, 1], [1]])
    assert b.getTensorShape(c0) == [1, 6, 3, 3] and b.getTensorShape(c1) == [2, 2, 4]
    g0, g1 = RNG.random((1, 6, 3, 3)), RNG.random((2, 2, 4))
    feeds = dict(x0=x0, w0=w0, x1=x1, w1=w1, b1=b1)
    got0, got1, dw0, dx1 = run(b, [c0, c1], feeds, {c0: g0, c1: g1}, ("w0", "x1"))
    # conv 0 has 2 groups (4 data channels, 2 per weight)
    conv0 = ort_conv(x0, w0, None, dilations=[1, 2], group=2, pads=[1, 0, 1, 1], strides=[2, 1])
    conv1 = ort_conv(x1, w1, b1, dilations=[2], pads=[0, 1], strides=[1])
    np.testing.assert_allclose(got0, conv0(x0, w0), rtol=1e-5)
    np.testing.assert_allclose(got1, conv1(x1, w1, b1), rtol=1e-5)
    # the gradients are the convolutions' (finite differences of onnxruntime's)
    np.testing.assert_allclose(dw0, numeric_grad(lambda v: np.sum(conv0(x0, v) * g0), w0, 1e-2),
                               rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(dx1, numeric_grad(lambda v: np.sum(conv1(v, w1, b1) * g1), x1,
                                                 1e-2), rtol=1e-3, atol=1e-3)


def test_multiconv_builder_checks_in_popart_words():
    b = popart.Builder()
    d, f = inputs(b, d=np.zeros((1, 2, 4, 4), np.float32), f=np.zeros((10, 2, 3, 3), np.float32))
    for kwargs, message in (
            (dict(dilations=[[1, 1], [2, 2, 2]]),
             "Length of dilations vector 3 != number of spatial dimensions 2"),
            (dict(dilations=[[1, 1], [2, 2], [3, 3]]), "number of dilations parameter sets (3) "
             "does not match the number of input sets (2)"),
            (dict(dilations=[[9, 9], [1, 1]]), "invalid spatial output shape: [-14 -14]"),
            (dict(partialsTypes=["float", "double"]), "Bad partialsType 'double'"),
            (dict(availableMemoryProportions=[0.5, 1.5]), "must be in (0,1]")):
        with pytest.raises(BuilderError) as err:
            b.aiGraphcore.multiconv([[d, f], [d, f]], **kwargs)
        assert message in str(err.value)
    with pytest.raises(BuilderError, match="must have at least two inputs - data and weights"):
        b.aiGraphcore.multiconv([[d], [d, f]])
    with pytest.raises(BuilderError, match="at most three inputs - data, weights, and bias"):
        b.aiGraphcore.multiconv([[d, f, d, f], [d, f]])


def test_multiconv_node_is_popart_s_and_in_dilations_are_refused():
    b = popart.Builder()
    d, f = inputs(b, d=np.zeros((1, 2, 4, 4), np.float32), f=np.zeros((3, 2, 3, 3), np.float32))
    c0, c1 = b.aiGraphcore.multiconv([[d, f], [d, f]], strides=[[1, 1], [2, 2]],
                                     partialsTypes=["half", "float"], planType="serial",
                                     enableConvDithering=[1, 0])
    node = onnx.load_from_string(b.getModelProto()).graph.node[-1]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert list(node.input) == [d, f, "", d, f, ""] and node.domain == "ai.graphcore"
    assert attrs["strides"] == [1, 1, 2, 2] and attrs["numConvs"] == 2
    assert attrs["__partials_type"] == [b"half", b"float"]
    assert attrs["__enable_conv_dithering"] == [1, 0] and attrs["planType"] == b"serial"
    assert b.getTensorShape(c1) == [1, 3, 1, 1]
    b.aiGraphcore.multiconv([[d, f]], inDilations=[[2, 2]])
    refused(b, "PopART's MultiConvOp reads only strides, pads and dilations")


# -- ctcloss ------------------------------------------------------------------------------------

def logaddexp(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    big, small = max(a, b), min(a, b)
    return big + math.log1p(math.exp(small - big))


def np_ctc_nll(lp: np.ndarray, target: list[int], steps: int, blank: int) -> float:
    """Graves' alpha recursion over the target with blanks around and between its labels."""
    ext = [blank]
    for c in target:
        ext += [int(c), blank]
    lp = lp.tolist()
    alpha = [lp[0][blank], lp[0][ext[1]] if target else -math.inf] + [-math.inf] * (len(ext) - 2)
    for t in range(1, steps):
        alpha = [logaddexp(logaddexp(alpha[s], alpha[s - 1] if s > 0 else -math.inf),
                           alpha[s - 2] if s > 1 and ext[s] not in (blank, ext[s - 2])
                           else -math.inf) + lp[t][ext[s]] for s in range(len(ext))]
    return -(logaddexp(alpha[-1], alpha[-2]) if target else alpha[-1])


def log_softmax(x: np.ndarray) -> np.ndarray:
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.sum(np.exp(x - top), -1, keepdims=True))


def np_ctc(lp: np.ndarray, targets, in_len, tgt_len, blank: int) -> np.ndarray:
    return np.array([np_ctc_nll(lp[:, n], list(targets[n, :tgt_len[n]]), int(in_len[n]), blank)
                     for n in range(lp.shape[1])])


def ctc_inputs(b: popart.Builder, steps: int, in_len: list[int], tgt_len: list[int],
               blanks: tuple[int, ...] = (0,), classes: int = 4, **names: str):
    """Random logits [T, N, C], targets (no blank) and lengths, as inputs of ``b``."""
    logits = RNG.random((steps, len(in_len), classes))
    targets = RNG.choice([c for c in range(classes) if c not in blanks],
                         size=(len(in_len), max(tgt_len)))
    feeds = dict(logits=logits.astype(np.float32), targets=targets.astype(np.uint32),
                 in_len=np.array(in_len, np.uint32), tgt_len=np.array(tgt_len, np.uint32))
    return inputs(b, **feeds), feeds


def test_ctcloss_matches_the_alpha_recursion_for_each_reduction():
    b = popart.Builder()
    i, feeds = ctc_inputs(b, 6, [6, 5, 6, 4], [3, 0, 2, 1], blanks=(0, 2))
    lp = b.aiOnnx.logsoftmax([i[0]], axis=2)
    reductions = (popart.ReductionType.NoReduction, popart.ReductionType.Sum,
                  popart.ReductionType.Mean)
    cases = [(0, r) for r in reductions] + [(2, reductions[0])]  # (blank, reduction)
    losses = {case: b.aiGraphcore.ctcloss([lp, *i[1:]], case[1], case[0]) for case in cases}
    got = dict(zip(losses, run(b, list(losses.values()), feeds), strict=True))
    for blank, r in cases:
        nll = np_ctc(log_softmax(feeds["logits"].astype(np.float64)), feeds["targets"],
                     feeds["in_len"], feeds["tgt_len"], blank)
        want = {reductions[0]: nll, reductions[1]: nll.sum(),
                reductions[2]: np.mean(nll / np.maximum(feeds["tgt_len"], 1))}[r]
        assert b.getTensorShape(losses[blank, r]) == list(np.shape(want))
        np.testing.assert_allclose(got[blank, r], want, rtol=1e-5)


def test_ctcloss_gradient_is_popart_s_and_zero_infinity():
    """PopLibs' gradient with respect to the log probabilities includes the LogSoftmax's:
    exp(lp) - posterior, where -posterior is the derivative of the loss (the op's second
    output, and what a Sum loss passes back); through the model's LogSoftmax, here with Mean,
    it is the derivative with respect to the logits (finite differences of the recursion).
    Sample 2 cannot emit 2 labels in 1 frame: an infinite loss, zero (and no gradient) with
    zeroInfinity."""
    b = popart.Builder()
    i, feeds = ctc_inputs(b, 4, [4, 3, 1], [2, 1, 2], classes=3)
    lp = RNG.normal(size=feeds["logits"].shape)
    (direct,) = inputs(b, lp=lp.astype(np.float32))
    sum_loss = b.aiGraphcore.ctcloss([direct, *i[1:]], popart.ReductionType.Sum,
                                     zeroInfinity=True)
    gradient_output = onnx.load_from_string(b.getModelProto()).graph.node[-1].output[1]
    log_probs = b.aiOnnx.logsoftmax([i[0]], axis=2)
    mean_loss = b.aiGraphcore.ctcloss([log_probs, *i[1:]], zeroInfinity=True)
    plain = b.aiGraphcore.ctcloss([log_probs, *i[1:]], popart.ReductionType.NoReduction)
    got, got_sum, got_plain, d_lp, d_logits = run(
        b, [gradient_output, sum_loss, plain], {**feeds, "lp": lp.astype(np.float32)},
        {sum_loss: 2.0, mean_loss: 1.0}, ("lp", "logits"))
    ok = [0, 1]  # the possible samples
    rest = (feeds["targets"][ok], feeds["in_len"][ok], feeds["tgt_len"][ok], 0)
    posterior = -numeric_grad(lambda v: np_ctc(v, *rest).sum(), lp[:, ok])
    assert np.isinf(got_plain[2]) and np.isfinite(got_plain[ok]).all()
    np.testing.assert_allclose(got_sum, np_ctc(lp[:, ok], *rest).sum(), rtol=1e-5)
    np.testing.assert_allclose(got[:, ok], np.exp(lp[:, ok]) - posterior, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_lp[:, ok], 2.0 * (np.exp(lp[:, ok]) - posterior), rtol=1e-4,
                               atol=1e-5)
    # Mean: each sample's gradient over N and its target length (at least 1)
    scale = 1.0 / (3 * np.maximum(feeds["tgt_len"][ok], 1))
    want = numeric_grad(lambda v: np.sum(np_ctc(log_softmax(v), *rest) * scale),
                        feeds["logits"][:, ok])
    np.testing.assert_allclose(d_logits[:, ok], want, rtol=1e-4, atol=1e-6)
    assert np.all(got[:, 2] == 0) and np.all(d_lp[:, 2] == 0) and np.all(d_logits[:, 2] == 0)


def test_ctcloss_types_and_refusals():
    b = popart.Builder()
    i = inputs(b, lp=np.zeros((3, 2, 4), np.float32), t=np.zeros((2, 2), np.uint32),
               il=np.zeros(2, np.uint32), tl=np.zeros(2, np.uint32))
    half = inputs(b, half=np.zeros((3, 2, 4), np.float16))
    loss = b.aiGraphcore.ctcloss([half[0], *i[1:]], outDataType="FLOAT")
    assert b.getTensorDtypeString(loss) == "float32" and b.getTensorShape(loss) == []
    with pytest.raises(BuilderError, match="expected a floating point type, got INT32"):
        b.aiGraphcore.ctcloss(i, outDataType="INT32")
    with pytest.raises(BuilderError, match="tensor of rank 3"):
        b.aiGraphcore.ctcloss([inputs(b, flat=np.zeros((3, 8), np.float32))[0], *i[1:]])
    with pytest.raises(TypeError, match="ReductionType"):
        b.aiGraphcore.ctcloss(i, "mean")
    half_loss = b.aiGraphcore.ctcloss(i, outDataType="FLOAT16")  # PopLibs: not of float input
    with pytest.raises(UnsupportedModel, match="outType HALF unsupported with input tensor"):
        run(b, [half_loss], {n: np.zeros(b.getTensorShape(n), np.float32 if n == "lp" else
                                         np.uint32) for n in i})


# -- ctcbeamsearchdecoder -----------------------------------------------------------------------

def np_prefix_beam_search(lp: np.ndarray, width: int, blank: int):
    """Prefix beam search (distill.pub/2017/ctc): (log probability, prefix) by likelihood."""
    beams = {(): (0.0, -np.inf)}
    for t in range(lp.shape[0]):
        nxt: dict = collections.defaultdict(lambda: (-np.inf, -np.inf))
        for prefix, (pb, pnb) in beams.items():
            for c in range(lp.shape[1]):
                p = lp[t, c]
                if c == blank:
                    b_, nb = nxt[prefix]
                    nxt[prefix] = (np.logaddexp(b_, np.logaddexp(pb, pnb) + p), nb)
                    continue
                new = prefix + (c,)
                b_, nb = nxt[new]
                if prefix and prefix[-1] == c:
                    nxt[new] = (b_, np.logaddexp(nb, pb + p))
                    b_, nb = nxt[prefix]
                    nxt[prefix] = (b_, np.logaddexp(nb, pnb + p))
                else:
                    nxt[new] = (b_, np.logaddexp(nb, np.logaddexp(pb, pnb) + p))
        ranked = sorted(nxt.items(), key=lambda kv: -np.logaddexp(*kv[1]))
        beams = dict(ranked[:width])
    return [(float(np.logaddexp(*v)), list(k)) for k, v in beams.items()]


def test_ctcbeamsearchdecoder_matches_prefix_beam_search():
    steps, batch, classes = 6, 3, 5
    lp = log_softmax(2 * RNG.random((steps, batch, classes))).astype(np.float32)
    lengths = np.array([6, 4, 1], np.uint32)
    b = popart.Builder()
    i = inputs(b, lp=lp, lengths=lengths)
    cases = [(4, 5, 3)]  # blank, beam_width, top_paths
    outs = [b.aiGraphcore.ctcbeamsearchdecoder(i, *case) for case in cases]
    got = run(b, [o for three in outs for o in three], {"lp": lp, "lengths": lengths})
    for k, ((blank, width, top), three) in enumerate(zip(cases, outs, strict=True)):
        assert [b.getTensorShape(o) for o in three] == [[3, top], [3, top], [3, top, 6]]
        probs, sizes, labels = got[3 * k:3 * k + 3]
        assert sizes.dtype == labels.dtype == np.uint32
        for n in range(batch):
            want = np_prefix_beam_search(lp[:lengths[n], n].astype(np.float64), width,
                                         blank)[:top]
            np.testing.assert_allclose(probs[n], [p for p, _ in want], rtol=1e-5)
            for path, (_, prefix) in enumerate(want):
                assert sizes[n, path] == len(prefix)
                assert list(labels[n, path, :len(prefix)]) == prefix


def test_ctcbeamsearchdecoder_refuses_more_paths_than_beams():
    b = popart.Builder()
    i = inputs(b, lp=np.zeros((3, 2, 4), np.float32), lengths=np.zeros(2, np.uint32))
    b.aiGraphcore.ctcbeamsearchdecoder(i, beam_width=2, top_paths=3, debug_context="decode")
    refused(b, "top_paths at most beam_width")


# -- groupnormalization -------------------------------------------------------------------------

def np_group_norm(x, scale, bias, groups, eps):
    n, c = x.shape[:2]
    xs = x.reshape(n, groups, -1)
    mean, var = xs.mean(-1, keepdims=True), xs.var(-1, keepdims=True)
    inv = 1 / np.sqrt(var + eps)
    shape = (1, c) + (1,) * (x.ndim - 2)
    y = ((xs - mean) * inv).reshape(x.shape) * scale.reshape(shape) + bias.reshape(shape)
    return y, mean.reshape(-1), inv.reshape(-1)


def test_groupnormalization_outputs_and_gradient():
    x = RNG.standard_normal((2, 6, 3)).astype(np.float32)
    scale, bias = RNG.random(6).astype(np.float32), RNG.random(6).astype(np.float32)
    b = popart.Builder()
    i = inputs(b, x=x, scale=scale, bias=bias)
    y, mean, inv = b.aiGraphcore.groupnormalization(i, 3, 1e-3)
    assert b.getTensorShape(mean) == b.getTensorShape(inv) == [6]
    feeds = dict(x=x, scale=scale, bias=bias)
    weight = RNG.random(x.shape)
    # the statistics outputs pass no gradient back (PopART's grad op reads only dY)
    *got, dx, dscale, dbias = run(b, [y, mean, inv], feeds, {y: weight, mean: 5.0, inv: 7.0},
                                  ("x", "scale", "bias"))
    for one, want in zip(got, np_group_norm(x, scale, bias, 3, 1e-3), strict=True):
        np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-6)
    args = [x.astype(np.float64), scale.astype(np.float64), bias.astype(np.float64)]
    for arg, d in enumerate((dx, dscale, dbias)):
        def fn(v, arg=arg):
            return np.sum(np_group_norm(*args[:arg], v, *args[arg + 1:], 3, 1e-3)[0] * weight)
        np.testing.assert_allclose(d, numeric_grad(fn, args[arg]), rtol=1e-3, atol=1e-4)
    # PopART writes epsilon only when it is not the default
    b2 = popart.Builder()
    b2.aiGraphcore.groupnormalization(inputs(b2, x=x, scale=scale, bias=bias), 2)
    node = onnx.load_from_string(b2.getModelProto()).graph.node[-1]
    assert [a.name for a in node.attribute] == ["num_groups"]


# -- batchnormalization (ai.graphcore) ----------------------------------------------------------

def test_batchnormalization_training_outputs_use_the_unbiased_variance():
    x = (100 * RNG.random((2, 3, 4))).astype(np.float32)
    scale, bias = RNG.random(3).astype(np.float32), RNG.random(3).astype(np.float32)
    mean, var = RNG.random(3).astype(np.float32), RNG.random(3).astype(np.float32)
    b = popart.Builder()
    i = inputs(b, x=x, scale=scale, bias=bias, mean=mean, var=var)
    outs = b.aiGraphcore.batchnormalization(i, 5, 1e-3, 0.25)
    assert [b.getTensorShape(o) for o in outs] == [[2, 3, 4]] + [[3]] * 4
    node = onnx.load_from_string(b.getModelProto()).graph.node[-1]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == {
        "epsilon": pytest.approx(1e-3), "momentum": 0.25, "unbiased_variance": 0}
    feeds = dict(x=x, scale=scale, bias=bias, mean=mean, var=var)
    dy = RNG.random(x.shape)
    y, run_mean, run_var, saved_mean, saved_var, dx, dscale, dbias = run(
        b, outs, feeds, {outs[0]: dy, **{o: 3.0 for o in outs[1:]}}, ("x", "scale", "bias"))
    m, v, count = x.mean((0, 2)), x.var((0, 2)), 8
    shape = (1, 3, 1)
    np.testing.assert_allclose(y, (x - m.reshape(shape)) / np.sqrt(v.reshape(shape) + 1e-3)
                               * scale.reshape(shape) + bias.reshape(shape), rtol=1e-4, atol=1e-5)
    unbiased = count / (count - 1) * (v + 1e-3) - 1e-3  # PopART: from PopLibs' invSd
    np.testing.assert_allclose(saved_mean, m, rtol=1e-5)
    np.testing.assert_allclose(saved_var, unbiased, rtol=1e-4)
    np.testing.assert_allclose(run_mean, 0.25 * mean + 0.75 * m, rtol=1e-5)
    np.testing.assert_allclose(run_var, 0.25 * var + 0.75 * unbiased, rtol=1e-4)
    # PopART's gradient: popnn's formulas with the saved (unbiased) variance; the statistics
    # outputs pass none back
    inv = (1 / np.sqrt(unbiased + 1e-3)).reshape(shape)
    xhat = (x - m.reshape(shape)) * inv
    want = scale.reshape(shape) * inv * (dy - dy.mean((0, 2), keepdims=True)
                                         - xhat * (dy * xhat).mean((0, 2), keepdims=True))
    np.testing.assert_allclose(dx, want, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(dscale, (dy * xhat).sum((0, 2)), rtol=1e-4)
    np.testing.assert_allclose(dbias, dy.sum((0, 2)), rtol=1e-5)


def test_batchnormalization_inference_and_its_refused_gradient():
    x = RNG.random((2, 3, 2, 2)).astype(np.float32)
    scale, bias = RNG.random(3).astype(np.float32), RNG.random(3).astype(np.float32)
    mean, var = RNG.random(3).astype(np.float32), RNG.random(3).astype(np.float32)
    b = popart.Builder()
    i = inputs(b, x=x, scale=scale, bias=bias, mean=mean, var=var)
    (y,) = b.aiGraphcore.batchnormalization(i, 1)
    feeds = dict(x=x, scale=scale, bias=bias, mean=mean, var=var)
    shape = (1, 3, 1, 1)
    np.testing.assert_allclose(run(b, [y], feeds)[0], (x - mean.reshape(shape))
                               / np.sqrt(var.reshape(shape) + 1e-5) * scale.reshape(shape)
                               + bias.reshape(shape), rtol=1e-5)
    with pytest.raises(Exception, match="inference mode, but its gradient Op is being created"):
        run(b, [y], feeds, {y: 1.0}, ("x",))
    with pytest.raises(BuilderError, match="rank >= 3"):
        b.aiGraphcore.batchnormalization(inputs(b, flat=np.zeros((2, 3), np.float32))
                                         + i[1:], 5)


# -- normalize_image ----------------------------------------------------------------------------

def test_normalize_image_as_popart_documents_it():
    b, feeds, outs = popart.Builder(), {}, {}
    for dtype in (np.float32, np.float16, np.uint8):
        img = (RNG.random((2, 2, 3)) * 255).astype(dtype)
        out_type = np.float16 if dtype != np.float32 else np.float32
        offsets, scales = np.array([1, 2, 3], out_type), np.array([4, 5, 6], out_type)
        name = np.dtype(dtype).name
        arrays = {f"img_{name}": img, f"offsets_{name}": offsets, f"scales_{name}": scales}
        out = b.aiGraphcore.normalize_image(inputs(b, **arrays), 1 / 255)
        assert b.getTensorShape(out) == [2, 2, 4]
        assert b.getTensorDtypeString(out) == np.dtype(out_type).name
        feeds.update(arrays)
        want = ((img.astype(np.float64) / 255) - offsets) * scales
        outs[out] = (np.concatenate([want, np.zeros((2, 2, 1))], -1), out_type)
    for got, (want, out_type) in zip(run(b, list(outs), feeds), outs.values(), strict=True):
        assert got.dtype == out_type
        np.testing.assert_allclose(got, want, rtol=1e-2 if out_type == np.float16 else 1e-5)


def test_normalize_image_refusals():
    b = popart.Builder()
    i = inputs(b, img=np.zeros((2, 4), np.float32), o=np.zeros(3, np.float32),
               s=np.zeros(3, np.float32))
    with pytest.raises(BuilderError, match="requires the inner dimension to be 3"):
        b.aiGraphcore.normalize_image(i)
    with pytest.raises(BuilderError, match="scale should be greater than 0"):
        b.aiGraphcore.normalize_image(i, 0.0)


# -- replicatedallreduce, replicatedreducescatter -----------------------------------------------

def replicated(b: popart.Builder, outputs: list[str], xs: np.ndarray) -> list[np.ndarray]:
    """The model on each of ``len(xs)`` replicas, vectorised as the runtime runs a device's
    replicas (the axis named LOCAL_REPLICA)."""
    graph = lower(onnx.load_from_string(b.getModelProto()))
    each = jax.vmap(lambda x: graph.evaluate(graph.weights, {"x": x}, outputs),
                    axis_name=LOCAL_REPLICA)
    got = jax.jit(each)(xs)
    return [np.asarray(got[o]) for o in outputs]


def test_replicatedallreduce_over_the_replicas_and_groups():
    xs = RNG.random((4, 2, 3)).astype(np.float32)
    b = popart.Builder()
    (x,) = inputs(b, x=xs[0])
    total = b.aiGraphcore.replicatedallreduce([x])
    biggest = b.aiGraphcore.replicatedallreduce([x], popart.CollectiveOperator.Max)
    mean = b.aiGraphcore.replicatedallreduce(
        [x], popart.CollectiveOperator.Mean, popart.CommGroup(popart.CommGroupType.Consecutive, 2))
    ortho = b.aiGraphcore.replicatedallreduce(
        [x], commGroup=popart.CommGroup(popart.CommGroupType.Orthogonal, 2))
    node = onnx.load_from_string(b.getModelProto()).graph.node[2]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == {
        "__collectiveOperator": 1, "__collectiveCommGroup": [1, 2]}
    got = replicated(b, [total, biggest, mean, ortho], xs)
    np.testing.assert_allclose(got[0], np.broadcast_to(xs.sum(0), xs.shape), rtol=1e-6)
    np.testing.assert_array_equal(got[1], np.broadcast_to(xs.max(0), xs.shape))
    pairs = xs.reshape(2, 2, 2, 3).mean(1)  # replicas (0, 1) and (2, 3)
    np.testing.assert_allclose(got[2], np.repeat(pairs, 2, axis=0), rtol=1e-6)
    strided = xs[[0, 1]] + xs[[2, 3]]      # replicas (0, 2) and (1, 3)
    np.testing.assert_allclose(got[3], np.concatenate([strided, strided]), rtol=1e-6)
    # one replica: the identity
    np.testing.assert_array_equal(run(b, [total], {"x": xs[0]})[0], xs[0])


def test_replicatedreducescatter_gives_each_replica_its_part():
    xs = RNG.random((3, 7)).astype(np.float32)
    b = popart.Builder()
    (x,) = inputs(b, x=xs[0])
    part = b.aiGraphcore.replicatedreducescatter([x])
    local = b.aiGraphcore.replicatedreducescatter([x], popart.CollectiveOperator.Local)
    got, own = replicated(b, [part, local], xs)
    padded = np.concatenate([xs.sum(0), np.zeros(2, np.float32)])  # 7 -> 9 = 3 parts of 3
    np.testing.assert_allclose(got, padded.reshape(3, 3), rtol=1e-6)
    mine = np.concatenate([xs, np.zeros((3, 2), np.float32)], 1).reshape(3, 3, 3)
    np.testing.assert_array_equal(own, mine[[0, 1, 2], [0, 1, 2]])
    np.testing.assert_array_equal(run(b, [part], {"x": xs[0]})[0], xs[0])


def test_collective_refusals():
    b = popart.Builder()
    (x,) = inputs(b, x=np.zeros(3, np.float32))
    b.aiGraphcore.replicatedallreduce([x], popart.CollectiveOperator.LogicalAnd)
    refused(b, "collective operator LogicalAnd is not supported")
    with pytest.raises(TypeError, match="popart.CollectiveOperator"):
        b.aiGraphcore.replicatedallreduce([x], "Add")


# -- splinebasis, splineweighting ---------------------------------------------------------------

def np_spline_basis(pseudo, kernel_size, is_open, degree):
    """torch_spline_conv's spline_basis (PopLibs' SplineBasis vertex), one edge at a time."""
    def factor(v, k):
        if degree == 1:
            return 1 - v - k + 2 * v * k
        if degree == 2:
            return [0.5 * v * v - v + 0.5, -v * v + v + 0.5, 0.5 * v * v][k]
        return [(1 - v) ** 3 / 6, (3 * v ** 3 - 6 * v * v + 4) / 6,
                (-3 * v ** 3 + 3 * v * v + 3 * v + 1) / 6, v ** 3 / 6][k]
    edges, dims = pseudo.shape
    splines = (degree + 1) ** dims
    basis, index = np.zeros((edges, splines)), np.zeros((edges, splines), np.int64)
    for e, s in itertools.product(range(edges), range(splines)):
        k, wi, offset, value = s, 0, 1, 1.0
        for d in range(dims):
            k_mod = k % (degree + 1)
            k //= degree + 1
            v = pseudo[e, d] * (kernel_size[d] - degree * is_open[d])
            wi += ((int(math.floor(v)) + k_mod) % kernel_size[d]) * offset
            offset *= kernel_size[d]
            value *= factor(v - math.floor(v), k_mod)
        basis[e, s], index[e, s] = value, wi
    return basis, index


def test_splinebasis_and_splineweighting():
    pseudo = RNG.random((5, 2)).astype(np.float32)
    kernel_size, is_open = np.array([5, 4], np.int32), np.array([1, 0], np.uint8)
    x, weight = RNG.random((5, 3)).astype(np.float32), RNG.random((20, 3, 2)).astype(np.float32)
    b = popart.Builder()
    i = inputs(b, pseudo=pseudo, kernel_size=kernel_size)
    i.append(b.addInputTensor(popart.TensorInfo("UINT8", [2]), "is_open"))
    ix, iw = inputs(b, x=x, weight=weight)
    outs = []
    for degree in (1, 2, 3):
        basis, index = b.aiGraphcore.splinebasis(i, degree)
        assert b.getTensorShape(basis) == [5, (degree + 1) ** 2]
        out = b.aiGraphcore.splineweighting([ix, iw, basis, index])
        assert b.getTensorShape(out) == [5, 2]
        outs += [basis, index, out]
    got = run(b, outs, dict(pseudo=pseudo, kernel_size=kernel_size, is_open=is_open, x=x,
                            weight=weight))
    for degree in (1, 2, 3):
        got_basis, got_index, got_out = got[3 * degree - 3:3 * degree]
        want_basis, want_index = np_spline_basis(pseudo, kernel_size, is_open, degree)
        np.testing.assert_allclose(got_basis, want_basis, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got_index, want_index)
        assert got_index.dtype == np.int32
        want = np.zeros((5, 2))
        for e, s in itertools.product(range(5), range(want_basis.shape[1])):
            want[e] += want_basis[e, s] * x[e] @ weight[want_index[e, s]]
        np.testing.assert_allclose(got_out, want, rtol=1e-5)


def test_splinebasis_refuses_degree_zero():
    b = popart.Builder()
    i = inputs(b, pseudo=np.zeros((2, 1), np.float32), kernel_size=np.ones(1, np.int32))
    i.append(b.addInputTensor(popart.TensorInfo("UINT8", [1]), "is_open"))
    b.aiGraphcore.splinebasis(i, 0)
    refused(b, "degrees 1 to 3 only")


# -- through a session: the runtime's replicas and session options ------------------------------

def session_run(b: popart.Builder, outputs: list[str], feeds: dict[str, np.ndarray],
                **options) -> list[np.ndarray]:
    opts = popart.SessionOptions()
    for name, value in options.items():
        setattr(opts, name, value)
    session = popart.InferenceSession(
        b.getModelProto(), popart.DataFlow(1, {o: popart.AnchorReturnType("All")
                                               for o in outputs}),
        popart.DeviceManager().createCpuDevice(), userOptions=opts)
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO(feeds, anchors))
    return [anchors[o] for o in outputs]


def test_replicated_collectives_in_a_replicated_session():
    data = RNG.random((4, 5)).astype(np.float32)
    b = popart.Builder()
    (x,) = inputs(b, x=data[0])
    total = b.aiGraphcore.replicatedallreduce([x])
    part = b.aiGraphcore.replicatedreducescatter([x])
    got_total, got_part = session_run(b, [total, part], {"x": data}, enableReplicatedGraphs=True,
                                      replicatedGraphCount=4)
    np.testing.assert_allclose(got_total, np.broadcast_to(data.sum(0), (4, 5)), rtol=1e-6)
    padded = np.concatenate([data.sum(0), np.zeros(3, np.float32)])  # 5 -> 4 parts of 2
    np.testing.assert_allclose(got_part, padded.reshape(4, 2), rtol=1e-6)


def test_groupnormalization_strided_channel_grouping_session_option():
    """groupNormStridedChannelGrouping: channel c is in group c % num_groups."""
    x = RNG.standard_normal((2, 6, 2)).astype(np.float32)
    scale, bias = RNG.random(6).astype(np.float32), RNG.random(6).astype(np.float32)
    b = popart.Builder()
    y, mean, inv = b.aiGraphcore.groupnormalization(inputs(b, x=x, scale=scale, bias=bias), 2)
    got = session_run(b, [y, mean, inv], dict(x=x, scale=scale, bias=bias),
                      groupNormStridedChannelGrouping=True)
    order = [0, 2, 4, 1, 3, 5]  # channels grouped as (0, 2, 4) and (1, 3, 5)
    want_y, want_mean, want_inv = np_group_norm(x[:, order], scale[order], bias[order], 2, 1e-5)
    np.testing.assert_allclose(got[0][:, order], want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], want_inv, rtol=1e-5)
