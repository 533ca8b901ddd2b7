"""Every combination runs: replication {1, 2} x accumulation {1, 4} x pipelining {off, stage
threads, stage processes} x instances {1, 2}, training and inference. Each equals the
one-replica sequential reference on the same global data, or is refused before compiling with
PopART's reason. (Pipelined training without accumulation is PopART's continuous pipelining,
whose stale weights differ from any sequential run by design: tests/test_pipeline.py checks it
against PopART's schedule.)"""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from combinations import Combination, distributed, reference, run

import popart_kit as pk
from popart_kit.launcher import launch

TOLERANCE = 1e-5
HERE = Path(__file__).parent

ONE_INSTANCE = [Combination(mode, r, a, pipe)
                for mode in ("training", "inference") for r in (1, 2) for a in (1, 4)
                for pipe in ("off", "threads", "processes")
                if not (mode == "training" and a == 1 and pipe != "off")
                and not (mode == "inference" and a > 1)]


def assert_equal(found: dict, want: dict, what: str) -> float:
    assert found.keys() == want.keys(), what
    worst = max(float(np.abs(found[k] - want[k]).max()) for k in want)
    assert worst < TOLERANCE, f"{what}: max difference {worst:.3g}"
    return worst


@pytest.mark.parametrize("c", ONE_INSTANCE, ids=lambda c: c.name)
def test_one_instance_equals_the_sequential_reference(c):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pk.PopartKitWarning)
        assert_equal(run(c), reference(c), c.name)


@pytest.mark.parametrize("pipe", ["off", "threads"])
def test_accumulation_in_inference_is_refused_before_compiling(pipe):
    """PopART: 'Gradient Accumulation only available when training' - refused with the
    config, before any session or program exists."""
    with pytest.raises(pk.InvalidConfig, match="gradient accumulation only exists when "
                                               "training") as err:
        run(Combination("inference", 1, 4, pipe))
    assert err.value.rules == ("V18",)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's threads; exec follows
def test_two_instances_equal_the_sequential_reference(tmp_path):
    """One launch of two instances runs every pipelining mode, training and inference; each
    instance's anchors are its replicas' share of the reference's."""
    out, err = io.StringIO(), io.StringIO()
    status = launch([sys.executable, str(HERE / "combinations.py"), str(tmp_path)],
                    num_instances=2, num_replicas=2, ipus_per_replica=2, timeout=240,
                    out=out, err=err)
    assert status == 0, (err.getvalue() + out.getvalue())[-3000:]
    for c in distributed(2):
        parts = [dict(np.load(tmp_path / f"{c.name}.instance{i}.npz")) for i in range(2)]
        want = reference(c)
        for p in parts[1:]:  # every instance holds the same weights
            for k in (k for k in want if k.startswith("weight:")):
                np.testing.assert_array_equal(p[k], parts[0][k])
        joined = dict(parts[0])
        axis = -1 if c.mode == "training" else 1  # loss [bps, A, G]; probs [bps, G, ...]
        for k in (k for k in want if k.startswith("anchor:")):
            joined[k] = np.stack([p[k] for p in parts], axis=axis)
        assert_equal(joined, want, c.name)
