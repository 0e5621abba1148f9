"""Resident phase workers: detached Ray actors that keep Python, torch and transformers warm.

A Ray job per unit keeps the Jobs API's guarantees (deterministic ids, attach on
retry, logs, stop), but a fresh job process spends seconds importing torch and
transformers. With the resident path, the job's entrypoint stays light: it
connects to the cluster and hands the unit to a named, detached actor that
already has everything imported. If that actor dies (node lost, OOM, SIGKILL),
the call fails, the job fails, Airflow retries it, and Ray restarts the actor;
the actor holds no state the store does not, so nothing is lost.

The actor is shared by every experiment on the cluster, so nothing secret is
passed to it: it reaches storage through the node's own credential chain.
"""
from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

import ray

import verl_tasks

NAMESPACE = "verl-tasks"


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@ray.remote(num_cpus=0, max_concurrency=1, max_restarts=-1)
class PhaseWorker:
    """Runs units one at a time in a warm process; returns the summary and the unit's log lines."""

    def __init__(self) -> None:
        import verl_tasks.runner  # noqa: F401 - import the heavy modules once, now

        logging.getLogger().setLevel(logging.INFO)

    def run(self, config_json: dict[str, Any], phase: str, epoch: int, batch: int | None) -> dict[str, Any]:
        from verl_tasks.config import parse_config
        from verl_tasks.execution import UnitSpec
        from verl_tasks.execution.inline import InlineBackend, record_summary
        from verl_tasks.execution.outcome import failure_result

        capture = _Capture()
        root = logging.getLogger()
        root.addHandler(capture)
        try:
            config = parse_config(config_json)
            spec = UnitSpec(config.experiment, phase, epoch, batch)
            return {"ok": True, **record_summary(InlineBackend().run(config, spec)), "log": capture.lines}
        except Exception as err:  # noqa: BLE001 - returned to the job, which fails with it (typed, see outcome.py)
            logging.getLogger(__name__).exception("unit failed")
            label = UnitSpec(str(config_json.get("experiment")), phase, epoch, batch).label
            return {**failure_result(err, label), "log": capture.lines}
        finally:
            root.removeHandler(capture)


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of the installed package's source: a new deploy gets new workers, never stale ones."""
    root = Path(verl_tasks.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def worker_name(phase: str, batch: int | None, slots: int) -> str:
    """Mapped phases spread over ``slots`` workers; each name is tied to the exact code."""
    slot = (batch or 0) % max(1, slots)
    return f"phase-worker-{verl_tasks.__version__}-{code_fingerprint()}-{slot}"


def run_on_resident_worker(config_json: dict[str, Any], phase: str, epoch: int, batch: int | None,
                           slots: int = 1) -> dict[str, Any]:
    """Connect to the job's cluster, get or create the worker, run the unit there."""
    if not ray.is_initialized():
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    worker = PhaseWorker.options(
        name=worker_name(phase, batch, slots), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote()
    return ray.get(worker.run.remote(config_json, phase, epoch, batch))
