"""verl-tasks: RL post-training of language models as idempotent, fault-tolerant tasks."""
import os as _os

# Quiet, reproducible library defaults; a user's explicit setting wins.
for _key, _value in {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "GX_ANALYTICS_ENABLED": "False",
    "HF_HUB_OFFLINE": "1",
    # numpy/scipy's own BLAS/OpenMP pools (Great Expectations imports them) at one thread: torch's pool is
    # set per unit from `torch_threads`; two runtimes' spinning threads made a torch step of the tiny model
    # 0.03 s -> 0.9-1.9 s on 2 busy cores (Ray sets the same for its workers).
    "OMP_NUM_THREADS": "1",
}.items():
    _os.environ.setdefault(_key, _value)

__version__ = "0.1.0"
