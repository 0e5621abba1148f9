"""Which environment variables hold secrets: never sent to a Ray job, never seen by a reward function.

The rule is by name: cloud and service credentials (``AWS_*``, ``RAY_*`` such as
``RAY_AUTH_TOKEN``, ``HF_*`` / ``HUGGING_FACE_*``, Airflow connections and
settings), and anything whose name says token, secret, password, credential or key.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

SECRET_PREFIXES = ("AWS_", "RAY_", "HF_", "HUGGING_FACE_", "HUGGINGFACE_", "AIRFLOW_", "AIRFLOW__",
                   "AZURE_", "GOOGLE_", "GCP_", "OPENAI_", "ANTHROPIC_")
SECRET_WORDS = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|CREDENTIAL|(^|_)(API_)?KEY(_|$)|AUTH", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """True for a variable that may carry a credential (see the module docstring)."""
    upper = name.upper()
    return upper.startswith(SECRET_PREFIXES) or bool(SECRET_WORDS.search(upper))


def scrubbed_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without any variable :func:`is_secret_name` flags."""
    return {k: v for k, v in env.items() if not is_secret_name(k)}


__all__ = ["is_secret_name", "scrubbed_env"]
