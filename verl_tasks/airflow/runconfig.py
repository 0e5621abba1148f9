"""Resolve the experiment config of one DAG run: YAML + trigger-form params + run type.

Every task of a run calls :func:`resolve` and gets the same config (it depends only
on the YAML, the run's params and the run's type and time), so no config travels
through XCom. The ``configure`` task validates it, before any compute.
"""
from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from verl_tasks.config import (
    TRIGGER_BOUNDS,
    TRIGGER_OVERRIDABLE,
    ExperimentConfig,
    check_name,
    flatten,
    parse_config,
    trigger_floors,
    trigger_limits,
    value_at,
)
from verl_tasks.errors import ConfigError
from verl_tasks.store import absolute_uri
from verl_tasks.yaml_files import read_yaml_file

# Trigger-form fields that are hyperparameters -> dotted config keys.
HYPERPARAMETERS = {
    "lr": ("algorithm.lr", "number"),
    "group_size": ("algorithm.group_size", "integer"),
    "temperature": ("rollout.temperature", "number"),
    "kl_coef": ("algorithm.kl_coef", "number"),
    "clip_ratio_high": ("algorithm.clip_ratio_high", "number"),
    "prompts_per_batch": ("rollout.prompts_per_batch", "integer"),
}
NAME_LIMIT = 128  # characters in an experiment name (config.NAME_PATTERN)
SCHEDULED_RUN_TYPES = ("scheduled", "asset_triggered", "backfill")


def read_yaml(path: str | Path) -> dict[str, Any]:
    """An experiment YAML's mapping, read within ``verl_tasks.yaml_files``' bounds (not yet validated)."""
    raw = read_yaml_file(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return raw


def run_type_of(dag_run: Any) -> str:
    value = getattr(dag_run, "run_type", None) if dag_run is not None else None
    return str(getattr(value, "value", value) or "manual")


def run_stamp(dag_run: Any) -> str:
    when = getattr(dag_run, "logical_date", None) or getattr(dag_run, "run_after", None) or datetime.utcnow()
    return when.strftime("%Y%m%dT%H%M%S")


def scheduled_name(base: str, stamp: str) -> str:
    """``<base>-<stamp>``, the experiment of one scheduled run; ConfigError when that name is too long."""
    name = f"{base}-{stamp}"
    if len(name) > NAME_LIMIT:
        raise ConfigError(
            f"scheduled runs name each experiment '<experiment>-<timestamp>' ({len(name)} characters for "
            f"experiment {base!r}), over the {NAME_LIMIT} allowed; shorten `experiment` in the YAML to at most "
            f"{NAME_LIMIT - len(stamp) - 1} characters"
        )
    return check_name(name)


def experiment_name(raw: dict[str, Any], params: dict[str, Any], dag_run: Any) -> str:
    """Manual runs: the form's name. Scheduled/asset runs: a new experiment per run, ``<name>-<stamp>``."""
    name = params.get("experiment") or raw["experiment"]
    if run_type_of(dag_run) in SCHEDULED_RUN_TYPES:
        return scheduled_name(str(raw["experiment"]), run_stamp(dag_run))
    return name


def trigger_overridable(dotted: str) -> bool:
    """Whether the trigger form may set config key ``dotted`` (see ``config.TRIGGER_OVERRIDABLE``)."""
    section, _, leaf = dotted.rpartition(".")
    return dotted in TRIGGER_OVERRIDABLE or (bool(leaf) and f"{section}.*" in TRIGGER_OVERRIDABLE)


def overrides_from(params: dict[str, Any], yaml_path: str | Path = "the DAG's YAML") -> dict[str, Any]:
    """Dotted config overrides of the trigger form. Raises ConfigError naming any key it may not set.

    ``params.overrides`` may use dotted keys or nested objects; both are flattened to
    leaf keys and checked against the allow-list, so a nested ``{"rewards": {...}}`` is
    refused like ``"rewards.function"``.
    """
    out: dict[str, Any] = {}
    for name, (dotted, _) in HYPERPARAMETERS.items():
        if params.get(name) is not None:
            out[dotted] = params[name]
    if params.get("epochs") is not None:
        out["epochs"] = params["epochs"]
    extra = params.get("overrides") or {}
    if not isinstance(extra, dict):
        raise ConfigError("params.overrides must be an object of dotted config keys, e.g. {\"algorithm.lr\": 0.0005}")
    out.update(flatten(extra))
    refused = sorted(key for key in out if not trigger_overridable(key))
    if refused:
        raise ConfigError(
            f"params.overrides: {', '.join(repr(k) for k in refused)} cannot be set from the trigger form, which "
            f"may only change hyperparameters ({', '.join(TRIGGER_OVERRIDABLE)}); it can only be changed in "
            f"{yaml_path} by whoever deploys the DAG"
        )
    return out


def dag_config(raw: dict[str, Any]) -> ExperimentConfig:
    """The DAG's own config: its YAML alone, defaults included (the base of the trigger form's bounds)."""
    return parse_config(raw, {"storage.uri": absolute_uri((raw.get("storage") or {}).get("uri", "file://.store"))})


def check_bounds(cfg: ExperimentConfig, own: ExperimentConfig, keys: set[str], params: dict[str, Any],
                 yaml_path: str | Path) -> None:
    """Refuse a run whose trigger form set ``keys`` beyond their bounds (``config.TRIGGER_BOUNDS``).

    Compares the run's parsed values (``epochs`` always, defaults included) against the bounds of the
    DAG's own config ``own``: the upper ones, and the lower ones of keys whose smaller values mean more
    work (``config.trigger_floors``). Raises ConfigError naming each key, its value, its bound and where the
    DAG's author sets it.
    """
    limits, floors = trigger_limits(own), trigger_floors(own)
    form_field = {dotted: name for name, (dotted, _) in HYPERPARAMETERS.items() if params.get(name) is not None}
    refused: list[str] = []
    over: list[str] = []
    under: list[str] = []
    for key in sorted(keys | {"epochs"}):
        if key not in TRIGGER_BOUNDS:
            refused.append(f"{key}: no bound is declared for it (config.TRIGGER_BOUNDS)")
            continue
        if key not in limits:
            continue  # a choice or a switch: its type bounds it
        value = value_at(cfg, key)
        limit, how = limits[key]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        shown = f"params.{form_field[key]} ({key})" if key in form_field else key
        if any(isinstance(v, (int, float)) and v > limit for v in values):
            refused.append(f"{shown}={value} exceeds its bound {limit:g} ({how})")
            over.append(key)
        elif key in floors and any(isinstance(v, (int, float)) and v < floors[key][0] for v in values):
            refused.append(f"{shown}={value} is below its bound {floors[key][0]:g} ({floors[key][1]}: a smaller "
                           f"value multiplies the work of the run)")
            under.append(key)
    if not refused:
        return
    where = [k for k in over if k != "epochs"]
    fix = (f" The DAG's author sets these bounds in {yaml_path}: trigger.bounds, e.g. "
           f"trigger: {{bounds: {{{where[0]}: N}}}}." if where else "")
    if "epochs" in over:
        fix += f" The DAG's epochs are set in {yaml_path} by whoever deploys it."
    if under:
        fix += f" A smaller {under[0]} is set in {yaml_path} by whoever deploys the DAG."
    raise ConfigError("the trigger form asks for more than this DAG allows: " + "; ".join(refused) + "." + fix)


# The trigger form's fields (``factory._params``); a run's conf may set nothing else.
FORM_FIELDS = ("experiment", "resume", "from_snapshot", "parent", "epochs", "overrides")


def check_known_params(params: dict[str, Any]) -> None:
    """Refuse conf keys the form does not have (a typo would otherwise be ignored), naming the likely one."""
    import difflib

    known = [*FORM_FIELDS, *HYPERPARAMETERS]
    unknown = sorted(key for key in params if key not in known)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"the run's conf has unknown key(s) {', '.join(hints)}; the form's keys are "
                          f"{', '.join(known)} (other hyperparameters go in 'overrides')")


def resolve(yaml_path: str | Path, params: dict[str, Any] | None, dag_run: Any = None,
            endpoint_url: str | None = None) -> ExperimentConfig:
    """The run's config. Raises ConfigError naming the bad key, or a key set beyond its bound."""
    params = dict(params or {})
    check_known_params(params)
    raw = read_yaml(yaml_path)
    overrides = overrides_from(params, yaml_path)
    asked = set(overrides)
    overrides["experiment"] = experiment_name(raw, params, dag_run)
    overrides["storage.uri"] = absolute_uri((raw.get("storage") or {}).get("uri", "file://.store"))
    if endpoint_url and not (raw.get("storage") or {}).get("endpoint_url"):
        overrides["storage.endpoint_url"] = endpoint_url
    cfg = parse_config(raw, overrides)
    check_bounds(cfg, dag_config(raw), asked, params, yaml_path)
    return cfg


def default_parent(raw: dict[str, Any]) -> str:
    """The experiment a ``resume=snapshot`` run starts from when the form names none: the YAML's
    ``schedule.parent`` (a retraining DAG's), else its own experiment."""
    schedule = raw.get("schedule") or {}
    return str((schedule.get("parent") if isinstance(schedule, dict) else None) or raw["experiment"])
