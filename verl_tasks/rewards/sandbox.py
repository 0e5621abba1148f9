"""Score samples in a sandbox: a separate worker with its own namespaces, environment and limits.

A reward function comes from whoever writes the experiment YAML, and the process that scores
holds the store and its credentials. So the worker (:mod:`verl_tasks.rewards.worker`) runs, by
default (``rewards.isolation: namespaces``), under bubblewrap (:mod:`verl_tasks.rewards.isolation`
says why bubblewrap and what the uid is):

- its own network namespace (no loopback services, no instance metadata), PID namespace (a fresh
  ``/proc``: no other process, no parent's ``environ``), mount namespace (an empty root with,
  read-only, ``/usr``, the interpreter's prefixes, the venv, the ``verl_tasks`` package and the
  reward module's top-level package, bound over the sandbox's own ``/tmp`` where they live under
  this machine's; never the store, the working folder or anything else of this machine's ``/tmp``),
  and a private ``/tmp`` of ``memory_limit_mb`` at most, which is also its ``HOME`` and working folder;
- uid 65534 inside, no capabilities, ``no_new_privs``, its own session, no nested user namespaces;
- an environment built from an allow-list (:func:`verl_tasks.secrets.reward_env`), for bubblewrap
  too (its PID 1 is inside, and its ``environ`` is readable there);
- limits: ``RLIMIT_AS`` (``memory_limit_mb``) and a CPU budget per sample (``cpu_limit_s``, default
  ``timeout_s``) with a hard cap per process, and ``max_processes`` tasks (``RLIMIT_NPROC`` and, where
  one can be made, a pids cgroup);
- :meth:`RewardSandbox.close` kills the sandbox's PID 1, which ends every process in the namespace
  (one that called ``setsid`` too), then the process group and the cgroup.

Where namespaces cannot be made (bubblewrap missing, a container without user namespaces), a
sandbox refuses to start with a :class:`ConfigError` naming ``rewards.isolation``. With
``rewards.isolation: process``, chosen explicitly (and logged at WARNING), the worker is a plain
child process with the same environment and limits, its own session and a temporary working
folder: it can read what this process can read and reach the network.

Start-up, measured on this 2-core machine as root (start until the worker's hello, median of 21,
three rounds interleaved with the worker this module had before, ``exact_answer``): before,
~40 ms; ``process`` ~58 ms; ``namespaces`` ~61 ms. Of the ~20 ms more, moving the child into its
pids cgroup is almost all (cgroup v1, root only); bubblewrap itself adds 3-5 ms. A sample costs
the same (~0.3 ms), ``close`` ~3 ms. Scoring keeps one warm sandbox per process and setting
(:func:`warm_sandbox`): one start per worker, not per batch or sample.

Whatever the isolation, a sample whose scoring raises, returns a non-number, hangs past
``timeout_s``, exceeds a limit or kills the worker gets the default score; its id and the reason
are returned so the phase can record them. The worker is restarted after a hang or a crash, and
every reply is checked (well-formed JSON, the request's sample index, a finite number).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, cast

import verl_tasks
from verl_tasks.errors import ConfigError
from verl_tasks.rewards.checks import RewardFunctionError, split_path
from verl_tasks.rewards.deployment import ISOLATIONS_ENV, check_allowed
from verl_tasks.rewards.isolation import (
    IsolationUnavailable,
    SandboxCgroup,
    bwrap_command,
    check_namespaces,
    seccomp_program,
)
from verl_tasks.rewards.source_check import top_level_location
from verl_tasks.secrets import reward_env

if TYPE_CHECKING:
    from verl_tasks.config import RewardsConfig

log = logging.getLogger(__name__)
MALFORMED = object()  # a reply line that is not JSON
BAD_REPLY = "malformed reply"
REQUEST_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")
# Unanswered request bytes in the worker's stdin pipe at most (Linux pipes hold 64 KiB).
WINDOW_BYTES = 32 << 10
ISOLATIONS = ("namespaces", "process")
DEFAULT_MAX_PROCESSES = 64
# CPU seconds any one process of the sandbox may use in all (at least 3 samples' budget); the
# worker is replaced before it reaches it.
CPU_CAP_S = 120
_WARNED: set[tuple[str, str]] = set()


@dataclass
class ScoreResult:
    scores: list[float]
    failures: dict[str, str] = field(default_factory=dict)  # sample id -> reason


def _warn_once(kind: str, key: str, message: str, *args: object) -> None:
    if (kind, key) not in _WARNED:
        _WARNED.add((kind, key))
        log.warning(message, *args)


class RewardSandbox:
    """A restartable, isolated worker process running one reward function.

    Args:
        function: ``package.module:function``.
        timeout_s: wall-clock limit per sample.
        memory_limit_mb: ``RLIMIT_AS`` of every process in the sandbox, and the size of its ``/tmp``.
        isolation: ``"namespaces"`` (bubblewrap; refused where it cannot work) or ``"process"``.
        cpu_limit_s: CPU seconds per sample (whole seconds, rounded up); None: ``timeout_s``.
        max_processes: processes and threads the worker and what it starts may run at once.
    """

    def __init__(self, function: str, timeout_s: float, memory_limit_mb: int, *, isolation: str = "namespaces",
                 cpu_limit_s: float | None = None, max_processes: int = DEFAULT_MAX_PROCESSES):
        if isolation not in ISOLATIONS:
            raise ConfigError(f"rewards.isolation {isolation!r} is not one of {', '.join(ISOLATIONS)}")
        self.function = function
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.memory_limit = memory_limit_mb << 20
        self.isolation = isolation
        self.cpu_limit_s = cpu_limit_s
        self.cpu_s = max(1, math.ceil(cpu_limit_s if cpu_limit_s is not None else timeout_s))
        self.cpu_cap_s = max(CPU_CAP_S, 3 * self.cpu_s)
        self.max_processes = max_processes
        self.proc: subprocess.Popen[str] | None = None
        self.reader: int | None = None
        self._buffer = b""
        self._eof = False
        self.workdir: str | None = None
        self.started_env: dict[str, str] | None = None
        self.ns_init: int | None = None  # the sandbox's PID 1, as seen from here (namespaces only)
        self._info: int | None = None  # bubblewrap's --info-fd
        self.cgroup: SandboxCgroup | None = None
        self.peak_memory: int | None = None  # the most memory the last closed sandbox held (memory cgroup)
        self.last_exit: int | None = None

    # --- what the worker gets ------------------------------------------------------------------

    def code_paths(self) -> tuple[list[str], list[str]]:
        """``(read-only paths, PYTHONPATH entries)`` the worker needs: the interpreter and its venv,
        installed packages outside them (a user site, e.g. the Airflow image's), the ``verl_tasks``
        package, and the reward module's top-level package (or single file). Other folders on this
        process's ``sys.path`` (its working folder, a dags folder) are not shown."""
        package = os.path.dirname(os.path.abspath(verl_tasks.__file__))
        try:
            folders, roots = top_level_location(split_path(self.function)[0])
        except RewardFunctionError:
            folders, roots = [], []  # the worker reports the malformed path
        prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
        sites = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)
                 and not any(p.startswith(prefix.rstrip("/") + "/") for prefix in prefixes)]
        read_only = [*prefixes, os.path.realpath(sys.executable), *sites, package, *folders]
        pythonpath = list(dict.fromkeys([*roots, os.path.dirname(package), *sites]))
        return [p for p in read_only if os.path.exists(p)], pythonpath

    def environment(self) -> dict[str, str]:
        """The worker's whole environment (an allow-list: :func:`verl_tasks.secrets.reward_env`)."""
        home = "/tmp" if self.isolation == "namespaces" else (self.workdir or tempfile.gettempdir())
        bindir = os.path.join(sys.prefix, "bin")
        return reward_env(os.environ, {
            "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(self.code_paths()[1]),
            "HOME": home, "TMPDIR": home, "PWD": home, "PYTHONHASHSEED": "0", "PYTHONNOUSERSITE": "1",
            "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"})

    def _limits_spec(self) -> dict[str, Any]:
        nproc = self.isolation == "namespaces" and os.geteuid() != 0  # counted per user namespace there
        return {"cpu_s": self.cpu_s, "cpu_cap_s": self.cpu_cap_s, "memory_mb": self.memory_limit_mb,
                "max_processes": self.max_processes,
                "nproc": self.max_processes + 1 if nproc else None}  # + the sandbox's PID 1

    def _before_exec(self) -> None:
        """In the child, between fork and exec (the worker sets the rest itself, before any user code)."""
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_limit, self.memory_limit))
        if self.cgroup is not None:
            self.cgroup.join()

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> subprocess.Popen[str]:
        """Start the worker and wait for its hello (the function imported and checked inside).
        Returns the process (also ``self.proc``): bubblewrap, or the worker itself with ``process``.

        Raises:
            ConfigError: the function cannot be loaded or checked, or (``namespaces``) this machine
                cannot build the namespaces; the message names the setting to change.
        """
        self.close()  # a worker still running (an explicit restart) goes first
        check_allowed(isolation=self.isolation, memory_limit_mb=self.memory_limit_mb,
                      max_processes=self.max_processes, timeout_s=self.timeout_s, cpu_limit_s=self.cpu_limit_s)
        bwrap = None
        if self.isolation == "namespaces":
            try:
                bwrap = check_namespaces()
            except IsolationUnavailable as err:
                raise ConfigError(
                    f"rewards.isolation is 'namespaces' (the default), but {err}. Install bubblewrap and allow user "
                    f"namespaces here (in a container: a seccomp/AppArmor profile that permits them), or, where "
                    f"the deployment allows it ({ISOLATIONS_ENV} includes process), set rewards.isolation: process "
                    f"to run {self.function!r} as a plain child process (it then sees this machine's files and "
                    f"network)") from None
        else:
            _warn_once("process", self.function, "rewards.isolation is 'process': the reward function %s runs as a "
                       "plain child process without namespaces; it can read every file and reach every address "
                       "this process can (the store included), only its environment and limits are its own",
                       self.function)
        # One cgroup for the whole sandbox: its tasks and its memory (processes and tmpfs pages together),
        # so children cannot multiply the limits. Moving the child in costs ~20 ms on cgroup v1 (measured
        # here), once per worker start.
        self.cgroup = SandboxCgroup.create(self.max_processes + (2 if bwrap else 0),  # + bubblewrap, PID 1
                                           self.memory_limit)
        if (self.cgroup is None or not self.cgroup.bounds("pids")) and (os.geteuid() == 0 or not bwrap):
            _warn_once("nproc", self.isolation, "rewards.max_processes is not enforced: no pids cgroup can be made "
                       "here, and RLIMIT_NPROC counts %s", "nothing for root" if os.geteuid() == 0 else
                       "every process of this user outside a user namespace")
        if self.cgroup is None or not self.cgroup.bounds("memory"):
            _warn_once("memory", self.isolation, "rewards.memory_limit_mb bounds each process of the sandbox "
                       "(RLIMIT_AS), not the sandbox as a whole: no memory cgroup can be made here (cgroup v1 or v2 "
                       "with a writable memory hierarchy), so a function that starts children or fills its /tmp "
                       "can use more")
        read_fd, write_fd = os.pipe()
        info_r, info_w = os.pipe() if bwrap else (-1, -1)
        if not bwrap:
            self.workdir = tempfile.mkdtemp(prefix="vt-reward-")
        self.started_env = self.environment()
        command = [sys.executable, "-m", "verl_tasks.rewards.worker", self.function, str(write_fd),
                   json.dumps(self._limits_spec())]
        seccomp_fd = -1
        if bwrap:
            program = seccomp_program()
            if program is None:
                _warn_once("seccomp", self.isolation, "no seccomp filter for this architecture: the reward sandbox "
                           "relies on its namespaces alone")
            else:
                seccomp_fd = os.memfd_create("verl-tasks-seccomp", 0)
                os.write(seccomp_fd, program)
                os.lseek(seccomp_fd, 0, os.SEEK_SET)
            # Its /tmp and /dev/shm share the memory budget: half of it each at most (the cgroup counts both).
            argv = bwrap_command(bwrap, self.code_paths()[0], self.memory_limit // 2, info_w, command,
                                 seccomp_fd if seccomp_fd >= 0 else None)
        debug = log.isEnabledFor(logging.DEBUG)
        try:
            self.proc = proc = subprocess.Popen(
                argv if bwrap else command,
                cwd="/" if bwrap else self.workdir,
                env=self.started_env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=None if debug else subprocess.DEVNULL,  # the function's prints: shown when debugging
                pass_fds=tuple(fd for fd in (write_fd, info_w, seccomp_fd) if fd >= 0),
                preexec_fn=self._before_exec,
                start_new_session=True,
                text=True,
            )
        except BaseException:
            for fd in (read_fd, write_fd, info_r, info_w, seccomp_fd):
                if fd >= 0:
                    os.close(fd)
            self.close()
            raise
        os.close(write_fd)
        if seccomp_fd >= 0:
            os.close(seccomp_fd)  # bubblewrap read its own copy
        self.reader = read_fd
        self._buffer = b""
        self._eof = False
        if bwrap:
            os.close(info_w)
            self._info = info_r  # kept open until close: bubblewrap writes more, and dies of SIGPIPE if no one reads
            self.ns_init = _read_child_pid(info_r)
        hello = self._read_line(max(30.0, self.timeout_s))
        if not isinstance(hello, dict) or not hello.get("ready"):
            reason = hello.get("load_error") if isinstance(hello, dict) else None
            if reason is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(1.0)
                reason = (f"the worker exited with code {proc.returncode} before it started" if proc.returncode
                          is not None else "the worker did not start")
            self.close()
            raise ConfigError(f"rewards.function {self.function!r} cannot be loaded: {reason}")
        return proc

    def _read_line(self, timeout: float) -> Any:
        """The next reply (any JSON value; ``MALFORMED`` when not JSON), or None on timeout or a dead worker."""
        reader = self.reader
        if reader is None:  # closed: no worker to read from
            return None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([reader], [], [], left)
            if not ready:
                return None
            chunk = os.read(reader, 65536)
            if not chunk:
                self._eof = True  # the worker died
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            return MALFORMED

    def close(self) -> None:
        """Kill everything the sandbox runs and wait for it: the namespace's PID 1 (the kernel then
        kills every process in the namespace), the process group, and the cgroup's members."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None and self.ns_init is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.ns_init, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if self.cgroup is not None:
                self.cgroup.kill()
            proc.wait()
            self.last_exit = proc.returncode
            if proc.stdin:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            self.proc = None
        self.ns_init = None
        if self.cgroup is not None:
            self.cgroup.kill()
            self.peak_memory = self.cgroup.peak_memory()
            self.cgroup.remove()
            self.cgroup = None
        for fd in (self.reader, self._info):
            if fd is not None:
                os.close(fd)
        self.reader = self._info = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> RewardSandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- scoring --------------------------------------------------------------------------------

    def score(self, samples: list[dict[str, Any]], default: float) -> ScoreResult:
        """Score samples in order. Each needs id, data_source, solution_str, ground_truth, extra_info.

        Requests go to the worker a window at a time (at most ``WINDOW_BYTES`` unanswered, so a
        write never blocks on a full pipe); the worker answers them one after another, so sample
        ``k`` still has ``timeout_s`` from the moment sample ``k - 1`` was answered. After a hang,
        a crash, a reply out of step or a worker that retires (its CPU cap is near), the worker is
        replaced and the rest are sent again.
        """
        result = ScoreResult(scores=[])
        lines = [json.dumps({"i": i, **{k: s[k] for k in REQUEST_KEYS}}) + "\n" for i, s in enumerate(samples)]
        i = 0
        while i < len(samples):
            proc = self.proc if self.proc is not None else self.start()
            stdin = cast(IO[str], proc.stdin)  # never None: the worker is started with stdin=PIPE
            end, size = i, 0
            while end < len(lines) and (end == i or size + len(lines[end]) <= WINDOW_BYTES):
                size += len(lines[end])
                end += 1
            try:
                stdin.write("".join(lines[i:end]))
                stdin.flush()
            except (BrokenPipeError, OSError):
                self._eof = True
                end = i + 1  # the worker is gone: sample i gets the default, the rest a new worker
            for k in range(i, end):
                reply = None if self._eof else self._read_line(self.timeout_s)
                i = k + 1
                if reply is None:
                    crashed = self._eof or proc.poll() is not None
                    if crashed:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            proc.wait(1.0)  # let it exit on its own: its status says how it died
                    self.close()
                    result.scores.append(default)
                    result.failures[samples[k]["id"]] = (crash_reason(self.last_exit, self.isolation) if crashed
                                                         else f"timed out after {self.timeout_s:g}s")
                    break
                score, reason = check_reply(reply, k)
                result.scores.append(default if score is None else score)
                if reason is not None:
                    result.failures[samples[k]["id"]] = reason
                    if reason.startswith(BAD_REPLY):
                        self.close()  # the protocol is out of step: start a clean worker, send the rest again
                        break
                if reply.get("retire") is True:
                    self.close()  # near its CPU cap: a fresh worker takes the rest
                    break
        return result


def crash_reason(returncode: int | None, isolation: str) -> str:
    """"worker crashed", with the signal that killed it when one did."""
    signum = None
    if returncode is not None and returncode < 0:
        signum = -returncode
    elif returncode is not None and isolation == "namespaces" and 128 < returncode < 128 + 65:
        signum = returncode - 128  # bubblewrap exits with 128 + the signal that killed the command
    if signum is None:
        return "worker crashed"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    hint = {"SIGKILL": ": a limit (CPU cap, memory) or the OOM killer", "SIGXCPU": ": CPU time limit",
            "SIGSEGV": ": segmentation fault"}.get(name, "")
    return f"worker crashed (killed by {name}{hint})"


def _read_child_pid(fd: int, timeout: float = 10.0) -> int | None:
    """The ``child-pid`` bubblewrap writes to its ``--info-fd`` (the sandbox's PID 1)."""
    data = b""
    deadline = time.monotonic() + timeout
    pattern = re.compile(rb'"child-pid"\s*:\s*(\d+)')
    while (match := pattern.search(data)) is None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
    return int(match.group(1))


def check_reply(reply: Any, index: int) -> tuple[float | None, str | None]:
    """``(score, None)`` for a good reply; ``(None, reason)`` for the function's error or a bad reply."""
    if not isinstance(reply, dict) or reply.get("i") != index or isinstance(reply.get("i"), bool):
        got = "a line that is not JSON" if reply is MALFORMED else str(reply)[:100]
        return None, f"{BAD_REPLY}: expected a JSON object for sample {index}, got {got}"
    if isinstance(reply.get("error"), str):
        return None, reply["error"][:300]
    score = reply.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return None, f"{BAD_REPLY}: score {str(score)[:100]} is not a finite number"
    return float(score), None


# --- one warm sandbox per process and reward setting ------------------------------------------------

_Key = tuple[str, float, int, str, float | None, int]
_WARM: dict[_Key, RewardSandbox] = {}
_WARM_LOCKS: dict[_Key, threading.Lock] = {}
_GUARD = threading.Lock()


@contextlib.contextmanager
def warm_sandbox(function: str, timeout_s: float, memory_limit_mb: int, *, isolation: str = "namespaces",
                 cpu_limit_s: float | None = None,
                 max_processes: int = DEFAULT_MAX_PROCESSES) -> Iterator[RewardSandbox]:
    """The process's worker for these reward settings, kept between batches (one user at a time).

    Starting a worker costs a sandbox and a Python start-up and the function's imports; a warm one
    is reused by the next batch. Isolation and limits are the same; a worker that crashed, hung,
    broke the protocol or died while idle is replaced, one whose batch was interrupted is closed,
    and every worker is closed when the process exits. Arguments as :class:`RewardSandbox`.
    """
    key: _Key = (function, timeout_s, memory_limit_mb, isolation, cpu_limit_s, max_processes)
    with _GUARD:
        lock = _WARM_LOCKS.setdefault(key, threading.Lock())
    with lock:
        sandbox = _WARM.get(key)
        if sandbox is not None and (sandbox.started_env != sandbox.environment()
                                    or (sandbox.proc is not None and sandbox.proc.poll() is not None)):
            sandbox.close()  # a stale environment, or a worker that died between batches
        if sandbox is None:
            sandbox = _WARM[key] = RewardSandbox(function, timeout_s, memory_limit_mb, isolation=isolation,
                                                 cpu_limit_s=cpu_limit_s, max_processes=max_processes)
        try:
            yield sandbox
        except BaseException:
            # Interrupted mid-batch (a unit's deadline, Ctrl-C): replies may still be on their way,
            # and the next batch would read them as its own.
            _WARM.pop(key, None)
            sandbox.close()
            raise


def scoring_sandbox(rewards: RewardsConfig) -> contextlib.AbstractContextManager[RewardSandbox]:
    """:func:`warm_sandbox` for an experiment's ``rewards`` section."""
    return warm_sandbox(rewards.function, rewards.timeout_s, rewards.memory_limit_mb, isolation=rewards.isolation,
                        cpu_limit_s=rewards.cpu_limit_s, max_processes=rewards.max_processes)


def preflight(rewards: RewardsConfig) -> None:
    """Start this process's sandbox for ``rewards`` now (it stays warm for scoring), so that a reward
    function the config parse could not fully check (see :mod:`verl_tasks.rewards.checks`), or a
    machine that cannot isolate it, fails before any compute.

    Raises:
        ConfigError: naming ``rewards.function`` or ``rewards.isolation`` and the reason.
    """
    with scoring_sandbox(rewards) as sandbox:
        if sandbox.proc is None:
            sandbox.start()


@atexit.register
def _close_warm() -> None:
    for sandbox in _WARM.values():
        sandbox.close()
