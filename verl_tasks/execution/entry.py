"""The Ray job entrypoint: run one phase unit and print one JSON line.

    python -m verl_tasks.execution.entry --store s3://bucket/prefix --experiment NAME --config-hash SHA256 \
        --config-digest SHA256 --phase rollout --epoch 3 --batch 7

The config travels by reference: the job reads its submitter's whole config from the store
(``configs/<config-digest>.json``, written by content before the submission) and runs only when the
experiment's pin still has the config hash the submitter ran under. The entrypoint (shown by the Jobs API
to every Ray token holder) carries the store's location (no credentials, no encryption key id), the
experiment name and the two digests; nothing else of the config.

Exit 0 after the unit is committed (or was already); exit 1 otherwise, the last
line then naming the unit and the error's class, module and message (see
:mod:`verl_tasks.execution.outcome`). S3 access comes from the Ray node's own
credential chain (environment, instance role, credentials file): verl-tasks never
sends keys to a job.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import signal
import sys
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from verl_tasks.config import ExperimentConfig, check_name, flatten, parse_config
from verl_tasks.errors import ConfigError, ConfigMismatch
from verl_tasks.execution import UnitSpec
from verl_tasks.execution.outcome import failure_result
from verl_tasks.layout import Layout
from verl_tasks.phase_registry import PHASE_NAMES

log = logging.getLogger("verl_tasks.execution.entry")


def public_location(url: str | None) -> str | None:
    """``url`` without any ``user:password@`` part: what may be shown to every Ray token holder."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=host))


KEY_DIGEST_CHARS = 4


def _key_digest(key: str, value: Any) -> str:
    blob = json.dumps([key, value], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:KEY_DIGEST_CHARS]


def key_digests(hashed_view: dict[str, Any]) -> str:
    """A short one-way digest of each training-relevant setting (16 bits each, concatenated): lets a job
    name the keys in which its submitter's config differs from the pin without carrying the config."""
    return "".join(_key_digest(key, value) for key, value in sorted(flatten(hashed_view).items()))


def _differing(pinned_view: dict[str, Any], digests: str | None) -> list[str]:
    """The pin's keys whose (key, value) is not among the submitter's ``digests``; ``config_hash`` when
    none can be named (a key only the submitter has, or no digests sent)."""
    text = digests or ""
    sent = {text[i:i + KEY_DIGEST_CHARS] for i in range(0, len(text), KEY_DIGEST_CHARS)}
    keys = sorted(key for key, value in flatten(pinned_view).items() if _key_digest(key, value) not in sent)
    return keys if digests and keys else ["config_hash"]


def pinned_config(store_uri: str, experiment: str, config_hash: str, config_digest: str, *,
                  endpoint_url: str | None = None, region: str | None = None,
                  digests: str | None = None) -> ExperimentConfig:
    """The submitter's config (``configs/<config_digest>.json``), if the experiment's pin has its hash ``config_hash``.

    The store is opened for reading only with its location (reading an SSE-S3 or SSE-KMS object needs no
    key id; credentials come from the node's own chain). The returned config keeps the run config's encryption
    settings and names the store it was read from, so the unit commits where the submitter expects it.

    Raises:
        ConfigMismatch: the pin's hash is not ``config_hash`` (the YAML changed after the experiment was
            pinned, or it was re-pinned since the job was submitted); names the differing keys
            (from ``digests``, see :func:`key_digests`).
        ConfigError: there is no pin, the run's config was not published or was altered, or it is not the
            config of ``experiment`` with hash ``config_hash`` (a class of ``verl_tasks.errors``: the
            Airflow side rebuilds it and does not retry).
        StoreError: the pin is damaged.
    """
    from verl_tasks.layout import Layout
    from verl_tasks.pinning import read_pin, read_run_config
    from verl_tasks.store import open_store

    check_name(experiment)
    store = open_store(store_uri, endpoint_url=endpoint_url, region=region)
    layout = Layout(experiment)
    where = store.url(layout.experiment_json)
    pin = read_pin(store, layout)
    if pin is None:
        raise ConfigError(f"{where} does not exist: experiment {experiment!r} is not pinned in this store, so this "
                         f"job has no config to run (the configure task, or the first plan, pins it before any "
                         f"unit is submitted); run configure again")
    if pin["config_hash"] != config_hash:
        log.error("%s has config %s, the job was submitted under %s (the YAML changed after the experiment was "
                  "pinned, or it was re-pinned since): nothing is computed", where, pin["config_hash"][:12],
                  config_hash[:12])
        raise ConfigMismatch(experiment, _differing(pin.get("hashed_config") or {}, digests),
                             store.url(layout.root))
    dumped = read_run_config(store, layout, config_digest)
    dumped["storage"] = {**dumped.get("storage", {}), "uri": store_uri, "endpoint_url": endpoint_url,
                         "region": region}
    config = parse_config(dumped)
    if config.experiment != experiment or config.config_hash() != config_hash:
        raise ConfigError(f"{store.url(layout.run_config(config_digest))} is experiment {config.experiment!r} "
                         f"with config hash {config.config_hash()[:12]}, not {experiment!r} with "
                         f"{config_hash[:12]}: nothing was computed")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl_tasks.execution.entry")
    parser.add_argument("--store", required=True, help="the store's URI (no credentials)")
    parser.add_argument("--endpoint-url", default=None, help="the S3 endpoint, when the store needs one")
    parser.add_argument("--region", default=None)
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--config-hash", required=True, help="the pinned config's hash the job must run under")
    parser.add_argument("--config-digest", required=True,
                        help="the sha256 of the submitter's whole config, published in the store")
    parser.add_argument("--key-digests", default=None, help="key_digests() of the submitter's config")
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
    unit = UnitSpec(args.experiment, args.phase, args.epoch, args.batch).label
    try:
        unit = Layout(check_name(args.experiment)).unit(args.phase, args.epoch, args.batch)
        config = pinned_config(args.store, args.experiment, args.config_hash, args.config_digest,
                               endpoint_url=args.endpoint_url, region=args.region, digests=args.key_digests)
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
