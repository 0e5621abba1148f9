"""What the deployment allows the reward sandbox, read from the environment of the machine that runs it.

An experiment's author chooses the reward function and may ask for a sandbox setting; the people who
run the machines decide what may be asked. Each bound is an environment variable of the Airflow workers
and the Ray nodes (set it in their image or service definition), never part of an experiment:

``VERL_TASKS_REWARD_ISOLATIONS``
    the isolations experiments may ask for, comma-separated (default ``namespaces``). Add ``process``
    only on machines that cannot make namespaces and run nothing worth hiding from the reward code.
``VERL_TASKS_REWARD_MAX_MEMORY_MB``
    the largest ``rewards.memory_limit_mb`` (default 4096): the whole sandbox's memory.
``VERL_TASKS_REWARD_MAX_PROCESSES``
    the largest ``rewards.max_processes`` (default 256).
``VERL_TASKS_REWARD_MAX_TIMEOUT_S``
    the largest ``rewards.timeout_s`` and ``rewards.cpu_limit_s`` (default 300).

A setting beyond its bound is refused with a :class:`ConfigError` naming the key, the bound and the
variable that sets it, when the sandbox starts: in ``configure`` / ``verl-tasks run``'s preflight,
before any compute, and again on every node that scores. None of these settings is hashed: they
fence the function, they do not change what it computes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from verl_tasks.errors import ConfigError

ISOLATIONS_ENV = "VERL_TASKS_REWARD_ISOLATIONS"
MAX_MEMORY_ENV = "VERL_TASKS_REWARD_MAX_MEMORY_MB"
MAX_PROCESSES_ENV = "VERL_TASKS_REWARD_MAX_PROCESSES"
MAX_TIMEOUT_ENV = "VERL_TASKS_REWARD_MAX_TIMEOUT_S"


@dataclass(frozen=True)
class SandboxBounds:
    isolations: tuple[str, ...]
    max_memory_mb: int
    max_processes: int
    max_timeout_s: float


def _number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; set it to a positive number or unset it") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a positive, finite number")
    return value


def bounds() -> SandboxBounds:
    """This machine's bounds (see the module docstring)."""
    isolations = tuple(p.strip() for p in os.environ.get(ISOLATIONS_ENV, "namespaces").split(",") if p.strip())
    return SandboxBounds(isolations or ("namespaces",), int(_number(MAX_MEMORY_ENV, 4096)),
                         int(_number(MAX_PROCESSES_ENV, 256)), _number(MAX_TIMEOUT_ENV, 300.0))


def check_allowed(*, isolation: str, memory_limit_mb: int, max_processes: int, timeout_s: float,
                  cpu_limit_s: float | None) -> None:
    """Refuse sandbox settings beyond what this machine's deployment allows.

    Raises:
        ConfigError: naming the ``rewards.*`` key, its value, the bound and the variable that sets it.
    """
    allowed = bounds()
    if isolation not in allowed.isolations:
        raise ConfigError(
            f"rewards.isolation {isolation!r} is not allowed on this machine (allowed: "
            f"{', '.join(allowed.isolations)}); the deployment decides it: its operators may add it to "
            f"{ISOLATIONS_ENV} on the Airflow workers and Ray nodes, or remove rewards.isolation from the experiment")
    checks: list[tuple[str, Any, float, str]] = [
        ("memory_limit_mb", memory_limit_mb, allowed.max_memory_mb, MAX_MEMORY_ENV),
        ("max_processes", max_processes, allowed.max_processes, MAX_PROCESSES_ENV),
        ("timeout_s", timeout_s, allowed.max_timeout_s, MAX_TIMEOUT_ENV),
        ("cpu_limit_s", cpu_limit_s, allowed.max_timeout_s, MAX_TIMEOUT_ENV)]
    for key, value, bound, env in checks:
        if value is not None and value > bound:
            raise ConfigError(f"rewards.{key} is {value:g}, above this deployment's bound of {bound:g}; lower it, "
                              f"or have the operators raise {env} on the Airflow workers and Ray nodes")


__all__ = ["ISOLATIONS_ENV", "MAX_MEMORY_ENV", "MAX_PROCESSES_ENV", "MAX_TIMEOUT_ENV", "SandboxBounds", "bounds",
           "check_allowed"]
