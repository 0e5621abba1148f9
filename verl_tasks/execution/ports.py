"""Free ports for the servers verl-tasks starts on a node (a local Ray head, the update group's TCP store).

A port asked of the kernel (a bind to port 0) comes from its ephemeral range, the same range every outgoing
connection and every other bind to port 0 draws from: on a busy node (a Ray head opens hundreds of
connections) such a port can be taken between the pick and the server's own bind, and that server then fails
with "address already in use". These ports are drawn below the ephemeral range instead, and above Ray's
worker ports (10002-19999 unless set), where only a process naming the port itself can take it.
"""
from __future__ import annotations

import logging
import random
import socket
from functools import partial
from pathlib import Path

log = logging.getLogger(__name__)
LOWEST = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
TRIES = 200


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(offsets: list[int]) -> int:
    """A base port B such that B + each of ``offsets`` is free on every address now, below the ephemeral range.

    A kernel whose ephemeral range starts too low to leave room (``1024 65535`` is a common tuning) gets ports
    the kernel picks, with a warning: they work, with the race this module avoids elsewhere.

    Raises:
        RuntimeError: no such base found after ``TRIES`` draws.
    """
    top = ephemeral_low() - max(offsets) - 1
    if top <= LOWEST:
        log.warning("the kernel's ephemeral ports start at %d (%s): no room above %d for servers' ports, so the "
                    "kernel picks them and another process may take one first; raise the range's lower end above "
                    "%d", ephemeral_low(), EPHEMERAL_RANGE, LOWEST, LOWEST + max(offsets) + 1)
    draw = partial(random.randint, LOWEST, top) if top > LOWEST else _kernel_port
    for _ in range(TRIES):
        base = draw()
        if base + max(offsets) <= 65535 and all(_bindable(base + offset) for offset in offsets):
            return base
    raise RuntimeError(f"no free ports {offsets} on this node after {TRIES} tries")


def free_port(span: int = 1) -> int:
    """A port P such that P..P+span-1 are free now (see :func:`free_ports`)."""
    return free_ports(list(range(span)))


def _kernel_port() -> int:
    """A port the kernel picks (its ephemeral range)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _bindable(port: int) -> bool:
    """Whether ``port`` is free on every IPv4 address (servers bind the wildcard address or one of them)."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


__all__ = ["free_port", "free_ports", "ephemeral_low"]
