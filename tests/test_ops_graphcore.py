"""PopART's ai.graphcore tensor operators (popart_kit/_model/graphcore/tensor_ops.py, lowered by
popart_kit/_runtime/xla/ops_graphcore.py): built with popart.Builder, run through the lowering,
held against numpy, onnxruntime and PopART's documented formulas - forward, gradient and the
refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import popart_kit.popart as popart
from popart_kit._model.builder_base import BuilderError
from popart_kit._runtime.xla.lowering import UnsupportedModel, lower

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

RNG = np.random.default_rng(7)
NP_TYPES = {np.float32: "FLOAT", np.int32: "INT32", np.uint32: "UINT32", np.float16: "FLOAT16"}


def inputs(b: popart.Builder, **arrays: np.ndarray) -> list[str]:
    return [b.addInputTensor(popart.TensorInfo(NP_TYPES[a.dtype.type], list(a.shape)), name)
            for name, a in arrays.items()]


def run(b: popart.Builder, outputs: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    graph = lower(onnx.load_from_string(b.getModelProto()))
    got = jax.jit(lambda x: graph.evaluate(graph.weights, x, outputs))(feeds)
    return [np.asarray(got[o]) for o in outputs]


def grads(b: popart.Builder, weighted: dict[str, np.ndarray], feeds: dict[str, np.ndarray],
          wrt: list[str]) -> dict[str, np.ndarray]:
    """d sum_k sum(output_k * weight_k) / d each input of ``wrt``, through the lowered graph
    (one compiled gradient for every case a test builds into its model)."""
    graph = lower(onnx.load_from_string(b.getModelProto()))

    def loss(xs: dict[str, jax.Array]) -> jax.Array:
        got = graph.evaluate(graph.weights, {**feeds, **xs}, list(weighted))
        return sum(jnp.sum(got[o] * w) for o, w in weighted.items())
    found = jax.jit(jax.grad(loss))({k: jnp.asarray(feeds[k]) for k in wrt})
    return {k: np.asarray(v) for k, v in found.items()}


def refused(b: popart.Builder, match: str) -> None:
    with pytest.raises(UnsupportedModel, match=match):
        lower(onnx.load_from_string(b.getModelProto()))


def unique(*shape: int) -> np.ndarray:
    return RNG.permutation(int(np.prod(shape))).reshape(shape).astype(np.float32) / 7


def weights_like(array: np.ndarray) -> np.ndarray:
    return RNG.standard_normal(array.shape).astype(np.float32)


# -- reducemedian -------------------------------------------------------------------------------

def test_reducemedian_values_indices_and_gradient():
    data = unique(3, 4, 5)
    b = popart.Builder()
    (x,) = inputs(b, x=data)
    cases = [(None, 0), ([1], 1), ([2, 0], 0), ([-1], 0), ([], 1)]
    built = [b.aiGraphcore.reducemedian([x], axes=axes, keepdims=keep) for axes, keep in cases]
    got = run(b, [t for pair in built for t in pair], {"x": data})
    weighted, expected_grad = {}, np.zeros_like(data)
    for k, ((axes, keepdims), (values, indices)) in enumerate(zip(cases, built, strict=True)):
        got_v, got_i = got[2 * k], got[2 * k + 1]
        reduced = sorted(a % 3 for a in axes) if axes is not None else [0, 1, 2]
        kept = [a for a in range(3) if a not in reduced]
        moved = data.transpose(kept + reduced)
        flat = moved.reshape([data.shape[a] for a in kept] + [-1])
        count = flat.shape[-1]
        # PopART's median: the lower middle value when the count is even (numpy averages)
        want = (np.median(flat, axis=-1) if count % 2 else
                np.partition(flat, (count - 1) // 2, axis=-1)[..., (count - 1) // 2])
        shape = [1 if a in reduced else d for a, d in enumerate(data.shape)
                 if keepdims or a not in reduced]
        assert list(got_v.shape) == shape == b.getTensorShape(values)
        assert shape == b.getTensorShape(indices) and got_i.dtype == np.int32
        np.testing.assert_array_equal(got_v, want.reshape(shape), err_msg=str(axes))
        # the index is the median's position in the reduced axes flattened in order
        where = got_i.reshape(flat.shape[:-1] + (1,)).astype(int)
        np.testing.assert_array_equal(np.take_along_axis(flat, where, -1).reshape(shape), got_v)
        # gradient: the top gradient goes to the median element only (ReduceMedianGradOp)
        weighted[values] = weights_like(got_v)
        scattered = np.zeros_like(flat)
        np.put_along_axis(scattered, where, weighted[values].reshape(where.shape), -1)
        expected_grad += scattered.reshape(moved.shape).transpose(np.argsort(kept + reduced))
    found = grads(b, weighted, {"x": data}, ["x"])["x"]
    np.testing.assert_allclose(found, expected_grad, rtol=1e-6)


def test_reducemedian_of_an_even_count_picks_the_lower_middle():
    data = np.arange(15, dtype=np.int32).reshape(3, 5)[:, :4].copy()  # 12 values: 5 and 6
    b = popart.Builder()
    (x,) = inputs(b, x=data)
    values, indices = b.aiGraphcore.reducemedian([x], keepdims=0)
    got_v, got_i = run(b, [values, indices], {"x": data})
    lower_middle = np.sort(data.reshape(-1))[5]
    assert got_v.shape == () and got_v == lower_middle and data.reshape(-1)[got_i] == got_v


def test_reducemedian_refuses_axes_out_of_range():
    b = popart.Builder()
    (x,) = inputs(b, x=unique(2, 3))
    with pytest.raises(BuilderError, match=r"Axis 2 is out of acceptable range \[-2, 1\]"):
        b.aiGraphcore.reducemedian([x], axes=[2])
    with pytest.raises(BuilderError, match="twice"):
        b.aiGraphcore.reducemedian([x], axes=[1, -1])


# -- bucketize ----------------------------------------------------------------------------------

def _popart_bucketize(x: np.ndarray, bounds: np.ndarray, right: int) -> np.ndarray:
    """Bucketizex's loop, written out: fill len(bounds), 0 below the first boundary, then
    upper = n-1 .. 1 writes ``upper`` where bounds[upper-1] < x <= bounds[upper]."""
    below = np.less if right else np.less_equal
    above = np.greater_equal if right else np.greater
    out = np.full(x.shape, len(bounds), np.int32)
    out[below(x, bounds[0])] = 0
    for upper in range(len(bounds) - 1, 0, -1):
        out[above(x, bounds[upper - 1]) & below(x, bounds[upper])] = upper
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_bucketize_matches_searchsorted(dtype):
    data = np.array([[3, 6, 9, 1], [-1, 0, 1, 140], [5, 7, 8, 2]], dtype)
    bounds = np.array([1, 3, 5, 7, 9], dtype)
    if dtype == np.float32:
        data[0, 0], data[1, 0] = np.nan, np.inf
    b = popart.Builder()
    x, bd = inputs(b, x=data, bd=bounds)
    outs = [b.aiGraphcore.bucketize([x, bd], right=right) for right in (0, 1)]
    got = run(b, outs, {"x": data, "bd": bounds})
    for right, out, found in zip((0, 1), outs, got, strict=True):
        want = np.searchsorted(bounds, data, side="right" if right else "left")
        assert found.dtype == np.int32 and b.getTensorShape(out) == list(data.shape)
        np.testing.assert_array_equal(found, want)


def test_bucketize_follows_popart_loop_for_unsorted_and_single_boundaries():
    data = np.arange(10, dtype=np.float32)
    unsorted, single = np.array([1, 2, 3, 6, 4, 5], np.float32), np.array([4], np.float32)
    b = popart.Builder()
    x, bu, bs = inputs(b, x=data, bu=unsorted, bs=single)
    outs = [b.aiGraphcore.bucketize([x, bd], right) for bd in (bu, bs) for right in (0, 1)]
    got = run(b, outs, {"x": data, "bu": unsorted, "bs": single})
    want = [_popart_bucketize(data, bd, right) for bd in (unsorted, single) for right in (0, 1)]
    for found, expected in zip(got, want, strict=True):
        np.testing.assert_array_equal(found, expected)


def test_bucketize_refusals():
    b = popart.Builder()
    x, b2, bi = inputs(b, x=unique(3), b2=unique(2, 2), bi=np.arange(3, dtype=np.int32))
    with pytest.raises(BuilderError, match="not a 1-D tensor"):
        b.aiGraphcore.bucketize([x, b2])
    with pytest.raises(BuilderError, match="different data types"):
        b.aiGraphcore.bucketize([x, bi])
    b = popart.Builder()
    x, bd = inputs(b, x=unique(3), bd=unique(2))
    b.aiGraphcore.bucketize([x, bd], right=2)
    refused(b, "right=2")


# -- sort ---------------------------------------------------------------------------------------

def test_sort_values_indices_and_gradient():
    data = np.array([[2, 2, 1, 10, 11], [2, 15, 15, 10, 11], [0, 3, 3, 3, -1]], np.float32)
    b = popart.Builder()
    (x,) = inputs(b, x=data)
    cases = [(0, 0), (1, 1), (-1, 0)]
    built = [b.aiGraphcore.sort([x], axis=axis, descending=down, stable=1) for axis, down in cases]
    got = run(b, [t for pair in built for t in pair], {"x": data})
    weighted, expected = {}, np.zeros_like(data)
    for k, ((axis, down), (values, indices)) in enumerate(zip(cases, built, strict=True)):
        want_i = np.argsort(-data if down else data, axis=axis, kind="stable")  # ties in order
        assert got[2 * k + 1].dtype == np.int32 and b.getTensorShape(indices) == [3, 5]
        np.testing.assert_array_equal(got[2 * k + 1], want_i)
        np.testing.assert_array_equal(got[2 * k], np.take_along_axis(data, want_i, axis))
        weighted[values] = weights_like(data)
        scattered = np.zeros_like(data)
        np.put_along_axis(scattered, want_i, weighted[values], axis)  # TopKGradOp
        expected += scattered
    np.testing.assert_allclose(grads(b, weighted, {"x": data}, ["x"])["x"], expected, rtol=1e-6)


def test_sort_refuses_an_axis_past_the_rank():
    b = popart.Builder()
    (x,) = inputs(b, x=unique(3, 4))
    with pytest.raises(BuilderError, match="axis 2 when input rank is 2"):
        b.aiGraphcore.sort([x], axis=2)


# -- sequenceslice ------------------------------------------------------------------------------

def test_sequenceslice_copies_rows_and_has_no_gradient():
    source = (np.arange(36) + 10).reshape(6, 6).astype(np.float32)
    dest = RNG.standard_normal((4, 6)).astype(np.float32)
    cases = [(1, [1, 1, 1], [0, 2, 4], [0, 1, 2]), (0, [1, 2], [0, 4], [2, 0]),
             (1, [2, 3], [5, 0], [0, 3])]
    b = popart.Builder()
    source_id, dest_id = inputs(b, source=source, dest=dest)
    feeds, outs = {"source": source, "dest": dest}, []
    for k, (zero_unused, *offsets) in enumerate(cases):
        arrays = {f"{name}{k}": np.asarray(v, np.uint32)
                  for name, v in zip(("n", "src", "dst"), offsets, strict=True)}
        feeds.update(arrays)
        outs.append(b.aiGraphcore.sequenceslice([source_id, dest_id, *inputs(b, **arrays)],
                                                zero_unused))
    got = run(b, outs, feeds)
    for (zero_unused, n, src, dst), out, found in zip(cases, outs, got, strict=True):
        want = np.zeros_like(dest) if zero_unused else dest.copy()
        for i in range(len(n)):  # rows past the end of either tensor are not copied
            rows = min(n[i], len(source) - src[i], len(dest) - dst[i])
            want[dst[i]:dst[i] + rows] = source[src[i]:src[i] + rows]
        assert b.getTensorShape(out) == list(dest.shape)
        np.testing.assert_array_equal(found, want)
    weighted = {out: np.ones_like(dest) for out in outs}
    assert not any(g.any() for g in grads(b, weighted, feeds, ["source", "dest"]).values())


# -- slice and depthtospace ---------------------------------------------------------------------

def test_slice_clamps_like_popart_and_pads_the_gradient():
    data = unique(4, 5, 3)
    b = popart.Builder()
    (x,) = inputs(b, x=data)
    cases = [([1, 0], [2, 3], [0, 1]), ([-5], [-1], [0]), ([1000], [1000], [1]),
             ([0, -3], [2, 10], [])]
    outs = [b.aiGraphcore.slice([x], ends=ends, starts=starts, axes=axes)
            for starts, ends, axes in cases]
    got = run(b, outs, {"x": data})
    weighted, expected = {}, np.zeros_like(data)
    for (starts, ends, axes), out, found in zip(cases, outs, got, strict=True):
        index = [slice(None)] * 3
        for axis, start, end in zip(axes or range(len(starts)), starts, ends, strict=True):
            index[axis] = slice(start, end)
        want = data[tuple(index)]
        assert b.getTensorShape(out) == list(want.shape)
        np.testing.assert_array_equal(found, want)
        weighted[out] = weights_like(want)
        expected[tuple(index)] += weighted[out]
    np.testing.assert_allclose(grads(b, weighted, {"x": data}, ["x"])["x"], expected, rtol=1e-6)


def test_slice_refusals():
    b = popart.Builder()
    (x,) = inputs(b, x=unique(4, 5))
    with pytest.raises(BuilderError, match="start 3 comes after end 1"):
        b.aiGraphcore.slice([x], ends=[1], starts=[3], axes=[0])
    with pytest.raises(BuilderError, match="axis = -1"):
        b.aiGraphcore.slice([x], ends=[1], starts=[0], axes=[-1])
    with pytest.raises(BuilderError, match="same length"):
        b.aiGraphcore.slice([x], ends=[1, 2], starts=[0], axes=[0])


def test_depthtospace_matches_onnxruntime():
    data = unique(2, 8, 2, 3)
    b = popart.Builder()
    (x,) = inputs(b, x=data)
    outs = [b.aiGraphcore.depthtospace([x], 2, mode) for mode in ("DCR", "CRD")]
    got = run(b, outs, {"x": data})
    for mode, out, found in zip(("DCR", "CRD"), outs, got, strict=True):
        node = onnx.helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode)
        model = onnx.helper.make_model(onnx.helper.make_graph(
            [node], "g", [onnx.helper.make_tensor_value_info("x", 1, data.shape)],
            [onnx.helper.make_tensor_value_info("y", 1, None)]),
            opset_imports=[onnx.helper.make_opsetid("", 13)])
        (want,) = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"]).run(["y"], {"x": data})
        assert b.getTensorShape(out) == list(want.shape) == [2, 2, 4, 6]
        np.testing.assert_array_equal(found, want)
    with pytest.raises(BuilderError, match="multiple of blocksize"):
        b.aiGraphcore.depthtospace([x], 3, "DCR")


# -- groupedgather ------------------------------------------------------------------------------

def test_groupedgather_gathers_per_group_and_scatter_adds_the_gradient():
    data = unique(2, 4, 5)
    index = np.array([[0, 3, 3], [2, 1, 0]], np.int32)
    b = popart.Builder()
    x, i = inputs(b, x=data, i=index)
    outs = [b.aiGraphcore.groupedgather([x, i], axis, group_size=2) for axis in (1, -1)]
    got = run(b, outs, {"x": data, "i": index})
    weighted, expected = {}, np.zeros_like(data)
    for inner, out, found in zip((0, 1), outs, got, strict=True):  # the axis inside a group
        want = np.stack([np.take(data[g], index[g], axis=inner) for g in range(2)])
        assert b.getTensorShape(out) == list(want.shape)
        np.testing.assert_array_equal(found, want)
        weighted[out] = weights_like(want)
        for g in range(2):
            np.add.at(np.moveaxis(expected[g], inner, 0), index[g],
                      np.moveaxis(weighted[out][g], inner, 0))
    found = grads(b, weighted, {"x": data, "i": index}, ["x"])["x"]
    np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-6)


def test_groupedgather_without_groups_is_gather_and_refuses_the_group_axis():
    data, index = unique(4, 3), np.array([[3, 0], [1, 1]], np.int32)
    b = popart.Builder()
    x, i = inputs(b, x=data, i=index)
    (got,) = run(b, [b.aiGraphcore.groupedgather([x, i], 0)], {"x": data, "i": index})
    np.testing.assert_array_equal(got, np.take(data, index, axis=0))
    with pytest.raises(BuilderError, match="indicates the dimension of the group"):
        b.aiGraphcore.groupedgather([x, i], 0, 2)


# -- scatterreduce ------------------------------------------------------------------------------

_NP_AT = {"sum": np.add.at, "max": np.maximum.at, "min": np.minimum.at, "mul": np.multiply.at}
_START = {"sum": 0.0, "max": -np.inf, "min": np.inf, "mul": 1.0}
_ENUM = {"sum": "Sum", "max": "Max", "min": "Min", "mul": "Mul", "none": "NoReduction"}


def _scatter_oracle(data: np.ndarray, index: np.ndarray, axis: int, size: int, reduction: str,
                    initial: np.ndarray | None) -> np.ndarray:
    """numpy's ufunc.at along ``axis``; untouched positions 0 without initial values."""
    shape = list(data.shape)
    shape[axis] = size
    where = list(np.indices(data.shape))
    where[axis] = index
    if reduction == "none":
        out = np.zeros(shape, data.dtype) if initial is None else initial.copy()
        out[tuple(where)] = data
        return out
    out = np.full(shape, _START[reduction], data.dtype) if initial is None else initial.copy()
    _NP_AT[reduction](out, tuple(where), data)
    if initial is None:
        touched = np.zeros(shape, bool)
        touched[tuple(where)] = True
        out[~touched] = 0
    return out


def _scatter_grads(data, index, axis, out, initial, reduction, g):
    """ScatterReduceGradOp's gradients (scatterreduceutilx.cpp)."""
    where = list(np.indices(data.shape))
    where[axis] = index
    picked_g, picked_out = g[tuple(where)], out[tuple(where)]
    grad_data = {"sum": picked_g, "none": picked_g, "max": picked_g * (data == picked_out),
                 "min": picked_g * (data == picked_out),
                 "mul": picked_g * picked_out / data}[reduction]
    if initial is None:
        return grad_data, None
    if reduction == "none":
        grad_init = g.copy()
        grad_init[tuple(where)] = 0
    else:
        grad_init = {"sum": g, "max": g * (out == initial), "min": g * (out == initial),
                     "mul": g * out / initial}[reduction]
    return grad_data, grad_init


def test_scatterreduce_forward_and_popart_gradient():
    b = popart.Builder()
    feeds, weighted, wanted = {}, {}, {}
    cases = [("sum", False), ("sum", True), ("max", False), ("min", True), ("mul", True),
             ("none", False), ("none", True)]
    for k, (reduction, with_initial) in enumerate(cases):
        data = RNG.integers(-3, 4, (4, 6)).astype(np.float32)  # repeats: ties for max/min
        data[data == 0] = 2
        index = RNG.integers(0, 3, (4, 6)).astype(np.int32)
        if reduction == "none":  # the winner of a repeated index is unspecified: unique
            index = np.argsort(RNG.random((3, 6)), axis=0).astype(np.int32)
            data = data[:3]
        initial = RNG.integers(-2, 3, (3, 6)).astype(np.float32) + 0.5 if with_initial else None
        arrays = {f"d{k}": data, f"i{k}": index, **({f"v{k}": initial} if with_initial else {})}
        feeds.update(arrays)
        out = b.aiGraphcore.scatterreduce(
            inputs(b, **arrays), 3, axis=0,
            reduction=getattr(popart.ScatterReduction, _ENUM[reduction]))
        want = _scatter_oracle(data, index, 0, 3, reduction, initial)
        assert b.getTensorShape(out) == list(want.shape)
        weighted[out] = weights_like(want)
        grad_d, grad_v = _scatter_grads(data, index, 0, want, initial, reduction, weighted[out])
        wanted[out] = (want, {f"d{k}": grad_d, **({f"v{k}": grad_v} if with_initial else {})})
    got = run(b, list(wanted), feeds)
    found = grads(b, weighted, feeds, [k for k in feeds if not k.startswith("i")])
    for (out, (want, want_grads)), value in zip(wanted.items(), got, strict=True):
        np.testing.assert_allclose(value, want, rtol=1e-6, err_msg=out)
        for name, expected in want_grads.items():
            np.testing.assert_allclose(found[name], expected, rtol=1e-5, err_msg=name)


def test_scatterreduce_vector_indices_broadcast_and_out_of_range_are_dropped():
    data = unique(5, 3)
    index = np.array([1, 0, 7, 1, -1], np.int32)  # 7 and -1 are out of range: dropped
    b = popart.Builder()
    d, i = inputs(b, d=data, i=index)
    out = b.aiGraphcore.scatterreduce([d, i], axis_size=2, axis=0)
    (got,) = run(b, [out], {"d": data, "i": index})
    want = np.stack([data[index == 0].sum(0), data[index == 1].sum(0)])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_scatterreduce_without_index_broadcast_uses_the_indexed_region():
    data = unique(4, 5)
    index = np.array([[1, 0], [0, 0], [2, 1]], np.int32)  # the leading [3, 2] region
    b = popart.Builder()
    d, i = inputs(b, d=data, i=index)
    out = b.aiGraphcore.scatterreduce([d, i], 3, 0, popart.ScatterReduction.Max, 0)
    (got,) = run(b, [out], {"d": data, "i": index})
    assert b.getTensorShape(out) == [3, 2]
    np.testing.assert_array_equal(got, _scatter_oracle(data[:3, :2], index, 0, 3, "max", None))


def test_groupedscatterreduce_scatters_each_group():
    data, index = unique(2, 4, 3), RNG.integers(0, 3, (2, 4, 3)).astype(np.int32)
    b = popart.Builder()
    d, i = inputs(b, d=data, i=index)
    out = b.aiGraphcore.groupedscatterreduce([d, i], 3, axis=1, group_size=2)
    (got,) = run(b, [out], {"d": data, "i": index})
    want = np.stack([_scatter_oracle(data[g], index[g], 0, 3, "sum", None) for g in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    g = weights_like(want)
    np.testing.assert_array_equal(grads(b, {out: g}, {"d": data, "i": index}, ["d"])["d"],
                                  np.take_along_axis(g, index, axis=1))


def test_scatterreduce_refusals():
    b = popart.Builder()
    d, i, p = inputs(b, d=unique(4, 3), i=np.zeros((2, 3), np.int32),
                     p=np.zeros((4, 3), np.int32))
    with pytest.raises(BuilderError, match="Partial broadcasting"):
        b.aiGraphcore.scatterreduce([d, i], 3, axis=0)
    with pytest.raises(BuilderError, match="axis_size = 0"):
        b.aiGraphcore.scatterreduce([d, p], 0)
    with pytest.raises(BuilderError, match="outside the acceptable range"):
        b.aiGraphcore.scatterreduce([d, p], 2, axis=2)
    with pytest.raises(ValueError, match="ScatterReduction"):
        b.aiGraphcore.scatterreduce([d, p], 2, reduction="mean")


# -- init, tensorremap, copyvarupdate, abort ----------------------------------------------------

def test_init_makes_zeros_of_popart_data_type_in_both_overloads():
    b = popart.Builder()
    a = b.aiGraphcore.init([2, 3], popart.DataType.FLOAT, popart.InitType.Zero, 0)
    c = b.aiGraphcore.init([4], popart.DataType.INT32, popart.InitType.NoInit, "named")
    e = b.aiGraphcore.init([1, 2], data_type=11, init_type=1)  # PopART's FLOAT is 11
    assert [b.getTensorShape(t) for t in (a, c, e)] == [[2, 3], [4], [1, 2]]
    assert [b.getTensorDtypeString(t) for t in (a, c, e)] == ["float32", "int32", "float32"]
    node = onnx.load_from_string(b.getModelProto()).graph.node[0]
    attrs = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
    assert attrs == {"shape": [2, 3], "tensor_type": 0, "data_type": 11, "init_type": 1,
                     "batch_axis": 0} and not node.input
    got = run(b, [a, c, e], {})
    for value, dtype, shape in zip(got, (np.float32, np.int32, np.float32),
                                   ((2, 3), (4,), (1, 2)), strict=True):
        assert value.dtype == dtype and value.shape == shape and not value.any()
    with pytest.raises(BuilderError, match="InitType"):
        b.aiGraphcore.init([2], popart.DataType.FLOAT, 5)


def test_tensorremap_passes_values_and_gradient_through():
    data = unique(3, 2)
    b = popart.Builder()
    (x,) = inputs(b, x=data)
    out = b.aiGraphcore.tensorremap([x], popart.TensorRemapType.Fwd, debugPrefix="remap")
    (got,) = run(b, [out], {"x": data})
    np.testing.assert_array_equal(got, data)
    weight = weights_like(data)
    np.testing.assert_array_equal(grads(b, {out: weight}, {"x": data}, ["x"])["x"], weight)


def test_copyvarupdate_is_checked_by_the_builder_and_refused_in_inference():
    b = popart.Builder()
    w = b.addInitializedInputTensor(np.zeros(2, np.float32))
    (x,) = inputs(b, x=unique(2))
    with pytest.raises(BuilderError, match="two args"):
        b.aiGraphcore.copyvarupdate([w])
    with pytest.raises(BuilderError, match="initialised tensor"):
        b.aiGraphcore.copyvarupdate([x, w])
    out = b.aiGraphcore.copyvarupdate([w, x])
    assert b.getTensorShape(out) == [2]
    flow = popart.DataFlow(1, {out: popart.AnchorReturnType("All")})
    with pytest.raises(popart.popart_exception, match="only in a training session"):
        popart.InferenceSession(b.getModelProto(), flow,
                                popart.DeviceManager().createCpuDevice())


def test_copyvarupdate_writes_the_weight_after_each_micro_batch_in_training():
    """A counter weight + 1 copied over itself (PopART's copy_var_update_test): each
    micro-batch reads the previous one's copy (accumulation 2, 2 batches per step: 4 per
    run), the counter gets no gradient update, and readWeights returns it."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]), "x")
    w = b.addInitializedInputTensor(np.ones(2, np.float32), "w")
    counter = b.addInitializedInputTensor(np.zeros(1, np.float32), "counter")
    added = b.aiOnnx.add([counter, b.aiOnnx.constant(np.ones(1, np.float32))])
    b.aiGraphcore.copyvarupdate([counter, added])
    loss = b.aiGraphcore.l1loss([b.aiOnnx.mul([x, w])], 0.1)
    opts = popart.SessionOptions()
    opts.enableGradientAccumulation, opts.accumulationFactor = True, 2
    session = popart.TrainingSession(
        b.getModelProto(), popart.DataFlow(2, {added: popart.AnchorReturnType("All")}), loss,
        popart.SGD({"defaultLearningRate": (0.1, False), "defaultWeightDecay": (0.5, False)}),
        popart.DeviceManager().createCpuDevice(), userOptions=opts)
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    for run in range(2):
        session.run(popart.PyStepIO({x: unique(2, 2, 2)}, anchors))
        np.testing.assert_array_equal(anchors[added].reshape(-1), np.arange(1, 5) + 4 * run)
    out = {"counter": np.zeros(1, np.float32)}
    session.weightsToHost()
    session.readWeights(popart.PyWeightsIO(out))
    assert out["counter"].tolist() == [8.0]


def test_abort_has_no_output_and_is_refused_by_the_xla_backend():
    b = popart.Builder()
    x, v = inputs(b, x=unique(1), v=unique(2))
    assert b.aiGraphcore.abort([x]) is None and b.aiGraphcore.abort([]) is None
    assert [len(n.output) for n in onnx.load_from_string(b.getModelProto()).graph.node] == [0, 0]
    refused(b, "Abort stops the device program")
    with pytest.raises(BuilderError, match="scalar"):
        b.aiGraphcore.abort([v])


def test_reducemedian_trains_through_a_popart_training_session():
    data = unique(3, 5)
    b = popart.Builder()
    w = b.addInitializedInputTensor(data, "w")
    values, _ = b.aiGraphcore.reducemedian([w], axes=[1], keepdims=0)
    loss = b.aiGraphcore.identityloss([values], reduction=popart.ReductionType.Sum)
    grad_w = popart.reservedGradientPrefix() + w
    session = popart.TrainingSession(fnModel=b.getModelProto(),
                                     dataFlow=popart.DataFlow(1, [grad_w]), loss=loss,
                                     optimizer=popart.ConstSGD(0.1),
                                     deviceInfo=popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO({}, anchors))
    expected = (data == np.median(data, axis=1, keepdims=True)).astype(np.float32)
    np.testing.assert_array_equal(anchors[grad_w], expected)


def test_an_integer_loss_backpropagates_integer_gradients_as_popart():
    data = RNG.permutation(15).reshape(3, 5).astype(np.int32)
    b = popart.Builder()
    (x,) = inputs(b, x=data)
    values, _ = b.aiGraphcore.reducemedian([x], axes=[1], keepdims=0)
    total = b.aiOnnx.reducesum([values], keepdims=False)
    loss = b.aiGraphcore.identityloss([total], reduction=popart.ReductionType.Sum)
    grad_x = popart.reservedGradientPrefix() + x
    session = popart.TrainingSession(fnModel=b.getModelProto(),
                                     dataFlow=popart.DataFlow(1, [values, grad_x]), loss=loss,
                                     optimizer=popart.ConstSGD(0.1),
                                     deviceInfo=popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO({x: data}, anchors))
    median = np.sort(data, axis=1)[:, 2]
    np.testing.assert_array_equal(anchors[values], median)
    assert anchors[grad_x].dtype == np.int32  # the median's position gets the loss's 1
    np.testing.assert_array_equal(anchors[grad_x], (data == median[:, None]).astype(np.int32))


# -- dynamic slices, reshape, subsample (ops.py) -------------------------------------------------

def test_dynamicslice_writes_into_its_slice_input_and_update_takes_a_dropped_axis():
    data = unique(4, 3, 2)
    b = popart.Builder()
    x, i = inputs(b, x=data, i=np.array([2], np.uint32))
    into = b.aiGraphcore.init([3, 2], popart.DataType.FLOAT, popart.InitType.Zero, "into")
    # PopART: a third input is the tensor the slice goes into - its shape (axis 0 dropped)
    sliced = b.aiGraphcore.dynamicslice([x, i, into], axes=[0], sizes=[1], noOverlap=True)
    assert b.getTensorShape(sliced) == [3, 2]
    updated = b.aiGraphcore.dynamicupdate([x, i, into], axes=[0], sizes=[1], noOverlap=True)
    got = run(b, [sliced, updated], {"x": data, "i": np.array([2], np.uint32)})
    np.testing.assert_array_equal(got[0], data[2])
    want = data.copy()
    want[2] = 0
    np.testing.assert_array_equal(got[1], want)


def test_graphcore_reshape_takes_zeros_and_one_minus_one_and_subsample_refuses_zero_strides():
    data = unique(2, 4, 3)
    b = popart.Builder()
    (x,) = inputs(b, x=data)
    out = b.aiGraphcore.reshape(x, shape=[-1, 0])  # reshape.cpp: 0 -> the input's size there
    assert b.getTensorShape(out) == [6, 4]
    np.testing.assert_array_equal(run(b, [out], {"x": data})[0], data.reshape(6, 4))
    with pytest.raises(BuilderError, match=r"^Strides invalid\. 0 stride at index 1"):
        b.aiGraphcore.subsample([x], [2, 0])


# -- packedDataBlock (graphcore/packed.py, ops_control.py) ---------------------------------------

def _unpack(data, offsets, lengths, width):
    out = np.zeros((len(offsets), width) + data.shape[1:], data.dtype)
    for s, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        out[s, :n] = data[o:o + n]
    return out


@pytest.mark.parametrize("batch", [1, 2])
def test_packeddatablock_unpacks_runs_the_callback_per_batch_and_packs(batch):
    lengths = np.array([3, 1, 4, 2], np.uint32)
    offsets = np.array([0, 3, 4, 8], np.uint32)
    data = unique(10, 2)
    b = popart.Builder()
    x, o, n = inputs(b, x=data, o=offsets, n=lengths)
    sub = b.createSubgraphBuilder()
    seq = sub.addUntypedInputTensor()
    sub.addOutputTensor(sub.aiOnnx.matmul([seq, sub.aiOnnx.transpose([seq], [0, 2, 1])]))
    out = b.aiGraphcore.packedDataBlock([x, o, n, o, n], [4], 12, batch, sub)
    assert b.getTensorShape(out) == [12, 4]
    (got,) = run(b, [out], {"x": data, "o": offsets, "n": lengths})
    seqs = _unpack(data, offsets, lengths, 4)
    products = seqs @ seqs.transpose(0, 2, 1)  # [4 sequences, 4, 4]
    want = np.zeros((12, 4), np.float32)  # rows never written stay zero (PopART's Init Zero)
    for s, (start, count) in enumerate(zip(offsets, lengths, strict=True)):
        want[start:start + count] = products[s, :count]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(BuilderError, match="Fix: give one per data input"):
        b.aiGraphcore.packedDataBlock([x, o, n, o, n], [4, 4], 12, batch, sub)
