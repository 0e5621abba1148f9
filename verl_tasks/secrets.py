"""Which environment variables hold secrets, and what a reward function's environment may hold.

Two rules, for two different boundaries:

- :func:`is_secret_name` is a deny-list by name, for what the project itself sends on
  (a Ray job's ``runtime_env``): cloud and service credentials (``AWS_*``, ``RAY_*`` such
  as ``RAY_AUTH_TOKEN``, ``HF_*`` / ``HUGGING_FACE_*``, Airflow connections and settings),
  and anything whose name says token, secret, password, credential or key. A deny-list
  misses names it has never heard of (``DATABASE_URL``, ``SENTRY_DSN``, a password inside
  ``MLFLOW_TRACKING_URI``), so it is never the rule for untrusted code.
- :func:`reward_env` is an allow-list, for the reward sandbox: a reward function sees the
  variables the sandbox sets (``REWARD_ENV_SET``), a few locale and determinism settings
  copied when the parent has them (``REWARD_ENV_COPIED``), and variables the operator names
  for reward functions on purpose with the ``VT_`` prefix (unless the name looks like a
  secret). Nothing else passes, whatever the parent's environment holds.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

SECRET_PREFIXES = ("AWS_", "RAY_", "HF_", "HUGGING_FACE_", "HUGGINGFACE_", "AIRFLOW_", "AIRFLOW__",
                   "AZURE_", "GOOGLE_", "GCP_", "OPENAI_", "ANTHROPIC_")
SECRET_WORDS = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|CREDENTIAL|(^|_)(API_)?KEY(_|$)|AUTH", re.IGNORECASE)

# Set by the sandbox itself (values chosen there: PATH, PYTHONPATH, HOME, TMPDIR ...).
REWARD_ENV_SET = ("PATH", "PYTHONPATH", "HOME", "TMPDIR", "PWD", "PYTHONHASHSEED", "PYTHONNOUSERSITE",
                  "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Copied from the parent when set there (the parent's value wins over the sandbox's default).
REWARD_ENV_COPIED = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONHASHSEED", "OMP_NUM_THREADS",
                     "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Operator settings meant for reward functions (fault injection in tests, feature switches).
REWARD_ENV_PREFIX = "VT_"


def is_secret_name(name: str) -> bool:
    """True for a variable that may carry a credential (see the module docstring)."""
    upper = name.upper()
    return upper.startswith(SECRET_PREFIXES) or bool(SECRET_WORDS.search(upper))


def reward_env(parent: Mapping[str, str], settings: Mapping[str, str]) -> dict[str, str]:
    """A reward function's environment: ``settings`` (names from ``REWARD_ENV_SET``), then what the
    allow-list copies from ``parent``. Nothing else of ``parent`` passes.

    Raises:
        ValueError: ``settings`` names a variable outside ``REWARD_ENV_SET``.
    """
    unknown = sorted(set(settings) - set(REWARD_ENV_SET))
    if unknown:
        raise ValueError(f"not settable in a reward function's environment: {', '.join(unknown)}")
    env = dict(settings)
    env.update({k: v for k, v in parent.items() if k in REWARD_ENV_COPIED})
    env.update({k: v for k, v in parent.items() if k.startswith(REWARD_ENV_PREFIX) and not is_secret_name(k)})
    return env


__all__ = ["is_secret_name", "reward_env", "REWARD_ENV_SET", "REWARD_ENV_COPIED", "REWARD_ENV_PREFIX"]
