"""Fault plans for the processes a test starts (Airflow, the Ray head): see :mod:`.vt_faults`.

    env = {**os.environ, **harness_env(plan_dir)}      # only for processes the test starts
    flag = fail_once(plan_dir, "exp", "rollout", 0, 1)  # that unit's next attempt fails
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .vt_faults import FAULTS_ENV, unit_name

FOLDER = Path(__file__).resolve().parent


def harness_env(plan_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """PYTHONPATH with this folder first (its sitecustomize installs the hooks) and the plan folder."""
    current = (base if base is not None else os.environ).get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(FOLDER), current) if p), FAULTS_ENV: str(plan_dir)}


def fail_once(plan_dir: Path, experiment: str, phase: str, epoch: int, batch: int | None = None) -> Path:
    """Plan one failure of the unit's next attempt; returns the file it renames to ``.failed`` when it fires."""
    flag = Path(plan_dir) / f"{unit_name(experiment, phase, epoch, batch)}.fail-once"
    flag.write_text("fail once\n")
    return flag.with_suffix(".failed")


def fail_at_commit(plan_dir: Path, experiment: str, phase: str, epoch: int, batch: int | None = None) -> Path:
    """Plan one failure of the unit's next attempt after its work, before its commit; returns the file it
    renames to ``.failed`` when it fires."""
    flag = Path(plan_dir) / f"{unit_name(experiment, phase, epoch, batch)}.fail-at-commit"
    flag.write_text("fail at commit\n")
    return flag.with_suffix(".failed")


def store_fails_once(plan_dir: Path, experiment: str, phase: str, epoch: int, batch: int | None = None) -> Path:
    """Plan one failed store write in the unit's next attempt (before its commit); returns the ``.failed`` file."""
    flag = Path(plan_dir) / f"{unit_name(experiment, phase, epoch, batch)}.store-fails-once"
    flag.write_text("store fails once\n")
    return flag.with_suffix(".failed")


def kill_update_worker(plan_dir: Path, experiment: str, epoch: int, rank: int, phase: str = "update") -> Path:
    """SIGKILL worker ``rank`` of the ``phase`` group (``update`` or ``critic``) mid-step in the unit's next
    attempt; returns the ``.killed`` file it leaves."""
    flag = Path(plan_dir) / f"{unit_name(experiment, phase, epoch)}.kill-rank{rank}"
    flag.write_text("kill\n")
    return flag.with_suffix(".killed")


def record_update_nodes(plan_dir: Path, experiment: str, epoch: int) -> Callable[[int], Path]:
    """Have each update worker of the unit's attempts record its Ray node; returns rank -> the file it writes."""
    name = unit_name(experiment, "update", epoch)
    (Path(plan_dir) / f"{name}.record-nodes").write_text("record\n")
    return lambda rank: Path(plan_dir) / f"{name}.rank{rank}.node"


def hold(plan_dir: Path, experiment: str, epoch: int, batch: int, *, at_start: bool = False) -> Path:
    """Hold the rollout batch in its middle (``at_start``: before its unit starts, inline backend only);
    returns the file that will name its PID once it waits."""
    name = unit_name(experiment, "rollout", epoch, batch)
    where = "-start" if at_start else ""
    (Path(plan_dir) / f"{name}.hold{where}").write_text("hold\n")
    return Path(plan_dir) / f"{name}.held{where}"


def release(plan_dir: Path, experiment: str, epoch: int, batch: int) -> None:
    """Let a held rollout go on (or never stop)."""
    name = unit_name(experiment, "rollout", epoch, batch)
    for suffix in (".hold", ".held", ".hold-start", ".held-start"):
        (Path(plan_dir) / f"{name}{suffix}").unlink(missing_ok=True)
