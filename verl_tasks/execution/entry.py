"""The Ray job entrypoint: run one phase unit and print one JSON line.

    python -m verl_tasks.execution.entry --config-b64 B64 --phase rollout --epoch 3 --batch 7

Exit 0 after the unit is committed (or was already); exit 1 otherwise, the last
line then naming the unit and the error's class, module and message (see
:mod:`verl_tasks.execution.outcome`). S3 access comes from the Ray node's own
credential chain (environment, instance role, credentials file): verl-tasks never
sends keys to a job.
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import signal
import sys
import time
from typing import Any

from verl_tasks.config import parse_config
from verl_tasks.execution import UnitSpec
from verl_tasks.execution.outcome import failure_result
from verl_tasks.layout import Layout
from verl_tasks.phase_registry import PHASE_NAMES

log = logging.getLogger("verl_tasks.execution.entry")


def encode_config(config_json: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(config_json, sort_keys=True, separators=(",", ":")).encode()).decode()


def decode_config(blob: str) -> dict:
    return json.loads(base64.urlsafe_b64decode(blob.encode()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl_tasks.execution.entry")
    parser.add_argument("--config-b64", required=True)
    parser.add_argument("--phase", required=True, choices=PHASE_NAMES)
    parser.add_argument("--epoch", required=True, type=int)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--pool", action="store_true",
                        help="run the unit on the phase's worker pool instead of in this process")
    args = parser.parse_args(argv)
    from verl_tasks.quiet import quiet_own_process

    quiet_own_process()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("botocore", "urllib3", "s3transfer", "great_expectations", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    started = time.monotonic()
    unit = UnitSpec("?", args.phase, args.epoch, args.batch).label
    try:
        config_json = decode_config(args.config_b64)
        config = parse_config(config_json)
        spec = UnitSpec(config.experiment, args.phase, args.epoch, args.batch)
        unit = Layout(config.experiment).unit(args.phase, args.epoch, args.batch)
        if args.pool:
            result = _run_on_pool(config, spec)
            for line in result.pop("log", []):
                sys.stderr.write(line + "\n")
            if not result.get("ok"):
                return _report({**result, "unit": unit})
            summary = {k: v for k, v in result.items() if k != "ok"}
        else:
            from verl_tasks.execution.inline import InlineBackend, record_summary

            summary = record_summary(InlineBackend().run(config, spec))
    except Exception as err:  # noqa: BLE001 - reported as the job's last line, then a non-zero exit
        log.exception("unit %s failed", unit)
        return _report(failure_result(err, unit))
    return _report({"ok": True, **summary, "duration_s": round(time.monotonic() - started, 3)})


def _run_on_pool(config, spec: UnitSpec) -> dict:
    """Hand the unit to its pool under a fresh attempt id; a stop of this job cancels it there.

    Ray stops a job with SIGTERM to this driver (Airflow's clear, mark-failed, timeout and
    ``on_kill`` all end in ``stop_job``): the handler fences the attempt, so it can never
    commit, and kills the actor if it is running it, so its slot is free again at once (a call
    still queued behind another unit is taken out of the queue instead).
    """
    from verl_tasks.execution import pools
    from verl_tasks.store.units import new_attempt_id

    pools.ensure_connected()
    attempt = new_attempt_id()
    sent: list[tuple[Any, Any]] = []  # (actor, ref) of each send

    def cancel(signum: int, _frame: object) -> None:
        # Fenced even before an actor is known: the unit may be on its way to one.
        actor, ref = sent[-1] if sent else (None, None)
        pools.cancel_unit(config, spec, attempt, actor, f"job stopped (signal {signum})", ref)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, cancel)
    signal.signal(signal.SIGINT, cancel)
    timeout_s = config.fault_tolerance.timeout_s.get(spec.phase)
    return pools.run_unit(config, spec, attempt, timeout_s, on_submit=lambda actor, ref: sent.append((actor, ref)))


def _report(result: dict) -> int:
    """Print the result line (the job's last stdout line); the exit code follows ``ok``."""
    sys.stdout.write(json.dumps(result, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
