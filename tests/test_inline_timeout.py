"""A unit's timeout inline (``verl-tasks run``): an alarm in the CLI's process stops it, the warm
state it may have caught half updated is dropped, and the retry is a new attempt with the same bytes."""
from __future__ import annotations

import time

import pytest

from tests.test_rewards import BAD, _requests
from verl_tasks import hooks
from verl_tasks.errors import UnitTimeout
from verl_tasks.events import read_events
from verl_tasks.execution.deadline import unit_deadline
from verl_tasks.models.policy_cache import POLICIES
from verl_tasks.runner import make_context, run_in_process
from verl_tasks.store.units import read_marker

HUNG_S = 60.0  # how long the injected hang lasts when nothing stops it


def rollout_once(cfg):
    """Plan and the rollout of epoch 0, inline; the rollout's marker."""
    ctx = make_context(cfg)
    for phase in ("plan", "rollout"):
        assert list(run_in_process(ctx, phase, 0, [0] if phase == "rollout" else [None]))
    return read_marker(ctx.store, ctx.layout.rollout(0, 0)), ctx


def test_a_hung_rollout_is_stopped_dropped_from_the_cache_and_retried_to_the_same_bytes(tiny_config, tmp_path):
    fault_free, _ = rollout_once(tiny_config(store_uri=f"file://{tmp_path}/plain",
                                             **{"model.tiny.warm_start_steps": 20}))
    seen: list[str] = []

    def hang_first_try(**info):
        if seen:
            return
        seen.append("hung")
        started = time.monotonic()
        try:
            while time.monotonic() - started < HUNG_S:
                time.sleep(0.05)
            seen.append("ran to the end")
        except BaseException:
            seen.append("interrupted")
            raise

    cfg = tiny_config(store_uri=f"file://{tmp_path}/faulty", **{
        "model.tiny.warm_start_steps": 20, "fault_tolerance.timeout_s": {"rollout": 2.0},
        "fault_tolerance.retries": 1, "fault_tolerance.retry_delay_s": 0})
    hooks.register("rollout_generate", hang_first_try)
    try:
        marker, ctx = rollout_once(cfg)
    finally:
        hooks.unregister("rollout_generate", hang_first_try)
    assert seen == ["hung", "interrupted"], seen
    assert marker.files["samples.jsonl"].sha256 == fault_free.files["samples.jsonl"].sha256
    failed = [e for e in read_events(ctx.store, ctx.layout) if e["kind"] == "failed" and e["phase"] == "rollout"]
    assert len(failed) == 1 and failed[0]["attempt"] != marker.attempt, failed
    assert failed[0]["error"].startswith("DeadlinePassed: the unit ran past its limit of 2 s"), failed


def test_the_policy_cache_is_dropped_when_a_unit_times_out(tiny_config):
    marker, ctx = rollout_once(tiny_config(**{"model.tiny.warm_start_steps": 20}))
    assert len(POLICIES._entries) >= 1
    with pytest.raises(UnitTimeout, match=r"timed out after 0.5 s \(fault_tolerance.timeout_s.rollout\)"):
        with unit_deadline(ctx.layout.rollout(0, 0), "rollout", 0.5):
            while True:
                time.sleep(0.05)
    assert len(POLICIES._entries) == 0


def test_an_exception_handler_in_the_unit_cannot_swallow_the_deadline():
    swallowed = []
    with pytest.raises(UnitTimeout):
        with unit_deadline("exp/epochs/00000/score/b0000", "score", 0.3):
            try:
                time.sleep(HUNG_S)
            except Exception as err:  # what a reward loop or a retry helper would write
                swallowed.append(err)
    assert swallowed == []


def test_a_reward_worker_interrupted_mid_batch_is_closed_and_the_next_batch_scores_right():
    from verl_tasks.rewards.sandbox import warm_sandbox

    function = f"{BAD}:misbehaving"
    with pytest.raises(UnitTimeout):
        with unit_deadline("exp/epochs/00000/score/b0000", "score", 1.0):
            with warm_sandbox(function, 30.0, 1024) as box:
                box.start()
                interrupted = box.proc
                box.score(_requests("1", "hang", "1"), default=-1.0)
    assert interrupted.poll() is not None, "the interrupted worker was left running"
    with warm_sandbox(function, 30.0, 1024) as box:
        result = box.score(_requests("1", "0"), default=-1.0)
    assert result.scores == [1.0, 0.0] and not result.failures, result


def test_an_alarm_that_fires_as_the_unit_ends_is_still_a_unit_timeout(monkeypatch):
    """The alarm may fire after the body returned, while the deadline is being disarmed: it must
    come out as UnitTimeout (which the runner retries), and the process's handler must be restored."""
    import signal

    from verl_tasks.execution import deadline

    real_setitimer = signal.setitimer

    def fire_while_disarming(which, seconds):
        real_setitimer(which, seconds)
        if seconds == 0:
            raise deadline.DeadlinePassed("fired as the unit ended")

    monkeypatch.setattr(signal, "setitimer", fire_while_disarming)
    before = signal.getsignal(signal.SIGALRM)
    with pytest.raises(UnitTimeout):
        with unit_deadline("exp/epochs/00000/plan", "plan", 5.0):
            pass
    assert signal.getsignal(signal.SIGALRM) == before
