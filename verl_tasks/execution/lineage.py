"""Start an experiment from another experiment's snapshot (continual training, forks).

The new experiment's base snapshot (version 0) becomes a copy of the parent's
snapshot ``version``: weights, model config and tokenizer are copied server-side,
the optimizer starts fresh and ``trainer_state.json`` records the parent. The
copy is an ordinary unit commit, so it is idempotent: a retried or re-run
``configure`` task finds the marker and does nothing. Once seeded, the origin is
recorded (in the base's marker and the experiment's pin) and reused: a rerun does
not follow the parent forward, and a quarantined base is re-seeded from the same
parent snapshot, never rebuilt from the configured model.

:func:`start_experiment` is the resume/fork policy (latest, fresh, from a snapshot,
scheduled child of a parent), shared by Airflow's ``configure`` task and
``verl-tasks run --resume-from EXPERIMENT[:VERSION]``. An Airflow run passes its DAG: it may
write only to experiments its DAG may reach and fork only from those its YAML permits
(:mod:`verl_tasks.ownership`), both checked before anything is copied or pinned.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from verl_tasks.config import ExperimentConfig, check_name
from verl_tasks.errors import ConfigError, StoreError
from verl_tasks.layout import Layout
from verl_tasks.ownership import DagAccess, check_fork, check_write, read_record
from verl_tasks.pinning import pin_experiment, read_pin
from verl_tasks.store import conventions
from verl_tasks.store.base import ObjectStore
from verl_tasks.store.conventions import NOT_COPIED, WEIGHTS, is_critic_optimizer_state, is_optimizer_state
from verl_tasks.store.units import CommitRecord, UnitWriter, read_marker, verify_unit

log = logging.getLogger(__name__)


def latest_version(store: ObjectStore, experiment: str) -> int | None:
    """The parent's newest published snapshot version, or None when it has none."""
    return conventions.latest_version(store, Layout(experiment))


def parent_snapshot(store: ObjectStore, experiment: str, version: int) -> CommitRecord:
    """The committed, unpruned snapshot ``version`` of ``experiment``.

    Raises:
        ConfigError: it is not committed, or it is a LoRA adapter (a base must hold whole weights).
        SnapshotPruned: retention deleted its weights (the message names the newest kept one).
    """
    layout = Layout(experiment)
    unit = layout.snapshot(version)
    record = read_marker(store, unit)
    if record is None:
        raise ConfigError(f"experiment {experiment!r} has no committed snapshot {version} ({unit})")
    conventions.check_not_pruned(store, layout, version)
    if conventions.is_adapter(record):
        raise ConfigError(f"snapshot {version} of {experiment!r} is a LoRA adapter, and a new experiment's base "
                          f"holds whole weights: export it merged (verl-tasks checkpoint export-hf "
                          f"{store.url(unit)} FOLDER --merge) and start from that folder (model.source: hf)")
    return record


def recorded_origin(store: ObjectStore, experiment: str) -> dict[str, Any] | None:
    """The parent snapshot ``experiment``'s base was seeded from: its base marker's, else its pin's.

    The pin still names it while the base is quarantined (it failed verification).
    """
    base = read_marker(store, Layout(experiment).snapshot(0))
    if base is not None:
        return base.meta.get("parent")
    pin = read_pin(store, Layout(experiment))
    return pin.get("parent") if pin else None


def seed_base_from(store: ObjectStore, experiment: str, parent: str, version: int, seed: int) -> dict[str, Any]:
    """Commit ``experiment``'s snapshot 0 as a copy of ``parent``'s snapshot ``version`` (once).

    A base that was quarantined but whose pin names this origin is re-seeded from it, verified.

    Raises:
        ConfigError: the experiment already starts from another snapshot or from its configured model,
            or ``version`` is not committed.
        SnapshotPruned: the parent snapshot's weights were pruned (a first seed).
        StoreError: a re-seed's parent snapshot is gone, pruned, corrupt or holds other weights.
    """
    target = Layout(experiment).snapshot(0)
    existing = read_marker(store, target)
    origin = existing.meta.get("parent") if existing is not None else recorded_origin(store, experiment)
    if origin and (origin.get("experiment"), origin.get("version")) != (parent, version):
        raise ConfigError(f"experiment {experiment!r} already starts from {origin}; use a new experiment name")
    if existing is not None:
        if not origin:
            raise ConfigError(f"experiment {experiment!r} already exists with a base built from its configured "
                              f"model, not from {parent} snapshot {version}; use a new experiment name")
        return {"unit": target, "attempt": existing.attempt, "parent": origin}
    source = _reseed_source(store, experiment, origin) if origin else parent_snapshot(store, parent, version)
    origin = {"experiment": parent, "version": version, "unit": source.unit, "attempt": source.attempt,
              "weights_sha256": source.files[WEIGHTS].sha256 if WEIGHTS in source.files else None}
    writer = UnitWriter(store, target)
    for name in sorted(source.files):
        if name not in NOT_COPIED and not is_optimizer_state(name) and not is_critic_optimizer_state(name):
            writer.copy_from(source, name)
    writer.write_json("trainer_state.json", {"version": 0, "step": 0, "epoch": None, "seed": seed, "parent": origin})
    record, won = writer.commit({"version": 0, "source": "parent", "parent": origin})
    log.info("base snapshot of %s %s from %s snapshot %d", experiment, "seeded" if won else "was already seeded",
             parent, version)
    return {"unit": target, "attempt": record.attempt, "parent": origin}


def _reseed_source(store: ObjectStore, experiment: str, origin: dict[str, Any]) -> CommitRecord:
    """The recorded parent snapshot, verified, for a base that was quarantined.

    Raises:
        StoreError: it cannot be used; the message names it and the two ways out.
    """
    parent, version = origin["experiment"], origin["version"]

    def refused(problem: str) -> StoreError:
        return StoreError(
            f"the base snapshot of {experiment!r} was quarantined and can only be re-seeded from its parent, "
            f"{parent} snapshot {version} ({Layout(parent).snapshot(version)}), but {problem}. Restore that "
            f"snapshot, or start a new experiment from one that exists: "
            f"verl-tasks run --resume-from {parent}:VERSION --experiment NEW_NAME"
        )

    try:
        source = parent_snapshot(store, parent, version)
        problems = verify_unit(store, source)
    except (ConfigError, StoreError) as err:  # not committed, pruned, or a damaged marker
        raise refused(str(err)) from err
    if problems:
        raise refused("it failed verification: " + "; ".join(problems))
    weights = source.files[WEIGHTS].sha256 if WEIGHTS in source.files else None
    if origin.get("weights_sha256") and weights != origin["weights_sha256"]:
        raise refused(f"its weights (sha256 {str(weights)[:16]}) are not the recorded ones "
                      f"({origin['weights_sha256'][:16]})")
    log.warning("base snapshot of %s was quarantined: re-seeding it from %s snapshot %d", experiment, parent, version)
    return source


RESUME_MODES = ("latest", "fresh", "snapshot")


def parse_source(text: str) -> tuple[str, int | None]:
    """``EXPERIMENT[:VERSION]`` -> (experiment, version or None for its latest snapshot). Raises ConfigError."""
    name, sep, version = text.partition(":")
    if sep and not version.isdigit():
        raise ConfigError(f"{text!r}: write EXPERIMENT or EXPERIMENT:VERSION with VERSION a snapshot number, e.g. "
                          f"{name}:3")
    return check_name(name), int(version) if sep else None


def start_experiment(store: ObjectStore, config: ExperimentConfig, *, resume: str = "latest",
                     parent: str | None = None, version: int | None = None,
                     scheduled_parent: str | None = None, dag: DagAccess | None = None) -> dict[str, Any]:
    """Apply the resume/fork policy, then pin the experiment: Airflow's ``configure`` and ``verl-tasks run``.

    Args:
        resume: ``latest`` continues what is committed (a changed hyperparameter under an
            existing name is refused by the pin); ``fresh`` needs a new name; ``snapshot``
            starts a new experiment whose base is snapshot ``version`` of ``parent``.
        parent, version: the fork's source (``version`` None: its latest snapshot, or the
            one the experiment already started from).
        scheduled_parent: continual training (``schedule.parent``, on any Airflow run type): a new
            experiment's base is this parent's latest snapshot when it has one, else the configured
            base model. An experiment that already started keeps its base (a child when the run is
            cleared or rerun after the parent moved on; one pinned without a parent, or the parent
            itself, continues as it is).
        dag: the Airflow DAG of the run (None: the CLI). Before anything is read from a parent or
            written, the run must be allowed to write to the experiment and to fork from the parent
            (:mod:`verl_tasks.ownership`); the pin records the DAG as the owner.
    Returns:
        ``experiment``, ``config_hash``, ``resume`` and ``parent`` (the pinned origin or None).
    Raises:
        ConfigError: an unknown mode, a fresh name that exists, a fork onto itself or from a
            missing snapshot, or a name that already starts from another snapshot.
        NotPermitted: ``dag`` may not write to the experiment or start from the parent.
        ConfigMismatch: the experiment is pinned with another config.
    """
    if resume not in RESUME_MODES:
        raise ConfigError(f"resume={resume!r}; use one of {RESUME_MODES}")
    layout = Layout(config.experiment)
    check_write(read_record(store, config.experiment), config.experiment, dag)
    if resume == "snapshot" and parent:
        check_fork(read_record(store, check_name(parent)), parent, dag)
    elif resume != "snapshot" and scheduled_parent:
        check_fork(read_record(store, check_name(scheduled_parent)), scheduled_parent, dag)
    if resume == "fresh" and store.exists(layout.experiment_json):
        raise ConfigError(f"experiment {config.experiment!r} already exists in {config.storage.uri}; "
                          f"pick a new name or use resume=latest")
    source: tuple[str, int] | None = None
    if resume == "snapshot":
        source = _fork_source(store, config.experiment, parent, version, recorded_origin(store, config.experiment))
    elif scheduled_parent:
        source = _scheduled_source(store, config.experiment, check_name(scheduled_parent),
                                   recorded_origin(store, config.experiment))
    origin = seed_base_from(store, config.experiment, source[0], source[1], config.seed)["parent"] if source else None
    # The pinning module, not the phases: configure stays torch-free (importing torch was 1.4 s of its 1.5 s).
    pinned = pin_experiment(SimpleNamespace(config=config, store=store, layout=layout), parent=origin, dag=dag)
    log.info("experiment %s pinned (config %s) in %s; resume=%s parent=%s",
             config.experiment, config.config_hash()[:12], config.storage.uri, resume, origin)
    return {"experiment": config.experiment, "config_hash": config.config_hash(), "resume": resume,
            "parent": pinned.get("parent")}


def _fork_source(store: ObjectStore, experiment: str, parent: str | None, version: int | None,
                 recorded: dict[str, Any] | None) -> tuple[str, int]:
    """(parent, version) of a fork; with no version, the one it started from, else the parent's latest.

    A rerun of ``--resume-from PARENT`` continues its fork after the parent trained on.
    """
    if not parent:
        raise ConfigError("resume=snapshot needs the parent experiment to start from")
    if check_name(parent) == experiment:
        raise ConfigError(f"a run from a snapshot starts a new experiment: pick a name other than {parent!r}")
    if version is None and recorded and recorded.get("experiment") == parent:
        return parent, recorded["version"]
    if version is None:
        version = latest_version(store, parent)
        if version is None:
            raise ConfigError(f"experiment {parent!r} has no published snapshot in this store to start from")
    return parent, version


def _scheduled_source(store: ObjectStore, experiment: str, parent: str,
                      recorded: dict[str, Any] | None) -> tuple[str, int] | None:
    """(parent, version) of a scheduled child: the one it started from, else the parent's latest.

    A Clear of the whole run starts ``configure`` again after the parent may have trained on:
    the child keeps its base. None: the configured base (the parent had no snapshot then).
    """
    if recorded and recorded.get("experiment") == parent:
        return parent, recorded["version"]
    if parent == experiment:
        return None  # a manual run of the parent's name under this DAG: it is its own lineage
    if recorded is None and store.exists(Layout(experiment).experiment_json):
        return None  # pinned without a parent: it started from the configured base and keeps it
    newest = latest_version(store, parent)
    if newest is None:
        log.info("parent %s has no snapshot yet; starting from the configured base", parent)
        return None
    return parent, newest
