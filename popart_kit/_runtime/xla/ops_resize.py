"""Resize (ai.onnx opsets 10 to 19) and Upsample (opsets 7 to 9) as PopART computes them.

PopART (willow/src/op/resize.cpp, popx/op/resizex.cpp) differs from the ONNX text in places,
and these follow PopART:

* the output size is ``floor(in * scale)`` computed in float32; with ``sizes`` the scale is
  ``float(size) / in`` and the output size comes from that scale the same way (so it can be
  one less than ``size``, e.g. 7 -> 31 gives 30);
* ``nearest_mode`` may be ``"pytorch"`` (index ``floor(i / scale)``, whatever the coordinate
  transformation), the default of opset 10, where PopART reads the attribute too; opset 11
  and later default to ``round_prefer_floor``; ``coordinate_transformation_mode`` defaults to
  ``half_pixel`` at every opset, opset 10 included;
* a dimension whose scale is exactly 1 is left as it is; ``align_corners`` and
  ``pytorch_half_pixel`` use the unrounded ``in * scale`` as the output length;
* ``cubic`` always uses ``cubic_coeff_a = -0.75`` (PopART ignores the attribute) and repeats
  the edge pixels; ``roi`` and ``extrapolation_value`` are ignored;
* Upsample is Resize in nearest ``pytorch`` mode (PopART's UpsampleToResize pattern);
* the gradient is PopART's ResizeGrad, not the chain rule of the forward: nearest adds each
  output gradient to input ``floor(i / scale)`` along every dimension whose size changed;
  cubic is the transpose of the ``half_pixel`` cubic forward; linear cannot be trained.

Refused, as PopART refuses them: an unknown ``mode``, ``nearest_mode`` or
``coordinate_transformation_mode`` (``tf_half_pixel_for_nn``, ``half_pixel_symmetric``),
``tf_crop_and_resize`` wherever a coordinate must be computed, ``exclude_outside`` other than
0, both or neither of non-empty ``scales`` and ``sizes``, scales or sizes of a length other than
the rank, Upsample ``linear``, Upsample from opset 10 and linear Resize when trained. Also
refused, as PopART implements neither: opset 18's ``antialias`` and ``keep_aspect_ratio_policy``
other than the defaults (its ``axes`` are honoured), and linear or cubic of integer tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .ops import Ctx, NotSupported, PopartRefusal, UnsupportedModel, op

__all__ = ["resize", "upsample"]

_F32 = np.float32
_MODES = ("nearest", "linear", "cubic")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "pytorch")
_TRANSFORMS = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric",
               "tf_crop_and_resize")
_CUBIC_A = _F32(-0.75)  # PopART's cubic coefficient, whatever cubic_coeff_a says



# -- the node's settings ------------------------------------------------------------------------

@dataclass(frozen=True)
class _Settings:
    """What PopART's ResizeOp keeps: mode, nearest mode, coordinate transformation."""

    mode: str
    nearest: str
    transform: str


def _settings(ctx: Ctx) -> _Settings:
    mode = ctx.attr("mode", "nearest")
    if mode not in _MODES:
        raise PopartRefusal(f"Unrecognised resize mode {mode}",
                            f"use one of {', '.join(_MODES)}.")
    nearest = ctx.attr("nearest_mode", "pytorch" if ctx.opset < 11 else "round_prefer_floor")
    if nearest not in _NEAREST_MODES:
        raise PopartRefusal(f"Unrecognised resize nearest mode {nearest}",
                            f"use one of {', '.join(_NEAREST_MODES)}.")
    transform = ctx.attr("coordinate_transformation_mode", "half_pixel")
    if transform not in _TRANSFORMS:
        raise PopartRefusal(f"Unrecognised resize coordinate transformation mode {transform}",
                            f"use one of {', '.join(_TRANSFORMS[:-1])}.")
    exclude = ctx.attr("exclude_outside", 0)
    if exclude != 0:
        raise PopartRefusal(f"ai.onnx.Resize:{min(ctx.opset, 11)}: Unsupported value "
                            f"'{exclude}' for attribute 'exclude_outside'. Acceptable values "
                            f"are [0]", "leave exclude_outside at 0.")
    if ctx.opset >= 18:
        if ctx.attr("antialias", 0) != 0:
            raise NotSupported(f"attribute antialias={ctx.attr('antialias')!r} is not "
                               f"supported (PopART's Resize has no antialiasing). Fix: leave "
                               f"antialias at 0.")
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            raise NotSupported(f"attribute keep_aspect_ratio_policy={policy!r} is not "
                               f"supported (PopART's Resize stretches). Fix: give the sizes "
                               f"wanted with keep_aspect_ratio_policy='stretch'.")
    return _Settings(mode, nearest, transform)


def _float_scales(value: np.ndarray | None, what: str) -> np.ndarray:
    if value is None:
        raise NotSupported(f"{what} is missing. Fix: give one scale per dimension.")
    if value.dtype not in (np.float32, np.float16):
        raise NotSupported(f"{what} is {value.dtype}; PopART reads float32 or float16 scales. "
                           f"Fix: give them as float32.")
    return value.astype(_F32).reshape(-1)


def _given_scales(ctx: Ctx) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(scales, sizes) as PopART picks them (one of the two is None); raises its refusals."""
    if ctx.op_type == "Upsample":
        if ctx.opset < 9:
            return np.asarray(ctx.attr("scales", []), _F32), None
        return _float_scales(ctx.static(1), "the scales input"), None
    if ctx.opset < 11:
        return _float_scales(ctx.static(1), "the scales input"), None
    scales = ctx.static(2) if ctx.has_input(2) else None
    sizes = ctx.static(3) if ctx.has_input(3) else None
    if scales is not None and sizes is not None:
        if scales.size and sizes.size:
            raise PopartRefusal(
                "Resize op has inputs for `sizes` and `scales`. Only one of these tensors "
                "should be present. If `sizes` is needed, please pass an empty string as the "
                "name of `scales` in the input list ( resize([X, roi, '', sizes]) ). If the "
                "proto is not generated from the PopART Builder, please confirm that only one "
                "of the two tensors shall have data.", "give scales or sizes, not both.")
        if not scales.size and not sizes.size:
            raise PopartRefusal("Resize op has  inputs for `sizes` and `scales`,but none of "
                                "them have data.", "give scales or sizes values.")
        if not sizes.size:
            sizes = None
        else:
            scales = None
    if scales is not None:
        return _float_scales(scales, "the scales input"), None
    if sizes is not None:
        if sizes.dtype not in (np.int64, np.int32):
            raise NotSupported(f"the sizes input is {sizes.dtype}; PopART reads int64 or int32 "
                               f"sizes. Fix: give them as int64.")
        return None, sizes.astype(np.int64).reshape(-1)
    raise PopartRefusal("Resize op has no input for `size` or `scales`. One of these tensors "
                        "needs to be present.", "give scales or sizes.")


def _scales(ctx: Ctx, shape: tuple[int, ...]) -> np.ndarray:
    """Every dimension's float32 scale, as PopART derives it from scales or sizes (and, from
    opset 18, axes)."""
    scales, sizes = _given_scales(ctx)
    given = scales if scales is not None else sizes
    axes = ctx.attr("axes") if ctx.op_type == "Resize" and ctx.opset >= 18 else None
    rank = len(shape)
    if axes is not None:
        axes = [a + rank if a < 0 else a for a in axes]
        if sorted(set(axes)) != sorted(axes) or any(not 0 <= a < rank for a in axes) \
                or len(axes) != len(given):
            raise NotSupported(f"axes={ctx.attr('axes')} do not name {len(given)} distinct "
                               f"dimensions of a rank-{rank} input. Fix: one axis per scale or "
                               f"size.")
        full = np.ones(rank, _F32) if scales is not None else np.asarray(shape, np.int64)
        full[axes] = given
        given = full
    if len(given) != rank:
        if ctx.op_type == "Upsample":
            raise NotSupported(f"Upsample has {len(given)} scales for a rank-{rank} input. "
                               f"Fix: give one scale per dimension.")
        if scales is None:
            raise PopartRefusal(f"ResizeOp, length of sizes ({len(given)}) does not match the "
                                f"rank of input shape ({rank})", "give one size per dimension.")
        raise PopartRefusal(f"The number of dimensions of the resize op scales ({len(given)}) "
                            f"must match the number of dimensions of the input ({rank})",
                            "give one scale per dimension.")
    if scales is None:
        return np.asarray([_F32(s) / _F32(n) for s, n in zip(given, shape, strict=True)], _F32)
    return np.asarray(given, _F32)


def _out_size(size: int, scale: np.float32) -> int:
    return int(np.floor(_F32(size) * scale))


# -- index arithmetic (numpy, float32 as PopART's C++) -------------------------------------------

def _coordinates(count: int, transform: str, scale: np.float32, size: int,
                 pytorch: bool = False) -> np.ndarray:
    """The input coordinate of each of ``count`` outputs along a dimension of ``size``."""
    i = np.arange(count, dtype=_F32)
    if pytorch:
        return i / scale
    half = _F32(0.5)
    if transform == "half_pixel":
        return (i + half) / scale - half
    if transform == "pytorch_half_pixel":
        return (i + half) / scale - half if _F32(size) * scale > 1 else np.zeros(count, _F32)
    if transform == "asymmetric":
        return i / scale
    if transform == "align_corners":
        length = _F32(size) * scale
        if length == 1:
            return np.zeros(count, _F32)
        return i * _F32(size - 1) / (length - _F32(1))
    raise PopartRefusal("Unsupported coordinate transformation mode",
                        f"coordinate_transformation_mode={transform!r} is accepted but not "
                        f"computed by PopART: use half_pixel, pytorch_half_pixel, "
                        f"align_corners or asymmetric.")


def _rounded(x: np.ndarray, nearest: str) -> np.ndarray:
    if nearest == "round_prefer_ceil":  # std::round: halves away from zero
        whole = np.trunc(x)
        return whole + np.sign(x) * (np.abs(x - whole) >= _F32(0.5))
    if nearest == "round_prefer_floor":
        return np.where(x - np.floor(x) <= _F32(0.5), np.floor(x), np.ceil(x))
    if nearest == "ceil":
        return np.ceil(x)
    return np.floor(x)  # floor, pytorch


def _nearest_indices(size: int, out: int, scale: np.float32, nearest: str,
                     transform: str) -> np.ndarray:
    """PopART's resizeNearest1D: the input index each output takes."""
    rounded = np.float32(np.round(scale))
    if (abs(rounded - scale) <= _F32(1e-5) and rounded >= 0 and transform == "half_pixel"
            and nearest not in ("floor", "ceil")):  # poplar's upsample (repeat)
        index = np.arange(out) // max(int(rounded), 1)
    else:
        coords = _coordinates(out, transform, scale, size, nearest == "pytorch")
        index = _rounded(coords, nearest).astype(np.int64)
    return np.clip(index, 0, size - 1)


def _cubic_taps(size: int, out: int, scale: np.float32, transform: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """PopART's getXOrisNCoeffsTensor: (out, 4) input indices (edge-clamped) and weights."""
    x = _coordinates(out, transform, scale, size)
    base = np.floor(x)
    r = (x - base).astype(_F32)
    a, one, s = _CUBIC_A, _F32(1), 1 - (x - base).astype(_F32)
    weights = np.stack([
        ((a * (r + one) - 5 * a) * (r + one) + 8 * a) * (r + one) - 4 * a,
        ((a + 2) * r - (a + 3)) * r * r + one,
        ((a + 2) * s - (a + 3)) * s * s + one,
        ((a * (s + one) - 5 * a) * (s + one) + 8 * a) * (s + one) - 4 * a,
    ], axis=1).astype(_F32)
    index = base.astype(np.int64)[:, None] + np.arange(-1, 3)[None, :]
    return np.clip(index, 0, size - 1), weights


def _grad_positions(count: int, scale: np.float32) -> np.ndarray:
    """ResizeGradOpx: output-gradient position i goes to input ``floor(i * (1 / scale))``."""
    return np.floor(np.arange(count, dtype=_F32) * (_F32(1) / scale)).astype(np.int64)


# -- jax pieces ---------------------------------------------------------------------------------

def _take(x: Any, index: np.ndarray, axis: int) -> Any:
    return jnp.take(x, jnp.asarray(index, jnp.int32), axis=axis)


def _along(values: np.ndarray, axis: int, rank: int, dtype: Any) -> Any:
    shape = [1] * rank
    shape[axis] = len(values)
    return jnp.asarray(values.reshape(shape), dtype)


def _scatter_add(g: Any, index: np.ndarray, size: int, axis: int) -> Any:
    """Sum the slices of ``g`` along ``axis`` into ``size`` slices at ``index`` (out-of-range
    positions dropped)."""
    moved = jnp.moveaxis(g, axis, 0)
    summed = jax.ops.segment_sum(moved, jnp.asarray(index, jnp.int32), num_segments=size)
    return jnp.moveaxis(summed, 0, axis)


@dataclass(frozen=True)
class _Plan:
    """One Resize with static shapes: everything but the data."""

    settings: _Settings
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    scales: tuple[np.float32, ...]

    def nearest(self, x: Any) -> Any:
        s = self.settings
        for d, scale in enumerate(self.scales):
            changed = (x.shape[d] != self.out_shape[d] if s.nearest == "pytorch"
                       else scale != _F32(1))
            if changed:
                x = _take(x, _nearest_indices(self.in_shape[d], self.out_shape[d], scale,
                                              s.nearest, s.transform), d)
        return x

    def linear(self, x: Any) -> Any:
        t = self.settings.transform
        for d, scale in enumerate(self.scales):
            if scale == _F32(1):
                continue
            size, out = self.in_shape[d], self.out_shape[d]
            low = _take(x, _nearest_indices(size, out, scale, "floor", t), d)
            high = _take(x, _nearest_indices(size, out, scale, "ceil", t), d)
            coords = np.maximum(_coordinates(out, t, scale, size), _F32(0))
            c = _along(coords - np.floor(coords), d, x.ndim, x.dtype)
            x = low * (1 - c) + high * c
        return x

    def cubic(self, x: Any, transform: str | None = None) -> Any:
        t = transform or self.settings.transform
        for d in reversed(range(len(self.scales))):
            if self.scales[d] == _F32(1):
                continue
            index, weights = _cubic_taps(self.in_shape[d], self.out_shape[d], self.scales[d], t)
            x = sum(_take(x, index[:, k], d) * _along(weights[:, k], d, x.ndim, x.dtype)
                    for k in range(4))
        return x

    def nearest_grad(self, g: Any) -> Any:
        for d, scale in enumerate(self.scales):
            if self.out_shape[d] != self.in_shape[d]:
                g = _scatter_add(g, _grad_positions(self.out_shape[d], scale),
                                 self.in_shape[d], d)
        return g

    def cubic_grad(self, g: Any) -> Any:
        """ResizeCubicHelper::runBackward: the transpose of the half_pixel cubic (the grad op
        is made with PopART's default coordinate transformation)."""
        for d, scale in enumerate(self.scales):
            if scale == _F32(1):
                continue
            index, weights = _cubic_taps(self.in_shape[d], self.out_shape[d], scale,
                                         "half_pixel")
            spread = jnp.moveaxis(g, d, -1)[..., None] * jnp.asarray(weights, g.dtype)
            spread = jnp.moveaxis(spread.reshape(spread.shape[:-2] + (-1,)), -1, d)
            g = _scatter_add(spread, index.reshape(-1), self.in_shape[d], d)
        return g


def _linear_grad_refused(_: Any, g: Any) -> Any:
    err = UnsupportedModel(["Resize (linear): Resize mode 'linear' is not supported when "
                            "training (PopART has no linear ResizeGrad). Fix: use nearest or "
                            "cubic, or do not train through this Resize."])
    err.popart_text = "Resize mode 'linear' is not supported when training."
    raise err


def _run(plan: _Plan, x: Any) -> Any:
    mode = plan.settings.mode
    if mode != "nearest" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise NotSupported(f"{mode} Resize of a {x.dtype} tensor is not supported (PopART "
                           f"interpolates floating-point tensors). Fix: cast to float first.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return plan.nearest(x)
    forward = getattr(plan, mode)
    backward = {"nearest": lambda _, g: (plan.nearest_grad(g),),
                "linear": _linear_grad_refused,
                "cubic": lambda _, g: (plan.cubic_grad(g),)}[mode]

    @jax.custom_vjp
    def run(v: Any) -> Any:
        return forward(v)

    run.defvjp(lambda v: (forward(v), None), backward)
    return run(x)


def _plan(ctx: Ctx, x: Any, settings: _Settings) -> _Plan:
    shape = tuple(int(n) for n in x.shape)
    scales = _scales(ctx, shape)
    out = tuple(_out_size(n, s) for n, s in zip(shape, scales, strict=True))
    if any(o < 1 for o in out):
        raise NotSupported(f"scales {[float(s) for s in scales]} give input {list(shape)} the "
                           f"output shape {list(out)}, with an empty dimension. Fix: scale "
                           f"every dimension to at least 1.")
    return _Plan(settings, shape, out, tuple(_F32(s) for s in scales))


# -- the operators ------------------------------------------------------------------------------

def _check_resize(ctx: Ctx) -> None:
    if ctx.opset < 10:
        raise NotSupported(f"Resize is an ai.onnx operator from opset 10; this model imports "
                           f"opset {ctx.opset}. Fix: use Upsample, or import opset 10 or later.")
    settings = _settings(ctx)
    if not all(ctx.known(i) is not None for i in range(1, len(ctx.inputs)) if ctx.has_input(i)):
        return  # reported by the lowering (scales, sizes and roi must be constants)
    scales, _ = _given_scales(ctx)
    if (settings.transform == "tf_crop_and_resize" and scales is not None
            and not (settings.mode == "nearest" and settings.nearest == "pytorch")
            and np.any(scales != _F32(1))):
        _coordinates(1, settings.transform, _F32(1), 1)  # PopART's refusal


@op("Resize", static=(1, 2, 3), check=_check_resize)
def resize(ctx: Ctx, x: Any, *_: Any) -> Any:
    """ai.onnx Resize as PopART computes it (see the module's docstring)."""
    return _run(_plan(ctx, x, _settings(ctx)), x)


def _upsample_settings(ctx: Ctx) -> _Settings:
    if ctx.opset >= 10:
        raise NotSupported(f"Upsample is deprecated from ai.onnx opset 10 and PopART "
                           f"implements it up to opset 9 (this model imports opset "
                           f"{ctx.opset}). Fix: use Resize.")
    mode = ctx.attr("mode", "nearest")
    if mode == "linear":
        raise PopartRefusal("Upsample op only supports the mode 'nearest' at this time.",
                            "use Resize with mode='linear'.")
    if mode != "nearest":
        raise PopartRefusal(f"Unrecognised upsample mode {mode}", "use mode='nearest'.")
    if ctx.opset < 9 and ctx.attr("scales") is None:
        raise NotSupported("Upsample before opset 9 needs the scales attribute. Fix: give "
                           "scales, one per dimension.")
    return _Settings("nearest", "pytorch", "half_pixel")


def _check_upsample(ctx: Ctx) -> None:
    _upsample_settings(ctx)


@op("Upsample", static=(1,), check=_check_upsample)
def upsample(ctx: Ctx, x: Any, *_: Any) -> Any:
    """ai.onnx Upsample as PopART computes it: Resize, nearest, ``pytorch`` nearest mode."""
    return _run(_plan(ctx, x, _upsample_settings(ctx)), x)
