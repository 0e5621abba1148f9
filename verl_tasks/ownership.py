"""Which Airflow DAG an experiment belongs to, and what runs of other DAGs may do with it.

Several DAGs may share one store; a user allowed to trigger one DAG must not reach, through it,
the experiments of another. ``experiment.json`` therefore records ``dag_id``: the DAG whose
``configure`` task created (or claimed) the experiment; ``null`` for one made outside Airflow
(``verl-tasks run``, scripts); the key is absent in experiments pinned before this was recorded.

The rules, for a run of DAG ``D`` (its YAML's ``access`` section is set by whoever deploys ``D``;
the trigger form cannot change it):

* **Owned by D**: everything, as before.
* **Owned by another DAG O**: ``D`` may not write to it (pin, re-pin, commit units, lift its safe
  mode), unless ``access.write_to`` lists ``O``; may not fork from it (``resume=snapshot``'s
  ``parent``, ``schedule.parent``) unless ``access.fork_from`` or ``access.write_to`` lists ``O``;
  its readers see it in the Training page and the metrics route only when ``access.write_to``
  lists ``O`` (forking copies one snapshot as a base; it grants no view of ``O``'s runs).
  Refusals happen in ``configure``, before anything is written, and name both DAGs and the key.
* **Owned by no DAG** (made by the CLI, or pinned before DAGs were recorded): ``D`` may write to it
  when ``D``'s YAML names it: its ``experiment``, a scheduled ``<experiment>-<YYYYmmddTHHMMSS>`` of
  it, or an entry of ``access.adopt``; ``configure`` then records ``D`` as its owner (it *claims*
  it). ``D`` may fork from it when the YAML names it that way or as ``schedule.parent``. Any other
  such experiment stays out of Airflow's reach until a deployer adopts it; the CLI can still
  continue it. The Training page shows it to readers of the DAG whose YAML names it, or, when no
  YAML names it, of the one DAG whose store it sits in (a store no other YAML uses).

The CLI is not governed: whoever runs it holds the store's credentials and may read and write
every experiment; an experiment it creates records ``dag_id: null``, and a re-pin it makes keeps
the recorded owner. Torch-free and Airflow-free.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from verl_tasks.config import AccessConfig
from verl_tasks.errors import NotPermitted
from verl_tasks.layout import Layout
from verl_tasks.store.base import NotFound, ObjectStore

OWNER = "dag_id"
STAMP_LENGTH = len("YYYYmmddTHHMMSS")  # runconfig.run_stamp
# (store uri, experiment, dag id) a run of that DAG may write to, checked by this process (owners never change
# once recorded, so one read of experiment.json per task process).
_MAY_WRITE: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class DagAccess:
    """A run of Airflow DAG ``dag_id``: what its YAML names and what its ``access`` section permits."""

    dag_id: str
    experiment: str  # the YAML's own experiment name (a run may use another)
    config_path: str = "the DAG's YAML"
    parent: str | None = None  # schedule.parent
    access: AccessConfig = field(default_factory=AccessConfig)

    @classmethod
    def from_yaml(cls, dag_id: str, raw: dict[str, Any], config_path: str) -> DagAccess:
        """From the YAML mapping alone (no full parse: the Training page reads YAMLs it may not open stores of)."""
        schedule = raw.get("schedule")
        parent = schedule.get("parent") if isinstance(schedule, dict) else None
        return cls(dag_id, str(raw.get("experiment", "")), config_path, parent,
                   AccessConfig.model_validate(raw.get("access") or {}))

    def names(self, experiment: str) -> bool:
        """Whether the YAML names ``experiment`` as its own: its experiment, a scheduled child of it, or adopted."""
        return experiment == self.experiment or is_scheduled_child(experiment, self.experiment) or \
            experiment in self.access.adopt

    def may_write_owner(self, owner: str) -> bool:
        return owner == self.dag_id or owner in self.access.write_to

    def may_fork_owner(self, owner: str) -> bool:
        return self.may_write_owner(owner) or owner in self.access.fork_from


def is_scheduled_child(name: str, base: str) -> bool:
    """``name`` is ``<base>-YYYYmmddTHHMMSS``, the experiment of one scheduled run (runconfig.scheduled_name)."""
    stamp = name[len(base) + 1:] if base and name.startswith(base + "-") else ""
    return len(stamp) == STAMP_LENGTH and stamp[8] == "T" and stamp.replace("T", "", 1).isdigit()


def read_record(store: ObjectStore, experiment: str) -> dict[str, Any] | None:
    """``experiment.json`` as a mapping for ownership only, or None when there is none. Never raises for a damaged
    one (it is ``{}``: no DAG recorded); the pin's own reader reports the damage where it matters."""
    try:
        body = json.loads(store.get(Layout(experiment).experiment_json))
    except NotFound:
        return None
    except (ValueError, UnicodeDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


def owner_of(record: dict[str, Any] | None) -> str | None:
    """The DAG id ``experiment.json`` records, or None: made by the CLI, pinned before DAGs were recorded, absent."""
    owner = (record or {}).get(OWNER)
    return owner if isinstance(owner, str) and owner else None


def _nobody(record: dict[str, Any] | None) -> str:
    if record is None:
        return "it has no experiment.json in this store"
    if OWNER in record:
        return "it was made outside Airflow, by verl-tasks run"
    return "it was pinned before experiments recorded their DAG"


def check_write(record: dict[str, Any] | None, experiment: str, dag: DagAccess | None) -> bool:
    """Refuse a run of ``dag`` that would write to ``experiment``; True when the run claims it (records ``dag``).

    ``dag`` None: not an Airflow run (the CLI): never refused, never claims. ``record`` None: a new name.

    Raises:
        NotPermitted: the experiment belongs to another DAG that ``access.write_to`` does not list, or to
            no DAG and the YAML does not name it.
    """
    if dag is None or record is None:
        return False
    owner = owner_of(record)
    if owner is not None:
        if dag.may_write_owner(owner):
            return False
        raise NotPermitted(
            experiment, owner, dag.dag_id, "access.write_to",
            f"experiment {experiment!r} belongs to DAG {owner!r}; a run of DAG {dag.dag_id!r} may not write to it "
            f"(pin, re-pin or commit units). Pick a new experiment name, or, if runs of {dag.dag_id!r} should "
            f"continue experiments of {owner!r}, whoever deploys {dag.dag_id!r} adds {owner!r} to access.write_to "
            f"in {dag.config_path}")
    if dag.names(experiment):
        return True
    raise NotPermitted(
        experiment, None, dag.dag_id, "access.adopt",
        f"experiment {experiment!r} belongs to no DAG ({_nobody(record)}) and DAG {dag.dag_id!r} does not name it "
        f"(its experiment is {dag.experiment!r}); a run of DAG {dag.dag_id!r} may not write to it. Pick a new "
        f"experiment name, continue it with verl-tasks run, or, to permit it, whoever deploys {dag.dag_id!r} adds "
        f"{experiment!r} to access.adopt in {dag.config_path} (the DAG then claims it)")


def check_fork(record: dict[str, Any] | None, parent: str, dag: DagAccess | None) -> None:
    """Refuse a run of ``dag`` that would start from a snapshot of ``parent`` (``dag`` None: the CLI, never).

    Raises:
        NotPermitted: ``parent`` belongs to another DAG that ``access.fork_from`` / ``write_to`` do not
            list, or to no DAG and the YAML names it neither as its own nor as ``schedule.parent``.
    """
    if dag is None:
        return
    owner = owner_of(record)
    if owner is not None:
        if dag.may_fork_owner(owner):
            return
        raise NotPermitted(
            parent, owner, dag.dag_id, "access.fork_from",
            f"a run of DAG {dag.dag_id!r} may not start from experiment {parent!r}, which belongs to DAG {owner!r}. "
            f"Start from an experiment of {dag.dag_id!r}, or, to permit it, whoever deploys {dag.dag_id!r} adds "
            f"{owner!r} to access.fork_from in {dag.config_path}")
    if dag.names(parent) or parent == dag.parent:
        return
    raise NotPermitted(
        parent, None, dag.dag_id, "access.adopt",
        f"a run of DAG {dag.dag_id!r} may not start from experiment {parent!r}: it belongs to no DAG "
        f"({_nobody(record)}) and DAG {dag.dag_id!r} names it neither as its experiment nor as schedule.parent. "
        f"Start from an experiment of {dag.dag_id!r}, or, to permit it, whoever deploys {dag.dag_id!r} adds "
        f"{parent!r} to access.adopt (or names it in schedule.parent) in {dag.config_path}")


def check_may_write(store: ObjectStore, experiment: str, dag: DagAccess | None) -> None:
    """A phase task's check before it computes or commits a unit (one read per process and experiment).

    An experiment not pinned yet passes: ``configure`` pins it, with its owner, before any unit runs.

    Raises:
        NotPermitted: see :func:`check_write`.
    """
    if dag is None:
        return
    key = (store.uri, experiment, dag.dag_id)
    if key in _MAY_WRITE:
        return
    record = read_record(store, experiment)
    check_write(record, experiment, dag)
    if record is not None:
        _MAY_WRITE.add(key)


def may_see(record: dict[str, Any] | None, experiment: str, dag: DagAccess) -> bool | None:
    """Whether readers of ``dag`` see ``experiment`` in the Training page: True, False, or None when no DAG
    is recorded and ``dag``'s YAML does not name it (the page then looks at which DAGs use the store)."""
    owner = owner_of(record)
    if owner is not None:
        return dag.may_write_owner(owner)
    return True if dag.names(experiment) else None


def claim_fields(record: dict[str, Any], dag: DagAccess, when: float) -> dict[str, Any]:
    """The ``experiment.json`` fields that record ``dag`` as the owner of ``record``'s experiment, and since when."""
    before = record.get(OWNER, "absent")
    return {OWNER: dag.dag_id, "claimed": {"by": dag.dag_id, "at": when, "recorded_before": before}}


__all__ = ["DagAccess", "OWNER", "check_fork", "check_may_write", "check_write", "claim_fields", "is_scheduled_child",
           "may_see", "owner_of", "read_record"]
