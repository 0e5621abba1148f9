"""Ports for the servers verl-tasks starts are drawn below the kernel's ephemeral range and skip taken ones."""
from __future__ import annotations

import socket
from collections.abc import Iterator

from verl_tasks.execution import ports


def test_a_local_heads_ports_lie_below_the_ephemeral_range_and_are_free():
    from verl_tasks.execution.cli_cluster import _free_ports

    low = ports.ephemeral_low()
    for _ in range(20):
        gcs, dashboard = _free_ports()
        wanted = [gcs, gcs + 1, *range(dashboard, dashboard + 5)]
        assert all(ports.LOWEST <= port < low for port in wanted), (wanted, low)
        for port in wanted:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))


def test_a_taken_port_is_passed_over(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen()
        held = taken.getsockname()[1]
        draws: Iterator[int] = iter([held - 1, held + 7])  # span 2 from held - 1 covers the taken port
        monkeypatch.setattr(ports.random, "randint", lambda low, high: next(draws))
        assert ports.free_port(span=2) == held + 7


def test_a_kernel_range_that_leaves_no_room_falls_back_to_the_kernels_pick_with_a_warning(tmp_path, monkeypatch,
                                                                                          caplog):
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", narrow)
    base = ports.free_ports([0, 1, 10])
    for port in (base, base + 1, base + 10):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    assert "ephemeral ports start at 1024" in caplog.text and "raise the range's lower end above 20011" in caplog.text
