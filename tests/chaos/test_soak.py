"""A shortened soak (benchmarks/soak.py runs the long one): 30 epochs of the tiny experiment on Ray pools with
three faults (a rollout worker SIGKILLed mid-batch, a unit failing once, a store write failing once) ends with
the weights of a fault-free run, and the resident pool worker's memory, open files and threads after the last
epoch have grown by at most 10% (or a few units: one reading each, and a shrink is fine) over their values
after epoch 10 (the first third is warm-up)."""
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
    # A measure that is slow to answer skips its epoch: the ends are the nearest epochs measured.
    assert grown["from_epoch"] >= min(WARM_EPOCH, EPOCHS // 3) and grown["to_epoch"] >= EPOCHS - 3, grown
    for key, slack in (("rss_mib", 32), ("fds", 8), ("threads", 4)):
        assert grown[key]["end"] <= max(1.1 * grown[key]["at"], grown[key]["at"] + slack), (key, grown[key])
