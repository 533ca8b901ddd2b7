"""Pipeline stages in worker processes (pipeline_workers="processes"): the same numbers as
stages on this process's devices, one process per stage, and failures that stop the run
cleanly with the session unchanged."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from pipeline_models import LR, mlp, session, simulate_continuous

import popart_kit as pk
from popart_kit._runtime.xla import stage_processes
from popart_kit._runtime.xla.stage_processes import StageWorkerError, WorkerDevice


@pytest.fixture(autouse=True)
def bounded(monkeypatch):
    """A worker that hangs fails its test within two minutes rather than ten."""
    monkeypatch.setattr(stage_processes, "SILENCE_SECONDS", 120.0)
    monkeypatch.setattr(stage_processes, "START_SECONDS", 120.0)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=1e-6)


def test_inference_in_processes_equals_threads_with_every_anchor_kind():
    here, feed = session(3, 2, False, True, bps=5)
    there, _ = session(3, 2, False, True, bps=5, workers="processes")
    assert_same(there.run(feed), here.run(feed))
    places = there.placement
    assert all(isinstance(d, WorkerDevice) for d in places.values())
    assert len({places[(0, s)].pid for s in range(3)}) == 3  # a process per stage
    assert os.getpid() not in {d.pid for d in places.values()}
    # a Sum anchor is summed where its stage runs
    summed, _ = session(3, 2, False, True, bps=5, workers="processes", sum_anchor=True)
    (name, total), = summed.run(feed).items()
    np.testing.assert_allclose(total, here.run(feed)[name].sum(axis=0), rtol=1e-5, atol=1e-6)


def test_training_in_processes_equals_threads_over_runs_and_written_weights():
    here, feed = session(2, 2, True, True, bps=2, acc=3)
    there, _ = session(2, 2, True, True, bps=2, acc=3, workers="processes")
    for _ in range(2):  # the second run uses the weights the workers kept
        assert_same(there.run(feed), here.run(feed))
    assert_same(there.weights(), here.weights())
    assert_same(there.optimizer_state(), here.optimizer_state())
    start = {k: v * 0.5 for k, v in here.weights().items()}
    here.write_weights(start)
    there.write_weights(start)  # the workers must be sent these
    assert_same(there.run(feed), here.run(feed))
    assert_same(there.weights(), here.weights())


def test_stale_weights_in_processes_follow_popart():
    sess, feed = session(3, 1, True, True, bps=6, workers="processes")
    xs = next(iter(feed.values())).astype(np.float64)
    sess.run(feed)
    want, _ = simulate_continuous(mlp(3)[4], xs, 3, LR)
    for name, value in sess.weights().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-5)


def test_closing_a_session_stops_its_workers_and_a_later_run_restarts_them():
    """The backend's close stops the workers (a failed run does the same); its next run
    starts new ones and computes the same."""
    sess, feed = session(2, 1, False, True, bps=3, workers="processes")
    sess.run(feed)
    pids = {d.pid for d in sess.placement.values()}
    sess.runtime.close()
    for pid in pids:  # gone: waited for by close
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    again = sess.run(feed)
    assert pids.isdisjoint({d.pid for d in sess.placement.values()})
    here, _ = session(2, 1, False, True, bps=3)
    assert_same(again, here.run(feed))
    sess.close()


@pytest.mark.parametrize("settle", [0.0, 1.0])  # 1 s: the run's first send finds its end gone
def test_a_dead_worker_stops_the_run_names_its_stage_and_changes_nothing(settle):
    sess, feed = session(2, 1, True, True, bps=1, acc=3, workers="processes")
    sess.run(feed)
    before = sess.weights()
    victim = sess.placement[(0, 1)].pid
    os.kill(victim, signal.SIGKILL)
    time.sleep(settle)
    with pytest.raises(StageWorkerError, match=r"stage 1's worker process .*nothing was applied"):
        sess.run(feed)
    assert_same(sess.weights(), before)
    sess.run(feed)  # new workers, sent the committed weights
    assert victim not in {d.pid for d in sess.placement.values()}
    assert any(not np.allclose(v, before[k]) for k, v in sess.weights().items())


def test_a_refused_run_leaves_the_workers_state_unused():
    here, feed = session(2, 1, True, True, bps=1, acc=3)
    there, _ = session(2, 1, True, True, bps=1, acc=3, workers="processes")
    bad = {k: np.full_like(v, np.inf) for k, v in here.weights().items()}
    there.write_weights(bad)
    with pytest.raises(pk.PopartKitError, match="not finite|non-finite|NaN|Inf"):
        there.run(feed)
    good = {k: v * 0.5 for k, v in here.weights().items()}
    here.write_weights(good)
    there.write_weights(good)
    assert_same(there.run(feed), here.run(feed))


def test_an_unknown_worker_kind_is_refused_with_the_choices():
    model, x, y, loss, _ = mlp(2)
    cfg = pk.SessionConfig(mode="inference", batches_per_step=2, ipus_per_replica=2,
                           pipeline={"enabled": True}, device={"target": "offline"})
    with pytest.raises(pk.ConfigError, match="pipeline_workers='thread'.*'processes'"):
        pk.InferenceSession(model, cfg, anchors={y: "All"}, backend="xla",
                            pipeline_workers="thread")
