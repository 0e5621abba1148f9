"""Build one DAG per experiment YAML: ``build_dag("dags/experiments/tiny_arith.yaml")``.

Shape (``E`` epochs from the YAML, ``B`` = ``rollout.batches_per_epoch``)::

    configure -> epoch_000[ plan -> rollout[B] -> score[B] -> validate -> update -> snapshot (-> evaluate) ]
              -> epoch_001[ plan ... ] -> ... (every evaluate -> promote, in retraining DAGs)

Every task is one idempotent unit (see :mod:`verl_tasks.airflow.operators`); the next
epoch's ``plan`` waits for this epoch's ``snapshot`` (``evaluate`` is a side branch).
Every epoch has an ``evaluate`` task: which epochs a run evaluates depends on the run
(``evaluate.every`` and ``epochs`` come from the trigger form too, and a run's last epoch
is always evaluated), so ``configure`` skips, up front, those its run does not evaluate.
A DAG with a ``schedule`` (cron, asset or parent) ends with ``promote``, the promotion gate
(:mod:`verl_tasks.airflow.promotion`). ``notifiers`` (Airflow ``BaseNotifier`` objects) hear
about safe mode (:mod:`verl_tasks.airflow.callbacks`).
Importing this module imports neither torch nor ray.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import DAG, Asset, Param, TaskGroup

from verl_tasks.airflow import callbacks, runconfig
from verl_tasks.airflow.operators import ConfigureExperimentOperator, VerlPhaseOperator
from verl_tasks.airflow.promotion import PromoteSnapshotOperator, promoted_asset
from verl_tasks.config import NAME_PATTERN, TRIGGER_OVERRIDABLE, parse_config, trigger_limits
from verl_tasks.execution.lineage import RESUME_MODES
from verl_tasks.phase_registry import phases_for

if TYPE_CHECKING:  # pragma: no cover - typing only
    from airflow.sdk import BaseOperator
    from airflow.sdk.definitions.mappedoperator import MappedOperator

GPU_POOL = "verl_gpu"
# Keys whose bound the form's description spells out: those that scale a run's work.
_SCALING = ("algorithm.group_size", "algorithm.ppo_epochs", "rollout.max_new_tokens", "rollout.prompts_per_batch",
            "evaluate.max_prompts")
GPU_PHASES = ("rollout", "top_up", "critic", "update")

RETRY_DOC = (
    "\n\n**Retry / Clear**: the task first looks for its unit's `_SUCCESS` marker and returns at once if it "
    "exists; otherwise it runs the phase again (attaching to a still-running Ray job of the same unit). A "
    "half-written attempt is never visible, so clearing this task redoes exactly this unit and nothing is "
    "counted twice."
)


def snapshot_asset(dag_id: str) -> Asset:
    """The Asset a DAG's final snapshot task updates (event extra: experiment, version, uri, sha256)."""
    return Asset(name=f"verl-tasks/{dag_id}/snapshots", uri=f"verl-tasks://{dag_id}/snapshots")


def _params(raw: dict[str, Any], cfg) -> dict[str, Param]:
    """The trigger form; each number's maximum is its bound (``config.TRIGGER_BOUNDS``, ``trigger.bounds``),
    which ``configure`` checks again for ``overrides`` and for runs triggered through the REST API."""
    algo, roll = cfg.algorithm, cfg.rollout
    limits = trigger_limits(cfg)
    current = {"lr": algo.lr, "group_size": algo.group_size, "temperature": roll.temperature, "kl_coef": algo.kl_coef,
               "clip_ratio_high": algo.clip_ratio_high, "prompts_per_batch": roll.prompts_per_batch}
    params = {
        "experiment": Param(cfg.experiment, type="string", pattern=NAME_PATTERN.pattern, title="Experiment name",
                            description="Storage prefix of the run. Reuse a name to resume it; a different "
                                        "hyperparameter under an existing name is refused."),
        "resume": Param("latest", enum=list(RESUME_MODES), title="Resume",
                        description="latest: continue from what is committed. fresh: the name must be new. "
                                    "snapshot: a new experiment starting from snapshot `from_snapshot` (default: the "
                                    "latest) of `parent`, in the same store."),
        "from_snapshot": Param(None, type=["null", "integer"], minimum=0, title="From snapshot (resume=snapshot)",
                               description="A snapshot version of `parent`; empty: its latest snapshot."),
        "parent": Param(None, type=["null", "string"], title="Parent experiment (resume=snapshot)",
                        description=f"Defaults to {runconfig.default_parent(raw)!r}"
                                    + (" (schedule.parent)." if cfg.schedule.parent else " (this DAG's experiment).")),
        "epochs": Param(cfg.epochs, type="integer", minimum=1, maximum=int(limits["epochs"][0]), title="Epochs",
                        description="At most the epochs in the YAML (the DAG's shape); later epoch groups skip."),
        "overrides": Param({}, type="object", title="Other hyperparameters",
                           description='Dotted config keys, e.g. {"algorithm.clip_ratio_low": 0.2}; only '
                                       + ", ".join(TRIGGER_OVERRIDABLE) + ", each up to its bound ("
                                       + ", ".join(f"{k} <= {v[0]:g}" for k, v in limits.items()
                                                   if k in _SCALING) + ", ...; trigger.bounds in the YAML). "
                                       "Everything else (model, data, rewards, storage, resources) is set in the "
                                       "YAML by whoever deploys the DAG."),
    }
    for name, (dotted, kind) in runconfig.HYPERPARAMETERS.items():
        limit = limits[dotted][0]
        spec: dict[str, Any] = {"type": kind, "title": name, "description": f"config key {dotted}, at most {limit:g}"}
        if kind == "integer":
            spec["minimum"], spec["maximum"] = 1, int(limit)
        else:
            spec["minimum"], spec["maximum"] = 0, limit
        params[name] = Param(current[name], **spec)
    return params


def _schedule(cfg) -> Any:
    if cfg.schedule.asset:
        return [Asset(cfg.schedule.asset)]
    return cfg.schedule.cron


def build_dag(yaml_path: str | Path, *, dag_id: str | None = None, backend: str | None = None,
              gpu_pool: str = GPU_POOL, ray_conn_id: str | None = "ray_default", aws_conn_id: str | None = None,
              tags: list[str] | None = None, notifiers: list[Any] | None = None) -> DAG:
    """A DAG for one experiment YAML. Raises ConfigError when the YAML is invalid.

    ``notifiers``: Airflow notifiers (``BaseNotifier``, e.g. a provider's Slack or SMTP one)
    called when the experiment enters safe mode, with the summary in the context as ``alert``.
    """
    yaml_path = Path(yaml_path).resolve()
    raw = runconfig.read_yaml(yaml_path)
    cfg = parse_config(raw)
    dag_id = dag_id or yaml_path.stem
    if cfg.schedule.cron or cfg.schedule.asset:
        runconfig.scheduled_name(cfg.experiment, runconfig.run_stamp(None))  # too long a name fails the import
    ft = cfg.fault_tolerance
    default_args: dict[str, Any] = {
        "retries": ft.retries,
        "retry_delay": timedelta(seconds=ft.retry_delay_s),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(seconds=ft.max_retry_delay_s),
    }
    asset = snapshot_asset(dag_id)
    retraining = bool(cfg.schedule.cron or cfg.schedule.asset or cfg.schedule.parent)
    promoted = promoted_asset(dag_id)
    doc = (
        f"### {cfg.experiment}: RL post-training as idempotent tasks\n\n"
        f"Built from `{yaml_path.name}`: {cfg.epochs} epochs x {cfg.rollout.batches_per_epoch} rollout batches of "
        f"{cfg.rollout.prompts_per_batch} prompts x {cfg.algorithm.group_size} samples; model `{cfg.model.source}`; "
        f"store `{cfg.storage.uri}`.\n\nEach task commits one unit under a `_SUCCESS` marker; clearing any task "
        f"(or the whole run) redoes only what is missing. The final snapshot updates the asset `{asset.uri}`."
        + (f"\n\nScheduled runs start a new experiment `{cfg.experiment}-<timestamp>`"
           + (f" from `{cfg.schedule.parent}`'s latest snapshot." if cfg.schedule.parent else ".")
           if (cfg.schedule.cron or cfg.schedule.asset) else "")
        + (f"\n\nA manual run starts its experiment from `{cfg.schedule.parent}`'s latest snapshot too (the "
           f"first time; an experiment that already started continues)." if cfg.schedule.parent else "")
        + (f"\n\n**Promotion gate**: `promote` publishes the final snapshot as the asset `{promoted.uri}` only "
           f"when its eval accuracy beats the snapshot the run started from by more than "
           f"{cfg.schedule.promote_margin:g}; otherwise it is skipped with the reason and the snapshot is kept. "
           f"Deploy or export DAGs schedule on that asset." if retraining else "")
    )
    common = {"config_path": str(yaml_path), "backend": backend, "ray_conn_id": ray_conn_id, "aws_conn_id": aws_conn_id}
    with DAG(
        dag_id=dag_id,
        schedule=_schedule(cfg),
        start_date=datetime(2024, 1, 1),
        catchup=False,
        max_active_runs=1,
        default_args=default_args,
        params=_params(raw, cfg),
        doc_md=doc,
        tags=tags or ["verl-tasks", "rl"],
        render_template_as_native_obj=False,
    ) as dag:
        configure = ConfigureExperimentOperator(
            task_id="configure", config_path=str(yaml_path), aws_conn_id=aws_conn_id, retries=0,
            doc_md="Validates the trigger form and pins the experiment (config hash) before any compute. "
                   "A changed hyperparameter under an existing experiment name fails here with the differing keys.",
        )
        previous: BaseOperator | MappedOperator = configure
        evaluations: list[Any] = []
        for epoch in range(cfg.epochs):
            with TaskGroup(group_id=f"epoch_{epoch:03d}", tooltip=f"epoch {epoch} -> policy version {epoch + 1}"):
                tasks: dict[str, BaseOperator | MappedOperator] = {}
                for phase, spec in phases_for(cfg).items():
                    kwargs: dict[str, Any] = dict(common, task_id=phase, phase=phase, epoch=epoch,
                                                  doc_md=spec.doc + RETRY_DOC)
                    timeout = ft.timeout_s.get(phase)
                    if timeout:
                        kwargs["execution_timeout"] = timedelta(seconds=timeout)
                    if ft.safe_mode:
                        kwargs["on_retry_callback"] = callbacks.escalation(callbacks.on_retry, notifiers)
                        kwargs["on_failure_callback"] = callbacks.escalation(callbacks.on_failure, notifiers)
                    if phase == "plan":
                        # configure skips the tasks of epochs with nothing left to do; the next one still runs
                        kwargs["trigger_rule"] = "none_failed"
                    if phase in ("score", "validate") and ft.min_committed_batch_fraction < 1:
                        # A mapped task waits on every instance upstream: a batch that failed for good must
                        # not block the others' scores, nor validate, which records the batches it may skip.
                        kwargs["trigger_rule"] = "all_done"
                    if phase in GPU_PHASES and gpu_pool:
                        kwargs["pool"] = gpu_pool
                    if phase == "snapshot" and epoch == cfg.epochs - 1:
                        kwargs["outlets"] = [asset]
                        kwargs["snapshot_asset"] = asset
                    if spec.batched:
                        tasks[phase] = VerlPhaseOperator.partial(
                            map_index_template="batch {{ task.batch }}", **kwargs
                        ).expand(batch=list(range(cfg.rollout.batches_per_epoch)))
                    else:
                        tasks[phase] = VerlPhaseOperator(**kwargs)
                previous >> tasks["plan"] >> tasks["rollout"] >> tasks["score"] >> tasks["validate"]
                if "top_up" in tasks:  # dynamic sampling: extra batches before the gate reads the epoch's
                    tasks["score"] >> tasks["top_up"] >> tasks["validate"]
                if "critic" in tasks:  # PPO: the policy update reads the advantages the critic computed
                    tasks["validate"] >> tasks["critic"] >> tasks["update"]
                tasks["validate"] >> tasks["update"] >> tasks["snapshot"] >> tasks["evaluate"]
                evaluations.append(tasks["evaluate"])
                previous = tasks["snapshot"]
        if retraining:
            evaluations >> PromoteSnapshotOperator(
                task_id="promote", config_path=str(yaml_path), asset=promoted, aws_conn_id=aws_conn_id, retries=0,
                trigger_rule="none_failed",
                doc_md="The promotion gate: publishes the final snapshot as the promoted asset when its eval "
                       "accuracy beats the snapshot the run started from by more than `schedule.promote_margin`; "
                       "otherwise skipped, with the reason in the log and a `promotion` event in the store. It "
                       "waits for every evaluation (a run of fewer epochs than the DAG skips the later ones).",
            )
    return dag
