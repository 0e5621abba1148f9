"""The one door to the Ray cluster: submit, find, wait for and stop phase jobs.

Each unit attempt is a Ray job with a deterministic submission id::

    vt-<experiment>-e<epoch>-<phase>[-b<batch>]-a<attempt>

so an Airflow retry can find the jobs of its unit before it submits anything:

* a job of the unit is PENDING or RUNNING -> attach to it (never a second live job);
* the newest job SUCCEEDED -> return it; the caller checks the unit's marker;
* the newest job FAILED or STOPPED (or none exists) -> submit attempt n + 1.

Ray 2.60 turns token authentication on by default. :class:`RayTarget` carries
the dashboard address and, when one is configured, the token, which is sent as
an explicit ``Authorization: Bearer`` header. Nothing turns authentication off.

A transient error of the dashboard (connection refused or reset, timeout, HTTP
5xx) is retried with exponential backoff for ``retry_s`` seconds (default 120,
``VERL_TASKS_RAY_RETRY_S``) before it is raised, so one blip does not fail a task.

No secret goes into a job: its ``runtime_env``, entrypoint and metadata are shown
by the Jobs API and the dashboard to anyone holding the Ray token. Jobs reach
storage through the Ray nodes' own credential chain, and the config by reference:
the entrypoint names the store, the experiment, the config hash and the digest of
the run's whole config, which the job reads from ``configs/<digest>.json`` in the
store (no tracking URI, key id or config on the Ray side).
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_tasks.config import ExperimentConfig
from verl_tasks.errors import ConfigError, VerlTasksError
from verl_tasks.execution import UnitSpec, store_identity
from verl_tasks.execution.pool_shape import drives_a_group
from verl_tasks.secrets import is_secret_name

log = logging.getLogger(__name__)

LIVE = ("PENDING", "RUNNING")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
ADDRESS_ENVS = ("VERL_TASKS_RAY_ADDRESS", "RAY_ADDRESS")
UNIT_META = "verl_tasks_unit"
STORE_META = "verl_tasks_store"  # which store a job commits to (a digest: no bucket names in the cluster)
DUPLICATE_ID = "Please use a different submission_id"
MAX_ATTEMPTS = 1000
OVERDUE_S = 30.0  # grace past a unit's timeout before a live job of it counts as hung
STOP_RETRY_S = 20.0  # how long a stop retries a failing dashboard: within the 30 s Airflow gives on_kill
RETRY_ENV = "VERL_TASKS_RAY_RETRY_S"
DEFAULT_RETRY_S = 120.0
_HTTP_STATUS = re.compile(r"status code (\d{3})")


def entrypoint_resources(config: ExperimentConfig, phase: str, pool: bool) -> dict[str, Any]:
    """What a unit's job entrypoint reserves. With pools the phase's actor holds the resources and the driver
    only waits for it: nothing. Without, the phase's; but a phase that drives a resident group (a distributed
    update or critic) keeps only its CPUs: its workers reserve the GPUs and memory, and a driver holding them
    would keep its own workers from being placed on a cluster sized for them."""
    if pool:
        return {"entrypoint_num_cpus": 0, "entrypoint_num_gpus": 0, "entrypoint_memory": None}
    res = config.phase_resources(phase)
    if drives_a_group(config, phase):
        return {"entrypoint_num_cpus": res.num_cpus, "entrypoint_num_gpus": 0, "entrypoint_memory": None}
    return {"entrypoint_num_cpus": res.num_cpus, "entrypoint_num_gpus": res.num_gpus,
            "entrypoint_memory": int(res.memory_mb * 1024 * 1024) if res.memory_mb else None}

class RayUnavailable(VerlTasksError):
    """No Ray address is configured, or the cluster refused or did not answer."""


def _transient_types() -> tuple[type[BaseException], ...]:
    import aiohttp
    import requests

    return (ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout,
            requests.exceptions.ChunkedEncodingError, aiohttp.ClientConnectionError)


def _status_code(err: BaseException) -> int | None:
    """The HTTP status of a failed dashboard request: Ray's RuntimeError text, requests' or aiohttp's error."""
    match = _HTTP_STATUS.search(str(err)) if isinstance(err, RuntimeError) else None
    if match:
        return int(match.group(1))
    status = getattr(getattr(err, "response", None), "status_code", None) or getattr(err, "status", None)
    return status if isinstance(status, int) else None


def is_transient(err: BaseException) -> bool:
    """A blip of the dashboard (refused, reset, timed out, HTTP 5xx), in ``err`` or any of its causes.

    A duplicate submission id never is: the head wraps the agent's HTTP 400 for it in an HTTP 500
    whose text carries the 400, and :meth:`RayJobBackend.submit` must see it at once to attach.
    """
    seen: BaseException | None = err
    while seen is not None:
        if DUPLICATE_ID in str(seen):
            return False
        if isinstance(seen, _transient_types()) or (_status_code(seen) or 0) >= 500:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def default_retry_s() -> float:
    return float(os.environ.get(RETRY_ENV, DEFAULT_RETRY_S))


class Backoff:
    """Exponential delays (0.5 s doubling to 15 s) until ``budget_s`` has passed since the first failure."""

    def __init__(self, budget_s: float, first_s: float = 0.5, max_s: float = 15.0):
        self.budget_s = budget_s
        self.first_s = first_s
        self.max_s = max_s
        self.reset()

    def reset(self) -> None:
        """Called after a success: the next failure starts a new budget."""
        self.failures = 0
        self.since: float | None = None

    def next_delay(self) -> float | None:
        """Seconds to wait before the next try, or None when the budget is spent."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        left = self.since + self.budget_s - now
        if left <= 0:
            return None
        delay = min(self.max_s, self.first_s * 2 ** self.failures, left)
        self.failures += 1
        return delay


def submission_id(spec: UnitSpec, attempt: int) -> str:
    """``vt-tiny-arith-e0-rollout-b1-a1``: deterministic per (unit, attempt number)."""
    return f"vt-{spec.experiment}-{spec.label}-a{attempt}"


def read_token(token_file: str | None = None) -> str | None:
    """The Ray auth token from ``token_file``, ``RAY_AUTH_TOKEN``, or ``RAY_AUTH_TOKEN_PATH``."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for candidate in (token_file, os.environ.get("RAY_AUTH_TOKEN_PATH")):
        if candidate and Path(candidate).expanduser().is_file():
            return Path(candidate).expanduser().read_text().strip() or None
    if os.environ.get("RAY_AUTH_MODE") == "token":
        default = Path("~/.ray/auth_token").expanduser()
        if default.is_file():
            return default.read_text().strip() or None
    return None


@dataclass(frozen=True)
class RayTarget:
    """Where the Ray dashboard answers, and the token to show it (never logged)."""

    address: str
    token: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls) -> RayTarget:
        """Address from ``VERL_TASKS_RAY_ADDRESS`` / ``RAY_ADDRESS``, token per :func:`read_token`.

        Raises:
            RayUnavailable: no address variable is set.
        """
        for name in ADDRESS_ENVS:
            if os.environ.get(name):
                return cls(normalise_address(os.environ[name]), read_token())
        raise RayUnavailable(
            "no Ray address: set an Airflow connection (ray_default, host and port of the Ray "
            f"dashboard) or one of {', '.join(ADDRESS_ENVS)} (e.g. http://127.0.0.1:8265)"
        )

    def headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.token}"} if self.token else None


def normalise_address(address: str) -> str:
    address = address.strip()
    if address.startswith("ray://"):
        raise RayUnavailable(f"{address!r} is a Ray client address; the Jobs API needs the dashboard's http://host:port")
    if not re.match(r"^https?://", address):
        address = "http://" + address
    return address.rstrip("/")


def check_same_store(jobs: list[JobHandle], config: ExperimentConfig, spec: UnitSpec) -> None:
    """Refuse to attach to a live job of this unit's id that commits to another store.

    Job ids name the experiment, not the store: two deployments (staging and production, a copied
    YAML) that run one experiment name on one cluster would otherwise take each other's running jobs
    for their own. A finished one of another store only moves the attempt number on (a succeeded
    one leaves no marker in this store, so the unit is submitted again).

    Raises:
        ConfigError: names the job and the fix.
    """
    mine = store_identity(config)
    for job in jobs:
        if job.status in LIVE and job.store is not None and job.store != mine:
            raise ConfigError(
                f"Ray job {job.submission_id} of unit {spec.label} commits to another store than this run's "
                f"({config.storage.uri}): two deployments run experiment {spec.experiment!r} on this cluster; "
                f"give one of them another experiment name")


@dataclass(frozen=True)
class JobHandle:
    """A Ray job of one unit: its id, its status when last seen, and whether we started it."""

    submission_id: str
    status: str
    attempt: int
    submitted: bool
    started_at: float = 0.0  # epoch seconds, 0 when unknown
    store: str | None = None  # ``store_identity`` of the config it was submitted with; None when unknown


class RayJobBackend:
    """Submit phase units as Ray jobs; one instance per target. The first call contacts the cluster.

    Args:
        target: the dashboard address and token.
        python: the interpreter the job runs (``VERL_TASKS_RAY_PYTHON``).
        env: plain settings for every job's environment (never credentials: the Jobs API shows them).
        pool: run units on the phase's worker pool (``VERL_TASKS_POOLS``, default on; see pools.py);
            off, the unit runs in the job's own process, which then holds the phase's resources.
        retry_s: how long transient dashboard errors are retried (0: raise at once).

    Example::

        backend = RayJobBackend(RayTarget("http://127.0.0.1:8265", token))
        handle = backend.submit(config, UnitSpec("tiny-arith", "rollout", 0, 1))
        backend.wait(handle.submission_id)
    """

    def __init__(self, target: RayTarget, *, python: str | None = None, env: dict[str, str] | None = None,
                 pool: bool | None = None, retry_s: float | None = None):
        self.target = target
        self.retry_s = default_retry_s() if retry_s is None else retry_s
        self.pool = pool if pool is not None else os.environ.get("VERL_TASKS_POOLS", "1") != "0"
        self.python = python or os.environ.get("VERL_TASKS_RAY_PYTHON", "python")
        self.env = dict(env or {})
        self._client = None

    @property
    def client(self):
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            try:
                self._client = JobSubmissionClient(self.target.address, headers=self.target.headers())
            except Exception as err:  # noqa: BLE001 - re-raised with the address and the fix
                hint = "" if self.target.token else (
                    " If the cluster uses token authentication (Ray's default), configure the token: "
                    "the connection's password, RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH."
                )
                raise RayUnavailable(f"Ray Jobs API at {self.target.address} is not usable: {err}.{hint}") from err
        return self._client

    # -- finding -----------------------------------------------------------------
    def unit_jobs(self, spec: UnitSpec) -> list[JobHandle]:
        """Every job of the unit, oldest attempt first, asked for by id (never by listing the cluster).

        Attempt ids are dense (``-a1``, ``-a2``, ...), so the unit's jobs are found by asking
        for each id in turn until one does not exist: the cost grows with the unit's own
        attempts, not with the number of jobs the cluster has run.
        """
        found = []
        for number in range(1, MAX_ATTEMPTS + 1):
            info = self._job_info(submission_id(spec, number))
            if info is None:
                break
            found.append(JobHandle(info.submission_id, str(getattr(info.status, "value", info.status)), number,
                                   False, (info.start_time or 0) / 1000.0,
                                   (getattr(info, "metadata", None) or {}).get(STORE_META)))
        return found

    def _job_info(self, job_id: str) -> Any:
        """The job's details, or None when no job has this id."""
        try:
            return self._retry(f"info of {job_id}", lambda: self.client.get_job_info(job_id))
        except RuntimeError as err:
            if "does not exist" in str(err) or "404" in str(err):
                return None
            raise

    # -- submitting --------------------------------------------------------------
    def entrypoint(self, config: ExperimentConfig, spec: UnitSpec) -> str:
        """The job's command: where the run's config is and which hashes it must have, never the config.

        The Jobs API shows the entrypoint to every Ray token holder, so it names the store (without any
        ``user:password@``), the experiment, the config hash and the digest of the whole config; the
        tracking URI, the encryption key id and every other setting are read by the job from
        ``configs/<digest>.json``, which the submitter published (``entry.pinned_config``).
        """
        from verl_tasks.execution.entry import key_digests, public_location
        from verl_tasks.pinning import run_config_body

        storage = config.storage
        parts = [self.python, "-m", "verl_tasks.execution.entry",
                 "--store", public_location(storage.uri) or storage.uri,
                 "--experiment", config.experiment, "--config-hash", config.config_hash(),
                 "--config-digest", run_config_body(config)[0],
                 "--key-digests", key_digests(config.hashed_view()),
                 "--phase", spec.phase, "--epoch", str(spec.epoch)]
        if storage.endpoint_url:
            parts += ["--endpoint-url", public_location(storage.endpoint_url) or storage.endpoint_url]
        if storage.region:
            parts += ["--region", storage.region]
        if spec.batch is not None:
            parts += ["--batch", str(spec.batch)]
        if self.pool:
            parts.append("--pool")
        return " ".join(shlex.quote(p) for p in parts)

    def submit(
        self,
        config: ExperimentConfig,
        spec: UnitSpec,
        *,
        env: dict[str, str] | None = None,
        resubmit_succeeded: bool = False,
    ) -> JobHandle:
        """Attach to the unit's live job, return its succeeded job, or submit the next attempt.

        Args:
            config: the resolved experiment config, published in its store (``pinning.publish_run_config``:
                ``pin_experiment`` does it); the job reads it there by its digest.
            spec: the unit.
            env: extra plain settings for the job's environment (never credentials)
            resubmit_succeeded: submit a new attempt even when the newest job succeeded
                (the caller found no marker, e.g. after a rollback).

        Returns:
            The handle; ``submitted`` tells whether a new job was started.

        Raises:
            RayUnavailable: the cluster cannot be reached or refuses the request.
        """
        jobs = self.unit_jobs(spec)
        check_same_store(jobs, config, spec)
        live = [j for j in jobs if j.status in LIVE]
        timeout_s = config.fault_tolerance.timeout_s.get(spec.phase)
        if live and timeout_s and live[-1].started_at and time.time() - live[-1].started_at > timeout_s + OVERDUE_S:
            # Its unit is past its timeout (the driver should have ended it): never attach to a hung attempt.
            log.warning("Ray job %s of unit %s is past its %gs timeout; stopping it and starting a new attempt",
                        live[-1].submission_id, spec.label, timeout_s)
            self.stop(live[-1].submission_id)  # raises while the dashboard fails: never two live jobs
            live = []
        if live:
            log.info("attaching to live Ray job %s (%s) of unit %s", live[-1].submission_id, live[-1].status,
                     spec.label)
            return live[-1]
        newest = jobs[-1] if jobs else None
        if newest is not None and newest.status == "SUCCEEDED" and not resubmit_succeeded:
            return newest
        number = (newest.attempt + 1) if newest else 1
        job_id = submission_id(spec, number)
        reserved = entrypoint_resources(config, spec.phase, self.pool)
        runtime_env: dict[str, Any] = {"env_vars": public_env({**self.env, **(env or {})})}
        if not self.pool and not reserved["entrypoint_num_gpus"]:
            # A job that reserved no GPU must not see one: Ray leaves a job's entrypoint every GPU of
            # its node unless it reserved some, and model.device auto would take one another unit holds.
            runtime_env["env_vars"]["CUDA_VISIBLE_DEVICES"] = ""
        try:
            self._submit_job(
                job_id,
                entrypoint=self.entrypoint(config, spec),
                runtime_env=runtime_env,
                metadata={UNIT_META: spec.label, "experiment": spec.experiment, STORE_META: store_identity(config)},
                **reserved,
            )
        except RuntimeError as err:
            if DUPLICATE_ID in str(err):  # another retry of this unit won the same attempt id: attach
                log.info("job %s was submitted concurrently; attaching", job_id)
                return JobHandle(job_id, self.status(job_id), number, False)
            raise RayUnavailable(f"could not submit {job_id} to {self.target.address}: {err}") from err
        log.info("submitted Ray job %s (attempt %d of unit %s)", job_id, number, spec.label)
        return JobHandle(job_id, "PENDING", number, True)

    def _submit_job(self, job_id: str, **kwargs: Any) -> None:
        """``submit_job``, retried on transient errors (also a fresh head's HTTP 500 "No available agent").

        A retry after a reset whose request did reach the head fails with a duplicate id,
        which :meth:`submit` turns into attaching to that job.
        """
        self._retry(f"submit {job_id}", lambda: self.client.submit_job(submission_id=job_id, **kwargs))

    def _retry(self, what: str, call: Any, budget_s: float | None = None) -> Any:
        """``call()``, retried with backoff while it fails transiently, for at most ``retry_s``
        (or ``budget_s``: a stop retries within its own budget, also where polls are retried by the caller).

        Raises:
            RayUnavailable: still failing transiently after the budget (names the address and last error).
            Exception: a non-transient error of ``call``, unchanged.
        """
        retry_s = self.retry_s if budget_s is None else budget_s
        backoff = Backoff(retry_s)
        while True:
            try:
                return call()
            except Exception as err:
                if not is_transient(err):
                    raise
                delay = backoff.next_delay()
                if delay is None and not retry_s:
                    raise  # the caller retries (the trigger, with asyncio.sleep)
                if delay is None:
                    raise RayUnavailable(f"Ray dashboard at {self.target.address}: {what} still failing after "
                                         f"{retry_s:g}s of retries ({RETRY_ENV}); last error: {err}") from err
                log.warning("Ray dashboard at %s: %s failed transiently (%s); retry %d in %.1fs",
                            self.target.address, what, err, backoff.failures, delay)
                time.sleep(delay)

    # -- watching ----------------------------------------------------------------
    def status(self, job_id: str) -> str:
        status = self._retry(f"status of {job_id}", lambda: self.client.get_job_status(job_id))
        return str(getattr(status, "value", status))

    def logs(self, job_id: str) -> str:
        return self._retry(f"logs of {job_id}", lambda: self.client.get_job_logs(job_id))

    def stop(self, job_id: str) -> bool:
        """Ask Ray to stop a job, retrying a dashboard that fails transiently for up to ``STOP_RETRY_S``
        (an ``on_kill`` has ~30 s); True if it was live, False if Ray refused (no such job).

        Raises:
            RayUnavailable: the dashboard kept failing; the job may still be running.
        """
        try:
            return bool(self._retry(f"stop {job_id}", lambda: self.client.stop_job(job_id), STOP_RETRY_S))
        except RuntimeError as err:
            log.warning("could not stop Ray job %s: %s", job_id, err)
            return False

    def wait(self, job_id: str, timeout_s: float = 600, poll_s: float = 0.5) -> str:
        """Block until the job is terminal; return its status (for scripts and tests)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.status(job_id)
            if status in TERMINAL:
                return status
            time.sleep(poll_s)
        raise TimeoutError(f"Ray job {job_id} not finished after {timeout_s}s")


def public_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a job's ``runtime_env``, which the Jobs API shows to every token holder.

    Raises:
        ConfigError: a variable's name marks it as a secret (credentials reach jobs through
            the Ray nodes' own credential chain, never through the job).
    """
    secret = sorted(name for name in env if is_secret_name(name))
    if secret:
        raise ConfigError(f"refusing to send {', '.join(secret)} in a Ray job's runtime_env (the Jobs API shows it "
                          "to anyone holding the Ray token); give the Ray nodes their own credentials instead")
    return env


_CONFIG_ARG = re.compile(r"(--config-b64\s+)(\S+)")


def redact_config(line: str) -> str:
    """A job log line with an entrypoint's base64 config replaced by its length (jobs submitted before the
    config went by reference carried it)."""
    return _CONFIG_ARG.sub(lambda m: f"{m.group(1)}<config, {len(m.group(2))} chars>", line)


def log_tail(text: str, lines: int = 40) -> str:
    return "\n".join(redact_config(line) for line in (text or "").splitlines()[-lines:])


__all__ = ["RayJobBackend", "RayTarget", "JobHandle", "RayUnavailable", "entrypoint_resources", "submission_id",
           "read_token", "log_tail", "redact_config"]
