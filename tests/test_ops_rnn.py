"""Recurrent operators on the xla backend (popart_kit/_runtime/xla/ops_rnn.py): ai.onnx LSTM, GRU
and RNN against onnxruntime (and ONNX's reference evaluator for the batch-major layout), their
gradients against finite differences of a float64 numpy implementation of ONNX's formulas,
PopART's aiGraphcore.lstm against the ai.onnx LSTM with the weights laid out as PopART documents
(lstm_test.py), and what PopART refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator
from test_xla_lowering import builder, model_of

import popart_kit as pk
from popart_kit._runtime.xla.lowering import NodeFailed, lower, unsupported

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")
ort.set_default_logger_severity(3)

RNG = np.random.default_rng(7)
T, B, IN, H = 4, 3, 2, 3  # steps, batch, input size, hidden size


def rand(*shape: int, scale: float = 0.6) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def run_xla(model: onnx.ModelProto, feeds: dict, outputs: list[str]) -> list[np.ndarray]:
    graph = lower(model)
    got = jax.jit(lambda w, x: graph.evaluate(w, x, outputs))(graph.weights, feeds)
    return [np.asarray(got[o]) for o in outputs]


def weights(b: pk.Builder, gates: int, bias: bool = True) -> list[str]:
    ids = [b.addInitializedInputTensor(rand(1, gates * H, IN)),
           b.addInitializedInputTensor(rand(1, gates * H, H))]
    return ids + [b.addInitializedInputTensor(rand(1, 2 * gates * H))] if bias else ids


# -- forward against onnxruntime ------------------------------------------------------------------

def test_onnx_lstm_gru_rnn_agree_with_onnxruntime():
    """One model, many forms: every input of LSTM (sequence lengths, initial states, biases),
    LSTM with PopART's other activations, GRU both ways (linear_before_reset 0 / 1, forward /
    reverse, sequence lengths), RNN with Relu; the outputs not asked for are left out."""
    b = builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [T, B, IN]))
    lens = b.addInputTensor(pk.TensorInfo("INT32", [B]))
    h0, c0 = (b.addInitializedInputTensor(rand(1, B, H)) for _ in range(2))
    full = b.aiOnnx.lstm([x, *weights(b, 4), lens, h0, c0], 3, hidden_size=H)
    acts = b.aiOnnx.lstm([x, *weights(b, 4, bias=False)], 3, hidden_size=H,
                         activations=["Sigmoid", "Relu", "Relu"])
    gru_fwd = b.aiOnnx.gru([x, *weights(b, 3), "", h0], 2, hidden_size=H)
    gru_rev = b.aiOnnx.gru([x, *weights(b, 3), lens], 2, hidden_size=H, direction="reverse",
                           linear_before_reset=1)
    rnn = b.aiOnnx.rnn([x, *weights(b, 1), "", h0], 2, hidden_size=H, activations=["Relu"])
    only_h = b.aiOnnx.lstm([x, *weights(b, 4)], 2, hidden_size=H)[1]
    outputs = [*full, *acts, *gru_fwd, *gru_rev, *rnn, only_h]
    model = model_of(b, outputs)
    feeds = {x: rand(T, B, IN, scale=1.0), lens: np.array([4, 2, 1], np.int32)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(outputs, feeds)
    got = run_xla(model, feeds, outputs)
    for name, value, ref in zip(outputs, got, want, strict=True):
        assert value.shape == ref.shape and value.dtype == ref.dtype, name
        np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.all(got[0][1:, :, 2] == 0) and np.all(got[0][0, :, 2] != 0)  # past its length 1


def test_batch_major_layout_agrees_with_onnx_reference():
    """layout=1 (opset 14, batch-major X, initial and final states, Y): onnxruntime refuses it,
    ONNX's reference evaluator is the oracle."""
    b = builder(14)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [B, T, IN]))
    h0 = b.addInitializedInputTensor(rand(B, 1, H))
    outputs = b.aiOnnx.lstm([x, *weights(b, 4), "", h0], 3, hidden_size=H, layout=1)
    model = model_of(b, outputs)
    feeds = {x: rand(B, T, IN, scale=1.0)}
    want = ReferenceEvaluator(model).run(outputs, feeds)
    for name, got, ref in zip(outputs, run_xla(model, feeds, outputs), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=name)


# -- gradients (finite differences), aiGraphcore.lstm (PopART's layout) ---------------------------

def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-v))


def np_lstm(x, w, r, bias, h, c, gate=_sigmoid, cell=np.tanh):
    """ONNX's LSTM (gates i, o, f, c), float64, Y [T, B, H]."""
    ys = []
    for x_t in x:
        i, o, f, g = np.split(x_t @ w[0].T + h @ r[0].T + bias[0, :4 * H] + bias[0, 4 * H:], 4, -1)
        c = gate(f) * c + gate(i) * cell(g)
        h = gate(o) * cell(c)
        ys.append(h)
    return np.stack(ys)


def np_gru(x, w, r, bias, h):
    """ONNX's GRU with linear_before_reset=1 (gates z, r, h), float64, Y [T, B, H]."""
    wz, wr, wh = np.split(w[0], 3)
    rz, rr, rh = np.split(r[0], 3)
    bz, br, bh, cz, cr, ch = np.split(bias[0], 6)
    ys = []
    for x_t in x:
        z = _sigmoid(x_t @ wz.T + h @ rz.T + bz + cz)
        reset = _sigmoid(x_t @ wr.T + h @ rr.T + br + cr)
        h = (1 - z) * np.tanh(x_t @ wh.T + reset * (h @ rh.T + ch) + bh) + z * h
        ys.append(h)
    return np.stack(ys)


def finite_differences(fn, values: list[np.ndarray], eps: float = 1e-6) -> list[np.ndarray]:
    values = [v.astype(np.float64) for v in values]
    grads = []
    for v in values:
        grad = np.zeros_like(v)
        for index in np.ndindex(v.shape):
            saved = v[index]
            v[index] = saved + eps
            up = fn(*values)
            v[index] = saved - eps
            down = fn(*values)
            v[index] = saved
            grad[index] = (up - down) / (2 * eps)
        grads.append(grad)
    return grads


def popart_layout(w: np.ndarray) -> np.ndarray:
    """ONNX weights [1, 4H, K] (gates i, o, f, c) as PopART's [4, K, H] (f, i, c, o)."""
    chunks = [w[0, g * H:(g + 1) * H].T for g in range(4)]
    return np.stack([chunks[g] for g in (2, 0, 3, 1)])


@pytest.fixture(scope="module")
def differentiated():
    """One model, one compilation (its cost is mostly per compilation, not per op): an LSTM and
    a GRU (linear_before_reset=1) whose loss is sum(Y * cotangent); an ai.onnx LSTM with every
    input and the aiGraphcore.lstm given the same values in PopART's layout (lstm_test.py:
    Weights = [input weights; recurrence weights] re-laid out, Bias = input + recurrence
    biases, InitState = [h0; c0]), each with the loss sum of its outputs' squares; and an
    aiGraphcore.lstm with outputFullSequence=0 and no bias or initial state. Gives the outputs
    and the gradient of every float initializer."""
    b = builder()
    out: dict = {"cases": []}
    for gates, states, reference in ((4, 2, np_lstm), (3, 1, np_gru)):
        values = [rand(T, B, IN, scale=1.0), rand(1, gates * H, IN), rand(1, gates * H, H),
                  rand(1, 2 * gates * H)] + [rand(1, B, H) for _ in range(states)]
        ids = [b.addInitializedInputTensor(v) for v in values]
        if gates == 4:
            y = b.aiOnnx.lstm(ids[:4] + ["", *ids[4:]], 3, hidden_size=H)[0]
        else:
            y = b.aiOnnx.gru(ids[:4] + ["", ids[4]], 2, hidden_size=H, linear_before_reset=1)[0]
        out["cases"].append((values, ids, y, reference, rand(T, 1, B, H, scale=1.0)))

    x, w, r, bias = rand(T, B, IN), rand(1, 4 * H, IN), rand(1, 4 * H, H), rand(1, 8 * H)
    h0, c0 = rand(1, B, H), rand(1, B, H)
    out["onnx_ids"] = [b.addInitializedInputTensor(v) for v in (x, w, r, bias)]
    out["onnx"] = b.aiOnnx.lstm([*out["onnx_ids"],
                                 b.addInitializedInputTensor(np.full(B, T, np.int32)),
                                 b.addInitializedInputTensor(h0),
                                 b.addInitializedInputTensor(c0)], 3)[::2]  # Y, Y_c
    split = [bias[:, g * H:(g + 1) * H] for g in range(8)]
    biases = (np.concatenate([split[g] for g in (2, 0, 3, 1)])
              + np.concatenate([split[g] for g in (6, 4, 7, 5)]))
    out["gc_ids"] = [b.addInitializedInputTensor(v) for v in
                     (x, np.concatenate([popart_layout(w), popart_layout(r)], axis=1), biases)]
    out["gc"] = b.aiGraphcore.lstm([*out["gc_ids"],
                                    b.addInitializedInputTensor(np.concatenate([h0, c0]))])
    out["last"] = b.aiGraphcore.lstm(out["gc_ids"][:2], outputFullSequence=0)[0]
    out["shapes"] = [b.getTensorShape(t) for t in [*out["gc"], out["last"]]]
    out["swish_gelu"] = b.aiOnnx.lstm(out["onnx_ids"][:3], 3,
                                      activations=["Swish", "Gelu", "Gelu"])[0]
    out["swish_gelu_reference"] = np_lstm(
        x.astype(np.float64), w, r, np.zeros((1, 8 * H)), np.zeros((B, H)), np.zeros((B, H)),
        gate=lambda v: v * _sigmoid(v),
        cell=lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3))))
    out["zero_state_reference"] = np_lstm(x.astype(np.float64), w, r, np.zeros((1, 8 * H)),
                                          np.zeros((B, H)), np.zeros((B, H)))[-1]
    squared = [*out["onnx"], *out["gc"]]
    wanted = [case[2] for case in out["cases"]] + squared + [out["last"], out["swish_gelu"]]
    graph = lower(model_of(b, wanted))

    def loss(ws):
        got = graph.evaluate(ws, {}, wanted)
        total = sum(jnp.sum(got[y] * cotangent) for _, _, y, _, cotangent in out["cases"])
        return total + sum(jnp.sum(got[t] ** 2) for t in squared), got

    grads, got = jax.jit(jax.grad(loss, has_aux=True))(
        {k: jnp.asarray(v) for k, v in graph.weights.items() if v.dtype == np.float32})
    out["grads"] = {k: np.asarray(v) for k, v in grads.items()}
    out["values"] = {k: np.asarray(v) for k, v in got.items()}
    return out


def test_gradients_match_finite_differences(differentiated):
    """d(sum(Y * cotangent))/d(every input) of an LSTM and of a GRU (linear_before_reset=1),
    by JAX through the lowered model, against central differences of the float64 numpy
    formulas."""
    for values, ids, _, reference, cotangent in differentiated["cases"]:
        def reference_loss(*vs, reference=reference, cotangent=cotangent):
            ys = reference(*vs[:4], *(state[0] for state in vs[4:]))
            return float(np.sum(ys * cotangent[:, 0]))
        want = finite_differences(reference_loss, values)
        for name, w in zip(ids, want, strict=True):
            np.testing.assert_allclose(differentiated["grads"][name], w, rtol=2e-3, atol=2e-5,
                                       err_msg=name)


def test_graphcore_lstm_equals_onnx_lstm_with_popart_layout(differentiated):
    """With the weights, biases and initial state laid out as PopART documents, the
    aiGraphcore.lstm gives the ai.onnx LSTM's hidden states and last cell state bit for bit,
    and the gradients of its inputs are the ONNX ones laid out the same way. With
    outputFullSequence=0 it gives the last hidden state [batch, hidden]."""
    d = differentiated
    (y, y_c), (out, cell), values, grads = d["onnx"], d["gc"], d["values"], d["grads"]
    assert d["shapes"] == [[T, B, H], [B, H], [B, H]]
    np.testing.assert_array_equal(values[out], values[y][:, 0])
    np.testing.assert_array_equal(values[cell], values[y_c][0])
    (x, w, r, bias), (gc_x, gc_w, gc_b) = d["onnx_ids"], d["gc_ids"]
    np.testing.assert_allclose(grads[gc_x], grads[x], rtol=1e-5, atol=1e-7)
    relaid = np.concatenate([popart_layout(grads[w]), popart_layout(grads[r])], axis=1)
    np.testing.assert_allclose(grads[gc_w], relaid, rtol=1e-5, atol=1e-7)
    bias_grad = grads[bias][0, :4 * H]
    np.testing.assert_allclose(
        grads[gc_b], np.stack([bias_grad[g * H:(g + 1) * H] for g in (2, 0, 3, 1)]),
        rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(grads[bias][0, 4 * H:], bias_grad)
    np.testing.assert_allclose(values[d["last"]], d["zero_state_reference"], rtol=1e-5,
                               atol=1e-6)


# -- what PopART refuses --------------------------------------------------------------------------

def _problems(op: str, gates: int, peephole: bool = False, **attrs) -> str:
    b = builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [T, B, IN]))
    ids = [x, *weights(b, gates, bias=False)]
    if peephole:
        ids += ["", "", "", "", b.addInitializedInputTensor(rand(1, 3 * H))]
    outs = getattr(b.aiOnnx, op)(ids, 2, **attrs)
    return "\n".join(unsupported(model_of(b, outs)))


@pytest.mark.parametrize(("op", "gates", "peephole", "attrs", "words"), [
    ("lstm", 4, False, {"direction": "reverse"},
     "LSTMOp attribute `direction' must be unset or `forward'"),
    ("lstm", 4, False, {"activations": ["Affine", "Affine", "Affine"]},
     "Activation type 'Affine' is not supported"),
    ("lstm", 4, False, {"activations": ["Sigmoid", "Tanh", "Relu"]},
     "LSTM activations must be the same for output and forget gates."),
    ("lstm", 4, False, {"clip": 1.0}, "LSTMOp attribute `clip' is not supported"),
    ("lstm", 4, False, {"input_forget": 1}, "LSTMOp attribute `input_forget' must be set to 0"),
    ("lstm", 4, True, {}, "Popart does not support peephole connections"),
    ("gru", 3, False, {"direction": "bidirectional"},
     "Bidirectional GRU has not yet been implemented"),
    ("gru", 3, False, {"activations": ["Sigmoid", "Tanh"]},
     "GRUOp attribute `activations' is not supported"),
    ("rnn", 1, False, {"activations": ["Tanh", "Tanh"]},
     "only supports 1 activation, 2 were specified"),
    ("rnn", 1, False, {"activation_alpha": [1.0]}, "`activation_alpha' of RNN"),
    ("rnn", 1, False, {"direction": "reverse"}, "only supports `forward' direction"),
])
def test_refusals_in_popart_words(op, gates, peephole, attrs, words):
    assert words in _problems(op, gates, peephole, **attrs)


def test_hidden_size_is_taken_from_the_weights_and_checked():
    """Without hidden_size the Builder types the outputs from R, as PopART's setup does; a
    hidden_size that R contradicts fails when the node is evaluated, with PopART's words."""
    b = builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [T, B, IN]))
    y, y_h = b.aiOnnx.rnn([x, *weights(b, 1)], 2)
    assert b.getTensorShape(y) == [T, 1, B, H] and b.getTensorShape(y_h) == [1, B, H]
    wrong = b.aiOnnx.rnn([x, *weights(b, 1)], 2, hidden_size=H + 1)[1]
    with pytest.raises(NodeFailed, match="does not match hidden size calculated from "
                                         "recurrenceWeights tensor"):
        run_xla(model_of(b, [wrong]), {x: rand(T, B, IN)}, [wrong])


def test_popart_activations(differentiated):
    """PopART's own activation names (Swish for the gates, Gelu - poplibs' tanh form - for the
    cell) against the numpy formulas."""
    d = differentiated
    np.testing.assert_allclose(d["values"][d["swish_gelu"]][:, 0], d["swish_gelu_reference"],
                               rtol=1e-5, atol=1e-6)
