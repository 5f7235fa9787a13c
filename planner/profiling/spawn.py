"""Helpers for the profilers that spawn process groups: a free local port, the group sizes a process count
allows."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A free local TCP port for a spawned process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def divisor_group_sizes(processes: int) -> tuple[int, ...]:
    """Every group size >= 2 that divides `processes` (all groups of that size run at once)."""
    return tuple(g for g in range(2, processes + 1) if processes % g == 0)
