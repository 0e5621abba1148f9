"""One exception family for verl-tasks; each error carries the ids a person needs."""
from __future__ import annotations


class VerlTasksError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(VerlTasksError):
    """The experiment configuration or its inputs are invalid; nothing was computed."""


class ConfigMismatch(ConfigError):
    """A run asked for an experiment name that already exists with a different config."""

    def __init__(self, experiment: str, differing_keys: list[str], prefix_url: str | None = None):
        self.experiment = experiment
        self.differing_keys = differing_keys
        keys = ", ".join(differing_keys)
        start_over = (f", or start over under this name by deleting everything under {prefix_url}"
                      if prefix_url else "")
        super().__init__(
            f"experiment {experiment!r} already computed units with a different configuration; "
            f"differing keys: {keys}. Use a new experiment name (--experiment NAME) to train "
            f"with these settings, restore the original values to resume{start_over}."
        )


class NotPermitted(ConfigError):
    """A run of one Airflow DAG asked to write to, or start from, an experiment its DAG may not reach
    (``verl_tasks.ownership``); nothing was written. ``owner`` is None for an experiment no DAG owns."""

    def __init__(self, experiment: str, owner: str | None, dag_id: str, key: str, message: str):
        self.experiment = experiment
        self.owner = owner
        self.dag_id = dag_id
        self.key = key
        super().__init__(message)


class DataError(ConfigError):
    """The prompt data cannot be used (malformed, empty, too long)."""


class StoreError(VerlTasksError):
    """Storage failed or holds something it should not."""


class IntegrityError(StoreError):
    """A committed unit does not match its manifest (missing, truncated or altered file)."""

    def __init__(self, unit: str, problems: list[str]):
        self.unit = unit
        self.problems = problems
        super().__init__(f"unit {unit} failed verification: " + "; ".join(problems))


class SnapshotPruned(StoreError):
    """A snapshot's weights were deleted by retention: it is unavailable, not corrupt (nothing is quarantined)."""

    def __init__(self, experiment: str, version: int, keep: int | None, newest_kept: int | None):
        self.experiment = experiment
        self.version = version
        kept = f"keep_snapshots={keep}" if keep else "storage.keep_snapshots"
        rerun = (f"rerun from snapshot {newest_kept} (the newest kept)" if newest_kept is not None
                 else "rerun from the base")
        super().__init__(
            f"snapshot {version} of {experiment} was pruned by retention ({kept}); {rerun} "
            f"or raise storage.keep_snapshots"
        )


class UnsafeKey(StoreError):
    """A key or name would escape the experiment prefix."""


class PhaseFailed(VerlTasksError):
    """A phase ran and could not produce its output."""

    def __init__(self, unit: str, reason: str):
        self.unit = unit
        self.reason = reason
        super().__init__(f"{unit}: {reason}")


class UnitTimeout(PhaseFailed):
    """A unit ran past its timeout where it runs; the attempt was fenced and its worker restarted."""


class AttemptFenced(StoreError):
    """An attempt was cancelled or timed out: it may not commit (a newer attempt owns the unit)."""

    def __init__(self, unit: str, attempt: str, reason: str):
        self.unit = unit
        self.attempt = attempt
        super().__init__(f"{unit}: attempt {attempt} was fenced ({reason}); it cannot commit")


class WriteConflict(StoreError):
    """A conditional write could not be decided: S3 kept answering 409 ConditionalRequestConflict (another
    conditional write to the same key was in flight) through every backoff. Nothing was written; retryable."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


class ConfigRepinned(StoreError):
    """The experiment was re-pinned to another config while an attempt computed under the old one: the
    attempt may not commit (its files are discarded). Retryable: a retry computes under the pin in force,
    or is refused with ``ConfigMismatch`` before any work when its config is still the old one."""

    def __init__(self, unit: str, attempt: str, ran_under: str, pinned: str | None):
        self.unit = unit
        self.attempt = attempt
        self.ran_under = ran_under
        self.pinned = pinned
        now = f"config {pinned[:12]}" if pinned else "no config (experiment.json is gone)"
        super().__init__(
            f"{unit}: attempt {attempt} computed under config {ran_under[:12]}, but the experiment is now pinned to "
            f"{now}; nothing was committed: rerun the task (it computes under the pinned config)"
        )


class ValidationFailed(PhaseFailed):
    """The data-quality gate refused an epoch's scored samples."""


class TooFewGroups(ValidationFailed):
    """DAPO's dynamic sampling drew its most rollout batches and still lacks groups whose rewards differ."""


class BatchesMissing(PhaseFailed):
    """An epoch lacks more batches than ``min_committed_batch_fraction`` allows: a person reruns them or lowers it."""


class RewardFailureRate(PhaseFailed):
    """Too many samples of a batch could not be scored."""


class NonFiniteUpdate(PhaseFailed):
    """The update produced a non-finite gradient, weight or optimizer state: nothing of it is committed.
    Not retried (the same inputs give the same numbers); the experiment then waits in safe mode."""


class JobFailed(VerlTasksError):
    """A Ray job for a unit ended without success."""

    def __init__(self, submission_id: str, status: str, log_tail: str = ""):
        self.submission_id = submission_id
        self.status = status
        self.log_tail = log_tail
        super().__init__(f"Ray job {submission_id} ended {status}. Log tail:\n{log_tail}")


class SafeMode(VerlTasksError):
    """The experiment is in safe mode: no epoch starts until a person resumes it."""
