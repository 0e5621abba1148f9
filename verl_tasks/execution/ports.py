"""Free ports for the servers verl-tasks starts on a node (a local Ray head, the update group's TCP store).

A port asked of the kernel (a bind to port 0) comes from its ephemeral range, the same range every outgoing
connection and every other bind to port 0 draws from: on a busy node (a Ray head opens hundreds of
connections) such a port can be taken between the pick and the server's own bind, and that server then fails
with "address already in use". These ports are drawn below the ephemeral range instead, and above Ray's
worker ports (10002-19999 unless set), where only a process naming the port itself can take it.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
TRIES = 200


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(offsets: list[int], host: str = "127.0.0.1") -> int:
    """A base port B such that B + each of ``offsets`` is free on ``host`` now, all below the ephemeral range.

    Raises:
        RuntimeError: no such base found (the range is full, or the kernel's range starts too low to leave one).
    """
    top = ephemeral_low() - max(offsets) - 1
    if top <= LOWEST:
        raise RuntimeError(f"the kernel's ephemeral ports start at {ephemeral_low()} ({EPHEMERAL_RANGE}), which "
                           f"leaves no room above {LOWEST} for verl-tasks' servers; raise the range's lower end")
    for _ in range(TRIES):
        base = random.randint(LOWEST, top)
        if all(_bindable(host, base + offset) for offset in offsets):
            return base
    raise RuntimeError(f"no free ports {offsets} above a base in {LOWEST}..{top} on {host} after {TRIES} tries")


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port P such that P..P+span-1 are free on ``host`` now (see :func:`free_ports`)."""
    return free_ports(list(range(span)), host)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


__all__ = ["free_port", "free_ports", "ephemeral_low"]
