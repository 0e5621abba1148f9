"""How the reward worker is fenced off: bubblewrap namespaces, and one cgroup bounding its tasks and memory.

Why bubblewrap (Debian's ``bubblewrap``, the ``bwrap`` binary Flatpak uses) rather than
``unshare`` plus a uid switch: one unprivileged exec builds the whole boundary in the right
order (user, mount, PID, network, IPC, UTS and cgroup namespaces; a root that is an empty
tmpfs holding only what is bound into it, read-only; a fresh ``/proc`` of the new PID
namespace; a private, size-limited ``/tmp``; no capabilities, ``no_new_privs``, a new session,
no nested user namespaces; the sandbox's PID 1 killed with its parent). Doing that with
``unshare`` means writing the mount and ``pivot_root`` dance ourselves, and bubblewrap is one
Debian package (``make system-packages`` installs it). It costs little: see the start-up figures in
:mod:`verl_tasks.rewards.sandbox`.

Which uid: the worker runs as uid 65534 inside its user namespace, with no capabilities.
bubblewrap maps that uid to the caller's own uid outside (it cannot map another one when it is
not installed setuid), so under root (tests, CI) the worker's processes are uid 0 as the kernel
counts them outside, though they can reach nothing: the store, the credentials and other
processes are not in their mount, PID and network namespaces. Two consequences:

- ``RLIMIT_NPROC`` is not enforced for uid 0. The process limit is therefore also a pids cgroup
  (:class:`SandboxCgroup`) when this process may create one (v2, or v1's ``pids`` hierarchy);
  ``RLIMIT_NPROC`` covers the non-root case. Without either, the limit is not enforced and a
  warning says so.
- Memory: ``RLIMIT_AS`` bounds each process, so the same cgroup also bounds the memory of the
  sandbox as a whole (its processes and the pages of its tmpfs ``/tmp`` and ``/dev/shm``, each
  sized half the budget). Where no memory cgroup can be made, the per-process limit stays and a
  warning says so.
- Files the worker reads (the interpreter, the venv, the code) are read through bind mounts the
  caller made, so what the caller can read, the worker can read; nothing needs to be opened up.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SANDBOX_UID = 65534  # "nobody"
# Read-only system folders: the shared libraries the interpreter links (merged /usr: /lib is /usr/lib); the
# interpreter's own prefixes and the code are added per sandbox. Nothing else of /usr (its binaries,
# /usr/local, /usr/share) is shown.
SYSTEM_DIRS = tuple(d for d in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32") if os.path.isdir(d))
SYSTEM_TOP = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # symlinks into /usr when merged
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
ISOLATING_FLAGS = ("--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                   "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "reward-sandbox")


class IsolationUnavailable(RuntimeError):
    """This machine cannot build the namespaces; the message says why (from bubblewrap)."""


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _system_binds() -> list[str]:
    args: list[str] = []
    for folder in SYSTEM_DIRS:
        args += ["--ro-bind", folder, folder]
    for top in SYSTEM_TOP:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    return args


def outermost(paths: list[str]) -> list[str]:
    """``paths`` (absolute) without those inside another one, or inside the system folders; sorted."""
    kept: list[str] = []
    for path in sorted({os.path.normpath(p) for p in paths}):
        inside = [p for p in (*kept, *SYSTEM_DIRS) if path == p or path.startswith(p.rstrip("/") + "/")]
        if not inside:
            kept.append(path)
    return kept


def bwrap_command(bwrap: str, read_only: list[str], tmp_bytes: int, info_fd: int, command: list[str],
                  seccomp_fd: int | None = None) -> list[str]:
    """The bubblewrap command line that runs ``command`` in the sandbox.

    Args:
        read_only: absolute files and folders shown read-only at the same path (the interpreter's
            prefixes, the venv, the code); nothing else of the machine's file system is visible.
        tmp_bytes: size of the private ``/tmp`` (a tmpfs, also the working directory and ``HOME``) and of
            ``/dev/shm``; every other folder is read-only, the empty root included.
        info_fd: bubblewrap writes ``{"child-pid": N, ...}`` there: N, the sandbox's PID 1 as seen
            from here, is what :meth:`RewardSandbox.close` kills to end everything inside.
        seccomp_fd: a file descriptor holding :func:`seccomp_program`, installed for everything in the sandbox.
    """
    args = [bwrap, *ISOLATING_FLAGS, *_system_binds(), "--proc", "/proc", "--dev", "/dev",
            "--size", str(tmp_bytes), "--tmpfs", "/tmp", "--size", str(tmp_bytes), "--tmpfs", "/dev/shm"]
    # After the tmpfs mounts: code that lives under /tmp (a checkout there, its venv) is bound over them,
    # not hidden by them.
    for path in outermost(read_only):
        args += ["--ro-bind", path, path]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return [*args, "--", *command]


# --- the seccomp filter ---------------------------------------------------------------------------

# System calls a reward function never needs and a sandbox escape or a look outside would: debugging
# other processes, mounts and namespaces, kernel keys and modules, BPF, raw handles on the file system.
# Refused with EPERM (a clean error in the function, not a kill). x86_64 numbers.
DENIED_SYSCALLS = {
    "ptrace": 101, "syslog": 103, "personality": 135, "pivot_root": 155, "chroot": 161, "acct": 163,
    "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175,
    "delete_module": 176, "quotactl": 179, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "unshare": 272, "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442,
}
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
# Classic BPF: instruction classes and fields, and seccomp's return actions.
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_ERRNO, _RET_KILL = 0x7FFF0000, 0x00050000, 0x00000000
_EPERM = 1


def seccomp_program() -> bytes | None:
    """The sandbox's seccomp filter as a classic BPF program (what ``bwrap --seccomp`` reads): deny
    ``DENIED_SYSCALLS`` with EPERM, kill a process that calls with another architecture's ABI (32-bit or
    x32 numbers would bypass the list), allow the rest. None off x86_64 (the list holds its numbers)."""
    import platform
    import struct

    if platform.machine() != "x86_64":
        return None

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    numbers = sorted(DENIED_SYSCALLS.values())
    program = [op(_LD_W_ABS, 4),  # seccomp_data.arch
               op(_JEQ_K, _AUDIT_ARCH_X86_64, 1, 0), op(_RET_K, _RET_KILL),
               op(_LD_W_ABS, 0),  # seccomp_data.nr
               op(_JGE_K, _X32_SYSCALL_BIT, 0, 1), op(_RET_K, _RET_KILL)]
    for index, number in enumerate(numbers):  # on a match, jump to the deny at the end
        program.append(op(_JEQ_K, number, len(numbers) - index, 0))
    program += [op(_RET_K, _RET_ALLOW), op(_RET_K, _RET_ERRNO | _EPERM)]
    return b"".join(program)


@functools.lru_cache(maxsize=4)
def _probe(bwrap: str) -> str | None:
    """None when ``bwrap`` can build the sandbox's namespaces here, else bubblewrap's reason."""
    true = os.path.realpath("/usr/bin/true") if os.path.exists("/usr/bin/true") else sys.executable
    command = [bwrap, *ISOLATING_FLAGS, *_system_binds(), "--ro-bind", true, true, "--proc", "/proc", "--dev",
               "/dev", "--tmpfs", "/tmp", "--", true]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{type(err).__name__}: {err}"
    if done.returncode != 0:
        return (done.stderr or done.stdout).strip()[-500:] or f"bwrap exited with {done.returncode}"
    return None


def check_namespaces() -> str:
    """The bubblewrap binary, after checking (once per process) that it can isolate here.

    Raises:
        IsolationUnavailable: bubblewrap is not installed, or the kernel or the container refuses
            the namespaces (no user namespaces, a seccomp profile, a read-only ``/proc``...).
    """
    bwrap = bwrap_path()
    if bwrap is None:
        raise IsolationUnavailable("bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)")
    reason = _probe(bwrap)
    if reason is not None:
        raise IsolationUnavailable(f"bubblewrap cannot create the namespaces here: {reason}")
    return bwrap


# --- the sandbox's cgroup ------------------------------------------------------------------------


def _hierarchies() -> dict[str, Path]:
    """This process's cgroup folder per controller that can bound the sandbox (``pids``, ``memory``):
    cgroup v1 has a hierarchy per controller, v2 one folder for all the controllers it enables."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    found: dict[str, Path] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            enabled = _read("/sys/fs/cgroup/cgroup.controllers").split()
            for name in ("pids", "memory"):
                if name in enabled and name not in found:
                    found[name] = Path("/sys/fs/cgroup") / path.lstrip("/")
            continue
        for name in ("pids", "memory"):
            if name in controllers.split(","):
                found[name] = Path("/sys/fs/cgroup") / name / path.lstrip("/")
    return found


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# Per controller: (limit file, value) on cgroup v1, then v2; the swap files keep swap from extending memory.
_LIMIT_FILES = {"pids": (("pids.max",), ("pids.max",)),
                "memory": (("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
                           ("memory.max", "memory.swap.max"))}


@dataclass
class SandboxCgroup:
    """The cgroups that bound the sandbox as a whole: every process and thread it starts counts against
    ``pids``, and every page it uses (its processes' memory and what it writes to its tmpfs ``/tmp`` and
    ``/dev/shm``) against ``memory``, so children cannot multiply a per-process limit.

    The child joins them before it execs (:meth:`join`), so everything it starts is inside, even a
    process that left the session and the process group: :meth:`kill` ends them all, and
    :meth:`remove` deletes the cgroups once they are gone. ``folders`` holds the controllers this
    process could bound (``pids``, ``memory``; v2: one folder for both).
    """

    folders: dict[str, Path]

    @classmethod
    def create(cls, max_tasks: int, memory_bytes: int) -> SandboxCgroup | None:
        """New cgroups with ``pids.max = max_tasks`` and a memory limit of ``memory_bytes`` (swap included),
        for the controllers this process may make them in; None when it may make none."""
        folders: dict[str, Path] = {}
        limits = {"pids": str(max_tasks), "memory": str(memory_bytes)}
        made: dict[Path, Path] = {}
        for name, parent in _hierarchies().items():
            if not os.access(parent, os.W_OK):
                continue
            folder = made.get(parent)
            if folder is None:
                _remove_stale(parent)
                folder = parent / f"vt-reward-{os.getpid()}-{time.monotonic_ns()}"
                try:
                    folder.mkdir()
                except OSError:
                    continue
                made[parent] = folder
            v1_files, v2_files = _LIMIT_FILES[name]
            files = v1_files if (folder / v1_files[0]).exists() else v2_files
            try:
                (folder / files[0]).write_text(limits[name])
                for extra in files[1:]:  # swap: not every kernel accounts it
                    if (folder / extra).exists():
                        (folder / extra).write_text(limits[name] if extra.endswith("memsw.limit_in_bytes") else "0")
            except OSError:
                continue
            folders[name] = folder
        for folder in set(made.values()) - set(folders.values()):
            try:
                folder.rmdir()
            except OSError:
                pass
        return cls(folders) if folders else None

    def bounds(self, controller: str) -> bool:
        return controller in self.folders

    def join(self) -> None:
        """Move the calling process into the cgroups (called in the child between fork and exec, where
        an exception would only say "preexec_fn failed": a refused move leaves the child outside)."""
        for folder in set(self.folders.values()):
            try:
                with open(folder / "cgroup.procs", "w") as handle:
                    handle.write("0")
            except OSError:
                pass

    def pids(self) -> list[int]:
        return sorted({int(pid) for folder in set(self.folders.values())
                       for pid in _read(folder / "cgroup.procs").split()})

    def peak_memory(self) -> int | None:
        """The most memory the sandbox used at once, in bytes (None without a memory cgroup)."""
        folder = self.folders.get("memory")
        if folder is None:
            return None
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            text = _read(folder / name).strip()
            if text.isdigit():
                return int(text)
        return None

    def kill(self) -> None:
        """SIGKILL every process in the cgroups (``cgroup.kill`` on v2, else each pid until none is left)."""
        for folder in set(self.folders.values()):
            if (folder / "cgroup.kill").exists():
                try:
                    (folder / "cgroup.kill").write_text("1")
                    continue
                except OSError:
                    pass
        for _ in range(50):  # a process may fork while we kill: go round until the cgroups are empty
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def remove(self) -> None:
        for folder in set(self.folders.values()):
            for _ in range(100):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy: killed processes not reaped yet
                    time.sleep(0.01)
            else:
                log.warning("could not remove the reward sandbox's cgroup %s", folder)


def _remove_stale(parent: Path) -> None:
    """Remove empty ``vt-reward-<pid>-*`` cgroups left by processes that died without closing them."""
    try:
        entries = list(parent.glob("vt-reward-*"))
    except OSError:
        return
    for entry in entries:
        try:
            owner = int(entry.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if owner != os.getpid() and not os.path.exists(f"/proc/{owner}"):
            try:
                entry.rmdir()
            except OSError:
                pass


__all__ = ["DENIED_SYSCALLS", "IsolationUnavailable", "SandboxCgroup", "seccomp_program", "SANDBOX_UID",
           "bwrap_command", "check_namespaces", "outermost"]
