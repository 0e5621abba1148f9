"""The local Ray head's ``head.json`` names its pid *and* that pid's start time: after a reboot or an
OOM kill the pid may belong to another process, which must never be taken for the head nor signalled.
No Ray is started: a ``sleep`` in its own session stands in for the process that reused the pid."""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict

import psutil
import pytest

from verl_tasks.execution import local_head


@pytest.fixture
def sleeper():
    """An unrelated process leading its own process group, as the head does (``start_new_session``)."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _write_head_json(state, pid: int, started: int | None, *, legacy: bool = False) -> local_head.HeadInfo:
    """``head.json`` as :func:`local_head.launch` writes it; ``legacy``: as written before start times were."""
    info = local_head.HeadInfo(pid, "http://127.0.0.1:9", "127.0.0.1:9", str(state / "auth_token"), str(state),
                               str(state / "head.log"), started)
    fields = asdict(info)
    if legacy:
        fields.pop("started")
    (state / "head.json").write_text(json.dumps(fields, indent=1))
    return info


def _still_running(proc) -> bool:
    time.sleep(0.2)  # a signal sent would have ended `sleep` by now
    return proc.poll() is None


@pytest.mark.parametrize("legacy", [False, True], ids=["other-start-time", "no-start-time"])
def test_a_reused_pid_is_not_the_head_and_is_never_signalled(tmp_path, sleeper, legacy):
    state = local_head.private_dir(tmp_path / "ray-head")
    wrong = local_head.start_time(sleeper.pid) + 12345
    info = _write_head_json(state, sleeper.pid, wrong, legacy=legacy)
    assert not local_head._alive(info)
    assert local_head.read_info(state) is None
    assert not (state / "head.json").exists(), "a stale head.json is deleted"

    _write_head_json(state, sleeper.pid, wrong, legacy=legacy)
    stopped = local_head.stop(state, timeout_s=1)
    assert _still_running(sleeper), "stop signalled a process that is not the head"
    assert stopped is False
    assert not (state / "head.json").exists()


def test_the_recorded_head_is_recognised_and_stopped(tmp_path, sleeper):
    state = local_head.private_dir(tmp_path / "ray-head")
    info = _write_head_json(state, sleeper.pid, local_head.start_time(sleeper.pid))
    assert local_head._alive(info) and local_head.read_info(state) == info
    assert local_head.stop(state, timeout_s=5) is True
    assert sleeper.wait(timeout=5) is not None and not (state / "head.json").exists()


def test_start_time_reads_field_22_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    odd = tmp_path / "a) b (c"
    odd.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(odd), "60"])
    try:
        ticks = local_head.start_time(proc.pid)
        assert psutil.Process(proc.pid).name() == "a) b (c"
        seconds = psutil.boot_time() + ticks / os.sysconf("SC_CLK_TCK")
        assert abs(seconds - psutil.Process(proc.pid).create_time()) < 0.05
    finally:
        proc.kill()
        proc.wait()
    assert local_head.start_time(proc.pid) is None


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for its new parent to reap it)."""
    time.sleep(0.2)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("same_boot", [True, False], ids=["same-boot", "other-boot"])
def test_what_a_dead_leader_left_of_its_head_is_killed_only_within_its_boot(tmp_path, same_boot):
    """The head's leader was OOM-killed; gcs_server and raylet (here: a ``sleep`` in its group) live on
    and hold the ports. Within the boot the group id can only be theirs; after a reboot it may not be."""
    state = local_head.private_dir(tmp_path / "ray-head")
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    started = local_head.start_time(leader.pid)
    member = int(leader.stdout.readline())
    leader.wait()
    try:
        info = local_head.HeadInfo(leader.pid, "http://127.0.0.1:9", "127.0.0.1:9", str(state / "auth_token"),
                                   str(state), str(state / "head.log"), started,
                                   local_head.boot_id() if same_boot else "another-boot")
        (state / "head.json").write_text(json.dumps(asdict(info), indent=1))
        assert local_head.stop(state, timeout_s=1) is False  # the head itself was not running
        assert _running(member) != same_boot, "leftovers killed only within the head's boot"
        assert not (state / "head.json").exists()
    finally:
        try:
            os.kill(member, 9)
        except ProcessLookupError:
            pass
