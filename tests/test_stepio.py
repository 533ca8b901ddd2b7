"""StepIOFactory: allocation, views over sample streams, strict checks, instances and replicas."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import popart_kit as pk

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

DTYPES = ["float32", "float16", "int32", "uint8", "bool"]


def config(bps=4, acc=2, local=2, global_factor=None, offset=0, **kw) -> pk.SessionConfig:
    rep = {"local_factor": local, "global_offset": offset}
    if global_factor:
        rep["global_factor"] = global_factor
    return pk.SessionConfig(mode=kw.pop("mode", "training"), batches_per_step=bps,
                            accumulation={"factor": acc}, replication=rep, **kw)


def factory(cfg=None, **inputs) -> pk.StepIOFactory:
    return pk.StepIOFactory(cfg or config(), inputs=inputs or {"x": pk.TensorSpec((8, 16))})


def errors(info) -> list[tuple[str, str]]:
    return [(".".join(map(str, e["loc"])), e["msg"]) for e in info.value.errors()]


@st.composite
def layouts(draw):
    """A config, one input spec, and the input's global layout factors."""
    bps, acc = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    local, instances = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    spec = pk.TensorSpec(shape, draw(st.sampled_from(DTYPES)), draw(st.booleans()))
    return bps, acc, local, instances, spec


# -- specs and construction ---------------------------------------------------------------------


def test_tensor_spec_takes_numpy_and_popart_dtype_names():
    assert pk.TensorSpec((2,), "FLOAT16").dtype == np.float16
    assert pk.TensorSpec((2,), np.int32).dtype == np.int32
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        pk.TensorSpec((2,), "float33")
    with pytest.raises(ValueError, match="non-negative integers"):
        pk.TensorSpec((2, -1))


def test_construction_reports_every_bad_anchor():
    cfg = config(bps=4, acc=8, ipus_per_replica=2,
                 pipeline={"enabled": True, "stages": 2})
    with pytest.raises(ValidationError) as info:
        pk.StepIOFactory(cfg, anchors={"a": (pk.TensorSpec((2,)), ("EveryN", 3)),
                                       "b": (pk.TensorSpec((2,)), ("EveryN", 2)),
                                       "c": ((2,), "Allish")})
    found = dict(errors(info))
    assert "does not divide batches_per_step=4" in found["anchors.a"]
    assert "not valid for pipelined models" in found["anchors.b"]
    assert "Invalid anchor return type ID supplied: Allish" in found["anchors.c"]


def test_shapes_and_allocation():
    cfg = config(bps=4, acc=2, local=2)
    io = pk.StepIOFactory(cfg, inputs={"x": pk.TensorSpec((8, 16)),
                                       "ids": pk.TensorSpec((8,), "int32"),
                                       "scale": pk.TensorSpec((), broadcast=True)},
                          anchors={"y": (pk.TensorSpec((8, 10)), "All"),
                                   "loss": (pk.TensorSpec(()), "Final"),
                                   "acc": (pk.TensorSpec((1,)), ("EveryN", 2))})
    assert io.input_shape("x") == (4, 2, 2, 8, 16)
    assert io.input_shape("scale") == (4, 2)
    assert io.anchor_shape("loss") == (2,)
    assert io.anchor_shape("acc") == (2, 2, 2, 1)
    zeros = io.allocate_inputs()
    assert {k: (v.shape, v.dtype) for k, v in zeros.items()} == {
        "x": ((4, 2, 2, 8, 16), np.float32), "ids": ((4, 2, 2, 8), np.int32),
        "scale": ((4, 2), np.float32)}
    assert not zeros["x"].any()
    # XLA on CPU reads a 64-byte aligned input in place: no copy before the run
    assert all(v.ctypes.data % 64 == 0 and v.flags.c_contiguous and v.flags.writeable
               for v in zeros.values())
    import jax
    assert jax.device_put(zeros["x"]).unsafe_buffer_pointer() == zeros["x"].ctypes.data
    a, b = io.allocate_inputs("random", seed=3), io.allocate_inputs("random", seed=3)
    assert all(np.array_equal(a[k], b[k]) for k in a) and a["x"].std() > 0.5
    assert a["ids"].min() >= 0 and a["ids"].max() < 10
    anchors = io.allocate_anchors()
    assert {k: v.shape for k, v in anchors.items()} == {"y": (4, 2, 2, 8, 10), "loss": (2,),
                                                        "acc": (2, 2, 2, 1)}
    io.check_inputs(zeros)
    io.check_anchors(anchors)
    with pytest.raises(KeyError, match="'z' is not an input of this session"):
        io.input_shape("z")
    with pytest.raises(ValueError, match="fill='ones'"):
        io.allocate_inputs("ones")


# -- from_samples ---------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(layouts())
def test_from_samples_makes_views_in_popart_order(layout):
    bps, acc, local, _, spec = layout
    cfg = config(bps=bps, acc=acc, local=local)
    io = pk.StepIOFactory(cfg, inputs={"x": spec})
    count = bps * acc * (1 if spec.broadcast else local)
    samples = np.arange(count * spec.nelms).astype(spec.dtype).reshape((count,) + spec.shape)
    out = io.from_samples({"x": samples})["x"]
    assert out.shape == io.input_shape("x")
    assert np.shares_memory(out, samples) and out.base is not None
    # micro-batch k of the stream is (b, a, r) = (k // (A R), k // R % A, k % R)
    blocks = out.reshape((-1,) + spec.shape)
    for k in range(count):
        assert np.array_equal(blocks[k], samples[k])


def test_from_samples_refuses_wrong_sizes_with_the_factors():
    io = factory(config(bps=4, acc=2, local=2))
    with pytest.raises(ValidationError) as info:
        io.from_samples({"x": np.zeros((10, 16), np.float32)})
    (loc, msg), = errors(info)
    assert loc == "inputs.x"
    assert "has shape (10, 16) (160 elements)" in msg
    assert "bps=4 × A=2 × R=2 × nelms(S=(8, 16))=128 = 2048 elements, ending in axes (16,)" in msg
    assert "pass exactly 16 micro-batches of (8, 16) (e.g. shape (128, 16))" in msg


def test_from_samples_refuses_rows_of_the_wrong_width():
    io = factory(config(bps=1, acc=1, local=2), x=pk.TensorSpec((3, 2)))
    with pytest.raises(ValidationError, match="ending in axes \\(2,\\)"):
        io.from_samples({"x": np.zeros((2, 2, 3), np.float32)})  # 12 elements, wrong rows


def test_from_samples_of_empty_tensors():
    io = factory(config(bps=2, acc=1, local=1), x=pk.TensorSpec((0, 3)))
    assert io.from_samples({"x": np.zeros((0, 3), np.float32)})["x"].shape == (2, 0, 3)


def test_from_samples_never_copies_a_strided_array():
    io = factory(config(bps=2, acc=1, local=1), x=pk.TensorSpec((4,)))
    strided = np.zeros((2, 8), np.float32)[:, ::2]
    with pytest.raises(ValidationError, match="not C-contiguous"):
        io.from_samples({"x": strided})


# -- check_inputs ---------------------------------------------------------------------


@pytest.mark.parametrize("given_shape, why", [
    ((4, 2, 8, 16), "the accumulation_factor (2) or the replication_factor (2) axis is missing"),
    ((4, 3, 2, 8, 16), "axis 1 (accumulation_factor) is 3, expected 2"),
    ((4, 2, 2, 8, 15), "axis 4 (tensor dim 1) is 15, expected 16"),
    ((1, 4, 2, 2, 8, 16), "leading factors equal to 1 are left out"),
    ((2, 4, 2, 8, 16), "same number of elements"),
    ((4, 2, 2, 128), "rank 4, expected 5"),
    ((4, 2, 2, 8, 16, 1), "rank 6, expected 5"),  # a trailing 1 is not a leading factor
])
def test_check_inputs_says_which_axis_is_wrong(given_shape, why):
    io = factory(config(bps=4, acc=2, local=2))
    with pytest.raises(ValidationError) as info:
        io.check_inputs({"x": np.zeros(given_shape, np.float32)})
    (loc, msg), = errors(info)
    assert loc == "inputs.x" and why in msg
    assert "expected [bps=4, A=2, R=2] + S=(8, 16) = (4, 2, 2, 8, 16)" in msg


def test_check_inputs_reports_every_problem_at_once():
    io = pk.StepIOFactory(config(bps=2, acc=1, local=1),
                          inputs={"x": pk.TensorSpec((3,)), "ids": pk.TensorSpec((3,), "int32"),
                                  "m": pk.TensorSpec((3,), "float16"),
                                  "w": pk.TensorSpec((3,))})
    with pytest.raises(ValidationError) as info:
        io.check_inputs({"x": np.zeros((2, 3), np.float64),
                         "ids": np.zeros((2, 3), np.int64),      # allowed: PopART converts
                         "m": np.zeros((3, 2), np.float16).T,    # not C-contiguous
                         "extra": np.zeros(1)})
    found = errors(info)
    assert [loc for loc, _ in found] == ["inputs.w", "inputs.extra", "inputs.x", "inputs.m"]
    assert "input 'x' has dtype float64, expected float32" in found[2][1]
    assert "not C-contiguous" in found[3][1]


def test_check_inputs_of_scalar_tensors():
    io = factory(config(bps=1, acc=1, local=1), s=pk.TensorSpec(()))
    io.check_inputs({"s": np.array(0.5, np.float32)})
    with pytest.raises(ValidationError, match="leading factors equal to 1 are left out"):
        io.check_inputs({"s": np.array([0.5], np.float32)})


def test_check_anchors_names_every_n_factor():
    io = pk.StepIOFactory(config(bps=4, acc=1, local=1),
                          anchors={"y": (pk.TensorSpec((3,)), ("EveryN", 2))})
    with pytest.raises(ValidationError) as info:
        io.check_anchors({"y": np.zeros((4, 3), np.float32)})
    assert "axis 0 (batches_per_step/N) is 4, expected 2; expected [bps/N=2] + S=(3,)" in str(
        info.value)


def test_dotted_tensor_names_stay_whole():
    io = pk.StepIOFactory(config(), inputs={"fc1.weight": pk.TensorSpec((2,))})
    with pytest.raises(ValidationError) as info:
        io.check_inputs({})
    assert info.value.errors()[0]["loc"] == ("inputs", "fc1.weight")


def test_every_n_with_explicit_main_loops_is_refused():
    cfg = config(bps=4, popart_options={"enableExplicitMainLoops": True, "useHostCopyOps": True})
    with pytest.raises(ValidationError, match="explicit main loops do not support"):
        pk.StepIOFactory(cfg, anchors={"y": (pk.TensorSpec((2,)), ("EveryN", 2))})


def test_tensor_specs_hold_numbers():
    with pytest.raises(ValueError, match="host tensors are numbers or booleans"):
        pk.TensorSpec((2,), object)


def test_check_inputs_refuses_non_arrays():
    with pytest.raises(ValidationError, match="input 'x' is a list, not a numpy array"):
        factory().check_inputs({"x": [1.0, 2.0]})


def test_check_anchors_needs_writable_arrays():
    io = pk.StepIOFactory(config(), anchors={"y": (pk.TensorSpec((2,)), "Sum")})
    frozen = io.allocate_anchors()["y"]
    frozen.flags.writeable = False
    with pytest.raises(ValidationError, match="read-only"):
        io.check_anchors({"y": frozen})


# -- shard and replica ---------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(layouts())
def test_shards_of_every_instance_give_back_the_global_arrays(layout):
    bps, acc, local, instances, spec = layout
    total = local * instances
    glob = np.arange(bps * acc * (1 if spec.broadcast else total) * spec.nelms).astype(
        spec.dtype).reshape(pk.input_shape(spec.shape, bps, acc, total, spec.broadcast))
    pieces = []
    for instance in range(instances):
        cfg = config(bps=bps, acc=acc, local=local, global_factor=total,
                     offset=instance * local)
        io = pk.StepIOFactory(cfg, inputs={"x": spec})
        mine = io.shard({"x": glob})["x"]
        assert mine.shape == io.input_shape("x") and mine.flags.c_contiguous
        io.check_inputs({"x": mine})
        pieces.append(mine)
    if spec.broadcast or instances == 1:
        assert all(np.array_equal(p, glob) for p in pieces)
        return
    axis = (bps > 1) + (acc > 1)
    joined = (np.concatenate(pieces, axis=axis) if local > 1 else np.stack(pieces, axis=axis))
    assert np.array_equal(joined, glob)
    # the same data G local replicas in one process would see
    one = pk.StepIOFactory(config(bps=bps, acc=acc, local=total, device={"target": "offline"}),
                           inputs={"x": spec})
    for g in range(total):
        inst, r = divmod(g, local)
        cfg = config(bps=bps, acc=acc, local=local, global_factor=total, offset=inst * local)
        io = pk.StepIOFactory(cfg, inputs={"x": spec})
        assert np.array_equal(io.replica({"x": pieces[inst]}, r)["x"],
                              one.replica({"x": glob}, g)["x"])


def test_shard_into_reused_buffers():
    io = factory(config(bps=2, acc=1, local=2, global_factor=4, offset=2), x=pk.TensorSpec((3,)))
    glob = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    out = io.allocate_inputs()
    got = io.shard({"x": glob}, out=out)
    assert got["x"] is out["x"] and np.array_equal(out["x"], glob[:, 2:4])
    with pytest.raises(ValidationError, match="out 'x' has dtype float64"):
        io.shard({"x": glob}, out={"x": np.zeros((2, 2, 3))})


def test_shard_refuses_local_shaped_arrays():
    io = factory(config(bps=2, acc=1, local=2, global_factor=8, offset=2),
                 x=pk.TensorSpec((3,)))
    with pytest.raises(ValidationError, match="axis 1 \\(replication_factor\\) is 2, expected 8"):
        io.shard({"x": np.zeros((2, 2, 3), np.float32)})


def test_replica_views():
    io = factory(config(bps=3, acc=2, local=4), x=pk.TensorSpec((5,)))
    x = io.allocate_inputs("random")["x"]
    for r in range(4):
        view = io.replica({"x": x}, r)["x"]
        assert view.shape == (3, 2, 5) and np.shares_memory(view, x)
        assert np.array_equal(view, x[:, :, r])
    with pytest.raises(ValueError, match="replica 4 does not exist: this instance runs 4"):
        io.replica({"x": x}, 4)
    with pytest.raises(ValueError, match="replica True does not exist"):
        io.replica({"x": x}, True)
    assert np.array_equal(io.replica({"x": x}, np.int64(2))["x"], x[:, :, 2])


def test_replica_of_a_scalar_tensor_is_a_view():
    io = factory(config(bps=1, acc=1, local=2), s=pk.TensorSpec(()))
    s = np.array([1.0, 2.0], np.float32)
    view = io.replica({"s": s}, 1)["s"]
    assert view.shape == () and np.shares_memory(view, s) and view == 2.0


def test_broadcast_inputs_are_the_same_for_every_replica():
    io = factory(config(bps=2, acc=1, local=2), s=pk.TensorSpec((3,), broadcast=True))
    s = io.allocate_inputs("random")["s"]
    assert io.replica({"s": s}, 0)["s"] is s and io.replica({"s": s}, 1)["s"] is s


# -- batches ---------------------------------------------------------------------


def _dataset(n: int, width: int = 3):
    return [{"x": np.full(width, i, np.float32), "y": np.int32(i)} for i in range(n)]


def test_batches_group_samples_into_runs_and_count_the_rest():
    cfg = config(bps=2, acc=1, local=2)
    io = pk.StepIOFactory(cfg, inputs={"x": pk.TensorSpec((4, 3)), "y": pk.TensorSpec((4,),
                                                                                       "int32")})
    runs = io.batches(_dataset(40))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(runs)
    assert runs.samples_per_run == 16 and runs.runs == 2 and len(got) == 2
    assert runs.dropped == 8
    assert any("8 samples at the end" in str(w.message) for w in caught)
    first = got[0]
    io.check_inputs(first)
    # sample k of the run sits at micro-batch (b, r) = divmod(k // 4, 2), row k % 4
    assert np.array_equal(first["y"], np.arange(16).reshape(2, 2, 4))
    assert np.array_equal(first["x"][1, 0, 2], np.full(3, 10))


def test_batches_of_columns_equal_batches_of_the_same_samples_one_by_one():
    cfg = config(bps=2, acc=1, local=2)
    io = pk.StepIOFactory(cfg, inputs={"x": pk.TensorSpec((4, 3)), "y": pk.TensorSpec((4,),
                                                                                       "int32")})
    columns = {"x": np.repeat(np.arange(40, dtype=np.float32)[:, None], 3, axis=1),
               "y": np.arange(40, dtype=np.int32)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        by_column, by_sample = io.batches(columns), io.batches(_dataset(40))
        got, expected = list(by_column), list(by_sample)
    assert len(got) == len(expected) == 2 and by_column.dropped == by_sample.dropped == 8
    assert sum("8 samples at the end" in str(w.message) for w in caught) == 2
    for run, same in zip(got, expected, strict=True):
        for name in ("x", "y"):
            np.testing.assert_array_equal(run[name], same[name], strict=True)
    with pytest.raises(pk.DataError, match="different numbers of samples"):
        io.batches({"x": columns["x"], "y": columns["y"][:10]})
    with pytest.raises(pk.DataError, match="no column 'y'"):
        io.batches({"x": columns["x"]})


def test_batches_of_each_instance_are_its_share_of_the_global_run():
    shards = []
    for offset in (0, 2):
        cfg = config(bps=2, acc=2, local=2, global_factor=4, offset=offset)
        io = pk.StepIOFactory(cfg, inputs={"y": pk.TensorSpec((1,), "int32")})
        runs = list(io.batches([{"y": np.int32(i)} for i in range(35)]))
        assert len(runs) == 2
        shards.append(runs[0]["y"])
    whole = np.arange(16).reshape(2, 2, 4, 1)
    assert np.array_equal(np.concatenate(shards, axis=2), whole)


def test_batches_refuse_what_samples_cannot_feed():
    io = pk.StepIOFactory(config(), inputs={"s": pk.TensorSpec((2,), broadcast=True),
                                            "t": pk.TensorSpec(())})
    with pytest.raises(ValidationError) as info:
        io.batches([])
    assert {loc for loc, _ in errors(info)} == {"inputs.s", "inputs.t"}
    io = pk.StepIOFactory(config(bps=1, acc=1, local=1), inputs={"x": pk.TensorSpec((2, 3))})
    with pytest.raises(ValueError, match=r"samples of shape \(4,\), expected \(3,\)"):
        next(io.batches([np.zeros(4)] * 2))


@pytest.mark.parametrize("values, dtype, fits", [
    ([1.7, -2.9], "int32", False),    # no silent truncation
    ([300, 2], "uint8", False),       # no silent wrap-around
    ([3, 4], "int32", True),          # Python ints fit
    ([0.5, 1.5], "float16", True),    # floats narrow within their kind
])
def test_batches_refuse_samples_that_change_value(values, dtype, fits):
    io = pk.StepIOFactory(config(bps=1, acc=1, local=1), inputs={"v": pk.TensorSpec((2,), dtype)})
    run = io.batches([{"v": v} for v in values])
    if fits:
        assert next(run)["v"].dtype == dtype
    else:
        with pytest.raises(ValueError, match=f"do not fit {dtype} without changing values"):
            next(run)


# -- callback feeding ----------------------------------------------------------------------------


def test_feeder_order_wraps_around_and_handles_empty_and_scalar_tensors():
    cfg = config(bps=2, acc=1, local=2)
    io = pk.StepIOFactory(cfg, inputs={"x": pk.TensorSpec((3,)), "e": pk.TensorSpec((0, 2)),
                                       "s": pk.TensorSpec(())},
                          anchors={"y": (pk.TensorSpec(()), "Sum")})
    inputs, anchors = io.allocate_inputs("random"), io.allocate_anchors()
    feeder = io.feeder(inputs, anchors)
    for run in range(2):  # the same feeder serves a second run, like PyStepIO
        for k in range(4):  # micro-batch-major, replica-minor
            block = feeder.input("x", prefetch=False)
            assert np.shares_memory(block, inputs["x"])
            assert np.array_equal(block, inputs["x"][k // 2, k % 2])
            feeder.input_complete("x")
            assert feeder.input("e", prefetch=False).shape == (0, 2)
            feeder.input_complete("e")
            scalar = feeder.input("s", prefetch=True)
            assert scalar.shape == (1,) and scalar[0] == inputs["s"][k // 2, k % 2]
            feeder.input_complete("s")
        for r in range(2):
            feeder.output("y")[...] = 10 * run + r
            feeder.output_complete("y")
        assert feeder.remaining == {"x": 4, "e": 4, "s": 4, "y": 2}
    assert np.array_equal(anchors["y"], [10, 11])
    with pytest.raises(KeyError, match="PopART asked for input 'z'"):
        feeder.input("z", prefetch=False)


def test_feeder_needs_exact_dtypes():
    io = factory(config(bps=1, acc=1, local=1), ids=pk.TensorSpec((2,), "int32"))
    ids = np.zeros(2, np.int64)
    io.check_inputs({"ids": ids})  # PyStepIO converts int64 -> int32 ...
    with pytest.raises(ValidationError, match="has dtype int64, expected int32"):
        io.feeder({"ids": ids}, {})  # ... the callback path copies raw bytes
