"""The reward sandbox is bounded as a whole: children and its tmpfs folders count against one memory budget
(``rewards.memory_limit_mb``), not one each. The probe is the one that held about 1.75 GB under a 256 MB
limit when the limit applied per process."""
from __future__ import annotations

import pytest

from verl_tasks.rewards.sandbox import RewardSandbox

PROBE = "tests.sandbox_probes:hold_memory"
LIMIT_MB = 256
ATTACK = {"children": 6, "mb": 200, "tmp_mb": 200}  # 1.6 GB asked for, each part under the per-process limit


@pytest.mark.parametrize("isolation", ["namespaces", "process"])
def test_children_and_tmpfs_share_one_memory_budget(isolation, allow_process_isolation):
    sample = {"id": "s0", "data_source": "t", "solution_str": "", "ground_truth": "0", "extra_info": ATTACK}
    with RewardSandbox(PROBE, 60.0, LIMIT_MB, isolation=isolation, max_processes=32) as box:
        assert box.cgroup is not None and box.cgroup.bounds("memory"), "no memory cgroup could be made here"
        result = box.score([sample], default=-1.0)
    peak = box.peak_memory  # read as the sandbox closed (after the sample, or when it was killed for it)
    held = result.scores[0]
    print(f"{isolation}: children held {held:g} MB of {6 * 200} asked; the sandbox's peak {peak / 2**20:.0f} MB")
    assert peak is not None and peak <= (LIMIT_MB + 8) << 20  # the whole sandbox, whatever it started
    assert held < LIMIT_MB or held == -1.0, result  # its children never held more (or it was killed for trying)
