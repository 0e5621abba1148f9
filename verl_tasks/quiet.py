"""Quiet, CPU-sharing defaults for a process verl-tasks owns (the CLI, a pool worker, a job's driver).

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
    # Torch's OpenMP threads spin after each parallel region unless told to sleep. Where several torch
    # processes share a node's cores (pool workers, a driver, the update on a CPU head) the spinning takes
    # the cores the others wait for (benchmarks/omp_wait.py measures both ways).
    # Read when torch loads, so it must be in the environment before the first import of torch.
    "OMP_WAIT_POLICY": "PASSIVE",
}


def quiet_own_process() -> None:
    """Set the defaults above in this process's environment (for the libraries it imports later)."""
    for key, value in OWN_PROCESS_DEFAULTS.items():
        os.environ.setdefault(key, value)
