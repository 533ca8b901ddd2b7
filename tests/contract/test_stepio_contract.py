"""Contract tests: the StepIO objects popart_kit builds are what PopART's PyStepIO and
PyStepIOCallback take, and feed/receive the right micro-batches in PopART's call order.

Facts from PopART's stepio and stepiosplitter code (canonical layout ``[bps, A, R, *S]``,
Broadcast drops R on inputs only; callback call k of a tensor is micro-batch
``(b, a) = divmod(k // R, A)``, replica ``k % R``). The expected values below are computed
here from those facts, not with popart_kit's shape helpers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strict_popart import (
    MANIFEST,
    first_run_check,
    make_popart_module,
    simulate_run,
    stepio_arrays,
    stepio_callbacks,
)

import popart_kit as pk

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

SETTINGS = settings(max_examples=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

DTYPES = ("float32", "int32", "float16")
shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


@st.composite
def setups(draw: Any) -> dict[str, Any]:
    """A session (bps, A, R; pipelining off) with a few inputs and anchors of every kind."""
    training = draw(st.booleans())
    bps = draw(st.integers(1, 6))
    A = draw(st.integers(1, 4)) if training else 1  # noqa: N806 - the reference's names
    R = draw(st.sampled_from((1, 2, 4)))  # noqa: N806
    n_in = draw(st.integers(1, 3))
    inputs = {f"in{i}": (draw(shapes), draw(st.sampled_from(DTYPES)), draw(st.booleans()))
              for i in range(n_in)}
    divisors = [d for d in range(1, bps + 1) if bps % d == 0]
    arts = st.one_of(st.sampled_from(("All", "Final", "Sum")),
                     st.sampled_from(divisors).map(lambda n: ("EveryN", n)))
    n_out = draw(st.integers(1, 4))
    anchors = {f"out{i}": (draw(shapes), draw(st.sampled_from(DTYPES)), draw(arts))
               for i in range(n_out)}
    return {"training": training, "bps": bps, "A": A, "R": R,
            "inputs": inputs, "anchors": anchors}


def _fetches(art: Any, bps: int, A: int) -> int:  # noqa: N803
    """Buffers per replica per run (reference §2.1, numOutFetchesPerRepl)."""
    if art in ("Final", "Sum"):
        return 1
    if art == "All":
        return bps * A
    return bps // art[1] * A


def _anchor_prefix(art: Any, bps: int, A: int, R: int) -> tuple[int, ...]:  # noqa: N803
    if art in ("Final", "Sum"):
        return (R,)
    return (bps if art == "All" else bps // art[1], A, R)


def _squeeze(prefix: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x for x in prefix if x != 1) + shape


def _build(s: dict[str, Any]) -> tuple[pk.StepIOFactory, dict, dict]:
    cfg = pk.SessionConfig.model_validate({
        "mode": "training" if s["training"] else "inference",
        "batches_per_step": s["bps"], "accumulation": {"factor": s["A"]},
        "replication": {"local_factor": s["R"]}})
    factory = pk.StepIOFactory(
        cfg, inputs={n: pk.TensorSpec(shape, dtype, broadcast)
                     for n, (shape, dtype, broadcast) in s["inputs"].items()},
        anchors={n: ((shape, dtype), art) for n, (shape, dtype, art) in s["anchors"].items()})
    bps, A, R = s["bps"], s["A"], s["R"]  # noqa: N806
    inputs = {}
    for n, (shape, dtype, broadcast) in s["inputs"].items():
        prefix = (bps, A) if broadcast else (bps, A, R)
        full = prefix + shape
        # distinct values (exact in float16: at most 6*4*4*9 = 864 < 2048)
        inputs[n] = np.arange(math.prod(full)).astype(dtype).reshape(_squeeze(prefix, shape))
    anchors = {n: np.zeros(_squeeze(_anchor_prefix(art, bps, A, R), shape), dtype)
               for n, (shape, dtype, art) in s["anchors"].items()}
    return factory, inputs, anchors


def _tensor_specs(s: dict[str, Any]) -> tuple[dict, dict]:
    bps, A = s["bps"], s["A"]  # noqa: N806
    return ({n: (shape, dtype, broadcast) for n, (shape, dtype, broadcast) in s["inputs"].items()},
            {n: (shape, dtype, _fetches(art, bps, A))
             for n, (shape, dtype, art) in s["anchors"].items()})


# -- PyStepIO ---------------------------------------------------------------------------------


@SETTINGS
@given(setups())
def test_stepio_holds_the_checked_arrays_and_passes_popart_size_check(s: dict[str, Any]) -> None:
    factory, inputs, anchors = _build(s)
    popart = make_popart_module()
    sio = factory.stepio(inputs, anchors, popart=popart)
    assert isinstance(sio, popart.PyStepIO)
    held_in, held_out = stepio_arrays(sio)
    assert held_in.keys() == inputs.keys() and held_out.keys() == anchors.keys()
    assert all(held_in[n] is inputs[n] for n in inputs)  # same objects: no copies
    assert all(held_out[n] is anchors[n] for n in anchors)  # PopART writes these in place
    in_specs, out_specs = _tensor_specs(s)
    first_run_check(sio, in_specs, out_specs, R=s["R"], bps=s["bps"], A=s["A"])


# -- PyStepIOCallback -------------------------------------------------------------------------


@SETTINGS
@given(setups(), st.integers(0, 2**16))
def test_callbacks_feed_and_fill_in_popart_order(s: dict[str, Any], seed: int) -> None:
    factory, inputs, anchors = _build(s)
    originals = {n: a.copy() for n, a in inputs.items()}
    popart = make_popart_module()
    cb = factory.stepio_callback(inputs, anchors, popart=popart)
    assert isinstance(cb, popart.PyStepIOCallback)
    in_specs, out_specs = _tensor_specs(s)
    bps, A, R = s["bps"], s["A"], s["R"]  # noqa: N806
    run = simulate_run(cb, in_specs, out_specs, R=R, bps=bps, A=A, seed=seed)

    for n, (shape, dtype, broadcast) in s["inputs"].items():
        full = inputs[n].reshape((bps, A) + (() if broadcast else (R,)) + shape)
        fed = run.fed[n]
        assert len(fed) == bps * A * (1 if broadcast else R)
        for k, block in enumerate(fed):
            # Broadcast: micro-batch k for every replica; else (b, a) = divmod(k // R, A), r = k % R
            where = divmod(k, A) if broadcast else divmod(k // R, A) + (k % R,)
            expected = full[where]
            assert block.dtype == np.dtype(dtype)
            assert block.shape == (shape or (1,)), (n, k, block.shape)
            assert np.array_equal(block.reshape(shape), expected), (n, k)
        np.testing.assert_array_equal(inputs[n], originals[n])  # inputs are only read

    for n, (shape, dtype, art) in s["anchors"].items():
        prefix = _anchor_prefix(art, bps, A, R)
        written = run.written[n]
        assert len(written) == _fetches(art, bps, A) * R
        expected = np.zeros(prefix + shape, dtype)
        for k, value in enumerate(written):
            j, r = divmod(k, R)
            where = (r,) if art in ("Final", "Sum") else divmod(j, A) + (r,)
            expected[where] = value
        assert anchors[n].shape == _squeeze(prefix, shape)
        np.testing.assert_array_equal(anchors[n].reshape(prefix + shape), expected)
        # every slot written once: the values are 1..(count * nelms), each exactly once
        assert sorted(anchors[n].reshape(-1).astype(np.int64).tolist()) == list(
            range(1, anchors[n].size + 1))


# -- dtypes: PyStepIO converts int64 -> int32, the callback path does not ----------------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.sampled_from((1, 2, 4)), shapes, st.booleans())
def test_int64_for_int32_input(bps: int, R: int, shape: tuple, broadcast: bool) -> None:  # noqa: N803
    s = {"training": False, "bps": bps, "A": 1, "R": R,
         "inputs": {"x": (shape, "int32", broadcast)},
         "anchors": {"y": (shape, "float32", "All")}}
    factory, inputs, anchors = _build(s)
    inputs = {"x": inputs["x"].astype(np.int64)}
    in_specs, out_specs = _tensor_specs(s)
    popart = make_popart_module()

    sio = factory.stepio(inputs, anchors, popart=popart)  # PopART converts int64 -> int32
    first_run_check(sio, in_specs, out_specs, R=R, bps=bps, A=1)
    assert stepio_arrays(sio)[0]["x"] is inputs["x"]

    with pytest.raises(ValueError, match="int64"):
        factory.stepio_callback(inputs, anchors, popart=popart)

    # and the simulated run itself would refuse int64 blocks (so the check above matters)
    blocks = list(inputs["x"].reshape((-1,) + (shape or (1,))))
    raw = popart.PyStepIOCallback(lambda name, prefetch: blocks[0], lambda name: None,
                                  lambda name: anchors["y"].reshape(-1)[:1], lambda name: None)
    with pytest.raises(RuntimeError, match="Type discrepancy"):
        simulate_run(raw, in_specs, {}, R=R, bps=bps, A=1)


# -- the recorder is strict (so the tests above can fail) ------------------------------------


def _noop(*args: Any) -> None:
    return None


def test_recorder_ctor_names_come_from_the_manifest() -> None:
    assert MANIFEST["classes"]["PyStepIO"]["ctor"] == [["inputs", "outputs"]]
    assert MANIFEST["classes"]["PyStepIOCallback"]["ctor"] == [[
        "input_callback", "input_complete_callback", "output_callback",
        "output_complete_callback"]]


def test_recorder_pystepio_is_strict() -> None:
    popart = make_popart_module()
    x = np.zeros((2, 3), np.float32)
    popart.PyStepIO({"x": x}, {})
    popart.PyStepIO(inputs={"x": x}, outputs={})
    popart.PyStepIO({"x": x}, outputs={})
    for kwargs in ({"input": {"x": x}, "outputs": {}}, {"inputs": {"x": x}, "anchors": {}},
                   {"inputs": {"x": x}}, {"inputs": {}, "outputs": {}, "extra": {}}):
        with pytest.raises(TypeError):
            popart.PyStepIO(**kwargs)
    with pytest.raises(TypeError, match="multiple"):
        popart.PyStepIO({}, {}, inputs={})
    with pytest.raises(TypeError):
        popart.PyStepIO([("x", x)], {})  # not a dict
    with pytest.raises(TypeError):
        popart.PyStepIO({"x": x.tolist()}, {})  # not an ndarray
    with pytest.raises(TypeError):
        popart.PyStepIO({0: x}, {})  # not a str key
    with pytest.raises(RuntimeError, match="input array for tensor 'x' as it is not c-contig"):
        popart.PyStepIO({"x": x.T}, {})
    with pytest.raises(RuntimeError, match="output array for tensor 'y' as it is not c-contig"):
        popart.PyStepIO({}, {"y": np.zeros((4, 4), np.float32)[:, ::2]})
    sio = popart.PyStepIO({"x": x}, {})
    with pytest.raises(TypeError):
        sio.enableRuntimeAsserts(1)
    with pytest.raises(AttributeError):
        sio.inputs = {}  # noqa: B010 - pybind classes take no new attributes
    with pytest.raises(AttributeError):
        sio.enableRuntimeAssert(False)  # noqa: B009


def test_recorder_first_run_check() -> None:
    popart = make_popart_module()
    specs = {"x": ((2,), "float32", False)}
    ok = np.zeros((3, 2, 2), np.float32)  # bps=3, R=2, S=(2,)
    first_run_check(popart.PyStepIO({"x": ok}, {}), specs, {}, R=2, bps=3, A=1)
    first_run_check(popart.PyStepIO({"x": ok.reshape(-1)}, {}), specs, {}, R=2, bps=3, A=1)
    bad = popart.PyStepIO({"x": ok[:2].copy()}, {})
    with pytest.raises(RuntimeError, match="Unexpected number of input elements for Tensor x. "
                                           "Expected 12, but received 8."):
        first_run_check(bad, specs, {}, R=2, bps=3, A=1)
    bad.enableRuntimeAsserts(False)
    first_run_check(bad, specs, {}, R=2, bps=3, A=1)
    with pytest.raises(RuntimeError, match="Expected 6"):  # Broadcast leaves R out
        first_run_check(popart.PyStepIO({"x": ok}, {}), {"x": ((2,), "float32", True)}, {},
                        R=2, bps=3, A=1)
    with pytest.raises(RuntimeError, match="Type discrepancy"):
        first_run_check(popart.PyStepIO({"x": ok.astype(np.float16)}, {}), specs, {},
                        R=2, bps=3, A=1)
    with pytest.raises(RuntimeError, match="No tensor x provided"):
        first_run_check(popart.PyStepIO({}, {}), specs, {}, R=2, bps=3, A=1)
    with pytest.raises(RuntimeError, match="output elements for Tensor y. Expected 4"):
        first_run_check(popart.PyStepIO({"x": ok}, {"y": np.zeros(6, np.float32)}), specs,
                        {"y": ((2,), "float32", 1)}, R=2, bps=3, A=1)


def test_recorder_pystepiocallback_is_strict() -> None:
    popart = make_popart_module()
    names = ["input_callback", "input_complete_callback", "output_callback",
             "output_complete_callback"]
    cb = popart.PyStepIOCallback(**dict.fromkeys(names, _noop))
    assert stepio_callbacks(cb) == dict.fromkeys(names, _noop)
    popart.PyStepIOCallback(_noop, _noop, _noop, _noop)
    for wrong in ({"inputCallback": _noop}, {"input": _noop}, {"output_complete": _noop}):
        kwargs = dict.fromkeys(names[1:], _noop) | wrong
        with pytest.raises(TypeError):
            popart.PyStepIOCallback(**kwargs)
    with pytest.raises(TypeError):
        popart.PyStepIOCallback(_noop, _noop, _noop)
    with pytest.raises(TypeError):
        popart.PyStepIOCallback(_noop, _noop, _noop, "not callable")


def _fixed(blocks: list, out: np.ndarray | None = None) -> Any:
    """A callback StepIO whose input_callback hands out ``blocks`` in turn."""
    popart = make_popart_module()
    state = {"i": 0}

    def inp(name: str, prefetch: bool) -> Any:
        return blocks[state["i"]] if state["i"] < len(blocks) else None

    def done(name: str) -> None:
        state["i"] += 1

    return popart.PyStepIOCallback(inp, done, lambda name: out, _noop)


def test_recorder_simulate_run_is_strict() -> None:
    specs = {"x": ((2,), "float32", False)}
    good = [np.full(2, i, np.float32) for i in range(4)]
    run = simulate_run(_fixed(good), specs, {}, R=2, bps=2, A=1, prefetch_rate=0.5)
    assert [b.tolist() for b in run.fed["x"]] == [[i, i] for i in range(4)]
    assert [c for c in run.calls if c[0] == "input_complete"] == [("input_complete", "x")] * 4

    with pytest.raises(RuntimeError, match="did not provide input data"):
        simulate_run(_fixed(good[:3]), specs, {}, R=2, bps=2, A=1, prefetch_rate=0.0)
    with pytest.raises(RuntimeError, match="not c-contiguous"):
        simulate_run(_fixed([np.zeros(4, np.float32)[::2]] * 4), specs, {}, R=2, bps=2, A=1)
    with pytest.raises(RuntimeError, match="3 elements"):
        simulate_run(_fixed([np.zeros(3, np.float32)] * 4), specs, {}, R=2, bps=2, A=1)
    with pytest.raises(RuntimeError, match="Type discrepancy"):
        simulate_run(_fixed([np.zeros(2, np.float64)] * 4), specs, {}, R=2, bps=2, A=1)
    with pytest.raises(TypeError):
        simulate_run(_fixed([[0.0, 0.0]] * 4), specs, {}, R=2, bps=2, A=1)
    # a scalar tensor must come as shape (1,): a 0-d array means "no data"
    scalar = {"s": ((), "int32", False)}
    simulate_run(_fixed([np.zeros(1, np.int32)] * 2), scalar, {}, R=1, bps=2, A=1)
    with pytest.raises(RuntimeError, match="did not provide input data"):
        simulate_run(_fixed([np.zeros((), np.int32)] * 2), scalar, {}, R=1, bps=2, A=1,
                     prefetch_rate=0.0)
    # outputs: the k-th call gets k*nelms + 1 .. (k+1)*nelms; wrong dtype or size is refused
    out = np.zeros(2, np.float32)
    with pytest.raises(TypeError, match="not a numpy array"):
        simulate_run(_fixed([]), {}, {"y": ((2,), "float32", 1)}, R=1, bps=3, A=1)
    with pytest.raises(RuntimeError, match="3 elements"):
        simulate_run(_fixed([], np.zeros(3, np.float32)), {}, {"y": ((2,), "float32", 1)},
                     R=1, bps=3, A=1)
    with pytest.raises(RuntimeError, match="Type discrepancy"):
        simulate_run(_fixed([], np.zeros(2, np.int32)), {}, {"y": ((2,), "float32", 1)},
                     R=1, bps=3, A=1)
    run = simulate_run(_fixed([], out), {}, {"y": ((2,), "float32", 3)}, R=1, bps=3, A=1)
    assert [v.tolist() for v in run.written["y"]] == [[1, 2], [3, 4], [5, 6]]
    assert out.tolist() == [5, 6]
    # Final/Sum anchors are fetched once, after the last micro-batch
    run = simulate_run(_fixed(good, out), specs, {"y": ((2,), "float32", 1)}, R=2, bps=2, A=1,
                       prefetch_rate=0.0)
    assert run.calls[-2:] == [("output", "y"), ("output_complete", "y")]
    assert run.calls.index(("output", "y")) == 2 * 4
