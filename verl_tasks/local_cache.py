"""The folder on each machine for what can be rebuilt from the store (warm starts, policies, handed-over
weights, run logs). A module of its own so that light paths (the CLI's answer from the store) name it
without importing torch."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("VERL_TASKS_CACHE", Path.home() / ".cache" / "verl-tasks"))
