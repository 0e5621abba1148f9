"""The Ray job entrypoint: run one phase unit and print one JSON line.

    python -m verl_tasks.execution.entry --config-b64 B64 --phase rollout --epoch 3 --batch 7

Exit 0 after the unit is committed (or was already); exit 1 with the error on
the last line otherwise. S3 credentials come from the standard AWS environment
variables of the job, never from the command line.

Fault injection for tests: when ``VERL_TASKS_FAIL_ONCE`` names a file that does
not exist yet, the job creates it and fails before doing any work; the next
attempt (the file now exists) runs normally.
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import sys
import time
from pathlib import Path

from verl_tasks.config import parse_config
from verl_tasks.phase_registry import PHASE_NAMES
from verl_tasks.execution import UnitSpec

log = logging.getLogger("verl_tasks.execution.entry")
FAIL_ONCE_ENV = "VERL_TASKS_FAIL_ONCE"


def encode_config(config_json: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(config_json, sort_keys=True, separators=(",", ":")).encode()).decode()


def decode_config(blob: str) -> dict:
    return json.loads(base64.urlsafe_b64decode(blob.encode()))


class InjectedFault(RuntimeError):
    """Raised once per flag file, so tests can see a task fail and then succeed on Clear."""


def maybe_fail_once(flag: str | None) -> None:
    """Fail once per flag file: create it and raise; do nothing when it exists or no flag is set."""
    if not flag:
        return
    path = Path(flag)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "x") as handle:
            handle.write(f"{time.time()}\n")
    except FileExistsError:
        return
    raise InjectedFault(f"injected fault ({FAIL_ONCE_ENV}={flag}); the next attempt will run normally")


def _credentials_from_env() -> dict[str, str] | None:
    keys = {"aws_access_key_id": "AWS_ACCESS_KEY_ID", "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
            "aws_session_token": "AWS_SESSION_TOKEN"}
    found = {k: os.environ[v] for k, v in keys.items() if os.environ.get(v)}
    return found or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl_tasks.execution.entry")
    parser.add_argument("--config-b64", required=True)
    parser.add_argument("--phase", required=True, choices=PHASE_NAMES)
    parser.add_argument("--epoch", required=True, type=int)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--resident", action="store_true",
                        help="run the unit on a warm, detached Ray actor instead of in this process")
    parser.add_argument("--slots", type=int, default=1, help="resident workers that mapped phases spread over")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("botocore", "urllib3", "s3transfer", "great_expectations", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    started = time.monotonic()
    try:
        config_json = decode_config(args.config_b64)
        config = parse_config(config_json)
        maybe_fail_once(os.environ.get(FAIL_ONCE_ENV))
        if args.resident:
            from verl_tasks.execution.resident import run_on_resident_worker

            result = run_on_resident_worker(config_json, args.phase, args.epoch, args.batch,
                                            _credentials_from_env(), args.slots)
            for line in result.pop("log", []):
                sys.stderr.write(line + "\n")
            if not result.get("ok"):
                raise RuntimeError(result.get("error", "unit failed on the resident worker"))
            summary = {k: v for k, v in result.items() if k != "ok"}
        else:
            from verl_tasks.execution.inline import InlineBackend, record_summary

            spec = UnitSpec(config.experiment, args.phase, args.epoch, args.batch)
            summary = record_summary(InlineBackend().run(config, spec, _credentials_from_env()))
    except Exception as err:  # noqa: BLE001 - reported as the job's last line, then a non-zero exit
        log.exception("unit failed")
        sys.stdout.write(json.dumps({"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}) + "\n")
        sys.stdout.flush()
        return 1
    summary = {"ok": True, **summary, "duration_s": round(time.monotonic() - started, 3)}
    sys.stdout.write(json.dumps(summary, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
