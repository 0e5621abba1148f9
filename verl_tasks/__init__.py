"""verl-tasks: RL post-training of language models as idempotent, fault-tolerant tasks."""
import os as _os

# Quiet, reproducible library defaults; a user's explicit setting wins.
for _key, _value in {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "GX_ANALYTICS_ENABLED": "False",
    "HF_HUB_OFFLINE": "1",
}.items():
    _os.environ.setdefault(_key, _value)

__version__ = "0.1.0"
