"""PopART's ai.graphcore network operators on the xla backend: MultiConv, Ctc (ctcloss),
CtcBeamSearchDecoder, GroupNormalization, BatchNormalization (ai.graphcore's, unbiased
variance), NormalizeImage, ReplicatedAllReduce, ReplicatedReduceScatter, SplineBasis and
SplineWeighting (willow/src/op/*.cpp for shapes and errors, willow/src/popx/op/*x.cpp and
PopLibs for the computation).

Gradients are PopART's: MultiConv's and GroupNormalization's are the chain rule of the forward
(JAX's; the statistics outputs pass none back, as PopART's grad ops read only dY); Ctc's and
BatchNormalization's are PopART's own (``jax.custom_vjp``); CtcBeamSearchDecoder,
NormalizeImage, ReplicatedAllReduce and the spline operators have no grad op in PopART, so no
gradient flows through them here either.

The replicated collectives reduce over the session's replicas: the replica axes a replicated
step binds (:data:`~.steps.LOCAL_REPLICA`, the vectorised replicas of a device, and the mesh's
:data:`~.placement.PROCESS` and :data:`~.placement.REPLICA`); where none is bound there is one
replica and they are the identity.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from onnx import TensorProto

from ..._model.builder_settings import COMM_GROUP
from ..._model.graphcore.nn_ops import COLLECTIVE_OPERATOR
from .ops import GRAPHCORE, Ctx, NotSupported, np_dtype, partials
from .ops import op as _op
from .ops_conv import conv
from .placement import PROCESS, REPLICA
from .steps import LOCAL_REPLICA

__all__ = ["group_norm_channels", "replica_axes"]


def op(*names: str, **kwargs: Any) -> Callable[[Callable], Callable]:
    """Register ai.graphcore operators."""
    return _op(*names, domain=GRAPHCORE, **kwargs)


def _float(x: Any) -> Any:
    """``x`` in float32 at least (PopLibs' statistics use float partials)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# -- MultiConv ----------------------------------------------------------------------------------

_NEUTRAL = {"inDilations": 1, "outPads": 0}


def _partials_of(ctx: Ctx, count: int) -> list[str | None]:
    """Each convolution's partials type (``__partials_type``: one per convolution, or one for
    all); None: the session's."""
    given = ctx.attr("__partials_type")
    if given is None:
        return [None] * count
    kinds = [given] * count if isinstance(given, str) else list(given)
    if len(kinds) != count:
        raise NotSupported(f"__partials_type has {len(kinds)} values for {count} convolutions")
    for kind in kinds:
        if kind.lower() not in ("float", "half"):
            raise NotSupported(f"Bad partialsType '{kind.lower()}'")
    return [kind.lower() for kind in kinds]


def _check_multiconv(ctx: Ctx) -> None:
    for key, neutral in _NEUTRAL.items():
        values = ctx.attr(key) or []
        if any(int(v) != neutral for v in values):
            raise NotSupported(
                f"attribute {key}={list(values)}: PopART's MultiConvOp reads only strides, pads "
                f"and dilations (willow/src/op/multiconv.cpp), so it computes as if {key} were "
                f"all {neutral} while its Builder sizes the outputs with them; the xla backend "
                f"refuses it rather than pick one. Fix: leave {key} empty.")
    _partials_of(ctx, int(ctx.attr("numConvs", 1)))


@op("MultiConv", check=_check_multiconv)
def multiconv(ctx: Ctx, *inputs: Any) -> tuple[Any, ...]:
    """Several independent convolutions: (data, weights, bias or omitted) per convolution, its
    strides, pads and dilations read from the flattened attributes at its place; each one is
    the Conv lowering (groups: data channels / weight channels), with its own partials type."""
    count = int(ctx.attr("numConvs", 1))
    inputs = inputs + (None,) * (3 * count - len(inputs))
    names = tuple(ctx.inputs) + ("",) * (3 * count - len(ctx.inputs))
    kinds = _partials_of(ctx, count)
    outs, done = [], 0
    for i in range(count):
        x, w, b = inputs[3 * i:3 * i + 3]
        n = x.ndim - 2
        attrs: dict[str, Any] = {"group": x.shape[1] // w.shape[1]}
        for key, per in (("strides", 1), ("pads", 2), ("dilations", 1)):
            flat = ctx.attr(key)
            if flat:
                attrs[key] = list(flat[per * done:per * (done + n)])
        one = Ctx(ctx.name, "Conv", ctx.opset, attrs, names[3 * i:3 * i + 3],
                  (ctx.outputs[i] if i < len(ctx.outputs) else "",), (False,) * 3)
        with partials(kinds[i]) if kinds[i] else contextlib.nullcontext():
            outs.append(conv(one, x, w, b))
        done += n
    return tuple(outs)


# -- Ctc (ctcloss) ------------------------------------------------------------------------------

_NEG_INF = -jnp.inf
#: log(0) in the CTC recursion: finite, so that its gradient has no NaN from inf - inf; a loss
#: beyond _IMPOSSIBLE means no alignment exists (an infinite loss)
_LOG_ZERO, _IMPOSSIBLE = -1e30, 1e29


def _ctc_nll(lp: Any, targets: Any, in_len: Any, tgt_len: Any, blank: int) -> Any:
    """-log p(targets | lp) per sample, [N] (inf where no alignment exists): the CTC forward
    (alpha) recursion in log space over the targets with blanks between and around them, from
    a virtual start state; frames at or past a sample's input length leave its alphas
    unchanged."""
    steps, batch, _ = lp.shape
    width = 2 * targets.shape[1] + 1
    labels = jnp.full((batch, width), blank, jnp.int32).at[:, 1::2].set(targets)
    skip = jnp.zeros((batch, width), bool).at[:, 2:].set(
        (labels[:, 2:] != blank) & (labels[:, 2:] != labels[:, :-2]))
    emit = jnp.take_along_axis(lp, jnp.broadcast_to(labels, (steps, batch, width)), axis=2)
    start = jnp.full((batch, width), _LOG_ZERO, lp.dtype).at[:, 0].set(0.0)
    pad1 = jnp.full((batch, 1), _LOG_ZERO, lp.dtype)
    pad2 = jnp.full((batch, 2), _LOG_ZERO, lp.dtype)

    def step(alpha: Any, inputs: Any) -> tuple[Any, None]:
        t, e = inputs
        one = jnp.concatenate([pad1, alpha[:, :-1]], axis=1)
        two = jnp.where(skip, jnp.concatenate([pad2, alpha[:, :-2]], axis=1), _LOG_ZERO)
        new = jnp.logaddexp(jnp.logaddexp(alpha, one), two) + e
        return jnp.where((t < in_len)[:, None], new, alpha), None

    alpha, _ = lax.scan(step, start, (jnp.arange(steps), emit))
    end = 2 * tgt_len
    last = jnp.take_along_axis(alpha, end[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(alpha, jnp.maximum(end - 1, 0)[:, None], axis=1)[:, 0]
    nll = -jnp.logaddexp(last, jnp.where(tgt_len > 0, before, _LOG_ZERO))
    return jnp.where(nll > _IMPOSSIBLE, jnp.inf, nll)


def _ctc_loss_and_gradient(lp: Any, targets: Any, in_len: Any, tgt_len: Any, blank: int,
                           zero_infinity: bool) -> tuple[Any, Any]:
    """PopLibs' calcLossAndGradientLogProbabilities: the loss per sample and the gradient of
    each sample's loss with respect to the log probabilities with the LogSoftmax gradient
    included, exp(lp) - posterior (the posterior: how much of the sample's probability passes
    through class c at frame t). An impossible alignment has an infinite loss and a NaN
    gradient; with zeroInfinity both are zero."""
    nll, pull = jax.vjp(lambda p: _ctc_nll(p, targets, in_len, tgt_len, blank), lp)
    (minus_posterior,) = pull(jnp.ones_like(nll))
    grad = jnp.exp(lp) + minus_posterior
    infinite = jnp.isinf(nll)
    if zero_infinity:
        nll = jnp.where(infinite, 0.0, nll)
        grad = jnp.where(infinite[None, :, None], 0.0, grad)
    else:
        grad = jnp.where(infinite[None, :, None], jnp.nan, grad)
    return nll, grad


def _ctc_per_sample_scale(reduction: str, tgt_len: Any, batch: int, dtype: Any) -> Any:
    """What each sample's loss is multiplied by before the sum (CtcOpx::applyReduction)."""
    if reduction == "Mean":
        return 1.0 / (jnp.maximum(tgt_len, 1).astype(dtype) * batch)
    return jnp.ones(tgt_len.shape, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ctc(lp: Any, targets: Any, in_len: Any, tgt_len: Any, blank: int, reduction: str,
         zero_infinity: bool, out: Any, gradient: bool) -> tuple[Any, Any]:
    """(loss, gradient output); the gradient output (its computation costs a backward pass)
    only when ``gradient`` is asked or the loss is differentiated, else None."""
    if gradient:
        return _ctc_forward(lp, targets, in_len, tgt_len, blank, reduction, zero_infinity,
                            out, gradient)[0]
    nll = _ctc_nll(_float(lp), targets, in_len, tgt_len, blank)
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), 0.0, nll)
    return _reduce_ctc(nll, reduction, tgt_len).astype(out), None


def _reduce_ctc(nll: Any, reduction: str, tgt_len: Any) -> Any:
    if reduction == "None":
        return nll
    return jnp.sum(nll * _ctc_per_sample_scale(reduction, tgt_len, nll.shape[0], nll.dtype))


def _ctc_forward(lp: Any, targets: Any, in_len: Any, tgt_len: Any, blank: int, reduction: str,
                 zero_infinity: bool, out: Any, gradient: bool
                 ) -> tuple[tuple[Any, Any], Any]:
    nll, grad = _ctc_loss_and_gradient(_float(lp), targets, in_len, tgt_len, blank,
                                       zero_infinity)
    loss = _reduce_ctc(nll, reduction, tgt_len).astype(out)
    return (loss, grad.astype(out) if gradient else None), (grad, tgt_len)


def _ctc_backward(blank: int, reduction: str, zero_infinity: bool, out: Any, gradient: bool,
                  saved: Any, cotangents: Any) -> tuple[Any, None, None, None]:
    """CtcGradOpx: the loss's incoming gradient spread over the samples as the reduction says
    (Mean: / (N * max(target length, 1))), times the forward's gradient output; nothing for the
    gradient output's own incoming gradient, nor for the integer inputs."""
    grad, tgt_len = saved
    incoming = cotangents[0].astype(grad.dtype)
    per = _ctc_per_sample_scale(reduction, tgt_len, grad.shape[1], grad.dtype) * incoming
    return (grad * per[None, :, None]).astype(out), None, None, None


_ctc.defvjp(lambda *args: _ctc_forward(*args), _ctc_backward)


def _check_ctc(ctx: Ctx) -> None:
    if ctx.attr("reduction", "Mean") not in ("Sum", "Mean", "None"):
        raise NotSupported(f"attribute reduction={ctx.attr('reduction')!r}: No loss reduction "
                           f"type for {ctx.attr('reduction')}; supported: 'Sum', 'Mean', "
                           f"'None'")
    out = int(ctx.attr("outDataType", 0))
    if out and out not in (TensorProto.FLOAT, TensorProto.FLOAT16):
        raise NotSupported(f"attribute outDataType={TensorProto.DataType.Name(out)}: Unsupported "
                           f"data type for output 0 of Op Ctc (expected a floating point type).")


@op("Ctc", check=_check_ctc)
def ctc_loss(ctx: Ctx, lp: Any, targets: Any, in_len: Any, tgt_len: Any) -> tuple[Any, Any]:
    """PopART's CTC loss of log probabilities [T, N, C] against targets [N, S] (classes, not
    blank), with input and target lengths [N]: the loss ([N] with reduction None, else the sum,
    or the mean of each loss over its target length, max 1) and PopLibs' gradient of each
    loss with respect to the log probabilities, [T, N, C] (see :func:`_ctc_loss_and_gradient`).
    Its gradient is PopART's: that second output times the incoming gradient of the loss."""
    out = np_dtype(ctx.attr("outDataType")) if ctx.attr("outDataType") else lp.dtype
    if np.dtype(out) == np.float16 and lp.dtype == jnp.float32:
        raise NotSupported("outType HALF unsupported with input tensor type FLOAT (PopLibs' CTC "
                           "loss)")
    ints = [v.astype(jnp.int32) for v in (targets, in_len, tgt_len)]
    loss, gradient = _ctc(lp, *ints, int(ctx.attr("blank", 0)), ctx.attr("reduction", "Mean"),
                          bool(ctx.attr("zeroInfinity", 0)), jnp.dtype(out), ctx.wants(1))
    return (loss,) if gradient is None else (loss, gradient)


# -- CtcBeamSearchDecoder -----------------------------------------------------------------------

def _beam_search(lp: Any, length: Any, blank: int, width: int, top: int
                 ) -> tuple[Any, Any, Any]:
    """Prefix beam search over one sample's log probabilities [T, C] (its first ``length``
    frames), keeping ``width`` beams: each frame every beam is copied (a blank, or its last
    class again) and extended by every other class, an extension that makes another beam's
    prefix is merged into that beam, and the ``width`` likeliest candidates go on. The ``top``
    likeliest: their log probabilities, lengths and labels (zeros past the length)."""
    steps, classes = lp.shape
    beams, pos, cls = jnp.arange(width), jnp.arange(steps), jnp.arange(classes)
    none = jnp.full(width, _NEG_INF, lp.dtype)
    state = (jnp.zeros((width, steps), jnp.int32), jnp.zeros(width, jnp.int32),
             none.at[0].set(0.0), none)

    def step(state: Any, inputs: Any) -> tuple[Any, None]:
        t, p = inputs
        prefix, size, pb, pnb = state
        total = jnp.logaddexp(pb, pnb)
        alive = total > _NEG_INF
        last = jnp.where(size > 0, prefix[beams, jnp.maximum(size - 1, 0)], -1)
        copy_pb = total + p[blank]
        copy_pnb = jnp.where(last >= 0, pnb + p[jnp.maximum(last, 0)], _NEG_INF)
        extend = jnp.where(cls[None] == last[:, None], pb[:, None], total[:, None]) + p[None]
        extend = jnp.where((cls[None] == blank) | ~alive[:, None], _NEG_INF, extend)
        # beam i extended by class c is beam j when j's prefix is i's with c at its end
        same = jnp.all((prefix[:, None, :] == prefix[None, :, :]) | (pos >= size[:, None, None]),
                       axis=2)
        parent = same & alive[:, None] & alive[None, :] & (size[None, :] == size[:, None] + 1)
        merged = jnp.where(parent, extend[:, jnp.maximum(last, 0)], _NEG_INF)  # [i, j]
        copy_pnb = jnp.logaddexp(copy_pnb, jax.nn.logsumexp(merged, axis=0))
        taken = jnp.any(parent[:, :, None] & (last[None, :, None] == cls[None, None]), axis=1)
        extend = jnp.where(taken, _NEG_INF, extend)
        copy_total = jnp.where(alive, jnp.logaddexp(copy_pb, copy_pnb), _NEG_INF)
        _, best = lax.top_k(jnp.concatenate([copy_total, extend.reshape(-1)]), width)
        is_copy = best < width
        source = jnp.where(is_copy, best, (best - width) // classes)
        added = jnp.where(is_copy, 0, (best - width) % classes)
        kept = prefix[source]
        grown = kept.at[beams, jnp.minimum(size[source], steps - 1)].set(added)
        extended = extend.reshape(-1)[jnp.maximum(best - width, 0)]
        new = (jnp.where(is_copy[:, None], kept, grown),
               size[source] + (~is_copy).astype(jnp.int32),
               jnp.where(is_copy, copy_pb[source], _NEG_INF),
               jnp.where(is_copy, copy_pnb[source], extended))
        keep = t < length
        return jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, state), None

    (prefix, size, pb, pnb), _ = lax.scan(step, state, (jnp.arange(steps), lp))
    total = jnp.logaddexp(pb, pnb)
    order = jnp.argsort(-total, stable=True)[:top]
    return total[order], size[order], prefix[order]


def _check_beam_search(ctx: Ctx) -> None:
    width, top = int(ctx.attr("beam_width", 100)), int(ctx.attr("top_paths", 1))
    if width < 1 or top < 1 or top > width:
        raise NotSupported(f"beam_width={width}, top_paths={top}: the decoder keeps beam_width "
                           f"beams and returns top_paths of them; both must be at least 1 and "
                           f"top_paths at most beam_width")


@op("CtcBeamSearchDecoder", check=_check_beam_search)
def ctc_beam_search_decoder(ctx: Ctx, lp: Any, lengths: Any) -> tuple[Any, Any, Any]:
    """PopLibs' CTC prefix beam search (popnn::ctc_infer) per sample of log probabilities
    [T, N, C] over its data length: label probabilities [N, top_paths] (log), label lengths
    [N, top_paths] and decoded labels [N, top_paths, T] (UINT32). No gradient (PopART has no
    grad op)."""
    blank, width = int(ctx.attr("blank", 0)), int(ctx.attr("beam_width", 100))
    top = int(ctx.attr("top_paths", 1))
    classes = lp.shape[2]
    if not 0 <= blank < classes:
        raise NotSupported(f"blank={blank} is not a class of the {classes} classes")
    search = jax.vmap(lambda one, n: _beam_search(one, n, blank, width, top), in_axes=(1, 0))
    probs, sizes, labels = search(lax.stop_gradient(_float(lp)), lengths.astype(jnp.int32))
    unsigned = jax.dtypes.canonicalize_dtype(np.uint32)
    return probs.astype(lp.dtype), sizes.astype(unsigned), labels.astype(unsigned)


# -- GroupNormalization -------------------------------------------------------------------------

_STRIDED: ContextVar[bool] = ContextVar("group_norm_strided", default=False)


@contextlib.contextmanager
def group_norm_channels(strided: bool) -> Iterator[None]:
    """While tracing under it, GroupNormalization groups channels as the session option
    ``groupNormStridedChannelGrouping`` says: strided (channel c in group c % num_groups) or,
    by default, consecutive."""
    token = _STRIDED.set(bool(strided))
    try:
        yield
    finally:
        _STRIDED.reset(token)


@op("GroupNormalization")
def group_norm(ctx: Ctx, x: Any, scale: Any, bias: Any) -> tuple[Any, Any, Any]:
    """popnn::gn: y = (x - mean) * invStdDev * scale + bias over num_groups groups of channels
    (consecutive ones, or strided under :func:`group_norm_channels`), invStdDev = 1 /
    sqrt(biased variance + epsilon), statistics in float; outputs y, mean and invStdDev
    [N * num_groups]. The gradient is the chain rule of y (the statistics outputs give none
    back, as GroupNormGradOp reads only dY)."""
    groups, (n, c) = int(ctx.attr("num_groups", 1)), x.shape[:2]
    if groups < 1 or c % groups:
        raise NotSupported(f"num_groups={groups} does not divide the {c} channels")
    strided = _STRIDED.get()
    xs = _float(x).reshape((n, c // groups, groups, -1) if strided else (n, groups, -1))
    xs = xs.swapaxes(1, 2).reshape((n, groups, -1)) if strided else xs
    mean = jnp.mean(xs, -1, keepdims=True)
    inv = lax.rsqrt(jnp.mean(jnp.square(xs - mean), -1, keepdims=True)
                    + ctx.attr("epsilon", 1e-5))
    y = (xs - mean) * inv
    if strided:
        y = y.reshape((n, groups, c // groups, -1)).swapaxes(1, 2)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    y = y.reshape(x.shape) * scale.reshape(shape) + bias.reshape(shape)
    stats = [lax.stop_gradient(s.reshape(-1)).astype(x.dtype) for s in (mean, inv)]
    return (y.astype(x.dtype), *stats)


# -- BatchNormalization (ai.graphcore) ----------------------------------------------------------

def _bn_axes(x: Any) -> tuple[int, ...]:
    return (0,) + tuple(range(2, x.ndim))


def _bn_shape(x: Any) -> tuple[int, ...]:
    return (1, -1) + (1,) * (x.ndim - 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _bn_train(x: Any, scale: Any, b: Any, mean: Any, var: Any, epsilon: float,
              momentum: float) -> tuple[Any, ...]:
    return _bn_train_forward(x, scale, b, mean, var, epsilon, momentum)[0]


def _bn_train_forward(x: Any, scale: Any, b: Any, mean: Any, var: Any, epsilon: float,
                      momentum: float) -> tuple[tuple[Any, ...], Any]:
    """BatchNormOpx training: y from the batch's mean and biased variance; the saved variance
    unbiased from PopLibs' inverse standard deviation (count / (count - 1) * (var + eps) -
    eps); the running statistics momentum * input + (1 - momentum) * batch."""
    xs, shape = _float(x), _bn_shape(x)
    count = x.size // x.shape[1]
    batch_mean = jnp.mean(xs, _bn_axes(x))
    biased = jnp.mean(jnp.square(xs - batch_mean.reshape(shape)), _bn_axes(x))
    y = (xs - batch_mean.reshape(shape)) * lax.rsqrt(biased + epsilon).reshape(shape)
    y = (y * scale.reshape(shape) + b.reshape(shape)).astype(x.dtype)
    batch_var = count / max(count - 1, 1) * (biased + epsilon) - epsilon if count > 1 \
        else jnp.full_like(biased, jnp.inf)
    saved_mean, saved_var = batch_mean.astype(mean.dtype), batch_var.astype(var.dtype)
    running_mean = (momentum * _float(mean) + (1 - momentum) * batch_mean).astype(mean.dtype)
    running_var = (momentum * _float(var) + (1 - momentum) * batch_var).astype(var.dtype)
    return (y, running_mean, running_var, saved_mean, saved_var), (x, scale, saved_mean,
                                                                   saved_var, mean, var)


def _bn_train_backward(epsilon: float, momentum: float, saved: Any, cotangents: Any
                       ) -> tuple[Any, ...]:
    """BatchNormGradOpx: popnn's batch norm gradients from the saved mean and (unbiased)
    saved variance: xhat = (x - mean) / sqrt(var + eps); dx = scale / sqrt(var + eps) *
    (dy - mean(dy) - xhat * mean(dy * xhat)), dscale = sum(dy * xhat), db = sum(dy); the mean
    and var inputs get none, nor do the statistics outputs pass any back."""
    x, scale, saved_mean, saved_var, mean, var = saved
    dy, shape, axes = _float(cotangents[0]), _bn_shape(x), _bn_axes(x)
    inv = lax.rsqrt(_float(saved_var) + epsilon)
    xhat = (_float(x) - _float(saved_mean).reshape(shape)) * inv.reshape(shape)
    dx = (_float(scale) * inv).reshape(shape) * (
        dy - jnp.mean(dy, axes, keepdims=True)
        - xhat * jnp.mean(dy * xhat, axes, keepdims=True))
    return (dx.astype(x.dtype), jnp.sum(dy * xhat, axes).astype(scale.dtype),
            jnp.sum(dy, axes).astype(scale.dtype), jnp.zeros_like(mean), jnp.zeros_like(var))


_bn_train.defvjp(_bn_train_forward, _bn_train_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _bn_infer(x: Any, scale: Any, b: Any, mean: Any, var: Any, epsilon: float) -> Any:
    shape = _bn_shape(x)
    y = (_float(x) - _float(mean).reshape(shape)) * lax.rsqrt(_float(var) + epsilon).reshape(
        shape)
    return (y * scale.reshape(shape) + b.reshape(shape)).astype(x.dtype)


def _bn_infer_backward(epsilon: float, saved: Any, cotangent: Any) -> tuple[Any, ...]:
    raise NotSupported("BatchNorm Op has 1 output(s) which means it is in inference mode, but "
                       "its gradient Op is being created. To use the BatchNorm Op in inference "
                       "mode during training, it has to be detached first.")


_bn_infer.defvjp(lambda x, s, b, m, v, eps: (_bn_infer(x, s, b, m, v, eps), None),
                 _bn_infer_backward)


def _check_batch_norm(ctx: Ctx) -> None:
    if int(ctx.attr("spatial", 1)) != 1:
        raise NotSupported(f"attribute spatial={ctx.attr('spatial')} is not supported; "
                           f"supported: 1")


@op("BatchNormalization", check=_check_batch_norm)
def batch_norm(ctx: Ctx, x: Any, scale: Any, b: Any, mean: Any, var: Any) -> tuple[Any, ...]:
    """PopART's ai.graphcore BatchNormalization (BatchNormOp with unbiased_variance): with one
    output, inference from the mean and var inputs; with more, training: y from the batch
    statistics, then the running mean and variance, the saved (batch) mean and the saved,
    unbiased variance. Its gradient is PopART's (see :func:`_bn_train_backward`); the
    inference form has none (PopART refuses to train it)."""
    if x.ndim < 3:
        raise NotSupported(f"batch norm requires X to have a rank >= 3.  x has rank {x.ndim}")
    epsilon = float(ctx.attr("epsilon", 1e-5))
    if len(ctx.outputs) == 1:
        return (_bn_infer(x, scale, b, mean, var, epsilon),)
    return _bn_train(x, scale, b, mean, var, epsilon,
                     float(ctx.attr("momentum", 0.9)))[:len(ctx.outputs)]


# -- NormalizeImage -----------------------------------------------------------------------------

def _check_image(ctx: Ctx) -> None:
    if abs(float(ctx.attr("scale", 1.0))) < np.finfo(np.float32).eps:
        raise NotSupported("[normalizeImageOpCreator] scale should be greater than 0.")


@op("NormalizeImage", check=_check_image)
def normalize_image(ctx: Ctx, image: Any, offsets: Any, scales: Any) -> Any:
    """popops::normaliseImage: ((image * scale) - offsets) * scales per channel of the last
    axis (3), computed in the output type (float16 for a uint8 image), then a fourth channel
    of zeros. No gradient (PopART has no grad op)."""
    if image.shape[-1] != 3 or image.ndim < 2:
        raise NotSupported("requires the inner dimension to be 3.")
    out = jnp.float16 if image.dtype == jnp.uint8 else image.dtype
    scale = jnp.asarray(ctx.attr("scale", 1.0), out)
    y = (lax.stop_gradient(image).astype(out) * scale - offsets.astype(out)) * scales.astype(out)
    return lax.stop_gradient(jnp.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, 1)]))


# -- ReplicatedAllReduce, ReplicatedReduceScatter ------------------------------------------------

_OPERATORS = ("Add", "Mean", "Mul", "Min", "Max", "LogicalAnd", "LogicalOr", "SquareAdd",
              "Local")
_GROUP_TYPES = ("All", "Consecutive", "Orthogonal", "Ungrouped")


def replica_axes() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The replica axes bound where this is traced: the mesh's (PROCESS, REPLICA), those bound,
    and the device's vectorised replicas (LOCAL_REPLICA) if bound. Empty: one replica."""
    def bound(name: str) -> bool:
        try:
            lax.axis_size(name)
        except NameError:
            return False
        return True
    return (tuple(a for a in (PROCESS, REPLICA) if bound(a)),
            (LOCAL_REPLICA,) if bound(LOCAL_REPLICA) else ())


def _gathered(x: Any) -> tuple[Any, Any]:
    """Every replica's ``x``, [R, *x.shape] in replica order (device-major, as the placement
    splits replicas into contiguous blocks), and this replica's index."""
    mesh, local = replica_axes()
    xs, index = x[None], jnp.zeros((), jnp.int32)
    if local:
        xs, index = lax.all_gather(x, local[0])[:, None], lax.axis_index(local[0])
        xs = xs.reshape((-1,) + x.shape)
    if mesh:
        block = xs.shape[0]
        xs = lax.all_gather(xs, mesh).reshape((-1,) + x.shape)
        index = lax.axis_index(mesh) * block + index
    return xs, index


def _group(ctx: Ctx, replicas: int) -> tuple[int, int]:
    """The (stride, group size) of the op's replica group (CommGroup::toReplicaGrouping)."""
    kind, size = (list(ctx.attr(COMM_GROUP)) + [0, 0])[:2] if ctx.attr(COMM_GROUP) else (0, 0)
    if kind == 0 or (kind in (1, 2) and size == replicas):
        return 1, replicas
    if kind == 3:
        return 1, 1
    if size < 1 or replicas % size:
        raise NotSupported(f"commGroup {_GROUP_TYPES[kind]} of {size} replicas does not divide "
                           f"the session's {replicas} replicas")
    return (1, size) if kind == 1 else (replicas // size, size)


def _check_collective(ctx: Ctx) -> None:
    operator = int(ctx.attr(COLLECTIVE_OPERATOR, 0))
    if not 0 <= operator < len(_OPERATORS) or _OPERATORS[operator] in ("LogicalAnd",
                                                                         "LogicalOr"):
        name = _OPERATORS[operator] if 0 <= operator < len(_OPERATORS) else operator
        raise NotSupported(f"collective operator {name} is not supported; supported: Add, "
                           f"Mean, Mul, Min, Max, SquareAdd, Local")
    group = ctx.attr(COMM_GROUP)
    if group and not 0 <= int(list(group)[0]) < len(_GROUP_TYPES):
        raise NotSupported(f"commGroup type {list(group)[0]} is not a CommGroupType")
    if ctx.attr("__collectiveReplicaGrouping"):
        raise NotSupported("__collectiveReplicaGrouping (popxl's replica groupings) is not "
                           "supported; give a commGroup")


def _layout(me: Any, stride: int, size: int) -> tuple[Any, Any]:
    """ReplicaGrouping: replica ``me``'s position in its group and the group's members."""
    first = (me // (stride * size)) * (stride * size) + me % stride
    return (me - first) // stride, first + jnp.arange(size) * stride


def _reduce_group(ctx: Ctx, x: Any) -> tuple[Any, Any, int]:
    """The reduction of ``x`` over this replica's group, this replica's position in its group
    and the group size (with one replica: ``x``, 0 and 1)."""
    operator = _OPERATORS[int(ctx.attr(COLLECTIVE_OPERATOR, 0))]
    xs, me = _gathered(x)
    stride, size = _group(ctx, xs.shape[0])
    position, members = _layout(me, stride, size)
    if operator == "Local":
        return x, position, size
    xs = xs[members]
    if operator in ("Add", "Mean"):
        out = jnp.sum(xs, axis=0)
    elif operator == "SquareAdd":
        out = jnp.sum(xs * xs, axis=0)
    elif operator == "Mul":
        out = jnp.prod(xs, axis=0)
    else:
        out = (jnp.min if operator == "Min" else jnp.max)(xs, axis=0)
    if operator == "Mean":
        out = out / size
    return out.astype(x.dtype), position, size


@op("ReplicatedAllReduce", check=_check_collective)
def replicated_all_reduce(ctx: Ctx, x: Any) -> Any:
    """The collective operator (Add by default) over the replicas of this replica's group (all
    of them by default); with one replica, or Local, the identity. No gradient (PopART's
    ReplicatedAllReduceOp has no grad op)."""
    return lax.stop_gradient(_reduce_group(ctx, x)[0])


@op("ReplicatedReduceScatter", check=_check_collective)
def replicated_reduce_scatter(ctx: Ctx, x: Any, *_: Any) -> Any:
    """The group's reduction of ``x`` flattened and zero-padded to a multiple of the group
    size, and this replica's part of it: [ceil(elements / group size)] (Local: its part of its
    own ``x``). Its gradient is PopART's for Local (a ReplicatedAllGather: every group
    member's gradient part, joined); PopART has none for the other operators and refuses to
    train them, as this does when the gradient is traced."""
    local = _OPERATORS[int(ctx.attr(COLLECTIVE_OPERATOR, 0))] == "Local"

    @jax.custom_vjp
    def scatter(value: Any) -> Any:
        out, position, size = _reduce_group(ctx, value)
        part = -(-out.size // size)
        flat = jnp.pad(out.reshape(-1), (0, part * size - out.size))
        return lax.dynamic_slice(flat, (position * part,), (part,))

    def backward(_: Any, grad: Any) -> tuple[Any]:
        if not local:
            raise NotSupported("ReplicatedReduceScatterOp: grad op is only implemented when "
                               "CollectiveOperator==CollectiveOperator::Local")
        parts, me = _gathered(grad)
        _, members = _layout(me, *_group(ctx, parts.shape[0]))
        whole = parts[members].reshape(-1)[:x.size]
        return (whole.reshape(x.shape).astype(x.dtype),)

    scatter.defvjp(lambda value: (scatter(value), None), backward)
    return scatter(x)


# -- SplineBasis, SplineWeighting ---------------------------------------------------------------

def _spline_factor(v: Any, k: Any, degree: int) -> Any:
    """PopLibs' B-spline basis of ``degree`` at fraction ``v`` for knot offset ``k``."""
    if degree == 1:
        return 1 - v - k + 2 * v * k
    if degree == 2:
        return jnp.where(k == 0, 0.5 * v * v - v + 0.5, jnp.where(k == 1, -v * v + v + 0.5,
                                                                   0.5 * v * v))
    return jnp.where(k == 0, (1 - v) ** 3 / 6,
                     jnp.where(k == 1, (3 * v ** 3 - 6 * v * v + 4) / 6,
                               jnp.where(k == 2, (-3 * v ** 3 + 3 * v * v + 3 * v + 1) / 6,
                                         v ** 3 / 6)))


def _check_spline_basis(ctx: Ctx) -> None:
    degree = int(ctx.attr("degree", 0))
    if not 0 <= degree <= 3:
        raise NotSupported(f"SplineBasisOp degree = {degree} is not valid: must be between 0 "
                           f"and 3.")
    if degree == 0:
        raise NotSupported("SplineBasisOp degree = 0: PopLibs' SplineBasis vertex exists for "
                           "degrees 1 to 3 only, so PopART cannot run it; give degree 1, 2 or 3")


@op("SplineBasis", check=_check_spline_basis)
def spline_basis(ctx: Ctx, pseudo: Any, kernel_size: Any, is_open: Any) -> tuple[Any, Any]:
    """popops::splineBasis: for edge e and spline s (digits k_d of s in base degree + 1) the
    product over dimensions d of the basis at the fraction of v = pseudo[e, d] *
    (kernel_size[d] - degree * is_open_spline[d]), and the weight index sum_d ((floor(v) +
    k_d) mod kernel_size[d]) * prod_{d' < d} kernel_size[d']. No gradient (PopART has no grad
    op)."""
    degree = int(ctx.attr("degree"))
    edges, dims = pseudo.shape
    splines = (degree + 1) ** dims
    k = (jnp.arange(splines)[:, None] // (degree + 1) ** jnp.arange(dims)[None]) % (degree + 1)
    sizes = kernel_size.astype(jnp.int32)
    v = lax.stop_gradient(_float(pseudo)) * (sizes - degree * is_open.astype(jnp.int32))
    whole = jnp.floor(v)
    index = (whole.astype(jnp.int32)[:, None, :] + k[None]) % sizes
    strides = jnp.concatenate([jnp.ones(1, jnp.int32), jnp.cumprod(sizes)[:-1]])
    basis = jnp.prod(_spline_factor((v - whole)[:, None, :], k[None], degree), axis=2)
    return (basis.astype(pseudo.dtype),
            jnp.sum(index * strides, axis=2).astype(kernel_size.dtype))


@op("SplineWeighting")
def spline_weighting(ctx: Ctx, x: Any, weight: Any, basis: Any, index: Any) -> Any:
    """popops::splineWeighting: out[e, o] = sum_s basis[e, s] * sum_i x[e, i] *
    weight[weight_index[e, s], i, o]. No gradient (PopART has no grad op)."""
    picked = weight[index.astype(jnp.int32)]  # [E, S, I, O]
    out = jnp.einsum("es,ei,esio->eo", _float(basis), _float(x), _float(picked))
    return lax.stop_gradient(out.astype(x.dtype))
