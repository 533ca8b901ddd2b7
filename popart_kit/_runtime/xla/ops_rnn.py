"""Recurrent operators as PopART runs them: ai.onnx LSTM, GRU and RNN and PopART's own LSTM
(ai.graphcore, ``builder.aiGraphcore.lstm``).

Each is one ``lax.scan`` over time (the input projection of every step is one product before
it); JAX differentiates the scan. What PopART implements (willow/src/op/lstm.cpp, gru.cpp,
rnn.cpp and their popx lowerings) is implemented, what it refuses is refused with its words:

* **LSTM** (ai.onnx 1, 7): forward only; initial_h, initial_c, B (the input and recurrence
  biases are added); ``activations`` of 1 to 3 names from PopART's list (the gates' function,
  then the cell's, the third equal to the second); no peepholes, clip, activation_alpha/beta or
  input_forget.
* **GRU** (ai.onnx 3, 7): ``direction`` forward and reverse (and PopART's own "backward", whose
  Y stays in processing order, as PopART gives it); ``linear_before_reset``; no activations,
  clip or bidirectional.
* **RNN** (ai.onnx 7): forward only; one activation from PopART's list; no clip or
  activation_alpha/beta.
* **ai.graphcore LSTM**: inputs X [T, B, I], Weights [4, I + H, H] (the input weights above the
  recurrence weights, gates in poplibs' order forget, input, candidate, output), Bias [4, H],
  InitState [2, B, H] (h then c), SeqLengths; outputs the hidden states (all steps, or the last
  with ``output_full_sequence=0``) and the last cell state.

``sequence_lens`` follows ONNX for all of them: a batch entry's state stops at its length, its Y
is zero after it and Y_h / Y_c are its state at its last step. (PopART ignores sequence_lens for
GRU and RNN; poplibs masks the LSTM but PopART reads Y_h from the last step: both agree with
this where every length is the full sequence.) The ``layout`` attribute of opset 14 (batch-major
tensors) is implemented as ONNX defines it; Tanh is computed to within an ulp (see ``_tanh``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .ops import GRAPHCORE, Ctx, NotSupported, op

__all__ = ["ACTIVATIONS", "lstm"]


@jax.custom_jvp
def _tanh(x: Any) -> Any:
    """tanh within an ulp of the correctly rounded value: XLA's CPU tanh gives exactly +-1 from
    |x| > 7.9 on (float32's tanh reaches 1 at 9.01), which zeroes the gradients of saturated
    units that torch and numpy keep; the tail is 1 - 2 / (exp(2|x|) + 1)."""
    e = jnp.exp(2 * jnp.abs(x))
    tail = jnp.sign(x) * (1 - 2 / (e + 1))
    return jnp.where(jnp.abs(x) > 1, tail, jnp.tanh(x)).astype(x.dtype)


@_tanh.defjvp
def _tanh_jvp(primals: tuple[Any], tangents: tuple[Any]) -> tuple[Any, Any]:
    y = _tanh(primals[0])
    return y, (1 - y * y) * tangents[0]  # from the rounded output, as torch differentiates


#: The activation functions PopART's recurrent ops take (lstmutil.cpp ``fromString``), as
#: poplibs computes them: Gelu is the tanh approximation, the softmaxes run over the hidden
#: units, SoftmaxScaled is the softmax times 62000 (poplibs' SOFTMAX_SCALING).
ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "Sigmoid": jax.nn.sigmoid,
    "Tanh": _tanh,
    "Relu": lambda x: jnp.maximum(x, jnp.zeros((), x.dtype)),
    "Gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "Swish": lambda x: x * jax.nn.sigmoid(x),
    "Softmax": lambda x: jax.nn.softmax(x, axis=-1),
    "SoftmaxStable": lambda x: jax.nn.softmax(x, axis=-1),
    "SoftmaxScaled": lambda x: (jax.nn.softmax(x, axis=-1) * 62000.0).astype(x.dtype),
}
_HALF = (np.dtype(np.float16), np.dtype(jnp.bfloat16))


def _op_name(op_type: str, ctx: Ctx) -> str:
    """The node as PopART's messages name an op (``debugName``): its type and its name."""
    return f"{op_type} {ctx.name!r}" if ctx.name else op_type


# -- checks (PopART's op creators) ----------------------------------------------------------------

def _activation(name: Any, suffix: str = "") -> str:
    if name not in ACTIVATIONS:
        raise NotSupported(f"Activation type '{name}' is not supported{suffix}; PopART's "
                           f"recurrent ops take {', '.join(ACTIVATIONS)}")
    return name


def _lstm_activations(ctx: Ctx) -> tuple[str, str]:
    """(gate activation, cell activation) of an ai.onnx LSTM, read as PopART reads them."""
    names = ctx.attr("activations")
    gates, cell = "Sigmoid", "Tanh"
    if names is None:
        return gates, cell
    if len(names) >= 1:
        gates = _activation(names[0])
    if len(names) >= 2:
        cell = _activation(names[1])
    if len(names) >= 3 and names[1] != names[2]:
        raise NotSupported(f"LSTM activations must be the same for output and forget gates. "
                           f"({names[1]!r} and {names[2]!r}) Fix: give the cell's activation "
                           f"as both the second and the third.")
    if len(names) > 3:
        raise NotSupported(f"Too many activations ({len(names)}) specified. Number of "
                           f"activations should be 1 or 3. Fix: name the gates' activation, "
                           f"then the cell's twice (PopART's LSTM has one direction).")
    return gates, cell


_UNSET = {"activation_alpha": "PopART's activations take no parameters",
          "activation_beta": "PopART's activations take no parameters",
          "clip": "PopART's recurrent ops do not clip",
          "activations": "PopART's GRU uses Sigmoid and Tanh"}
_REVERSE = ("Fix: reverse the sequence (aiGraphcore.reverse on axis 0) and run it forward; "
            "for bidirectional, two ops whose outputs are concatenated.")


def _refuse_attributes(ctx: Ctx, message: Callable[[str], str], *names: str) -> None:
    for name in names:
        if name in ctx.attrs:
            raise NotSupported(f"{message(name)} Fix: leave it unset ({_UNSET[name]}).")


def _check_layout(ctx: Ctx) -> None:
    if ctx.attr("layout", 0) not in (0, 1):
        raise NotSupported(f"attribute layout={ctx.attr('layout')!r} is not supported; "
                           f"ONNX defines 0 (time-major) and 1 (batch-major)")


def _check_lstm(ctx: Ctx) -> None:
    if ctx.attr("direction", "forward") != "forward":
        raise NotSupported(f"LSTMOp attribute `direction' must be unset or `forward' "
                           f"{_REVERSE}")
    _lstm_activations(ctx)
    _refuse_attributes(ctx, lambda n: f"LSTMOp attribute `{n}' is not supported",
                       "activation_alpha", "activation_beta", "clip")
    if ctx.attr("input_forget", 0) != 0:
        raise NotSupported("LSTMOp attribute `input_forget' must be set to 0 Fix: leave it at "
                           "0.")
    if ctx.has_input(7):
        raise NotSupported("Popart does not support peephole connections Fix: omit input P "
                           "(the eighth).")
    _check_layout(ctx)


_GRU_DIRECTIONS = ("forward", "reverse", "backward")


def _check_gru(ctx: Ctx) -> None:
    _refuse_attributes(ctx, lambda n: f"GRUOp attribute `{n}' is not supported",
                       "activations", "activation_alpha", "activation_beta", "clip")
    if ctx.attr("input_forget", 0) != 0:
        raise NotSupported("GRUOp attribute `input_forget' must be set to 0 Fix: leave it at "
                           "0.")
    direction = ctx.attr("direction", "forward")
    if direction == "bidirectional":
        raise NotSupported(f"Bidirectional GRU has not yet been implemented. This is for Op "
                           f"{_op_name('GRU', ctx)} Fix: two GRUs, direction forward and "
                           f"reverse, their outputs concatenated on the num_directions axis.")
    if direction not in _GRU_DIRECTIONS:
        raise NotSupported(f"GRU direction {direction!r} is not supported; use one of "
                           f"{', '.join(_GRU_DIRECTIONS)}")
    _check_layout(ctx)


def _rnn_activation(ctx: Ctx) -> str:
    names = ctx.attr("activations")
    if names is None:
        return "Tanh"
    if len(names) != 1:
        raise NotSupported(f"{_op_name('RNN', ctx)} only supports 1 activation, {len(names)} were "
                           f"specified")
    return _activation(names[0], f" for {_op_name('RNN', ctx)}")


def _check_rnn(ctx: Ctx) -> None:
    _rnn_activation(ctx)
    _refuse_attributes(ctx, lambda n: f"Attribute `{n}' of {_op_name('RNN', ctx)} is not "
                       f"supported",
                       "activation_alpha", "activation_beta", "clip")
    if ctx.attr("direction", "forward") != "forward":
        raise NotSupported(f"{_op_name('RNN', ctx)} only supports `forward' direction "
                           f"{_REVERSE}")
    _check_layout(ctx)


# -- shapes (PopART's setup, checked when traced) -------------------------------------------------

def _expect(what: str, value: Any, shape: Sequence[int], fix: str = "") -> None:
    if value is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {list(value.shape)}, expected {list(shape)}"
                         f"{'; ' + fix if fix else ''}")


def _hidden_size(ctx: Ctx, r: Any, op_name: str) -> int:
    """H from the recurrence weights R [1, gates * H, H]; PopART's error if the hidden_size
    attribute says otherwise."""
    if r.ndim != 3:
        raise ValueError(f"R (the recurrence weights) has shape {list(r.shape)}; ONNX's "
                         f"{op_name} takes [num_directions, gates * hidden_size, hidden_size]")
    hidden = int(r.shape[2])
    given = ctx.attr("hidden_size")
    if given is not None and int(given) != hidden:
        raise ValueError(f"hidden_size attribute passed to {_op_name(op_name, ctx)} ({given}) does "
                         f"not match hidden size calculated from recurrenceWeights tensor "
                         f"({hidden}).")
    return hidden


def _sequence_lengths(lens: Any, batch: int) -> Any:
    if lens is None:
        return None
    if lens.ndim != 1:
        raise ValueError(f"Invalid rank for sequence length tensor : {lens.ndim} != 1")
    if lens.shape[0] != batch:
        raise ValueError(f"Incorrect sequence len shape : {list(lens.shape)} != [{batch}]")
    return jnp.asarray(lens).astype(jnp.int32)


def _time_major(ctx: Ctx, x: Any) -> Any:
    return jnp.swapaxes(x, 0, 1) if ctx.attr("layout", 0) else x


def _state_in(ctx: Ctx, state: Any, name: str, batch: int, hidden: int) -> Any:
    """initial_h / initial_c [1, B, H] (batch-major: [B, 1, H]) as [B, H]; None if omitted."""
    if state is None:
        return None
    batch_major = bool(ctx.attr("layout", 0))
    _expect(name, state, (batch, 1, hidden) if batch_major else (1, batch, hidden))
    return state[:, 0] if batch_major else state[0]


def _outputs(ctx: Ctx, ys: Any, *states: Any) -> tuple[Any, ...]:
    """Y [T, 1, B, H] and the final states [1, B, H] (batch-major: [B, T, 1, H], [B, 1, H]);
    None for the outputs not asked for."""
    batch_major = bool(ctx.attr("layout", 0))
    y = None
    if ctx.wants(0):
        y = jnp.transpose(ys[:, None], (2, 0, 1, 3)) if batch_major else ys[:, None]
    finals = tuple((s[:, None] if batch_major else s[None]) if ctx.wants(i + 1) else None
                   for i, s in enumerate(states))
    return (y, *finals)


# -- the recurrence -------------------------------------------------------------------------------

def _product(spec: str, a: Any, b: Any) -> Any:
    """A product in ``a``'s type; half-precision ones accumulate in float32 (poplibs' default
    partials for recurrent layers)."""
    if np.dtype(a.dtype) in _HALF:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(a.dtype)
    return jnp.einsum(spec, a, b)


def _scan(cell: Callable[[tuple[Any, ...], Any], tuple[Any, ...]], state: tuple[Any, ...],
          steps: Any, lens: Any, reverse: bool) -> tuple[tuple[Any, ...], Any]:
    """Run ``cell(state, step_input) -> new state`` (its first entry the hidden state) over the
    leading axis of ``steps``; entries past their length (``lens``, None for all the steps) keep
    their state and give zeros. Returns the final state and the hidden state of every step, in
    time order. (The mask is there without ``lens`` too: XLA then compiles the same step either
    way, and a model gives the same values with lengths as without.)"""
    count = jax.tree_util.tree_leaves(steps)[0].shape[0]
    if lens is None:
        lens = jnp.full(state[0].shape[:1], count, jnp.int32)

    def body(carry: tuple[Any, ...], inputs: tuple[Any, Any]) -> tuple[tuple[Any, ...], Any]:
        t, x_t = inputs
        new = cell(carry, x_t)
        valid = (t < lens)[:, None]
        new = tuple(jnp.where(valid, n, c) for n, c in zip(new, carry, strict=True))
        return new, jnp.where(valid, new[0], jnp.zeros((), new[0].dtype))

    return lax.scan(body, state, (jnp.arange(count), steps), reverse=reverse)


def lstm(x: Any, w_in: Any, w_rec: Any, bias: Any, h0: Any, c0: Any, lens: Any = None,
         gates: str = "Sigmoid", cell: str = "Tanh") -> tuple[Any, Any, Any]:
    """An LSTM in poplibs' layout: x [T, B, I], w_in [4, I, H], w_rec [4, H, H], bias [4, H],
    gates in the order forget, input, candidate, output. Returns (hidden states [T, B, H],
    last hidden state, last cell state)."""
    gate, act = ACTIVATIONS[gates], ACTIVATIONS[cell]
    projected = _product("tbi,gih->tgbh", x, w_in) + bias[:, None, :]

    def step(state: tuple[Any, Any], p: Any) -> tuple[Any, Any]:
        h, c = state
        units = p + _product("bk,gkh->gbh", h, w_rec)
        c = gate(units[0]) * c + gate(units[1]) * act(units[2])
        return gate(units[3]) * act(c), c

    (h, c), ys = _scan(step, (h0, c0), projected, lens, reverse=False)
    return ys, h, c


def _zeros(x: Any, hidden: int) -> Any:
    return jnp.zeros((x.shape[1], hidden), x.dtype)


def _onnx_weights(w: Any, gates: int, hidden: int, order: Sequence[int] | None = None) -> Any:
    """ONNX weights [1, gates * H, K] as [gates, K, H], the gates taken in ``order``."""
    if w.ndim != 3 or w.shape[0] != 1 or w.shape[1] != gates * hidden:
        raise ValueError(f"weights have shape {list(w.shape)}, expected [1, {gates * hidden}, "
                         f"K] (one direction, {gates} gates of hidden size {hidden})")
    w = jnp.swapaxes(w[0].reshape(gates, hidden, w.shape[2]), 1, 2)
    return w if order is None else w[np.asarray(order)]


def _onnx_biases(b: Any, gates: int, hidden: int) -> tuple[Any, Any]:
    """ONNX biases [1, 2 * gates * H] as the input and recurrence biases, [gates, H] each."""
    _expect("B (the biases)", b, (1, 2 * gates * hidden))
    b = b[0].reshape(2, gates, hidden)
    return b[0], b[1]


_ONNX_TO_POPLIBS = (2, 0, 3, 1)  # ONNX's i, o, f, c as poplibs' f, i, c, o


@op("LSTM", check=_check_lstm)
def onnx_lstm(ctx: Ctx, x: Any, w: Any, r: Any, b: Any = None, lens: Any = None,
              h0: Any = None, c0: Any = None, p: Any = None) -> tuple[Any, ...]:
    x = _time_major(ctx, x)
    hidden = _hidden_size(ctx, r, "LSTM")
    w_in = _onnx_weights(w, 4, hidden, _ONNX_TO_POPLIBS)
    w_rec = _onnx_weights(r, 4, hidden, _ONNX_TO_POPLIBS)
    if b is None:
        bias = jnp.zeros((4, hidden), x.dtype)
    else:
        b_in, b_rec = _onnx_biases(b, 4, hidden)
        bias = (b_in + b_rec)[np.asarray(_ONNX_TO_POPLIBS)]
    h0 = _state_in(ctx, h0, "initial_h", x.shape[1], hidden)
    c0 = _state_in(ctx, c0, "initial_c", x.shape[1], hidden)
    gates, cell = _lstm_activations(ctx)
    ys, h, c = lstm(x, w_in, w_rec, bias, _zeros(x, hidden) if h0 is None else h0,
                    _zeros(x, hidden) if c0 is None else c0,
                    _sequence_lengths(lens, x.shape[1]), gates, cell)
    return _outputs(ctx, ys, h, c)


@op("LSTM", domain=GRAPHCORE)
def graphcore_lstm(ctx: Ctx, x: Any, weights: Any, bias: Any = None, state: Any = None,
                   lens: Any = None) -> tuple[Any, Any]:
    """PopART's LSTM (PopartLSTMOp): see the module docstring for the layout."""
    if x.ndim != 3 or weights.ndim != 3:
        raise ValueError(f"ai.graphcore LSTM takes X [seq, batch, input] and Weights [4, "
                         f"input + hidden, hidden]; got {list(x.shape)} and "
                         f"{list(weights.shape)}")
    steps, batch, size = x.shape
    hidden = weights.shape[2]
    _expect("Weights", weights, (4, size + hidden, hidden),
            "PopART's LSTM weights are [4, input_size + hidden_size, hidden_size]")
    _expect("Bias", bias, (4, hidden))
    _expect("InitState", state, (2, batch, hidden), "the initial h above the initial c")
    bias = jnp.zeros((4, hidden), x.dtype) if bias is None else bias
    h0, c0 = (_zeros(x, hidden), _zeros(x, hidden)) if state is None else (state[0], state[1])
    ys, h, c = lstm(x, weights[:, :size], weights[:, size:], bias, h0, c0,
                    _sequence_lengths(lens, batch))
    full = ctx.attr("output_full_sequence", 1)
    return (ys if full else h), c


@op("GRU", check=_check_gru)
def onnx_gru(ctx: Ctx, x: Any, w: Any, r: Any, b: Any = None, lens: Any = None,
             h0: Any = None) -> tuple[Any, ...]:
    x = _time_major(ctx, x)
    hidden = _hidden_size(ctx, r, "GRU")
    w_in, w_rec = _onnx_weights(w, 3, hidden), _onnx_weights(r, 3, hidden)
    if b is None:
        b_in = b_rec = jnp.zeros((3, hidden), x.dtype)
    else:
        b_in, b_rec = _onnx_biases(b, 3, hidden)
    h0 = _state_in(ctx, h0, "initial_h", x.shape[1], hidden)
    linear_before_reset = bool(ctx.attr("linear_before_reset", 0))
    projected = _product("tbi,gih->tgbh", x, w_in) + b_in[:, None, :]

    def step(state: tuple[Any], p: Any) -> tuple[Any]:
        (h,) = state
        update_reset = p[:2] + _product("bk,gkh->gbh", h, w_rec[:2]) + b_rec[:2, None, :]
        z, r_ = jax.nn.sigmoid(update_reset[0]), jax.nn.sigmoid(update_reset[1])
        if linear_before_reset:
            recurrent = r_ * (_product("bk,kh->bh", h, w_rec[2]) + b_rec[2])
        else:
            recurrent = _product("bk,kh->bh", r_ * h, w_rec[2]) + b_rec[2]
        candidate = _tanh(p[2] + recurrent)
        return ((1 - z) * candidate + z * h,)

    direction = ctx.attr("direction", "forward")
    (h,), ys = _scan(step, (_zeros(x, hidden) if h0 is None else h0,), projected,
                     _sequence_lengths(lens, x.shape[1]), reverse=direction != "forward")
    if direction == "backward":  # PopART's own spelling: Y in the order the steps ran
        ys = ys[::-1]
    return _outputs(ctx, ys, h)


@op("RNN", check=_check_rnn)
def onnx_rnn(ctx: Ctx, x: Any, w: Any, r: Any, b: Any = None, lens: Any = None,
             h0: Any = None) -> tuple[Any, ...]:
    x = _time_major(ctx, x)
    hidden = _hidden_size(ctx, r, "RNN")
    w_in, w_rec = _onnx_weights(w, 1, hidden)[0], _onnx_weights(r, 1, hidden)[0]
    projected = _product("tbi,ih->tbh", x, w_in)
    if b is not None:
        b_in, b_rec = _onnx_biases(b, 1, hidden)
        projected = projected + (b_in[0] + b_rec[0])
    h0 = _state_in(ctx, h0, "initial_h", x.shape[1], hidden)
    act = ACTIVATIONS[_rnn_activation(ctx)]

    def step(state: tuple[Any], p: Any) -> tuple[Any]:
        return (act(p + _product("bk,kh->bh", state[0], w_rec)),)

    (h,), ys = _scan(step, (_zeros(x, hidden) if h0 is None else h0,), projected,
                     _sequence_lengths(lens, x.shape[1]), reverse=False)
    return _outputs(ctx, ys, h)
