"""The end-to-end waits follow progress: slow but moving is fine, stuck fails with the diagnosis."""
from __future__ import annotations

import itertools
import time

import pytest

from tests.airflow.e2e_support import wait_for


def test_a_wait_longer_than_the_stall_window_passes_while_things_move():
    ticks = itertools.count()
    ready_at = time.monotonic() + 1.0
    done = wait_for("slow but moving", lambda: time.monotonic() >= ready_at and "done", 0.3, every=0.05,
                    progress=lambda: next(ticks))
    assert done == "done"


def test_a_wait_gives_up_when_nothing_moves_and_says_what_it_saw():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"nothing moved for 0s .* waiting for stuck") as err:
        wait_for("stuck", lambda: None, 0.3, every=0.05, progress=lambda: ("queued",), diagnose=lambda: "DIAG")
    assert time.monotonic() - started < 5
    assert "last progress picture: ('queued',)" in str(err.value) and "DIAG" in str(err.value)


def test_moving_forever_is_still_bounded_by_the_limit():
    ticks = itertools.count()
    with pytest.raises(TimeoutError, match="timed out after"):
        wait_for("never done", lambda: None, 0.3, every=0.05, progress=lambda: next(ticks), limit_s=0.5)
