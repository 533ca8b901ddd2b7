"""PopART's host-array layout rules (PyStepIO and initAnchorArrays shapes)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import popart_kit as pk

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

counts = st.integers(1, 6)
tensor_shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)


@st.composite
def return_types(draw, bps: int) -> pk.AnchorReturnType:
    name = draw(st.sampled_from(["All", "final", "SUM", "EveryN"]))
    if name == "EveryN":
        return pk.AnchorReturnType(name, draw(st.sampled_from(
            [d for d in range(1, bps + 1) if bps % d == 0])))
    return pk.AnchorReturnType(name)


# -- AnchorReturnType -----------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (("INVALID",), "Invalid anchor return type ID supplied: INVALID"),
    (("ALL", 2), "A return period should not be supplied for this anchor return type"),
    (("EveryN", -1), "Anchor return period must be greater than zero"),
    (("EveryN", 0), "Anchor return period must be greater than zero"),
    (("EveryN",), "Must specify return period with option 'EVERYN'"),
])
def test_constructor_errors_are_popart_s(args, message):
    with pytest.raises(ValueError, match=message):
        pk.AnchorReturnType(*args)


@pytest.mark.parametrize("name", ["all", "ALL", "All", "final", "Sum", "everyn"])
def test_names_are_case_insensitive(name):
    art = pk.AnchorReturnType(name, 1 if name == "everyn" else None)
    assert art.name in ("All", "Final", "Sum", "EveryN")
    assert pk.AnchorReturnType.of(art) is art


def test_of_accepts_names_and_pairs():
    assert pk.AnchorReturnType.of("final") == pk.AnchorReturnType("Final")
    assert pk.AnchorReturnType.of(("EveryN", 2)) == pk.AnchorReturnType("EveryN", 2)
    with pytest.raises(ValueError, match="cannot read an anchor return type from 3"):
        pk.AnchorReturnType.of(3)


@pytest.mark.parametrize("period, bps, message", [
    (4, 2, "EveryN period 4 exceeds batches_per_step=2"),
    (3, 4, r"EveryN period 3 does not divide batches_per_step=4. Fix: use a period that "
           r"divides 4: one of \[1, 2, 4\]"),
])
def test_period_must_divide_batches_per_step(period, bps, message):
    with pytest.raises(ValueError, match=message):
        pk.anchor_shape((2,), ("EveryN", period), batches_per_step=bps)


def test_numpy_integers_are_counts():
    assert pk.AnchorReturnType("EveryN", np.int64(2)).period == 2
    assert pk.input_shape((np.int64(3),), np.int32(2)) == (2, 3)
    with pytest.raises(ValueError, match="batches_per_step=True"):
        pk.input_shape((3,), True)


def test_element_counts_validate_like_shapes():
    with pytest.raises(ValueError, match="does not divide batches_per_step=4"):
        pk.anchor_elements((2,), ("EveryN", 3), 4)


def test_every_n_returns_micro_batches_n_minus_1_2n_minus_1():
    # anchorreturntype_test.py::test_simple_training_session: bps=2, A=2, N=2 returns the 2nd and
    # 4th of the 4 micro-batches
    art = pk.AnchorReturnType("EveryN", 2)
    assert list(art.returned_micro_batches(2, 2)) == [1, 3]
    assert art.fetches_per_replica(2, 2) == 2
    assert list(pk.AnchorReturnType("Final").returned_micro_batches(3, 2)) == [5]
    assert list(pk.AnchorReturnType("All").returned_micro_batches(3, 2)) == list(range(6))


# -- the layout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, shape", [
    ({}, (4, 2, 2, 8, 16)),
    ({"broadcast": True}, (4, 2, 8, 16)),
    ({"batches_per_step": 1}, (2, 2, 8, 16)),
    ({"accumulation_factor": 1, "replication_factor": 1}, (4, 8, 16)),
])
def test_input_shape_examples(kw, shape):
    args = {"batches_per_step": 4, "accumulation_factor": 2, "replication_factor": 2} | kw
    assert pk.input_shape((8, 16), **args) == shape


def test_tensor_dimensions_of_one_are_kept():
    assert pk.input_shape((1, 4), batches_per_step=1, replication_factor=2) == (2, 1, 4)
    assert pk.anchor_shape((1,), "Final", batches_per_step=8) == (1,)
    assert pk.input_shape((), batches_per_step=1) == ()


@pytest.mark.parametrize("art, shape", [
    ("All", (4, 2, 2, 8, 10)), (("EveryN", 2), (2, 2, 2, 8, 10)), (("EveryN", 4), (2, 2, 8, 10)),
    ("Final", (2, 8, 10)), ("Sum", (2, 8, 10)),
])
def test_anchor_shape_examples(art, shape):
    assert pk.anchor_shape((8, 10), art, batches_per_step=4, accumulation_factor=2,
                           replication_factor=2) == shape


def test_bad_counts_are_named():
    with pytest.raises(ValueError, match="batches_per_step=0, replication_factor=-1"):
        pk.input_shape((2,), batches_per_step=0, replication_factor=-1)
    with pytest.raises(ValueError, match="non-negative integers"):
        pk.input_shape((2, -1), batches_per_step=1)


@settings(max_examples=300, deadline=None)
@given(tensor_shapes, counts, counts, counts, st.booleans())
def test_input_shape_rule(shape, bps, acc, reps, broadcast):
    got = pk.input_shape(shape, bps, acc, reps, broadcast)
    prefix = [bps, acc] + ([] if broadcast else [reps])
    assert got == tuple(x for x in prefix if x != 1) + shape
    assert got[len(got) - len(shape):] == shape  # tensor dims always kept, in order
    assert math.prod(got) == pk.input_elements(shape, bps, acc, reps, broadcast)
    # PopART's own size check: nelms(S) * A * bps * (1 if Broadcast else R)
    assert pk.input_elements(shape, bps, acc, reps, broadcast) == (
        math.prod(shape) * acc * bps * (1 if broadcast else reps))


@settings(max_examples=300, deadline=None)
@given(st.data(), tensor_shapes, counts, counts, counts)
def test_anchor_shape_rule(data, shape, bps, acc, reps):
    art = data.draw(return_types(bps))
    got = pk.anchor_shape(shape, art, bps, acc, reps)
    prefix = {"All": [bps, acc, reps], "EveryN": [bps // (art.period or 1), acc, reps],
              "Final": [reps], "Sum": [reps]}[art.name]
    assert got == tuple(x for x in prefix if x != 1) + shape
    # PopART's getOutExpected
    expected = {"All": math.prod(shape) * acc * bps * reps,
                "EveryN": math.prod(shape) * acc * bps * reps // (art.period or 1),
                "Final": math.prod(shape) * reps, "Sum": math.prod(shape) * reps}[art.name]
    assert math.prod(got) == pk.anchor_elements(shape, art, bps, acc, reps) == expected
    returned = len(art.returned_micro_batches(bps, acc))  # Sum adds all of them into one
    assert art.fetches_per_replica(bps, acc) == (1 if art.name == "Sum" else returned)


@settings(max_examples=100, deadline=None)
@given(tensor_shapes, counts, st.sampled_from([1, 2, 4]), st.integers(2, 4), st.data())
def test_global_replication_never_changes_instance_shapes(shape, bps, local, instances, data):
    offset = local * data.draw(st.integers(0, instances - 1))
    alone = pk.SessionConfig(mode="training", batches_per_step=bps,
                             replication={"local_factor": local})
    spread = pk.SessionConfig(mode="training", batches_per_step=bps,
                              replication={"local_factor": local,
                                           "global_factor": local * instances,
                                           "global_offset": offset})
    specs = {"inputs": {"x": pk.TensorSpec(shape), "b": pk.TensorSpec(shape, broadcast=True)},
             "anchors": {"y": (pk.TensorSpec(shape), "All"), "s": (pk.TensorSpec(shape), "Sum")}}
    one, many = pk.StepIOFactory(alone, **specs), pk.StepIOFactory(spread, **specs)
    for name in ("x", "b"):
        assert one.input_shape(name) == many.input_shape(name) == alone.input_shape(
            shape, broadcast=name == "b")
    for name in ("y", "s"):
        assert one.anchor_shape(name) == many.anchor_shape(name)


def test_config_shapes_use_its_factors():
    cfg = pk.SessionConfig(mode="training", batches_per_step=4, accumulation={"factor": 2},
                           replication={"local_factor": 2})
    assert cfg.input_shape((8, 16)) == (4, 2, 2, 8, 16)
    assert cfg.input_shape((8, 16), broadcast=True) == (4, 2, 8, 16)
    assert cfg.anchor_shape((8, 10), "Final") == (2, 8, 10)
    assert cfg.anchor_shape((8, 10)) == (4, 2, 2, 8, 10)
    inference = pk.SessionConfig(mode="inference", batches_per_step=4)
    assert inference.anchor_shape((3,), ("EveryN", 2)) == (2, 3)


def test_a_step_shape_multiplies_its_factors_once():
    from popart_kit._base.shapes import AnchorReturnType, StepShape

    shape = StepShape.of(pk.SessionConfig(mode="training", batches_per_step=2,
                                          accumulation={"factor": 3},
                                          replication={"local_factor": 4}))
    assert (shape.micro_batches, shape.global_replicas) == (6, 4)
    assert StepShape(2, 3, 4, instances=2).global_replicas == 8
    assert shape.returned(AnchorReturnType("Final")) == range(5, 6)
    assert list(shape.returned(AnchorReturnType("EveryN", 2))) == [1, 3, 5]
