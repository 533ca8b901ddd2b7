"""The pipeline schedule as data: its actions, bubble, grid and JSON (pure, no JAX)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import popart_kit as pk
from popart_kit._base.schedule import Action, PipelineSchedule, measured_bubble


def config(mode: str, stages: int, bps: int, acc: int) -> pk.SessionConfig:
    return pk.SessionConfig(mode=mode, batches_per_step=bps, accumulation={"factor": acc},
                            ipus_per_replica=stages, pipeline={"enabled": True,
                                                               "stages": stages},
                            device={"target": "offline"})


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(2, 8), extra=st.integers(0, 40), mode=st.sampled_from(
    ["inference", "training", "continuous"]))
def test_the_schedule_bubble_is_the_plan_bubble(stages, extra, mode):
    depth = stages if mode == "inference" else 2 * stages - 1
    m = depth + extra  # PopART needs at least K micro-batches per fill-drain
    if mode == "training":
        cfg = config("training", stages, 2, m)
    else:
        cfg = config("training" if mode == "continuous" else "inference", stages, m, 1)
    schedule = PipelineSchedule.for_config(cfg, stages)
    assert schedule.depth == cfg.plan().pipeline_depth
    assert schedule.bubble_fraction == pytest.approx(cfg.plan().bubble_fraction, abs=1e-12)
    assert schedule.bubble_fraction == pytest.approx((depth - 1) / (m + depth - 1), abs=1e-12)
    schedule.validate()


def test_training_with_accumulation_fills_runs_flushes_then_updates_once():
    s = PipelineSchedule.training(3, 4, updates=2)
    assert s.depth == 5 and s.slots == 2 * (4 + 5 - 1 + 1)
    first = [a for a in s.actions if a.update == 0]
    assert [a.slot for a in first if a.kind == "U"] == [8, 8, 8]  # after the flush, once
    assert {a.micro_batch for a in first if a.kind == "U"} == {None}
    # stage 0's forward of micro-batch 3 in slot 3; its backward on pipeline stage 4, slot 7
    assert Action(3, 0, "F", 3, 0) in s.actions and Action(7, 0, "B", 3, 0) in s.actions
    # the loss stage does forward and backward of a micro-batch in one slot
    assert Action(2, 2, "F", 0, 0) in s.actions and Action(2, 2, "B", 0, 0) in s.actions
    assert [str(a) for a in s.for_stage(2)[:3]] == ["2F0", "2B0", "2F1"]


def test_training_without_accumulation_updates_after_every_backward():
    s = PipelineSchedule.training(2, 4, accumulate=False)
    updates = [a for a in s.actions if a.kind == "U"]
    assert len(updates) == 2 * 4
    backward = {(a.stage, a.micro_batch): a.slot for a in s.actions if a.kind == "B"}
    assert all(backward[(u.stage, u.micro_batch)] == u.slot for u in updates)


def test_render_is_a_stage_by_time_grid():
    text = PipelineSchedule.training(3, 3).render()
    lines = text.splitlines()
    assert "bubble 57.1%" in lines[0]
    assert lines[1].split() == ["slot", *map(str, range(8))]
    assert lines[2].split() == ["stage", "0", "fwd", "0", "1", "2", ".", ".", ".", ".", "."]
    assert lines[4].split() == ["stage", "2", "fwd+bwd", ".", ".", "0", "1", "2", ".", ".",
                                "U"]
    assert lines[6].split() == ["stage", "0", "bwd", ".", ".", ".", ".", "0", "1", "2", "U"]
    stale = PipelineSchedule.training(2, 2, accumulate=False).render()
    assert stale.splitlines()[3].split()[-3:] == ["0*", "1*", "."]
    long = PipelineSchedule.inference(2, 100).render(max_slots=10)
    assert long.endswith("... 91 more slot(s)")


def test_json_round_trips_and_names_every_action():
    s = PipelineSchedule.training(2, 3, updates=2)
    data = json.loads(s.to_json())
    assert data["bubble_fraction"] == s.bubble_fraction and len(data["actions"]) == len(s.actions)
    assert PipelineSchedule.from_json(s.to_json()) == s
    data["actions"].pop()
    with pytest.raises(ValueError, match="not those of the schedule"):
        PipelineSchedule.from_json(json.dumps(data))


def test_validate_finds_an_action_out_of_order():
    s = PipelineSchedule.training(2, 2)
    s.actions[s.actions.index(Action(1, 1, "F", 0, 0))] = Action(0, 1, "F", 0, 0)
    with pytest.raises(ValueError, match="1F0 .*needs 0F0"):
        s.validate()


@pytest.mark.parametrize("bad", [dict(stages=0), dict(micro_batches=True),
                                 dict(mode="eval"), dict(updates=2, accumulate=False)])
def test_bad_arguments_are_named(bad):
    args = {"mode": "training", "stages": 2, "micro_batches": 3, "updates": 1,
            "accumulate": True, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        PipelineSchedule(**args)


def test_measured_bubble_of_a_trace():
    # two devices over 4 time units: one busy 4, the other 2 -> 25% idle
    assert measured_bubble([(0, 0.0, 4.0), (1, 1.0, 3.0)]) == pytest.approx(0.25)


def test_the_schedule_module_imports_no_jax():
    code = ("import sys, popart_kit as pk; pk.PipelineSchedule.training(2, 4).render(); "
            "print('jax' in sys.modules, 'onnx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]
