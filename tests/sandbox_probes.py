"""Reward functions that attack the reward sandbox (tests/test_reward_sandbox.py).

Each is a probe a reviewer ran against the old sandbox. They return 1.0 when the attack worked
and 0.0 when the boundary held, or raise naming what they found; run under
``rewards.isolation: process`` they succeed, which shows the probe itself works.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time


def read_environs(data_source, solution_str, ground_truth, extra_info):
    """Looks for ``extra_info["secret"]`` in ``/proc/<pid>/environ`` of the scoring process
    (``extra_info["pid"]``, its pid on the machine), of its own parent and of every process it can
    see. Raises naming where it found it; returns 1.0 when the scoring process is visible at all."""
    secret = extra_info["secret"].encode()
    pids = {str(extra_info["pid"]), str(os.getppid())} | {p for p in os.listdir("/proc") if p.isdigit()}
    found = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if secret in handle.read():
                    found.append(pid)
        except OSError:
            continue
    if found:
        raise LookupError(f"the secret is in /proc/{{{','.join(found)}}}/environ")
    return 1.0 if os.path.exists(f"/proc/{extra_info['pid']}") else 0.0


def environment_names(data_source, solution_str, ground_truth, extra_info):
    """Raises when its environment differs from ``extra_info["expected"]`` (names) or a value holds
    ``extra_info["secret"]``; else 1.0."""
    names = set(os.environ)
    expected = set(extra_info["expected"])
    if names != expected:
        raise LookupError(f"unexpected {sorted(names - expected)}, missing {sorted(expected - names)}")
    leaked = sorted(k for k, v in os.environ.items() if extra_info["secret"] in v)
    if leaked:
        raise LookupError(f"the secret is in {leaked}")
    return 1.0


def connect(data_source, solution_str, ground_truth, extra_info):
    """1.0 when a TCP connection to ``extra_info["host"]:extra_info["port"]`` opens."""
    try:
        with socket.create_connection((extra_info["host"], extra_info["port"]), timeout=2):
            return 1.0
    except OSError:
        return 0.0


def forge_commit(data_source, solution_str, ground_truth, extra_info):
    """Writes a file and a ``_SUCCESS`` marker for it into a local store (``extra_info["store"]``,
    unit ``extra_info["unit"]``), as a committed unit looks. 1.0 when both were written into the real
    store (its committed ``extra_info["witness"]`` is there to see); 0.0 when the store is not visible (a
    write then lands, if anywhere, in the sandbox's own empty view); raises when the store is visible but
    not writable (the boundary half held)."""
    root, unit = extra_info["store"], extra_info["unit"]
    visible = os.path.exists(os.path.join(root, extra_info["witness"]))
    body = b'{"sample_id": "forged", "score": 1.0}\n'
    marker = {"unit": unit, "attempt": "forged", "meta": {}, "committed_at": time.time(),
              "files": {"scores.jsonl": {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}}}
    try:
        attempt = os.path.join(root, unit, ".attempts", "forged")
        os.makedirs(attempt, exist_ok=True)
        with open(os.path.join(attempt, "scores.jsonl"), "wb") as handle:
            handle.write(body)
        with open(os.path.join(root, unit, "_SUCCESS"), "w") as handle:
            json.dump(marker, handle)
    except OSError as err:
        if visible:
            raise LookupError(f"the store is visible ({err})") from None
        return 0.0
    return 1.0 if visible else 0.0


def setsid_grandchild(data_source, solution_str, ground_truth, extra_info):
    """Leaves behind a grandchild in a new session, ``extra_info["marker"]`` on its command line; 1.0."""
    code = "import os, time\nos.setsid()\nif os.fork():\n    os._exit(0)\ntime.sleep(600)\n"
    subprocess.run([sys.executable, "-c", code, extra_info["marker"]], check=True)
    return 1.0


def fork_bomb(data_source, solution_str, ground_truth, extra_info):
    """Forks sleeping children until forking fails (then the error propagates); 1.0 if 2000 fit."""
    children = []
    try:
        for _ in range(2000):
            pid = os.fork()
            if pid == 0:
                try:
                    time.sleep(60)
                finally:
                    os._exit(0)
            children.append(pid)
    finally:
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    return 1.0


def spin(data_source, solution_str, ground_truth, extra_info):
    """Burns ``extra_info["seconds"]`` of CPU (default: until stopped); 1.0 if it returns."""
    until = time.process_time() + float(extra_info.get("seconds", 3600))
    while time.process_time() < until:
        pass
    return 1.0


def spinning_child(data_source, solution_str, ground_truth, extra_info):
    """Starts a child that burns CPU forever (``extra_info["marker"]`` on its command line) and returns 1.0
    without waiting for it."""
    subprocess.Popen([sys.executable, "-c", "while True: pass", extra_info["marker"]])
    return 1.0


def exact(data_source, solution_str, ground_truth, extra_info):
    return 1.0 if solution_str == ground_truth else 0.0


def hold_memory(data_source, solution_str, ground_truth, extra_info):
    """Holds as much memory as it can at once: ``extra_info["tmp_mb"]`` MB written to ``/tmp`` and to
    ``/dev/shm`` (tmpfs in the namespaced sandbox), then ``extra_info["children"]`` children of
    ``extra_info["mb"]`` MB each (each under the per-process limit). Returns the MB its children held
    at once (all of them when nothing bounds the sandbox as a whole)."""
    import tempfile

    mb, children, tmp_mb = int(extra_info["mb"]), int(extra_info["children"]), int(extra_info["tmp_mb"])
    held = 0
    for folder in (tempfile.gettempdir(), "/dev/shm"):
        try:
            with open(os.path.join(folder, "fill"), "wb") as handle:
                for _ in range(tmp_mb):
                    handle.write(b"\1" * (1 << 20))
        except OSError:
            pass
    code = (f"import sys, time\nb = bytearray({mb} << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
            "sys.stdout.write('ok'); sys.stdout.flush(); time.sleep(30)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(children)]
    for proc in procs:
        if proc.stdout.read(2) == b"ok":
            held += mb
    for proc in procs:
        proc.kill()
    return float(held)


def forbidden_syscalls(data_source, solution_str, ground_truth, extra_info):
    """Calls that succeed for any unprivileged process unless a seccomp filter refuses them: ptrace(TRACEME),
    personality(query), and ptrace(ATTACH) of the sandbox's PID 1. Raises naming those that went through."""
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True)
    calls = {"ptrace(TRACEME)": (101, 0, 0, 0, 0), "personality(query)": (135, 0xFFFFFFFF),
             "ptrace(ATTACH, 1)": (101, 16, 1, 0, 0)}
    passed = []
    for name, args in calls.items():
        if libc.syscall(*args) != -1 or ctypes.get_errno() != errno.EPERM:
            passed.append(name)
    if passed:
        raise LookupError(f"not refused: {passed}")
    return 1.0


def visible_paths(data_source, solution_str, ground_truth, extra_info):
    """Raises naming the paths of ``extra_info["paths"]`` that exist in the sandbox; else 1.0."""
    seen = [p for p in extra_info["paths"] if os.path.exists(p)]
    if seen:
        raise LookupError(f"visible: {seen}")
    return 1.0
