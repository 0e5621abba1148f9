"""A unit's ``fault_tolerance.timeout_s`` in the process that runs it inline (``verl-tasks run``).

The Ray pools kill the actor of a unit past its timeout, and Airflow has its own
``execution_timeout``; an inline unit runs in the CLI's own process, so the limit is a
``SIGALRM`` there, like Airflow's. The alarm interrupts Python code, including between
torch operations, but not one C call that never returns (kill the process for that).
Whatever the unit had kept warm in this process (the policy cache, the vLLM engine) is
dropped, since the interruption may have caught it half updated; the store is the truth,
and the retry is a new attempt that reads it again.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

from verl_tasks.errors import UnitTimeout

log = logging.getLogger(__name__)


class DeadlinePassed(BaseException):
    """The alarm, inside the unit (its ``failed`` event names it); ``UnitTimeout`` outside. A
    BaseException, so no ``except Exception`` inside a phase (a reward function's error, a retry
    loop) can take the deadline for a failure of its own and carry on."""


@contextlib.contextmanager
def unit_deadline(unit: str, phase: str, timeout_s: float | None) -> Iterator[None]:
    """Raise ``UnitTimeout`` in this thread once the body has run ``timeout_s`` seconds.

    No limit (None) or not the main thread (signals reach only it): the body just runs.
    """
    if not timeout_s or threading.current_thread() is not threading.main_thread():
        yield
        return

    limit = f"{timeout_s:g} s (fault_tolerance.timeout_s.{phase})"

    def expire(signum: int, frame: object) -> None:
        raise DeadlinePassed(f"the unit ran past its limit of {limit}")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        try:
            yield
        finally:  # disarmed first; an alarm that fires even here is caught below, the handler restored
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
            finally:
                signal.signal(signal.SIGALRM, previous)
    except DeadlinePassed:
        drop_warm_state()
        raise UnitTimeout(unit, f"timed out after {limit}; what this process kept warm was dropped and the "
                                f"retry is a new attempt") from None


def drop_warm_state() -> None:
    """Forget the loaded policies and shut the vLLM engine down; the next unit loads from the store."""
    from verl_tasks.models import vllm_engine
    from verl_tasks.models.policy_cache import POLICIES

    POLICIES.clear()
    vllm_engine.shutdown()
    log.warning("a unit timed out in this process: its warm policies were dropped")
