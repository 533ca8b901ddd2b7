"""Control flow: ai.onnx If, Loop and Scan, and PopART's Call (ai.graphcore), each running the
subgraphs the lowering prepared once (a :class:`~.lowering.Body` in the node's graph attribute).
A node's inputs are its own, then the tensors its subgraphs read from the enclosing graphs
(``ctx.attr("__outer")``).

* **Call** runs its callee inline: gradients flow through it, as through PopART's CallGradOp.
* **If** picks a branch in Python when its condition is known before running (a constant, or
  computed from shapes: the branches may then differ in output shapes), else with
  ``lax.cond``, which needs the branches' outputs of one shape and type; gradients flow through
  the branch taken, as through PopART's IfGradOp.
* **Loop** runs its body with ``lax.while_loop``, or ``lax.scan`` when the body has scan
  outputs: their length is the trip count M, which must then be a constant (PopART's LoopOp
  reads M when the graph is built; M is a compile-time input here in every case, and may be
  omitted only for a loop without scan outputs). Iterations after the condition turns false
  leave the carried values as they are and write zeros to the scan outputs, whose length stays
  M, as PopART's do.
* **Scan** (opsets 8, 9, 11) runs its body with ``lax.scan``. A scan output is the body's
  outputs stacked on a new axis (ONNX), or - PopART's ScanOp, for a model that declares it so
  (the output's declared rank is the body output's, as popart_kit's Builder types it) -
  concatenated along the output axis, with rank-1 scan inputs sliced to shape [1].

Loop and Scan pass no gradient to their inputs (``lax.stop_gradient``): PopART's LoopOp and
ScanOp have no gradient ops, so autodiff leaves what feeds them without a gradient from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .ops import GRAPHCORE, Ctx, NotSupported, op
from .ops_random import random_subscope

__all__: list[str] = []


def _split(ctx: Ctx, inputs: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The node's own inputs, and every input by name (what its subgraphs read among them)."""
    own = len(ctx.inputs) - len(ctx.attr("__outer", ()))
    return list(inputs[:own]), {n: v for n, v in zip(ctx.inputs, inputs, strict=True) if n}


def _is_known(value: Any) -> bool:
    """A value known before running (numpy: a constant or computed from shapes)."""
    return isinstance(value, np.ndarray | np.generic | bool | int | float)


def _first(value: Any) -> Any:
    return np.asarray(value).reshape(-1)[0] if _is_known(value) else jnp.reshape(value, (-1,))[0]


def _stopped(value: Any) -> Any:
    return value if value is None or _is_known(value) else lax.stop_gradient(value)


def _aval(value: Any) -> str:
    return f"{tuple(np.shape(value))} {jnp.result_type(value)}"


def _check_counts(what: str, body: Any, inputs: int | None, outputs: int) -> None:
    if inputs is not None and len(body.inputs) != inputs:
        raise NotSupported(f"{what} takes {inputs} inputs, but its graph {body.name!r} declares "
                           f"{len(body.inputs)}")
    if len(body.outputs) < outputs:
        raise NotSupported(f"{what} gives {outputs} outputs, but its graph {body.name!r} has "
                           f"only {len(body.outputs)}")


# -- Call ---------------------------------------------------------------------------------------

def _check_call(ctx: Ctx) -> None:
    own = len(ctx.inputs) - len(ctx.attr("__outer", ()))
    _check_counts("Call", ctx.attr("callee"), own, len(ctx.outputs))


@op("Call", domain=GRAPHCORE, check=_check_call)
def call(ctx: Ctx, *inputs: Any) -> tuple[Any, ...]:
    args, scope = _split(ctx, inputs)
    with random_subscope(ctx.name):  # each call site's random operators draw their own values
        return tuple(ctx.attr("callee")(args, scope))


# -- PackedDataBlock ----------------------------------------------------------------------------

def _check_packed(ctx: Ctx) -> None:
    own = len(ctx.inputs) - len(ctx.attr("__outer", ()))
    data = (own - 2) // 3
    if own < 5 or (own - 2) % 3 or len(ctx.attr("maxSequenceLengths", ())) != data:
        raise NotSupported(f"PackedDataBlock takes [data, offsets, lengths] per data input, "
                           f"then the result's offsets and lengths, with one "
                           f"maxSequenceLengths each: got {own} inputs and maxSequenceLengths "
                           f"{list(ctx.attr('maxSequenceLengths', ()))}")
    _check_counts("PackedDataBlock's callback", ctx.attr("callback"), data, 1)


def _unpack(data: Any, offsets: Any, lengths: Any, width: int) -> Any:
    """[S, width, ...]: sequence s is data[offsets[s]:offsets[s] + lengths[s]], zero-padded."""
    steps = jnp.arange(width)
    rows = offsets.astype(jnp.int32)[:, None] + steps
    inside = (steps < lengths.astype(jnp.int32)[:, None]) & (rows < data.shape[0])
    taken = jnp.take(data, jnp.clip(rows, 0, data.shape[0] - 1), axis=0)
    mask = inside.reshape(inside.shape + (1,) * (data.ndim - 1))
    return jnp.where(mask, taken, jnp.zeros((), data.dtype))


@op("PackedDataBlock", domain=GRAPHCORE, check=_check_packed)
def packed_data_block(ctx: Ctx, *inputs: Any) -> Any:
    """PopART's PackedDataBlock (its pattern's Loop of SequenceSlices): each data input's
    sequences unpacked to [S, maxSequenceLength, ...], the callback run on
    callbackBatchSize of them at a time (S // callbackBatchSize calls), and the first
    resultLengths[s] rows of each result sequence s written at resultOffsets[s] into zeros of
    [resultSize, ...]."""
    args, scope = _split(ctx, inputs)
    batch, size = int(ctx.attr("callbackBatchSize")), int(ctx.attr("resultSize"))
    *packed, out_offsets, out_lengths = args
    calls = jnp.shape(out_offsets)[0] // batch
    unpacked = []
    for i, width in enumerate(ctx.attr("maxSequenceLengths")):
        data, offsets, lengths = (jnp.asarray(a) for a in packed[3 * i:3 * i + 3])
        seqs = _unpack(data, offsets[:calls * batch], lengths[:calls * batch], int(width))
        unpacked.append(seqs.reshape((calls, batch) + seqs.shape[1:]))
    callback = ctx.attr("callback")
    results = lax.map(lambda xs: callback(list(xs), scope)[0], tuple(unpacked))
    results = results.reshape((calls * batch,) + results.shape[2:])  # [S, length, ...]
    steps = jnp.arange(results.shape[1])
    rows = jnp.asarray(out_offsets)[:calls * batch].astype(jnp.int32)[:, None] + steps
    written = steps < jnp.asarray(out_lengths)[:calls * batch].astype(jnp.int32)[:, None]
    rows = jnp.where(written, rows, size)  # out of range: dropped
    out = jnp.zeros((size,) + results.shape[2:], results.dtype)
    return out.at[rows].set(results, mode="drop")


# -- If -----------------------------------------------------------------------------------------

def _check_if(ctx: Ctx) -> None:
    for name in ("then_branch", "else_branch"):
        if ctx.attr(name) is not None:  # None: never taken, its condition being a constant
            _check_counts(f"If's {name}", ctx.attr(name), None, len(ctx.outputs))


@op("If", check=_check_if)
def if_(ctx: Ctx, *inputs: Any) -> tuple[Any, ...]:
    (cond, *_), scope = _split(ctx, inputs)
    then, other = ctx.attr("then_branch"), ctx.attr("else_branch")
    count = len(ctx.outputs)
    if _is_known(cond):
        return tuple((then if bool(_first(cond)) else other)([], scope)[:count])
    try:
        return tuple(lax.cond(_first(cond).astype(bool),
                              lambda: tuple(then([], scope)[:count]),
                              lambda: tuple(other([], scope)[:count])))
    except TypeError as err:
        raise NotSupported(f"its branches give outputs of different shapes or types, which "
                           f"the xla backend selects between only when the condition is known "
                           f"before running (a constant, or computed from shapes): {err}"
                           ) from None


# -- Loop ---------------------------------------------------------------------------------------

def _check_loop(ctx: Ctx) -> None:
    own = len(ctx.inputs) - len(ctx.attr("__outer", ()))
    body = ctx.attr("body")
    _check_counts("Loop's body", body, own, 1 + max(own - 2, 0))


def _same(what: str, body: Any, index: int, new: Any, old: Any) -> None:
    if np.shape(new) != np.shape(old) or jnp.result_type(new) != jnp.result_type(old):
        raise NotSupported(f"{what} {body.inputs[index]!r} of {body.name!r} changes from "
                           f"{_aval(old)} to {_aval(new)} in an iteration; the xla backend "
                           f"runs loops whose carried values keep their shape and type")


@op("Loop", check=_check_loop, static=(0,))
def loop(ctx: Ctx, *inputs: Any) -> tuple[Any, ...]:
    own, scope = _split(ctx, inputs)
    trip, cond, initial = own[0], own[1] if len(own) > 1 else None, own[2:]
    scope = {k: _stopped(v) for k, v in scope.items()}
    initial = [jnp.asarray(_stopped(v)) for v in initial]
    body = ctx.attr("body")
    carried, scans = len(initial), len(body.outputs) - 1 - len(initial)
    index_type = jax.dtypes.canonicalize_dtype(np.int64)
    limit = None if trip is None else min(int(_first(trip)), int(jnp.iinfo(index_type).max))

    def run(i: Any, c: Any, values: Sequence[Any]) -> tuple[Any, list[Any], list[Any]]:
        with random_subscope(i):  # each iteration's random operators draw their own values
            outs = body([i, c, *values], scope)
        new = [jnp.asarray(v) for v in outs[1:1 + carried]]
        for j, (n, o) in enumerate(zip(new, values, strict=True)):
            _same("loop-carried value", body, 2 + j, n, o)
        return jnp.reshape(outs[0], (-1,))[0].astype(bool), new, list(outs[1 + carried:])

    start = True if cond is None else _first(cond)
    if scans == 0:
        def going(state: Any) -> Any:
            i, c, _ = state
            return c if limit is None else jnp.logical_and(c, i < limit)

        def step(state: Any) -> Any:
            i, c, values = state
            c, values, _ = run(i, c, values)
            return i + 1, c, values

        state = (jnp.zeros((), index_type), jnp.asarray(start, bool), initial)
        return tuple(lax.while_loop(going, step, state)[2])
    if limit is None:
        raise NotSupported(f"a loop with scan outputs ({scans}) needs its trip count M: the "
                           f"scan outputs have one row per iteration (PopART reads M when the "
                           f"graph is built)")
    # the condition stays true when it starts true and the body passes it on unchanged
    always = _is_known(start) and bool(start) and body.outputs[0] == body.inputs[1]

    def scan_step(state: Any, i: Any) -> Any:
        c, values = state
        c_next, new, ys = run(i, c, values)
        if always:
            return (c, new), ys
        new = [jnp.where(c, n, v) for n, v in zip(new, values, strict=True)]
        ys = [jnp.where(c, y, jnp.zeros_like(y)) for y in ys]
        return (jnp.logical_and(c, c_next), new), ys

    (_, final), ys = lax.scan(scan_step, (jnp.asarray(start, bool), initial),
                              jnp.arange(limit, dtype=index_type))
    return (*final, *ys)


# -- Scan ---------------------------------------------------------------------------------------

def _check_scan(ctx: Ctx) -> None:
    own = len(ctx.inputs) - len(ctx.attr("__outer", ()))
    scans = ctx.attr("num_scan_inputs")
    if scans is None or scans < 1:
        raise NotSupported(f"num_scan_inputs={scans}: a Scan needs at least one scan input")
    states = own - scans - (1 if ctx.opset < 9 else 0)
    if states < 0:
        raise NotSupported(f"num_scan_inputs={scans} but the node has {own} inputs")
    _check_counts("Scan's body", ctx.attr("body"), states + scans, len(ctx.outputs))
    for name in ("directions", "scan_input_directions", "scan_output_directions"):
        if any(d not in (0, 1) for d in ctx.attr(name, [])):
            raise NotSupported(f"attribute {name}={ctx.attr(name)}: directions are 0 "
                               f"(forward) or 1 (reverse)")


def _entry(values: Sequence[int], i: int) -> int:
    return int(values[i]) if i < len(values) else 0


def _run_scan(body: Any, scope: Mapping[str, Any], states: Sequence[Any],
              slices: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """``body`` over the leading axis of ``slices``: the final states, and the scan outputs
    stacked on a leading axis."""
    count = len(states)

    def step(carry: Any, xs: Any) -> Any:
        outs = body([*carry, *xs], scope)
        new = [jnp.asarray(v) for v in outs[:count]]
        for j, (n, o) in enumerate(zip(new, carry, strict=True)):
            _same("state", body, j, n, o)
        return tuple(new), tuple(outs[count:])

    final, ys = lax.scan(step, tuple(jnp.asarray(s) for s in states), tuple(slices))
    return list(final), list(ys)


def _stacked_ranks(body: Any, scope: Mapping[str, Any], states: Sequence[Any],
                   slices: Sequence[Any]) -> list[int] | None:
    """The ranks of the scan outputs stacked as ONNX stacks them, None if the body cannot
    take ONNX's slices."""
    def one(*args: Any) -> Any:
        return body([*args[:len(states)], *args[len(states):]], scope)[len(states):]

    try:
        shapes = jax.eval_shape(one, *states, *(s[0] for s in slices))
    except Exception:  # noqa: BLE001 - the body is for PopART's slices; tried next
        return None
    return [len(s.shape) + 1 for s in shapes]


@op("Scan", check=_check_scan)
def scan(ctx: Ctx, *inputs: Any) -> tuple[Any, ...]:
    own, scope = _split(ctx, inputs)
    scope = {k: _stopped(v) for k, v in scope.items()}
    own = [_stopped(v) for v in own]
    body, scans = ctx.attr("body"), int(ctx.attr("num_scan_inputs"))
    if ctx.opset < 9:
        return _scan8(ctx, body, scope, own, scans)
    states, xs = own[:len(own) - scans], [jnp.asarray(x) for x in own[len(own) - scans:]]
    in_axes, in_dirs = ctx.attr("scan_input_axes", []), ctx.attr("scan_input_directions", [])
    slices = []
    for m, x in enumerate(xs):
        if x.ndim == 0:
            raise NotSupported(f"scan input {m} is a scalar: there is no axis to scan")
        moved = jnp.moveaxis(x, _entry(in_axes, m) % x.ndim, 0)
        slices.append(jnp.flip(moved, 0) if _entry(in_dirs, m) else moved)
    trips = {s.shape[0] for s in slices}
    if len(trips) != 1:
        raise NotSupported(f"its scan inputs have different lengths on their scan axes "
                           f"{sorted(trips)}")
    (trip,) = trips
    declared = ctx.attr("__declared", ())[len(states):]
    stacked = _stacked_ranks(body, scope, states, slices)
    popart = stacked is None or any(
        d is not None and len(d) != r for d, r in zip(declared, stacked, strict=False))
    if popart:  # PopART's ScanOp: a rank-1 input gives slices of shape [1]
        slices = [s[:, None] if s.ndim == 1 else s for s in slices]
    final, ys = _run_scan(body, scope, states, slices)
    out_axes, out_dirs = ctx.attr("scan_output_axes", []), ctx.attr("scan_output_directions", [])
    outputs = []
    for k, y in enumerate(ys):
        y = jnp.flip(y, 0) if _entry(out_dirs, k) else y
        if popart and y.ndim > 1:  # concatenated along the axis, iteration-major
            axis = _entry(out_axes, k) % (y.ndim - 1)
            y = jnp.moveaxis(y, 0, axis)
            y = jnp.reshape(y, (*y.shape[:axis], trip * y.shape[axis + 1], *y.shape[axis + 2:]))
        else:
            y = jnp.moveaxis(y, 0, _entry(out_axes, k) % y.ndim)
        outputs.append(y)
    return (*final, *outputs)


def _scan8(ctx: Ctx, body: Any, scope: Mapping[str, Any], own: Sequence[Any],
           scans: int) -> tuple[Any, ...]:
    """Scan-8: [sequence_lens, states..., scan inputs...], every input batched on axis 0 and
    scanned on axis 1; sequence_lens, when given, must be the full length."""
    lens, rest = own[0], own[1:]
    states, xs = rest[:len(rest) - scans], [jnp.asarray(x) for x in rest[len(rest) - scans:]]
    trip = xs[0].shape[1]
    if lens is not None and not (_is_known(lens) and np.all(np.asarray(lens) == trip)):
        raise NotSupported(f"sequence_lens other than the full length {trip} (or a value not "
                           f"known before running) is not supported")
    dirs = ctx.attr("directions", [])

    def one(state: Sequence[Any], x: Sequence[Any]) -> Any:
        slices = [jnp.flip(s, 0) if _entry(dirs, m) else s for m, s in enumerate(x)]
        final, ys = _run_scan(body, scope, state, slices)
        return final, ys

    final, ys = jax.vmap(one)([jnp.asarray(s) for s in states], xs)
    return (*final, *ys)
