"""The local Ray head's ``head.json`` names its pid *and* that pid's start time: after a reboot or an
OOM kill the pid may belong to another process, which must never be taken for the head nor signalled.
No Ray is started there: a ``sleep`` in its own session stands in for the process that reused the pid.

The head offers the machine's GPUs unless told a count: real heads, on this machine (no GPU) and on
"a machine with 2 GPUs" (a stand-in NVML library, which is all Ray's count reads), are asked what they offer.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT
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


@pytest.mark.parametrize("same_boot, uses_head_tmpdir", [(True, True), (False, True), (True, False)],
                         ids=["same-boot", "other-boot", "unrelated-group"])
def test_what_a_dead_leader_left_of_its_head_is_killed_only_when_it_is_the_heads(tmp_path, same_boot,
                                                                                  uses_head_tmpdir):
    """The head's leader was OOM-killed; gcs_server and raylet (here: a ``sleep`` naming the head's Ray temp
    folder, and a renamed worker that names nothing) live on and hold the ports: within the boot they are
    killed. After a reboot, or when no process of the group uses the head's temp folder (an unrelated
    group that got the id once the head was gone), nothing is signalled."""
    state = local_head.private_dir(tmp_path / "ray-head")
    tmpdir = tmp_path / "vt-ray-test"
    named = f"--temp-dir={tmpdir}" if uses_head_tmpdir else "--temp-dir=/elsewhere"
    stand_in = f"{sys.executable} -c 'import time; time.sleep(60)' {named}"  # gcs_server's command line names it
    leader = subprocess.Popen(["sh", "-c", f"{stand_in} & echo $!; sleep 61 & echo $!"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    started = local_head.start_time(leader.pid)
    members = [int(leader.stdout.readline()), int(leader.stdout.readline())]
    leader.wait()
    for pid in members:  # both exec'd: what they show is final
        while psutil.Process(pid).cmdline()[:1] in ([], ["sh"]):
            time.sleep(0.01)
    try:
        info = local_head.HeadInfo(leader.pid, "http://127.0.0.1:9", "127.0.0.1:9", str(state / "auth_token"),
                                   str(tmpdir), str(state / "head.log"), started,
                                   local_head.boot_id() if same_boot else "another-boot")
        (state / "head.json").write_text(json.dumps(asdict(info), indent=1))
        assert local_head.stop(state, timeout_s=1) is False  # the head itself was not running
        killed = same_boot and uses_head_tmpdir
        assert [_running(pid) for pid in members] == [not killed, not killed], (same_boot, uses_head_tmpdir)
        assert not (state / "head.json").exists()
    finally:
        for pid in members:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_a_planted_or_open_head_json_is_not_trusted_by_stop_or_env(tmp_path, sleeper):
    """stop and env check owner and mode as launch does: a head.json anyone may write names no group to kill."""
    state = local_head.private_dir(tmp_path / "ray-head")
    _write_head_json(state, sleeper.pid, local_head.start_time(sleeper.pid))
    os.chmod(state / "head.json", 0o666)
    with pytest.raises(local_head.UnsafeStateDir, match="not this user's own private file"):
        local_head.stop(state, timeout_s=1)
    assert _still_running(sleeper)
    assert local_head.main(["env", "--state-dir", str(state)]) == 2
    os.chmod(state / "head.json", 0o600)
    os.chmod(state, 0o755)
    assert local_head.main(["stop", "--state-dir", str(state)]) == 2
    assert _still_running(sleeper)


# What a machine with $STAND_IN_GPUS NVIDIA GPUs answers to the NVML calls Ray's GPU count makes;
# nothing else (an unknown symbol is NVML's "function not found", which Ray's callers handle).
STAND_IN_NVML = r"""
#include <stdlib.h>
#include <string.h>
int nvmlInit_v2(void) { return 0; }
int nvmlInitWithFlags(unsigned int flags) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = atoi(getenv("STAND_IN_GPUS")); return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **handle) { *handle = (void *)(size_t)(i + 1); return 0; }
int nvmlDeviceGetName(void *handle, char *name, unsigned int length) { strncpy(name, "NVIDIA H200", length); return 0; }
const char *nvmlErrorString(int result) { return "unsupported by the stand-in NVML"; }
"""


@pytest.fixture(scope="module")
def two_gpu_machine(tmp_path_factory) -> dict[str, str]:
    """The environment under which a process sees a machine with 2 GPUs through NVML (a stand-in
    ``libnvidia-ml.so.1`` first on the library path); CUDA itself stays absent."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in NVML library")
    folder = tmp_path_factory.mktemp("nvml")
    (folder / "nvml.c").write_text(STAND_IN_NVML)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "libnvidia-ml.so.1"), str(folder / "nvml.c")],
                   check=True)
    return {"LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(folder), os.environ.get("LD_LIBRARY_PATH")) if p),
            "STAND_IN_GPUS": "2"}


@pytest.mark.parametrize("machine, env, offered", [
    ("this", {}, 0),
    ("two-gpus", {"CUDA_VISIBLE_DEVICES": "1"}, 1),  # how a user narrows the head of `verl-tasks run --backend ray`
], ids=["this-machine", "two-gpu-machine-one-visible"])
def test_the_head_offers_the_machines_gpus(machine, env, offered, tmp_path, request, caplog):
    """``start`` without a count, as ``verl-tasks run --backend ray`` starts its own head (the whole
    2-GPU machine: :func:`test_backend_ray_refuses_gpus_its_own_head_does_not_offer`)."""
    from tests.test_pools import join_loopback_head
    from verl_tasks.execution.cli_cluster import _free_ports

    if machine == "this" and Path("/proc/driver/nvidia").exists():
        pytest.skip("this machine has an NVIDIA driver: the stand-in machine checks the count")
    state = local_head.private_dir(tmp_path / "ray-head")
    port, dashboard = _free_ports()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**(request.getfixturevalue("two_gpu_machine") if machine == "two-gpus" else {}),
                           **env}.items():
            mp.setenv(key, value)
        umask = os.umask(0o002)  # a desktop user's usual umask: group-writable files by default
        try:
            info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=1, dashboard=False)
        finally:
            os.umask(umask)
        try:
            assert os.lstat(state / "head.json").st_mode & 0o777 == 0o600  # check_private accepts it
            assert local_head.read_info(state) == info
            join_loopback_head(mp, info)
            with caplog.at_level("INFO", logger=local_head.__name__):
                resources = local_head.wait_for_node(info)
            # Its Ray temp folder is a fresh one of ours under an unpredictable name (nobody can make it first;
            # Ray itself opens its mode once it runs there), and its processes are recognised by it.
            tmp = os.lstat(info.tmpdir)
            assert tmp.st_uid == os.getuid() and Path(info.tmpdir).name != f"vt-ray-{port}", info.tmpdir
            members = local_head.head_members(info)
            assert len(members) >= 2 and info.pid in members, members  # the leader, gcs_server, raylet, ...
        finally:
            local_head.stop(state, timeout_s=0)
    assert resources.get("GPU", 0) == offered, resources
    assert f"offers 1 CPUs and {offered} GPUs" in caplog.text
    assert not local_head.head_members(info)
    assert (state / "ray_tmpdir").read_text() == info.tmpdir  # kept for a restart of this head


def test_an_explicit_gpu_count_is_offered_as_given(two_gpu_machine, tmp_path):
    """``python -m verl_tasks.execution.local_head start --num-gpus 3`` (``make airflow``/``make demo`` start it
    so) on the 2-GPU machine: the head offers 3 logical GPUs and says so."""
    from verl_tasks.execution.cli_cluster import _free_ports

    state = tmp_path / "ray-head"
    port, dashboard = _free_ports()
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env.update(two_gpu_machine)
    head = [sys.executable, "-m", "verl_tasks.execution.local_head"]
    try:
        started = subprocess.run([*head, "start", "--state-dir", str(state), "--port", str(port), "--dashboard-port",
                                  str(dashboard), "--num-cpus", "1", "--num-gpus", "3"],
                                 env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    finally:
        subprocess.run([*head, "stop", "--state-dir", str(state)], env=env, cwd=ROOT, capture_output=True, timeout=60)
    assert started.returncode == 0, started.stderr
    assert "offers 1 CPUs and 3 GPUs" in started.stderr, started.stderr


def test_backend_ray_refuses_gpus_its_own_head_does_not_offer(two_gpu_machine, tmp_path):
    """``verl-tasks run --backend ray`` on the 2-GPU machine, its rollout asking for 4: the head it starts
    offers the machine's 2 GPUs, and the run stops at once, naming the setting, instead of waiting forever
    for a worker Ray cannot place."""
    from tests.conftest import small_overrides, write_yaml

    yaml_path = write_yaml(tmp_path, small_overrides(epochs=1, **{"resources.rollout.num_gpus": 4}))
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env.update(two_gpu_machine, COLUMNS="1000")
    run = subprocess.Popen([sys.executable, "-m", "verl_tasks.cli", "run", str(yaml_path), "--store",
                            f"file://{tmp_path}/store", "--backend", "ray"],
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = run.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        run.terminate()  # the CLI stops its own head on SIGTERM
        out = run.communicate(timeout=60)[0] + "\n(still running after 120 s: stopped)"
    said = " ".join(out.split())
    assert run.returncode == 2, said[-3000:]
    assert "CPUs and 2 GPUs" in said, said
    assert "resources.rollout.num_gpus: 4, but the local Ray head offers 2 GPUs" in said, said


@pytest.fixture
def dashboard_answering():
    """A stand-in for a Ray dashboard that answers every request with one HTTP status; yields a setter."""
    import http.server
    import threading

    answer = {"status": 401}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(answer["status"])
            self.end_headers()
            self.wfile.write(b"refused by the stand-in")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answer
    server.shutdown()
    server.server_close()


def test_a_refused_token_is_raised_at_once_and_other_errors_are_said_at_warning(tmp_path, sleeper, monkeypatch,
                                                                               dashboard_answering, caplog):
    """Start-up waits out a head that is still starting, not a dashboard that refuses the head's token
    (another head on the port): that is raised at once, long before the deadline, naming the token file."""
    import logging

    from verl_tasks.execution.ray_jobs import RayUnavailable

    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    address, answer = dashboard_answering
    state = local_head.private_dir(tmp_path / "ray-head")
    local_head.ensure_token(state / "auth_token")
    info = local_head.HeadInfo(sleeper.pid, address, "127.0.0.1:9", str(state / "auth_token"), str(state),
                               str(state / "head.log"), local_head.start_time(sleeper.pid))
    with pytest.raises(RayUnavailable, match="refused the token in .*auth_token: is another Ray head using"):
        local_head._ready(info, timeout_s=600)  # a retry would wait all of it and raise TimeoutError
    answer["status"] = 404  # neither a refused token nor a head still starting: tried again, said at WARNING
    with caplog.at_level(logging.WARNING, logger="verl_tasks.execution.local_head"), \
            pytest.raises(TimeoutError, match="not ready after 3s: .*404"):
        local_head._ready(info, timeout_s=3)
    warnings = [r for r in caplog.records if r.name == "verl_tasks.execution.local_head"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, warnings  # once: the error did not change
    assert "not ready yet" in warnings[0].getMessage() and "404" in warnings[0].getMessage()


def test_env_output_is_shell_quoted_for_eval(tmp_path, sleeper, capsys):
    """``local_head env`` lines are ``eval``-ed by scripts: a path with spaces, quotes or ``$(...)`` stays one
    literal value and runs nothing."""
    state = local_head.private_dir(tmp_path / "ray head's $(touch pwned) `state`")
    _write_head_json(state, sleeper.pid, local_head.start_time(sleeper.pid))
    assert local_head.main(["env", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    script = out + 'printf "%s\\n" "$RAY_AUTH_TOKEN_PATH" "$RAY_TMPDIR"\n'
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [str(state / "auth_token"), str(state)]
    assert not (tmp_path / "pwned").exists()


def test_a_head_that_exits_during_start_up_is_started_again(tmp_path, monkeypatch, caplog):
    """On a busy machine ``ray start`` gives up when its raylet takes over 30 s to register, after its GCS already
    listens. Injected here: the first head's process group is SIGKILLed as soon as it is launched. ``start``
    sees it exit, starts the head again and returns only once that one's node registered."""
    import signal

    from verl_tasks.execution.cli_cluster import _free_ports

    state = local_head.private_dir(tmp_path / "ray-head")
    port, dashboard = _free_ports()
    real_launch, launched = local_head.launch, []

    def launch_then_kill_the_first(*args, **kwargs):
        info = real_launch(*args, **kwargs)
        launched.append(info.pid)
        if len(launched) == 1:
            os.killpg(info.pid, signal.SIGKILL)
        return info

    monkeypatch.setattr(local_head, "launch", launch_then_kill_the_first)
    with caplog.at_level("WARNING", logger=local_head.__name__):
        try:
            info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=1, dashboard=False)
            assert local_head.read_info(state) == info and info.pid == launched[-1] != launched[0]
            assert local_head.RUNTIME_STARTED.decode() in Path(info.log_file).read_text()
            assert info.pid in local_head.head_members(info)
        finally:
            local_head.stop(state, timeout_s=0)
    assert len(launched) == 2, launched
    assert "exited during start-up (attempt 1 of 3" in caplog.text


def _group_of(pgid: int) -> dict[int, str]:
    """Live (not zombie) processes of process group ``pgid``: pid -> the first word of the command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
    return found


def test_a_stopped_head_leaves_none_of_its_processes_behind_its_node_agents_included(tmp_path):
    """The node's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) name no temp folder: when ``ray
    start``, SIGTERMed and then SIGKILLed (``stop(timeout_s=0)``), had already stopped gcs_server and raylet
    before ``stop`` looked at the group, the group was no longer recognisable as the head's and the agents lived
    on for minutes, holding memory and CPU (2 of 4 stops measured on this machine). ``stop`` kills what it saw
    of the head before it signalled it."""
    from verl_tasks.execution.cli_cluster import _free_ports

    state = local_head.private_dir(tmp_path / "ray-head")
    port, dashboard = _free_ports()
    info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=1, dashboard=False)
    try:
        deadline, seen = time.monotonic() + 120, {}
        while time.monotonic() < deadline and not any(n.startswith("ray::RuntimeEnvAgent") for n in seen.values()):
            seen = _group_of(info.pid)
            time.sleep(0.2)
        assert any(name.startswith("ray::DashboardAgent") for name in seen.values()), seen
        time.sleep(3)  # a head at rest, as a test's or a run's head is when it is stopped
    finally:
        local_head.stop(state, timeout_s=0)
    deadline, left = time.monotonic() + 10, _group_of(info.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _group_of(info.pid)
    assert left == {}, f"the stopped head left {left}"
