"""A shortened soak (benchmarks/soak.py runs the long one): 30 epochs of the tiny experiment on Ray pools with
three faults (a rollout worker SIGKILLed mid-batch, a unit failing once, a store write failing once) ends with
the weights of a fault-free run, and the resident pool worker's memory, open files and threads after the last
epoch are within 10% of their values after epoch 10 (the first third is warm-up)."""
from __future__ import annotations

import pytest

from benchmarks.soak import KINDS, WARM_EPOCH, growth, soak

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
EPOCHS, EVERY, SEED = 30, 9, 3


def test_thirty_epochs_with_three_faults_end_on_the_fault_free_weights_without_growing(tmp_path):
    import os

    import ray

    if ray.is_initialized():
        ray.shutdown()  # the soak starts and joins its own head
    saved = dict(os.environ)
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR", "RAY_ADDRESS", "PYTHONPATH"):
        os.environ.pop(key, None)
    try:
        result = soak(EPOCHS, EVERY, SEED, tmp_path)
    finally:  # the soak points this process at its own head and fault plan: undo it for the tests after
        os.environ.clear()
        os.environ.update(saved)
    print({k: v for k, v in result.items() if k != "per_epoch"})
    assert sorted(f["fault"] for f in result["faults"]) == sorted(KINDS), result["faults"]
    assert len(result["fired"]) + len(result["killed"]) >= 3, result  # every planned fault went off
    assert result["same_weights"], (result["soak_sha"], result["reference_sha"])
    grown = growth(result)
    assert grown["from_epoch"] == min(WARM_EPOCH, EPOCHS // 3) and grown["to_epoch"] == EPOCHS - 1, grown
    for key in ("rss_mib", "fds", "threads"):
        assert 0.9 <= grown[key]["ratio"] <= 1.1, (key, grown[key])
