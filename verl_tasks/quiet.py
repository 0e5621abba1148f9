"""Quiet, single-threaded-BLAS defaults for a process verl-tasks owns (the CLI, a pool worker).

Never applied on import: Airflow's own components import the package. A setting the
user made wins.
"""
from __future__ import annotations

import os

OWN_PROCESS_DEFAULTS = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    # The reward sandbox forks after the tokenizer ran: without this, every child warns and disables it.
    "TOKENIZERS_PARALLELISM": "false",
    "GX_ANALYTICS_ENABLED": "False",
}


def quiet_own_process() -> None:
    """Set the defaults above in this process's environment (for the libraries it imports later)."""
    for key, value in OWN_PROCESS_DEFAULTS.items():
        os.environ.setdefault(key, value)
