"""PopART's ai.graphcore tensor operators on the xla backend: ReduceMedian, Bucketize, Sort,
SequenceSlice, Slice, DepthToSpace, GroupedGather, ScatterReduce, Init, TensorRemap, and the
refusals of CopyVarUpdate and Abort (willow/src/op/*.cpp for the shapes and errors,
willow/src/popx/op/*x.cpp for the computation).

Gradients are JAX's where they are PopART's (ReduceMedian and Sort scatter the gradient to the
selected element, GroupedGather scatter-adds, Slice pads); ScatterReduce has PopART's own
gradient (a custom_vjp) and SequenceSlice none (PopART gives it no grad op).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..._model.graphcore.tensor_ops import (
    POPART_DATA_TYPES,
    SCATTER_REDUCTIONS,
    gather_axis,
    reduce_axes,
    scatter_shapes,
    slice_bounds,
)
from .ops import GRAPHCORE, Ctx, NotSupported, _checks, _nonneg, _one_of, depth_to_space, np_dtype
from .ops import op as _op

__all__: list[str] = []


def op(*names: str, **kwargs: Any) -> Callable[[Callable], Callable]:
    """Register ai.graphcore operators."""
    return _op(*names, domain=GRAPHCORE, **kwargs)


def _rule(fn: Callable[..., Any], *args: Any) -> Any:
    """A shared shape rule of tensor_ops; its ValueError (PopART's refusal) as NotSupported."""
    try:
        return fn(*args)
    except ValueError as err:
        raise NotSupported(str(err)) from None


def _at_least(name: str, default: int, low: int) -> Callable[[Ctx], None]:
    def check(ctx: Ctx) -> None:
        if int(ctx.attr(name, default)) < low:
            raise NotSupported(f"attribute {name}={ctx.attr(name, default)} is not valid: must "
                               f"be >= {low}")
    return check


# -- ReduceMedian -------------------------------------------------------------------------------

@op("ReduceMedian", check=_one_of("keepdims", 1, 0, 1))
def reduce_median(ctx: Ctx, x: Any) -> tuple[Any, Any]:
    """PopART's median: the lower of the two middle values for an even count (not their mean),
    and its index in the reduced axes flattened in order; the gradient goes to that element."""
    axes = _rule(reduce_axes, ctx.attr("axes"), x.ndim)
    kept = [i for i in range(x.ndim) if i not in axes]
    y = jnp.transpose(x, kept + axes)
    y = y.reshape(*y.shape[:len(kept)], -1)
    index = jnp.argsort(y, axis=-1, stable=True)[..., (y.shape[-1] - 1) // 2]
    values = jnp.take_along_axis(y, index[..., None], axis=-1)[..., 0]
    shape = [1 if i in axes else d for i, d in enumerate(x.shape)
             if ctx.attr("keepdims", 1) or i not in axes]
    return values.reshape(shape), index.astype(jnp.int32).reshape(shape)


# -- Bucketize ----------------------------------------------------------------------------------

@op("Bucketize", check=_one_of("right", 0, 0, 1))
def bucketize(ctx: Ctx, x: Any, boundaries: Any) -> Any:
    """Bucketizex: the bucket i with boundaries[i-1] < x <= boundaries[i] (``right``:
    boundaries[i-1] <= x < boundaries[i]), 0 below the first, len(boundaries) above the last
    or for NaN; with unsorted boundaries, the lowest i that matches, as PopART's loop leaves."""
    if boundaries.ndim != 1 or boundaries.shape[0] == 0:
        raise NotSupported(f"BucketizeOp::setup The boundaries tensor is not a non-empty 1-D "
                           f"tensor (shape {tuple(boundaries.shape)}).")
    if x.dtype != boundaries.dtype:
        raise NotSupported(f"BucketizeOp::setup The input and boundaries tensors have "
                           f"different data types ({x.dtype}, {boundaries.dtype}).")
    b, xe = boundaries, x[..., None]
    if ctx.attr("right", 0):
        inside, first = (xe >= b[:-1]) & (xe < b[1:]), x < b[0]
    else:
        inside, first = (xe > b[:-1]) & (xe <= b[1:]), x <= b[0]
    count = b.shape[0]
    out = jnp.where(first, 0, count)
    if count > 1:  # the lowest bucket whose bounds hold x (PopART's loop writes it last)
        out = jnp.where(jnp.any(inside, axis=-1), jnp.argmax(inside, axis=-1) + 1, out)
    return out.astype(jnp.int32)


# -- Sort ---------------------------------------------------------------------------------------

@op("Sort", check=_checks(_one_of("descending", 0, 0, 1), _one_of("stable", 0, 0, 1)))
def sort(ctx: Ctx, x: Any) -> tuple[Any, Any]:
    """The values sorted along ``axis`` and their INT32 indices (ties in input order)."""
    axis = int(ctx.attr("axis", -1))
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise NotSupported(f"Cannot compute BaseSortOp on axis {axis} when input rank is "
                           f"{x.ndim}.")
    index = jnp.argsort(x, axis=axis, stable=True, descending=bool(ctx.attr("descending", 0)))
    return jnp.take_along_axis(x, index, axis=axis), index.astype(jnp.int32)


# -- SequenceSlice ------------------------------------------------------------------------------

@op("SequenceSlice")
def sequence_slice(ctx: Ctx, source: Any, dest: Any, count: Any, source_offset: Any,
                   dest_offset: Any) -> Any:
    """popops::sequenceSlice: for each i, rows [dest_offset[i], + N[i]) of the destination take
    rows [source_offset[i], + N[i]) of the source (rows past either end are left alone); with
    zeroUnused the rows no slice writes are zero. No gradient flows (PopART has no grad op)."""
    if source.shape[1:] != dest.shape[1:]:
        raise NotSupported(f"SequenceSlice: source {tuple(source.shape)} and destination "
                           f"{tuple(dest.shape)} must have the same shape after the first "
                           f"dimension")
    n, src, dst = (jnp.reshape(v, (-1,)).astype(jnp.int32)
                   for v in (count, source_offset, dest_offset))
    rows = jnp.arange(dest.shape[0], dtype=jnp.int32)[:, None]
    taken = src + rows - dst                                   # [dest rows, slices]
    covered = (rows >= dst) & (rows < dst + n) & (taken >= 0) & (taken < source.shape[0])
    last = covered.shape[1] - 1 - jnp.argmax(covered[:, ::-1], axis=1)  # the last slice wins
    row = jnp.take_along_axis(taken, last[:, None], axis=1)[:, 0]
    values = jnp.take(source, jnp.clip(row, 0, max(source.shape[0] - 1, 0)), axis=0)
    hit = jnp.any(covered, axis=1).reshape((-1,) + (1,) * (dest.ndim - 1))
    rest = jnp.zeros_like(dest) if ctx.attr("zeroUnused", 0) else dest
    return lax.stop_gradient(jnp.where(hit, values.astype(dest.dtype), rest))


# -- Slice, DepthToSpace, GroupedGather ---------------------------------------------------------

def _check_steps(ctx: Ctx) -> None:
    steps = ctx.attr("steps")
    if steps is not None and any(int(s) != 1 for s in steps):
        raise NotSupported(f"attribute steps={list(steps)} is not supported (aiGraphcore.slice "
                           f"has none); use ai.onnx Slice for strided or reversed slices")


@op("Slice", check=_check_steps)
def popart_slice(ctx: Ctx, x: Any) -> Any:
    """ai.graphcore Slice (ONNX Slice-1's attributes): indices clamped to [-dim, dim], negative
    ones counted from the end; axes from 0 when left out."""
    index = [slice(None)] * x.ndim
    for axis, start, end in _rule(slice_bounds, x.shape, ctx.attr("starts", []),
                                  ctx.attr("ends", []), ctx.attr("axes")):
        index[axis] = slice(start, end)
    return x[tuple(index)]


@op("DepthToSpace", check=_one_of("mode", "DCR", "DCR", "CRD"))
def popart_depth_to_space(ctx: Ctx, x: Any) -> Any:
    """ai.graphcore DepthToSpace: ai.onnx's on a 4-D input with a positive blocksize."""
    block = int(ctx.attr("blocksize", 0))
    if block <= 0 or x.ndim != 4 or x.shape[1] % (block * block):
        raise NotSupported(f"DepthToSpace needs a positive blocksize (got {block}) and a 4-D "
                           f"input whose channels are a multiple of blocksize^2 (got "
                           f"{tuple(x.shape)})")
    return depth_to_space(ctx, x)


@op("GroupedGather", check=_at_least("group_size", 1, 1))
def grouped_gather(ctx: Ctx, data: Any, indices: Any) -> Any:
    """Gather along ``axis``; with group_size > 1 the first dimension of data and indices is
    the group, each group gathering from its own data."""
    group = int(ctx.attr("group_size", 1))
    axis = _rule(gather_axis, data.shape, int(ctx.attr("axis", 0)), group)
    if group == 1:
        return jnp.take(data, _nonneg(indices, data.shape[axis]), axis=axis, mode="clip")
    if data.shape[0] != group or indices.shape[0] != group:
        raise NotSupported(f"GroupedGather: the first dimension of data {tuple(data.shape)} and "
                           f"indices {tuple(indices.shape)} must be group_size={group}")
    size = data.shape[axis]
    return jax.vmap(lambda d, i: jnp.take(d, _nonneg(i, size), axis=axis - 1, mode="clip"))(
        data, indices)


# -- ScatterReduce ------------------------------------------------------------------------------

_IDENTITY = {"sum": 0, "mul": 1, "none": 0}


def _positions(index: Any, axis: int, size: int) -> tuple[tuple[Any, ...], Any]:
    """The output positions an index array (shape of the data it scatters) addresses, the
    out-of-range ones moved past the end (dropped), and which are in range."""
    valid = (index >= 0) & (index < size)
    index = jnp.where(valid, index, size).astype(jnp.int32)
    return tuple(index if k == axis else lax.broadcasted_iota(jnp.int32, index.shape, k)
                 for k in range(index.ndim)), valid


def _gathered(tensor: Any, where: tuple[Any, ...], valid: Any, axis: int) -> Any:
    clipped = tuple(jnp.minimum(w, tensor.shape[axis] - 1) if k == axis else w
                    for k, w in enumerate(where))
    return jnp.where(valid, tensor[clipped], jnp.zeros((), tensor.dtype))


def _scatter_forward(reduction: str, data: Any, index: Any, initial: Any, axis: int,
                     shape: Sequence[int]) -> Any:
    where, _ = _positions(index, axis, shape[axis])
    if reduction in ("max", "min"):
        lowest, highest = ((-jnp.inf, jnp.inf) if jnp.issubdtype(data.dtype, jnp.inexact) else
                           (False, True) if data.dtype == jnp.bool_ else
                           (jnp.iinfo(data.dtype).min, jnp.iinfo(data.dtype).max))
        start = lowest if reduction == "max" else highest
        base = jnp.full(shape, start, data.dtype) if initial is None else initial
        at = base.at[where]
        out = at.max(data, mode="drop") if reduction == "max" else at.min(data, mode="drop")
        if initial is None:  # PopART leaves the positions nothing is scattered to zero
            touched = jnp.zeros(shape, bool).at[where].set(True, mode="drop")
            out = jnp.where(touched, out, jnp.zeros((), data.dtype))
        return out
    base = jnp.full(shape, _IDENTITY[reduction], data.dtype) if initial is None else initial
    at = base.at[where]
    return (at.add(data, mode="drop") if reduction == "sum" else
            at.multiply(data, mode="drop") if reduction == "mul" else at.set(data, mode="drop"))


def _scatter_reduce_fn(reduction: str, axis: int, shape: Sequence[int]) -> Callable[..., Any]:
    """f(data, index, initial) with ScatterReduceGradOp's gradient: the output's gradient
    gathered back to each data element - times (data == its output) for max and min, times
    output / data for mul, as is for sum and none (every duplicate gets it) - and for the
    initial values the output's gradient (sum), zero where scattered (none), where the output
    is the initial value (max, min), or times output / initial (mul)."""

    @jax.custom_vjp
    def f(data: Any, index: Any, initial: Any) -> Any:
        return _scatter_forward(reduction, data, index, initial, axis, shape)

    def forward(data: Any, index: Any, initial: Any) -> tuple[Any, Any]:
        out = _scatter_forward(reduction, data, index, initial, axis, shape)
        return out, (data, index, initial, out)

    def backward(saved: Any, grad: Any) -> tuple[Any, None, Any]:
        data, index, initial, out = saved
        where, valid = _positions(index, axis, shape[axis])
        grad_data = _gathered(grad, where, valid, axis)
        if reduction in ("max", "min"):
            grad_data = grad_data * (data == _gathered(out, where, valid, axis))
        elif reduction == "mul":
            grad_data = grad_data * _gathered(out, where, valid, axis) / data
        grad_initial = None
        if initial is not None:
            grad_initial = (grad if reduction == "sum" else
                            grad.at[where].set(0, mode="drop") if reduction == "none" else
                            grad * (out == initial) if reduction in ("max", "min") else
                            grad * out / initial)
        return grad_data.astype(data.dtype), None, grad_initial

    f.defvjp(forward, backward)
    return f


def _check_scatter(ctx: Ctx) -> None:
    if ctx.attr("axis_size") is None:
        raise NotSupported("attribute axis_size is required")
    reduction = str(ctx.attr("reduction", "sum")).lower()
    if reduction not in SCATTER_REDUCTIONS.values():
        raise NotSupported(f"attribute reduction={ctx.attr('reduction')!r} is not supported; "
                           f"supported: {', '.join(SCATTER_REDUCTIONS.values())}")


@op("ScatterReduce", check=_checks(_check_scatter, _at_least("axis_size", 1, 1),
                                   _at_least("group_size", 1, 1),
                                   _one_of("enable_index_broadcast", 1, 0, 1)))
def scatter_reduce(ctx: Ctx, data: Any, indices: Any, initial: Any = None) -> Any:
    """PopART's ScatterReduce: data scattered along ``axis`` into ``axis_size`` positions,
    combined by ``reduction`` (sum, max, min, mul, none: the last write) with the initial
    values, or with none (positions nothing reaches are 0). Out-of-range (and negative)
    indices are dropped; with group_size > 1 the first dimension is the group."""
    group = int(ctx.attr("group_size", 1))
    axis, region, shape = _rule(scatter_shapes, data.shape, indices.shape,
                                int(ctx.attr("axis", -1)), int(ctx.attr("axis_size")), group,
                                bool(ctx.attr("enable_index_broadcast", 1)))
    if tuple(indices.shape) != tuple(region):  # a vector of indices along the axis
        vector = [d if k == axis or (group > 1 and k == 0) else 1 for k, d in enumerate(region)]
        indices = jnp.broadcast_to(jnp.reshape(indices, vector), region)
    data = data[tuple(slice(0, d) for d in region)]
    if initial is not None:
        if initial.ndim != data.ndim or initial.dtype != data.dtype:
            raise NotSupported(f"ScatterReduce: the initial values {tuple(initial.shape)} "
                               f"{initial.dtype} must have the data's rank and type "
                               f"({data.ndim}, {data.dtype})")
        shape = list(initial.shape)
    index = jnp.asarray(indices).astype(jnp.int32)  # a wrapped unsigned index is negative: dropped
    reduction = str(ctx.attr("reduction", "sum")).lower()
    if group == 1:
        return _scatter_reduce_fn(reduction, axis, shape)(data, index, initial)
    fn = _scatter_reduce_fn(reduction, axis - 1, shape[1:])
    return jax.vmap(fn, in_axes=(0, 0, None if initial is None else 0))(data, index, initial)


# -- Init, TensorRemap, CopyVarUpdate, Abort ----------------------------------------------------

def _check_init(ctx: Ctx) -> None:
    if ctx.attr("data_type") not in POPART_DATA_TYPES:
        raise NotSupported(f"attribute data_type={ctx.attr('data_type')} is not a PopART "
                           f"DataType with an array type (one of "
                           f"{', '.join(n for n, _ in POPART_DATA_TYPES.values())})")
    if ctx.attr("init_type") not in (0, 1):
        raise NotSupported(f"[InitOpx] Unexpected InitType {ctx.attr('init_type')} (NoInit=0, "
                           f"Zero=1)")
    if ctx.attr("shape") is None:
        raise NotSupported("attribute shape is required")


@op("Init", check=_check_init)
def init(ctx: Ctx) -> Any:
    """A tensor of ``shape`` and ``data_type`` (PopART's DataType value): zeros for Zero, and
    for NoInit too (PopART leaves its contents undefined)."""
    return jnp.zeros(tuple(ctx.attr("shape")), np_dtype(POPART_DATA_TYPES[ctx.attr("data_type")]
                                                        [1]))


@op("TensorRemap", check=_one_of("remap_type", 0, 0, 1, 2))
def tensor_remap(ctx: Ctx, x: Any, ref: Any = None) -> Any:
    """A tile-layout change on the IPU: the values pass through, forward and backward."""
    return x


@op("CopyVarUpdate")
def copy_var_update(ctx: Ctx, variable: Any, updater: Any) -> Any:
    """The updated variable's value: the updater, with no gradient. A training session
    copies it over the weight after each micro-batch (``XlaTrainingBackend.copy_updates``);
    an inference session refuses the op (``XlaBackend._setup_training``)."""
    return lax.stop_gradient(updater)


def _refuse_abort(ctx: Ctx) -> None:
    raise NotSupported("Abort stops the device program when run (when its scalar condition is "
                       "non-zero, if it has one); the xla backend cannot raise from inside a "
                       "compiled step. Remove the abort, or check the condition on an anchor "
                       "on the host.")


@op("Abort", check=_refuse_abort)
def abort(ctx: Ctx, *condition: Any) -> tuple[()]:
    """No outputs (refused by its check: see _refuse_abort)."""
    return ()
