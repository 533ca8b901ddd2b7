"""A training run that is refused or interrupted leaves the committed weights and optimizer
state exactly as they were and the session usable, on every path that commits state
(unpipelined, pipeline stages in threads or in worker processes); stage worker processes import
nothing from the working directory."""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from pipeline_models import LR, mlp

import popart_kit as pk
from popart_kit import NonFiniteUpdate
from popart_kit._runtime.xla import stage_processes, steps
from popart_kit._runtime.xla.stage_processes import StageProcesses
from popart_kit._runtime.xla.stages import StageRunner

MODES = ["threads", "dispatched", "processes", "unpipelined", "unpipelined-host"]


@pytest.fixture(autouse=True)
def bounded(monkeypatch):
    """A stage worker that hangs is named within a minute, and a test that hangs anyway dumps
    every thread's stack and ends pytest after five, rather than stalling CI."""
    monkeypatch.setattr(stage_processes, "SILENCE_SECONDS", 60.0)
    monkeypatch.setattr(stage_processes, "START_SECONDS", 60.0)
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def momentum_session(mode: str, bps: int = 2):
    """The 2-stage MLP trained by SGD with momentum 0.9 (bps x 3 micro-batches): ``mode`` is
    pipelined with stages in "threads", in "processes" or "dispatched" from one thread, or
    "unpipelined" with chunks looped in the program or from the host ("unpipelined-host")."""
    model, x, _, loss, _ = mlp(2)
    piped_off = mode.startswith("unpipelined")
    cfg = pk.SessionConfig(mode="training", batches_per_step=bps, accumulation={"factor": 3},
                           ipus_per_replica=2, pipeline={"enabled": not piped_off},
                           device={"target": "offline"})
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("ignore", pk.PopartKitWarning)
        patch.setattr(steps, "LOOP_UNFRIENDLY_ON_CPU",
                      frozenset({"MatMul"}) if mode == "unpipelined-host" else frozenset())
        sess = pk.TrainingSession(model, cfg, loss=loss,
                                  optimizer=pk.SGD(learning_rate=LR, momentum=0.9),
                                  anchors={loss: "All"}, backend="xla",
                                  pipeline_workers="processes" if mode == "processes"
                                  else "threads")
    backend = sess.runtime
    assert (backend.pipeline is None) is piped_off
    assert backend.on_host is (mode == "unpipelined-host")
    if mode == "dispatched":
        backend.pipeline.threads = False
    rng = np.random.default_rng(0)
    return sess, {x: rng.standard_normal(sess.io.input_shape(x)).astype(np.float32)}


def committed(sess) -> tuple[dict, dict]:
    return sess.weights(), sess.optimizer_state()


def assert_identical(a, b) -> None:
    """Equal bit for bit, nested dicts of arrays alike."""
    jax.tree.map(np.testing.assert_array_equal, a, b)


@functools.cache
def reference(mode: str) -> list:
    """What a session that never saw a bad run returns and commits over two good runs."""
    sess, feed = momentum_session(mode)
    out = [(sess.run(feed), committed(sess)) for _ in range(2)]
    sess.close()
    return out


def assert_goes_on_as(sess, feed: dict, expected: list) -> None:
    """``sess`` (one good run behind it) runs on exactly as the reference session did."""
    for anchors, state in expected[1:]:
        assert_identical(sess.run(feed), anchors)
        assert_identical(committed(sess), state)


# -- refused runs -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_run_keeps_weights_and_optimizer_state_and_the_session_goes_on(mode):
    expected = reference(mode)
    sess, feed = momentum_session(mode)
    sess.run(feed)
    before = committed(sess)
    assert_identical(before, expected[0][1])
    with pytest.raises(NonFiniteUpdate, match="no update of the run was applied"):
        sess.run({k: np.full_like(v, np.nan) for k, v in feed.items()})
    assert_identical(committed(sess), before)
    assert_goes_on_as(sess, feed, expected)
    sess.close()


# -- Ctrl-C -------------------------------------------------------------------------------------


def _default_sigint() -> None:
    """Ctrl-C as a terminal delivers it, even when this suite was started in the background
    (where SIGINT is inherited ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """This process's Ctrl-C raises KeyboardInterrupt during each test, as in a terminal."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_when(monkeypatch: pytest.MonkeyPatch, stage: int, kind: str) -> list:
    """Ctrl-C, sent to the main thread as a terminal's is, when pipeline stage ``stage`` starts
    its first ``kind`` action, which then keeps its thread busy a moment longer. Returns a
    list that gets the action that sent it."""
    act, sent = StageRunner.act, []

    def interrupting(self, a, ctx, got):
        if (a.stage, a.kind) == (stage, kind) and not sent:
            sent.append(a)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.2)
        return act(self, a, ctx, got)

    monkeypatch.setattr(StageRunner, "act", interrupting)
    return sent


def test_ctrl_c_in_a_run_of_stage_threads_stops_them_and_changes_nothing(monkeypatch):
    expected = reference("threads")
    sess, feed = momentum_session("threads")
    sess.run(feed)
    before, running = committed(sess), set(threading.enumerate())
    sent = interrupt_when(monkeypatch, 1, "U")
    with pytest.raises(KeyboardInterrupt):
        sess.run(feed)
    assert sent
    assert set(threading.enumerate()) <= running  # every stage thread has stopped
    assert_identical(committed(sess), before)
    assert_goes_on_as(sess, feed, expected)


def interrupt_answer(monkeypatch: pytest.MonkeyPatch, what: str) -> list:
    """Ctrl-C in the session's process while it waits for the stage workers' first answer of
    their ``what`` ("start" or "run"). Returns the list of their pids when it came."""
    answer, pids = StageProcesses._answer, []

    def interrupting(self, s, seconds, during):
        if during == what and not pids:
            pids.extend(p.pid for p in self._procs)
            raise KeyboardInterrupt
        return answer(self, s, seconds, during)

    monkeypatch.setattr(StageProcesses, "_answer", interrupting)
    return pids


def assert_exited(pids: list[int]) -> None:
    for pid in pids:  # waited for by the session: gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("during", ["start", "run"])
def test_ctrl_c_while_stage_workers_start_or_run_stops_them_and_changes_nothing(
        during, monkeypatch):
    expected = reference("processes")
    sess, feed = momentum_session("processes")
    sess.run(feed)
    before = committed(sess)
    if during == "start":
        sess.runtime.close()  # the workers stop; the session's next run starts new ones
    pids = interrupt_answer(monkeypatch, during)
    with pytest.raises(KeyboardInterrupt):
        sess.run(feed)
    assert len(pids) == 2
    assert_exited(pids)
    assert_identical(committed(sess), before)
    assert_goes_on_as(sess, feed, expected)
    sess.close()


def test_stage_workers_ignore_a_terminals_ctrl_c():
    """A terminal sends SIGINT to every process of its group: the workers carry on, and the
    session's process decides."""
    sess, feed = momentum_session("processes")
    sess.run(feed)
    pids = [d.pid for d in sess.placement.values()]
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    sess.run(feed)
    assert [d.pid for d in sess.placement.values()] == pids
    sess.close()


UNCAUGHT = """
import signal, sys, threading
sys.path.insert(0, {tests!r})
from popart_kit._runtime.xla.stages import StageRunner
from test_pipeline_state import momentum_session

sess, feed = momentum_session("threads", bps=64)  # the stages have much left to do
sess.run(feed)
act = StageRunner.act

def interrupting(self, a, ctx, got):  # Ctrl-C early in a long run
    if (a.stage, a.kind, a.micro_batch, a.update) == (1, "F", 0, 0):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    return act(self, a, ctx, got)

StageRunner.act = interrupting
sess.run(feed)
"""


def test_an_uncaught_ctrl_c_in_a_pipelined_run_ends_the_process_by_sigint_not_sigabrt():
    tests = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", UNCAUGHT.format(tests=tests)],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=_default_sigint)  # as a terminal starts it
    assert "KeyboardInterrupt" in done.stderr
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr[-2000:])


# -- where workers import from ------------------------------------------------------------------


def test_stage_workers_import_nothing_from_the_working_directory(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "struct.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        f"raise ImportError('the working directory\\'s struct.py was imported')\n")
    monkeypatch.chdir(tmp_path)
    there, feed = momentum_session("processes")
    here, _ = momentum_session("threads")
    got, want = there.run(feed), here.run(feed)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-5, atol=1e-6)
    assert not marker.exists()
    there.close()
