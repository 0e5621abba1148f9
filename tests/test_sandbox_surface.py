"""What the reward sandbox shows and lets through: the one folder its module's import resolves through (not a
sibling portion of a namespace package), no part of /usr but the shared libraries, and no ptrace, mount,
namespace, key or BPF system call (a seccomp filter answers EPERM)."""
from __future__ import annotations

from verl_tasks.rewards.isolation import DENIED_SYSCALLS, seccomp_program
from verl_tasks.rewards.sandbox import RewardSandbox

PROBES = "tests.sandbox_probes"


def _score(function: str, extra_info: dict) -> tuple[float, dict]:
    with RewardSandbox(function, 10.0, 512) as box:
        result = box.score([{"id": "s0", "data_source": "t", "solution_str": "", "ground_truth": "0",
                             "extra_info": extra_info}], default=-1.0)
    return result.scores[0], result.failures


def test_debugging_mounting_and_namespace_calls_are_refused_inside():
    score, failures = _score(f"{PROBES}:forbidden_syscalls", {})
    assert (score, failures) == (1.0, {}), failures


def test_the_filter_lists_the_calls_the_docs_name():
    assert {"ptrace", "mount", "unshare", "setns", "bpf", "keyctl", "perf_event_open"} <= set(DENIED_SYSCALLS)
    assert seccomp_program() is not None and len(seccomp_program()) % 8 == 0  # whole BPF instructions


def test_only_the_shared_libraries_of_usr_are_shown():
    score, failures = _score(f"{PROBES}:visible_paths", {"paths": ["/usr/local", "/usr/share", "/usr/bin",
                                                                   "/usr/local/etc", "/usr/sbin"]})
    assert (score, failures) == (1.0, {}), failures


def test_a_sibling_portion_of_the_reward_modules_namespace_package_is_not_shown(tmp_path, monkeypatch):
    ours, theirs = tmp_path / "team_a", tmp_path / "team_b"
    (ours / "vtshared").mkdir(parents=True)
    (theirs / "vtshared").mkdir(parents=True)
    (ours / "vtshared" / "reward.py").write_text(
        "import os\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return 0.0 if os.path.exists(extra_info['theirs']) else 1.0\n")
    (theirs / "vtshared" / "secret.py").write_text("KEY = 'not yours'\n")
    monkeypatch.syspath_prepend(str(theirs))
    monkeypatch.syspath_prepend(str(ours))
    score, failures = _score("vtshared.reward:score", {"theirs": str(theirs / "vtshared" / "secret.py")})
    assert (score, failures) == (1.0, {}), failures
