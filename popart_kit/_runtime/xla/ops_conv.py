"""Conv and ConvTranspose on the xla backend, with the lowering chosen per shape and type for
the CPU (:func:`lowering_for`). Measured against onnxruntime and against XLA's NCHW convolution (the
lowering before) with benchmarks/conv_bench.py, interleaved, on a shared 2-core machine:

* ``channels_last``: XLA's own convolution on channels-last operands, transposed at the op's
  edges. XLA:CPU hands a channels-last convolution to its YNNPACK fusion; XLA's algebraic
  simplifier cancels the transposes between convolutions of a chain (conv, Relu, conv runs
  channels-last throughout, one transpose at each end), so no layout pass is needed. Outside a
  loop it is about XLA's NCHW speed (XLA transposes an NCHW convolution itself there), but
  inside a loop body (fori_loop over micro-batches) XLA leaves an NCHW convolution on its slow
  path: 3x3 64->64 at 56x56 batch 8, 4 iterations, 9.0 s NCHW against 0.16 s channels-last
  (0.20 s driven from the host). Its gradient inside a loop body is still XLA's slow path
  (the same layer's gradient, 4 iterations: 30-44 s in a fori_loop, 0.4-0.5 s from the
  host), so steps.py's LOOP_UNFRIENDLY_ON_CPU still holds for training. Dense convolutions
  and ConvTranspose take it.
* ``split``: a grouped convolution (at most :data:`SPLIT_MAX_GROUPS` groups, not depthwise) as
  one channels-last dense convolution per group, concatenated. XLA:CPU's grouped convolution
  is its slowest case, its gradient above all: 32 groups 128->128 3x3 at 28x28 batch 8,
  forward about 1.3-2x, backward 12 s against well under 1 s; 8 groups of 256 at 14x14: 4-8x
  forward, 40-60x backward.
* ``shifted``: a convolution whose output channels each read one input channel (depthwise,
  ``group == C``, with any channel multiplier; or one input channel, ``C == 1``) as one
  multiply-add of strided slices per kernel tap, NCHW, accumulated in float32 for half inputs
  (as XLA:CPU's convolution does: it upcasts half). Kernels up to :data:`SHIFTED_MAX_TAPS`
  taps. Depthwise 3x3 at 28x28x128 batch 8: 10-20x XLA's grouped convolution forward (about
  onnxruntime's time) and about 10x backward, differentiating the multiply-adds; MNIST's
  1->32 k5 at batch 32: about 1.7x forward. With one input channel a differentiated
  convolution is ``channels_last``, forward and backward (a :func:`jax.custom_vjp` whose
  forward rule is XLA's): the multiply-adds' weight gradient, reduced over the batch, is 5-10x
  slower than XLA's, and XLA's gradient after the multiply-adds' forward 2x.

* ``mlas``: onnxruntime's MLAS convolution (:mod:`.conv_mlas`), float32 and float16 on the
  CPU only, where
  :func:`mlas_wins`: a one-Conv onnxruntime session per shape, run inside the XLA program by
  ``jax.experimental.buffer_callback`` on XLA's own buffers (``io_binding``: no copies), in
  MLAS's channel-blocked (NCHWc) layout as onnxruntime's graph optimizer would choose for
  constant weights (the filter reordered by XLA each call: the weights are run inputs; with
  weights as plain run inputs instead, MLAS's NCHW path measured 1.5-2x slower on the ResNet
  3x3). Its gradient is the XLA lowering's (:func:`xla_lowering_for`; a custom_vjp); other
  platforms (:func:`jax.lax.platform_dependent`) and bfloat16 run XLA's lowering. Under
  vmap the batch folds into N. Float16 is convolved in float32 between Casts in the onnxruntime
  session and rounded once (XLA:CPU's half convolution upcasts too, whatever the partials type, so
  the values are those of the XLA lowering), the bias then added in half by XLA as that lowering
  adds it; fp16 forward rows of conv_bench against the XLA lowering (load 1.1-3): 4->64 k4 s2 at
  540x960 45 -> 9 ms, ResNet 3x3 15 -> 6 ms, 1x1 256->256 at 14x14 2.2 -> 1.3 ms, grouped 3x3 10
  -> 2.2 ms (onnxruntime's own float16 session: 7.6, 5.6, 0.7, 1.7 ms; it casts the same way).
  Measured (fp32 Conv+Relu, medians and fastest of interleaved calls, load average 4-7): 4->64 k4
  s2 at 540x960 and the 3->64 7x7 s2 ResNet stem 2-3x XLA; 3x3 64->64 at 56x56 batch 8 1.2-1.5x;
  3x3 512->512 at 7x7 batch 8 1.1-1.2x; grouped 3x3 (32 groups of 4 channels) 2-3.5x ``split``.
  Timed in blocks of calls (each in its own steady state, as ``pk.bench.interleaved(block=)``;
  load 1.7-1.9), dense convolutions of few input channels and 1x1 ones gain too: 3->16 3x3 at
  32x32 batch 8-32 1.3-4x, 3->32 5x5 at 64x64 batch 4 3x, 4->8 and 8->16 3x3 1.1-1.4x (from
  :data:`MLAS_MIN_FEW_CHANNELS_WORK`; 3->16 at batch 1, 2^19 multiply-adds: 0.6-0.75x); 1x1
  64->256 at 56x56 2.8-3.5x, 256->256 at 14x14 batch 8 1.4x, 64->64 at 28x28 batch 8 1.3-1.45x
  (from :data:`MLAS_MIN_POINTWISE_WORK`; 512->512 at 7x7, 2^23.6: 0.8-0.9x). Not chosen:
  convolutions under :data:`MLAS_MIN_WORK` multiply-adds of 16 input channels or more (3x3 32->32
  at 16x16: 0.75-0.8x, 16->32 at 16x16 batch 32: 0.9-1.0x, the callback's fixed tens of
  microseconds), grouped ones of 16 or more channels per group (0.65-1.1x ``split``), ``shifted``
  ones (depthwise 3x3 at 28x28x128 batch 8: 0.3-0.6x; MNIST's 1->32 k5: 0.2-0.9x), 1-D and 3-D
  (not measured). A Conv whose only reader is a Relu runs with MLAS's Relu in the same call (not
  inside a pipeline stage, whose every output is kept) (:func:`conv_relu`, lowering.py's
  ``FUSIONS``; onnxruntime fuses them alike): against the Relu as a pass over MLAS's output, 4->64
  k4 s2 1.15-1.25x raw and 1.4-2x through a session, the ResNet 3x3 about even to 1.1x, grouped
  1.0-1.4x; its gradient unchanged (about even).
  What stays between the kit and onnxruntime there: the filter reorder.
  onnxruntime's intra-op threads: one per CPU the process may use (XLA's pool's size; one
  thread was 1.5-5x slower on the larger rows), spinning off (spinning threads fought XLA's:
  up to 2x slower on the depthwise row; timed in blocks, spinning made the MLAS call itself
  1.2-1.4x faster on the 1x1 and depthwise rows but the XLA program run after it 1.3-1.5x
  slower on the grouped row). A program holding a callback is not kept by the
  persistent compilation cache (JAX does not serialise host callbacks).

In an inference session on one CPU device, a float32 convolution is mostly not lowered here
at all: it runs inside an onnxruntime session with its neighbours (:mod:`.delegated`), which
holds the weights as constants and so reorders the filter once. What this module chooses
runs in training, in bfloat16, in float16 segments holding an operator onnxruntime does not
compute as the lowering does (:mod:`.half_segment`), and wherever a segment is not delegated.

Rejected after measuring: im2col + GEMM (patches, then a matmul: 1.5-3x slower than XLA's
convolution but for 1x1, where it is even); space-to-depth for the strided 4x4 kernel (no
gain); block-diagonal dense weights for grouped convolutions (slower than ``split``);
onnxruntime's MLAS through ``jax.pure_callback`` (the callback's copies and thread hand-off
put it 1.1-3x behind XLA; ``buffer_callback`` above has neither). XLA:CPU's library flags in
jaxlib 0.10.2 offer nothing more: YNNPACK takes channels-last convolutions by default,
``xla_cpu_experimental_xnn_fusion_type`` / ``..._onednn_fusion_type`` = INDIVIDUAL_CONVOLUTION
leave convolutions to XLA, and turning YNNPACK off (``xla_cpu_experimental_ynn_fusion_type``
empty) is slower.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import conv_mlas
from .ops import _HALF, Ctx, _accumulator, _channel_bias, _check_auto_pad, _geometry, op

__all__ = ["MLAS_MAX_GROUP_CHANNELS", "MLAS_MIN_FEW_CHANNELS_WORK", "MLAS_MIN_GROUPED_WORK",
           "MLAS_MIN_POINTWISE_WORK", "MLAS_MIN_WORK",
           "SHIFTED_MAX_TAPS", "SPLIT_MAX_GROUPS", "conv", "conv_relu", "conv_transpose",
           "lowering_for",
           "mlas_wins", "xla_lowering_for"]

#: The most kernel taps (product of the kernel's sizes) the shifted lowering unrolls.
SHIFTED_MAX_TAPS = 49
#: The most groups a grouped convolution is split into (one dense convolution each); more
#: take XLA's grouped convolution.
SPLIT_MAX_GROUPS = 64
#: The fewest multiply-adds (at stride 1) of a Conv run by onnxruntime's MLAS: below, XLA's
#: convolution and the callback's fixed cost measured about even or better.
MLAS_MIN_WORK = 1 << 26
#: The same for grouped convolutions (XLA's ``split`` is many small convolutions).
MLAS_MIN_GROUPED_WORK = 1 << 20
#: The same for 1x1 kernels (a matrix product either way; MLAS's the faster from here).
MLAS_MIN_POINTWISE_WORK = 1 << 24
#: The same for dense convolutions of fewer than :data:`MLAS_MAX_GROUP_CHANNELS` input
#: channels (XLA's channels-last convolution vectorises over the input channels).
MLAS_MIN_FEW_CHANNELS_WORK = 1 << 21
#: Grouped convolutions of this many input channels per group or more stay on ``split``;
#: dense ones of fewer take :data:`MLAS_MIN_FEW_CHANNELS_WORK`.
MLAS_MAX_GROUP_CHANNELS = 16


def lowering_for(x_shape: Sequence[int], w_shape: Sequence[int], group: int,
                 dtype: Any = None) -> str:
    """The lowering a Conv of these shapes takes on the CPU: ``"mlas"`` for a float32 or
    float16 ``dtype`` (float16 computed in float32) where :func:`mlas_wins` and onnxruntime is
    available (:func:`conv_mlas.available`), else :func:`xla_lowering_for`'s."""
    if (dtype is not None and np.dtype(dtype) in (np.float32, np.float16)
            and mlas_wins(x_shape, w_shape, group) and conv_mlas.available()):
        return "mlas"
    return xla_lowering_for(x_shape, w_shape, group)


def mlas_wins(x_shape: Sequence[int], w_shape: Sequence[int], group: int) -> bool:
    """Whether onnxruntime's MLAS convolution measured faster than XLA's lowering for a float32
    Conv of these shapes (the module docs): two spatial axes, not one :func:`xla_lowering_for`
    runs as ``"shifted"``, and at least so many multiply-adds at stride 1: grouped (fewer than
    :data:`MLAS_MAX_GROUP_CHANNELS` input channels per group, a kernel of more than one tap)
    :data:`MLAS_MIN_GROUPED_WORK`; dense with a 1x1 kernel :data:`MLAS_MIN_POINTWISE_WORK`, of
    fewer than :data:`MLAS_MAX_GROUP_CHANNELS` input channels
    :data:`MLAS_MIN_FEW_CHANNELS_WORK`, else :data:`MLAS_MIN_WORK`."""
    if len(x_shape) != 4 or xla_lowering_for(x_shape, w_shape, group) == "shifted":
        return False
    taps = int(np.prod(w_shape[2:], dtype=np.int64))
    work = int(np.prod([x_shape[0], *x_shape[2:], w_shape[0], w_shape[1], taps], dtype=np.int64))
    if group > 1:
        return taps > 1 and w_shape[1] < MLAS_MAX_GROUP_CHANNELS and work >= MLAS_MIN_GROUPED_WORK
    least = (MLAS_MIN_POINTWISE_WORK if taps == 1 else MLAS_MIN_FEW_CHANNELS_WORK
             if w_shape[1] < MLAS_MAX_GROUP_CHANNELS else MLAS_MIN_WORK)
    return work >= least


def xla_lowering_for(x_shape: Sequence[int], w_shape: Sequence[int], group: int) -> str:
    """The XLA lowering of a Conv of these shapes: ``"shifted"`` when each output channel reads
    one input channel (depthwise, or one input channel) and the kernel has at most
    :data:`SHIFTED_MAX_TAPS` taps; ``"split"`` for other grouped ones of at most
    :data:`SPLIT_MAX_GROUPS` groups; else ``"channels_last"``. Half precision and platforms
    other than the CPU always take it; it is the gradient of ``"mlas"``."""
    channels, per_group = x_shape[1], w_shape[1]
    taps = int(np.prod(w_shape[2:], dtype=np.int64))
    if per_group == 1 and channels == group and taps <= SHIFTED_MAX_TAPS and len(w_shape) > 2:
        return "shifted"
    if 1 < group <= SPLIT_MAX_GROUPS:
        return "split"
    return "channels_last"


def _channels_last(x: Any, w: Any, strides: Sequence[int], padding: Sequence[tuple[int, int]],
                   lhs_dilation: Sequence[int], rhs_dilation: Sequence[int], group: int,
                   accumulator: Any) -> Any:
    """XLA's convolution of NCHW ``x`` and OIHW ``w`` computed channels-last, NCHW out; a
    grouped one (at most :data:`SPLIT_MAX_GROUPS` groups) as one dense convolution per group,
    concatenated."""
    n = x.ndim - 2
    spec = lax.ConvDimensionNumbers(lhs_spec=(0, n + 1, *range(1, n + 1)),
                                    rhs_spec=(n + 1, n, *range(n)),
                                    out_spec=(0, n + 1, *range(1, n + 1)))
    xs, ws = x.transpose(0, *range(2, n + 2), 1), w.transpose(*range(2, n + 2), 1, 0)

    def one(xs: Any, ws: Any, groups: int) -> Any:
        return lax.conv_general_dilated(xs, ws, strides, padding, lhs_dilation=lhs_dilation,
                                        rhs_dilation=rhs_dilation, dimension_numbers=spec,
                                        feature_group_count=groups,
                                        preferred_element_type=accumulator)

    if 1 < group <= SPLIT_MAX_GROUPS:
        y = jnp.concatenate([one(a, b, 1) for a, b in zip(jnp.split(xs, group, axis=-1),
                                                          jnp.split(ws, group, axis=-1),
                                                          strict=True)], axis=-1)
    else:
        y = one(xs, ws, group)
    return y.transpose(0, n + 1, *range(1, n + 1)).astype(x.dtype)


def _shifted(x: Any, w: Any, strides: Sequence[int], pads: Sequence[tuple[int, int]],
             dilations: Sequence[int]) -> Any:
    """The convolution of NCHW ``x`` (C == group, or C == 1) with ``w`` (M, 1, k...) as one
    multiply-add of strided slices per kernel tap; output channel o reads input channel
    o // (M / C). Half inputs accumulate in float32, rounded once at the end."""
    n, m, kernel = x.ndim - 2, w.shape[0], w.shape[2:]
    dtype = jnp.float32 if np.dtype(x.dtype) in _HALF else x.dtype
    xs, ws = x.astype(dtype), w.astype(dtype)
    if 1 < x.shape[1] < m:  # a channel multiplier: each input channel feeds M / C outputs
        xs = jnp.repeat(xs, m // x.shape[1], axis=1)
    xs = jnp.pad(xs, [(0, 0), (0, 0), *pads])
    size = xs.shape[2:]
    out = [(s - (k - 1) * d - 1) // st + 1
           for s, k, d, st in zip(size, kernel, dilations, strides, strict=True)]
    acc = None
    for tap in itertools.product(*(range(k) for k in kernel)):
        start = [t * d for t, d in zip(tap, dilations, strict=True)]
        limit = [b + (o - 1) * st + 1 for b, o, st in zip(start, out, strides, strict=True)]
        part = lax.slice(xs, (0, 0, *start), (xs.shape[0], xs.shape[1], *limit),
                         (1, 1, *strides))
        term = part * ws[(slice(None), 0, *tap)].reshape((1, m) + (1,) * n)
        acc = term if acc is None else acc + term
    return acc.astype(x.dtype)


def _shifted_xla_backward(x: Any, w: Any, strides: Sequence[int],
                          pads: Sequence[tuple[int, int]], dilations: Sequence[int]) -> Any:
    """:func:`_shifted` (one input channel), but XLA's convolution, forward and backward, where
    it is differentiated (its custom_vjp forward rule)."""
    def xla(x: Any, w: Any) -> Any:
        return _channels_last(x, w, strides, pads, [1] * len(strides), dilations, 1,
                              jnp.float32 if np.dtype(x.dtype) in _HALF else None)

    @jax.custom_vjp
    def fn(x: Any, w: Any) -> Any:
        return _shifted(x, w, strides, pads, dilations)

    def forward(x: Any, w: Any) -> tuple[Any, Any]:
        return jax.vjp(xla, x, w)

    def backward(vjp: Any, dy: Any) -> tuple[Any, Any]:
        return vjp(dy)

    fn.defvjp(forward, backward)
    return fn(x, w)


def _xla_conv(x: Any, w: Any, b: Any, strides: Sequence[int],
              pads: Sequence[tuple[int, int]], dilations: Sequence[int], group: int) -> Any:
    """The convolution by :func:`xla_lowering_for`'s lowering, plus the bias ``b`` (or None)."""
    if xla_lowering_for(x.shape, w.shape, group) == "shifted":
        if x.shape[1] == 1:
            y = _shifted_xla_backward(x, w, strides, pads, dilations)
        else:
            y = _shifted(x, w, strides, pads, dilations)
    else:
        y = _channels_last(x, w, strides, pads, [1] * len(strides), dilations, group,
                           _accumulator(x))
    return _channel_bias(y, b)


def _mlas_or_xla(ctx: Ctx, x: Any, w: Any, b: Any, activation: str | None) -> Any:
    """The Conv ``ctx`` names by MLAS (with ``activation`` fused) where :func:`lowering_for`
    says ``"mlas"``; else by XLA's lowering, or None when an activation was asked (the two
    then run apart)."""
    strides, dilations, pads = _geometry(ctx, x.shape[2:], w.shape[2:])
    group = ctx.attr("group", 1)
    xla = functools.partial(_xla_conv, strides=strides, pads=pads, dilations=dilations,
                            group=group)
    if lowering_for(x.shape, w.shape, group, x.dtype) == "mlas":
        return conv_mlas.conv(x, w, b, strides, pads, dilations, group, xla,
                              activation=activation)
    return None if activation else xla(x, w, b)


@op("Conv", check=_check_auto_pad)
def conv(ctx: Ctx, x: Any, w: Any, b: Any = None) -> Any:
    """ONNX Conv, lowered by :func:`lowering_for`."""
    return _mlas_or_xla(ctx, x, w, b, None)


def conv_relu(conv_ctx: Ctx, relu_ctx: Ctx, x: Any, w: Any, b: Any = None) -> Any:
    """A Conv whose only reader is a Relu, as one MLAS call with onnxruntime's fused Relu
    where the Conv takes the ``"mlas"`` lowering (the lowering's fusion table,
    lowering.py); its gradient is the Relu's (from the output) then the XLA lowering's.
    None (the two run apart) for every other lowering: XLA fuses the Relu itself there."""
    return _mlas_or_xla(conv_ctx, x, w, b, "Relu")


@op("ConvTranspose", check=_check_auto_pad)
def conv_transpose(ctx: Ctx, x: Any, w: Any, b: Any = None) -> Any:
    """ONNX ConvTranspose: the convolution of the stride-dilated input with the flipped,
    transposed kernel, channels-last."""
    n, group = x.ndim - 2, ctx.attr("group", 1)
    size, kernel = x.shape[2:], w.shape[2:]
    strides = list(ctx.attr("strides") or [1] * n)
    dilations = list(ctx.attr("dilations") or [1] * n)
    extra = list(ctx.attr("output_padding") or [0] * n)
    window = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    full = [s * (i - 1) + e + k for s, i, e, k in zip(strides, size, extra, window, strict=True)]
    auto_pad, wanted = ctx.attr("auto_pad", "NOTSET"), ctx.attr("output_shape")
    wanted = list(wanted)[-n:] if wanted else None
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") and not ctx.attr("pads"):
        # with output_shape given, PopART (convtranspose.cpp) puts the larger half at the
        # start for SAME_UPPER and at the end for SAME_LOWER, the reverse of ONNX's text;
        # without it, ONNX's rule (ONNX's conformance cases)
        upper = (auto_pad == "SAME_UPPER") != bool(wanted)
        wanted = wanted or [i * s for i, s in zip(size, strides, strict=True)]
        totals = [f - o for f, o in zip(full, wanted, strict=True)]
        pads = [(t // 2, t - t // 2) if upper else (t - t // 2, t // 2) for t in totals]
    else:
        flat = list(ctx.attr("pads") or [0] * 2 * n) if auto_pad == "NOTSET" else [0] * 2 * n
        pads = list(zip(flat[:n], flat[n:], strict=True))
        if wanted:  # output_shape with explicit pads: the end grows (or shrinks) to it
            extra = [e + o - (f - lo - hi) for e, o, f, (lo, hi)
                     in zip(extra, wanted, full, pads, strict=True)]
    # (C, M/g, k...) -> (M, C/g, k...), flipped: a convolution of the stride-dilated input
    c, m = w.shape[0], w.shape[1]
    kernel_t = w.reshape((group, c // group, m) + kernel).swapaxes(1, 2)
    kernel_t = jnp.flip(kernel_t.reshape((group * m, c // group) + kernel), range(2, 2 + n))
    padding = [(k - 1 - lo, k - 1 - hi + e)
               for k, (lo, hi), e in zip(window, pads, extra, strict=True)]
    y = _channels_last(x, kernel_t, [1] * n, padding, strides, dilations, group,
                       _accumulator(x))
    return _channel_bias(y, b)
