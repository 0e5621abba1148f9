"""Start and stop a project-local Ray head that never touches other Ray processes.

    python -m verl_tasks.execution.local_head start [--state-dir .ray-head] [--port 6399] [--dashboard-port 8275]
                                                    [--num-gpus N]
    python -m verl_tasks.execution.local_head stop  [--state-dir .ray-head]
    python -m verl_tasks.execution.local_head env   [--state-dir .ray-head]   # shell exports for clients and drivers

The head runs ``ray start --head --block`` under ``setsid`` with its own
``RAY_TMPDIR`` and its own token file (token authentication stays on), created 0600
from the start in a state directory created 0700. Its PID and the kernel's start
time of that PID are recorded in the state directory (``head.json``); ``stop`` sends
SIGTERM to that process group leader and waits. A PID whose start time differs (the
head died, e.g. a reboot or an OOM kill, and the PID went to another process) is not
the head: it is never signalled, and its ``head.json`` is deleted. ``ray stop`` is
never used: it kills every Ray process on the machine by name.

The head offers the machine's GPUs unless told a count: Ray counts them itself (through NVML,
without initialising CUDA, and no more than ``CUDA_VISIBLE_DEVICES`` lists), as ``ray start``
does on every node of a real cluster. An explicit count is offered as given: on a machine
without CUDA those are logical GPUs, which Ray still places actors on (tests use them).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_tasks.quiet import OWN_PROCESS_DEFAULTS

log = logging.getLogger(__name__)
# Logical CPUs the head offers: every phase pool of an experiment (1 CPU per worker by default)
# stays resident at once on a small machine; Ray's CPU resource is a placement count, not a limit.
LOGICAL_CPUS = 8
START_ATTEMPTS = 3  # a head that exits during start-up (a raylet slow to register on a busy machine) is started again
RUNTIME_STARTED = b"Ray runtime started."  # what `ray start` prints once its node registered


class HeadExited(RuntimeError):
    """The head's process ended before the head was ready."""


@dataclass
class HeadInfo:
    pid: int
    address: str
    gcs_address: str
    token_file: str
    tmpdir: str
    log_file: str
    started: int | None = None  # start time of ``pid`` (clock ticks after boot, /proc/<pid>/stat field 22)
    boot_id: str | None = None  # the boot it started in: its process group id means nothing after a reboot

    def client_env(self) -> dict[str, str]:
        """Environment a client (Airflow worker, triggerer, test) needs to use this head."""
        return {"VERL_TASKS_RAY_ADDRESS": self.address, "RAY_AUTH_TOKEN_PATH": self.token_file}

    def driver_env(self) -> dict[str, str]:
        """What a Ray driver joining this loopback head also needs (the ``ray-driver`` backend).

        Ray reads the last three when it is imported: set them before.
        """
        return {"VERL_TASKS_RAY_GCS_ADDRESS": self.gcs_address, "RAY_AUTH_MODE": "token",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": self.tmpdir}


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, field 22 of ``/proc/<pid>/stat``), or None
    when there is no such process. Read after the ``)`` that ends the command name, which may hold
    spaces and parentheses itself."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(stat_line.rpartition(")")[2].split()[19])  # fields 3.. follow the ")": field 22 is [19]


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 first), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def _uses_tmpdir(pid: int, tmpdir: str) -> bool:
    """Whether process ``pid`` is one of a head's: its environment's RAY_TMPDIR, or its command line, names
    the head's own Ray temp folder (every Ray process of the head inherits the one, or is given the other)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return f"RAY_TMPDIR={tmpdir}".encode() in environ or tmpdir.encode() in cmdline


def head_members(info: HeadInfo) -> list[int]:
    """The live processes of the head's process group, when that group is the head's; else none.

    A group id alone proves nothing: once every process of the head is gone, the kernel may give its
    id to an unrelated process, whose orphans then carry it. While any process of the head lives, it
    cannot. So the group's members (this user's, started no earlier than the head's leader) count as
    the head's only when one of them visibly uses the head's Ray temp folder (gcs_server and raylet
    name it on their command lines; workers rename themselves, ``ray::...``, and show nothing)."""
    group = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        fields = _stat_fields(pid)
        # pgid is field 5 ([2] here), the start time field 22 ([19]); a zombie (state Z) holds nothing.
        if fields is None or fields[0] == "Z" or int(fields[2]) != info.pid:
            continue
        if info.started is not None and int(fields[19]) < info.started:
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        group.append(pid)
    return group if any(_uses_tmpdir(pid, info.tmpdir) for pid in group) else []


def _kill_members(info: HeadInfo, known: dict[int, int] | None = None, settle_s: float = 5.0) -> None:
    """SIGKILL the head's members until none is left (a raylet may still spawn a worker meanwhile) or
    ``settle_s`` has passed: the ports are free once this returns.

    ``known`` (pid -> start time) are members seen while the head still ran: once gcs_server and raylet are
    gone, :func:`head_members` no longer recognises the group, and the node's agents (DashboardAgent,
    RuntimeEnvAgent), renamed like workers, would outlive their head for minutes. Each is killed only while
    its pid is still the process that started then."""
    deadline = time.monotonic() + settle_s
    while members := sorted(set(head_members(info)) | {pid for pid, started in (known or {}).items()
                                                      if _still(pid, started)}):
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > deadline:
            log.warning("processes %s of the Ray head %d outlived SIGKILL for %gs", members, info.pid, settle_s)
            return
        time.sleep(0.05)


def _still(pid: int, started: int) -> bool:
    """Whether ``pid`` is still the live (not zombie) process that started at ``started``."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == started


def _kill_leftovers(info: HeadInfo) -> None:
    """SIGKILL what is left of a head whose leader died (gcs_server, raylet, dashboard still holding its
    ports): the members of its process group that :func:`head_members` recognises, within the head's
    boot and only while no process holds the leader's pid. After a reboot nothing is signalled."""
    if info.boot_id is None or info.boot_id != boot_id() or start_time(info.pid) is not None:
        return
    _kill_members(info)


def _alive(info: HeadInfo) -> bool:
    """Whether the head ``info`` names still runs: its pid is alive *and* started when the head did.

    A pid alone proves nothing once the head is gone (a reboot, an OOM kill): the kernel hands
    it to another process. A ``head.json`` written before start times were recorded proves
    only a pid, so it counts as not alive: see :func:`_forget`.
    """
    pid = info.pid
    try:  # a head this process started and that exited is a zombie until reaped: its /proc entry stays
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:  # not our child
        pass
    return info.started is not None and start_time(pid) == info.started  # None: no such process


def _forget(path: Path, info: HeadInfo) -> None:
    """Delete the ``head.json`` of a head that no longer runs; the pid it names is never signalled.

    One written before start times were recorded, whose pid is taken, counts as stale too: a pid
    (even with a Ray command line: another checkout's head has the same one) cannot tell our head
    from a process that reused it, and a wrong guess would SIGKILL someone else's process group.
    """
    if info.started is None and start_time(info.pid) is not None:
        log.warning("%s names pid %d without its start time (written by an older verl-tasks): not treating that "
                    "process as the Ray head. If it is a head left running from before the upgrade, stop it by "
                    "hand (kill -TERM -- -%d) before starting a new one", path, info.pid, info.pid)
    path.unlink(missing_ok=True)


def _read(path: Path) -> HeadInfo:
    return HeadInfo(**json.loads(path.read_text()))


def read_info(state_dir: Path) -> HeadInfo | None:
    """The running head recorded in ``state_dir``, or None; a ``head.json`` of a head that no longer
    runs (its pid gone or now another process's) is deleted.

    Raises:
        UnsafeStateDir: the folder or its ``head.json`` is not this user's own, private one.
    """
    path = Path(state_dir) / "head.json"
    if not path.is_file():
        return None
    check_private(Path(state_dir), path)
    info = _read(path)
    if _alive(info):
        return info
    _forget(path, info)
    return None


class UnsafeStateDir(RuntimeError):
    """The state folder or the token in it is open to other users (the token admits to the cluster)."""


def private_dir(path: Path) -> Path:
    """The state folder, created 0700; an existing one must already be closed to group and others."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        mode = os.lstat(path).st_mode
        if not stat.S_ISDIR(mode) or mode & 0o077:
            raise UnsafeStateDir(f"ray head state folder {path} is not a private directory (mode {oct(mode & 0o777)}); "
                                 f"run `chmod 700 {path}` or pass another --state-dir") from None
    return path


def check_private(state_dir: Path, head_json: Path) -> None:
    """What ``launch`` makes sure of, checked wherever a ``head.json`` is trusted (start, stop, env): the
    state folder and the file are this user's, and nobody else may write them (a planted ``head.json``
    would name a process group to signal)."""
    uid = os.getuid()
    for path, kind in ((state_dir, stat.S_ISDIR), (head_json, stat.S_ISREG)):
        info = os.lstat(path)
        if not kind(info.st_mode) or info.st_uid != uid or info.st_mode & 0o022 or (
                path == state_dir and info.st_mode & 0o077):
            raise UnsafeStateDir(f"{path} is not this user's own private {'folder' if path == state_dir else 'file'} "
                                 f"(owner uid {info.st_uid}, mode {oct(info.st_mode & 0o777)}): not trusted to name a "
                                 f"Ray head; check who wrote it, or pass another --state-dir")


def ensure_token(path: Path) -> Path:
    """A fresh random token, 0600 from the moment the file exists (O_EXCL: a planted file or link is
    never written through); an existing token is kept only if nobody else can read it."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode) or mode & 0o077:
            raise UnsafeStateDir(f"ray token {path} is readable by others or not a plain file "
                                 f"(mode {oct(mode & 0o777)}); delete it and start again to get a new one") from None
        return path
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    return path


def _caused_by(err: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``err``, or an error it was raised from or while handling, is a ``kind``."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _ready(info: HeadInfo, timeout_s: float) -> None:
    """Wait until the head's Jobs API answers with the head's token.

    A refused connection or an HTTP 5xx is the head still starting: tried again, quietly. A refused
    token is not (another head answering on the dashboard port, or another token file): waiting
    cannot change it, so it is raised at once. Any other error is tried again too, and said at
    WARNING each time it changes.
    """
    from ray.exceptions import AuthenticationError

    from verl_tasks.execution.ray_jobs import RayJobBackend, RayTarget, RayUnavailable, is_transient, read_token

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not _alive(info):
            raise HeadExited(f"ray head exited during start-up; see {info.log_file}")
        try:
            RayJobBackend(RayTarget(info.address, read_token(info.token_file))).client.list_jobs()
            return
        except Exception as err:  # noqa: BLE001 - sorted below: a refused token, the head starting, anything else
            if _caused_by(err, AuthenticationError):
                raise RayUnavailable(
                    f"the Ray dashboard at {info.address} refused the token in {info.token_file}: is another Ray "
                    f"head using that port? ({err})") from err
            if not is_transient(err) and str(err) != str(last):
                log.warning("ray head at %s not ready yet (trying again until %gs have passed): %s: %s",
                            info.address, timeout_s, type(err).__name__, err)
            last = err
            time.sleep(0.5)
    raise TimeoutError(f"ray head at {info.address} not ready after {timeout_s}s: {last}")


def _gcs_listening(info: HeadInfo, timeout_s: float) -> None:
    host, port = info.gcs_address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(info):
            raise HeadExited(f"ray head exited during start-up; see {info.log_file}")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"ray head's GCS at {info.gcs_address} not listening after {timeout_s}s; see {info.log_file}")


def start(state_dir: Path, *, port: int = 6399, dashboard_port: int = 8275, num_cpus: int = LOGICAL_CPUS,
          num_gpus: int | None = None, resources: dict[str, float] | None = None, cwd: Path | None = None,
          timeout_s: float = 90, dashboard: bool = True) -> HeadInfo:
    """Start the head (or return the running one) and wait until its Jobs API answers.

    Workers start in ``cwd`` (default: the state folder), where relative paths resolve.
    ``num_gpus``: None offers the machine's GPUs (Ray counts them); a number is offered as
    given (logical GPUs on a machine without CUDA: Ray still places actors that reserve them
    and sets their ``CUDA_VISIBLE_DEVICES``). ``resources``: custom resources the node offers.
    ``dashboard=False`` (a head only drivers use, e.g. ``verl-tasks run --backend ray``) starts
    without the dashboard and its Jobs API, about half the start-up on 2 cores; it is then
    ready when its GCS port accepts connections (see :func:`wait_for_node` for a driver).
    """
    running = read_info(Path(state_dir).resolve()) if Path(state_dir).is_dir() else None
    attempt = 0
    while True:
        attempt += 1
        log_file = Path(state_dir) / "head.log"
        offset = log_file.stat().st_size if log_file.exists() else 0
        info = launch(state_dir, port=port, dashboard_port=dashboard_port, num_cpus=num_cpus, num_gpus=num_gpus,
                      resources=resources, cwd=cwd, dashboard=dashboard)
        try:
            _ready(info, timeout_s) if dashboard else _gcs_listening(info, timeout_s)
            if running is None:
                _runtime_started(info, offset, timeout_s)
        except HeadExited:
            stop(state_dir)
            if attempt == START_ATTEMPTS:
                raise
            log.warning("the Ray head exited during start-up (attempt %d of %d; on a busy machine its raylet can miss "
                        "Ray's 30 s to register, see %s); starting it again", attempt, START_ATTEMPTS, info.log_file)
        except Exception:
            stop(state_dir)
            raise
        else:
            return info


def _runtime_started(info: HeadInfo, offset: int, timeout_s: float) -> None:
    """Until ``ray start`` says its node registered (its log, past ``offset``). The GCS listens before the raylet
    registers, and ``ray start`` gives up when that takes longer than 30 s, so a head can still exit here."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(info.log_file, "rb") as log_text:
            log_text.seek(offset)
            if RUNTIME_STARTED in log_text.read():
                return
        if not _alive(info):
            raise HeadExited(f"ray head exited during start-up; see {info.log_file}")
        time.sleep(0.2)
    raise TimeoutError(f"ray head at {info.gcs_address} did not finish starting in {timeout_s}s; see {info.log_file}")


def launch(state_dir: Path, *, port: int = 6399, dashboard_port: int = 8275, num_cpus: int = LOGICAL_CPUS,
           num_gpus: int | None = None, resources: dict[str, float] | None = None, cwd: Path | None = None,
           dashboard: bool = True) -> HeadInfo:
    """Spawn the head (or find the running one) and return at once: the caller works while it boots."""
    state_dir = private_dir(Path(state_dir).resolve())
    running = read_info(state_dir)
    if running:
        return running
    token_file = ensure_token(state_dir / "auth_token")
    tmpdir = _ray_tmpdir(state_dir, port)
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "RAY_TMPDIR": str(tmpdir),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_file),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    for key, value in OWN_PROCESS_DEFAULTS.items():  # every worker and driver of the head inherits them
        env.setdefault(key, value)
    env.pop("RAY_ADDRESS", None)
    log_file = state_dir / "head.log"
    cmd = [
        str(Path(bin_dir) / "ray"), "start", "--head", "--block", f"--num-cpus={num_cpus}",
        f"--port={port}", f"--dashboard-port={dashboard_port}", "--dashboard-host=127.0.0.1",
        "--node-ip-address=127.0.0.1", f"--include-dashboard={str(dashboard).lower()}", "--disable-usage-stats",
        f"--temp-dir={tmpdir}",
        # Every fixed port derives from the two given ones, so two project heads (demo + tests) coexist.
        f"--dashboard-agent-listen-port={dashboard_port + 1}", f"--dashboard-agent-grpc-port={dashboard_port + 2}",
        f"--metrics-export-port={dashboard_port + 3}", f"--runtime-env-agent-port={dashboard_port + 4}",
        f"--ray-client-server-port={port + 1}",
    ]
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    if not dashboard:
        # A head only drivers use needs no autoscaler monitor, and no log monitor (its drivers take each
        # unit's log lines from the unit's result, never from Ray's log stream): two Python processes
        # fewer competing with the node's start-up on a small machine.
        cmd += ["--no-monitor", "--include-log-monitor=false"]
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=str(cwd or state_dir))
    info = HeadInfo(proc.pid, f"http://127.0.0.1:{dashboard_port}", f"127.0.0.1:{port}", str(token_file),
                    str(tmpdir), str(log_file), start_time(proc.pid), boot_id())
    # 0600 from creation, whatever the umask: check_private refuses a head.json others could write.
    fd = os.open(state_dir / "head.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(asdict(info), indent=1))
    return info


def _ray_tmpdir(state_dir: Path, port: int) -> Path:
    """The head's Ray temp folder: under /tmp (Unix socket paths must stay short), made by ``mkdtemp`` under
    an unpredictable name, so never one another user made first. Recorded in the (private) state folder
    and kept: a restarted head, and drivers that joined the old one, find the same folder."""
    pointer = state_dir / "ray_tmpdir"
    if pointer.is_file():
        folder = Path(pointer.read_text().strip())
        try:
            ours = folder.is_dir() and not folder.is_symlink() and folder.stat().st_uid == os.getuid()
        except OSError:
            ours = False
        if ours and folder.name.startswith("vt-ray-"):
            return folder
    folder = Path(tempfile.mkdtemp(prefix=f"vt-ray-{port}-", dir="/tmp"))
    pointer.write_text(str(folder))
    return folder


def wait_for_node(info: HeadInfo, timeout_s: float = 90) -> dict[str, float]:
    """Until the head's node is alive in its GCS, checked every 0.1 s: ``ray.init`` on a head still
    starting finds no node and sleeps a whole second per try. Needs the head's token in this process's
    environment (``client_env``/``driver_env``), as a driver does.

    Returns:
        What the head's node offers (``CPU``, ``GPU`` when it has any, custom resources, ...),
        also logged: a GPU pool waits forever on a head that offers no GPUs.
    """
    # Both exist at run time: _raylet.pyi omits the compiled GcsClient; protobuf makes gcs_pb2's names at import.
    from ray._raylet import GcsClient  # type: ignore[attr-defined]
    from ray.core.generated.gcs_pb2 import GcsNodeInfo  # type: ignore[attr-defined]
    from ray.exceptions import RpcError

    deadline = time.monotonic() + timeout_s
    _gcs_listening(info, timeout_s)
    client = None
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if not _alive(info):
            raise HeadExited(f"ray head exited during start-up; see {info.log_file}")
        try:
            client = client or GcsClient(address=info.gcs_address)
            nodes = client.get_all_node_info(timeout=5, state_filter=GcsNodeInfo.GcsNodeState.ALIVE).values()
        except RpcError as err:  # a GCS still starting, or slow on a busy machine: asked again until the deadline
            last_error = err
            log.debug("ray head at %s not answering yet: %s", info.gcs_address, err)
            time.sleep(0.5)
            continue
        head = next((node for node in nodes if node.is_head_node), None)
        if head is not None:
            offered = dict(head.resources_total)
            log.info("ray head at %s offers %g CPUs and %g GPUs", info.gcs_address, offered.get("CPU", 0),
                     offered.get("GPU", 0))
            return offered
        time.sleep(0.1)
    raise TimeoutError(f"ray head at {info.gcs_address} has no live node after {timeout_s}s"
                       f"{f' (last answer: {last_error})' if last_error else ''}; see {info.log_file}")


def stop(state_dir: Path, timeout_s: float = 30) -> bool:
    """SIGTERM the recorded head, wait up to ``timeout_s``, then SIGKILL what is left of it
    (:func:`head_members`: its group's processes that use its Ray temp folder). True if it ran.

    Only a head that :func:`_alive` recognises (pid and start time) is signalled: a recorded pid
    that is now another process's is left alone, and so is its process group (after a reboot that
    group id may be a daemon's session). A leader that died leaves its group to
    :func:`_kill_leftovers`. The stale ``head.json`` is deleted either way.

    Raises:
        UnsafeStateDir: the state folder or ``head.json`` is not this user's own, private one.
    """
    path = Path(state_dir) / "head.json"
    if not path.is_file():
        return False
    check_private(Path(state_dir), path)
    info = _read(path)
    if not _alive(info):
        _kill_leftovers(info)
        _forget(path, info)
        return False
    known = {pid: started for pid in head_members(info) if (started := start_time(pid)) is not None}
    os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(info) and time.monotonic() < deadline:  # _alive reaps our own child
        time.sleep(0.05)
    if _alive(info):
        os.kill(info.pid, signal.SIGKILL)
    _kill_members(info, known)  # whatever of the head is left (workers, agents): only processes that are its own
    try:  # a head this process started is reaped, not left a zombie
        os.waitpid(info.pid, 0)
    except ChildProcessError:
        pass
    path.unlink(missing_ok=True)
    _remove_sessions(Path(info.tmpdir))
    return True


def _remove_sessions(tmpdir: Path) -> None:
    """Delete what the stopped head left in its Ray temp folder (session logs, sockets): the folder itself
    stays, recorded in the state folder for the next head."""
    if not tmpdir.name.startswith("vt-ray-") or not tmpdir.is_dir() or tmpdir.is_symlink():
        return
    for entry in tmpdir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl_tasks.execution.local_head")
    parser.add_argument("action", choices=("start", "stop", "env"))
    parser.add_argument("--state-dir", default=".ray-head")
    parser.add_argument("--port", type=int, default=6399)
    parser.add_argument("--dashboard-port", type=int, default=8275)
    parser.add_argument("--num-cpus", type=int, default=LOGICAL_CPUS)
    parser.add_argument("--num-gpus", type=int, default=None,
                        help="GPUs the head offers (default: the machine's, as Ray counts them)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    state = Path(args.state_dir)
    if args.action == "start":
        started = time.monotonic()
        os.environ["RAY_AUTH_MODE"] = "token"  # read when Ray is imported (start does): to ask the GCS what it offers
        try:
            info = start(state, port=args.port, dashboard_port=args.dashboard_port, num_cpus=args.num_cpus,
                         num_gpus=args.num_gpus)
        except UnsafeStateDir as err:
            log.error("%s", err)
            return 2
        os.environ.update(info.client_env())
        wait_for_node(info)
        log.info("ray head pid %d at %s (ready in %.1fs)", info.pid, info.address, time.monotonic() - started)
    elif args.action == "stop":
        try:
            log.info("ray head stopped" if stop(state) else "no ray head was running")
        except UnsafeStateDir as err:
            log.error("%s", err)
            return 2
    else:
        try:
            running = read_info(state)
        except UnsafeStateDir as err:
            log.error("%s", err)
            return 2
        if running is None:
            log.error("no ray head running under %s", state)
            return 1
        for key, value in {**running.client_env(), **running.driver_env()}.items():
            sys.stdout.write(f"export {key}={shlex.quote(value)}\n")  # scripts eval these lines
    return 0


if __name__ == "__main__":
    sys.exit(main())
