"""Pieces the store tests share: the daemon's fds and mappings, /dev/shm, memory cgroups (seeded
contents and bounded waits: shmshare.testing's pattern and wait_until)."""

from __future__ import annotations

import os

from ..cgroup_helpers import memory_cgroup

__all__ = ["WAIT", "memfds", "mapped_memfds", "dev_shm", "memory_cgroup", "close_fds"]

WAIT = 30.0  # s: the bound of every wait on a child or a condition


def memfds(pid: int) -> int:
    """How many memfds of shmshare's process `pid` holds (fds, not mappings)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:shmshare_"):
                n += 1
        except OSError:
            pass
    return n


def mapped_memfds(pid: int) -> int:
    """Bytes of shmshare memfds process `pid` maps."""
    total = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/memfd:shmshare_" in line:
                lo, hi = line.split()[0].split("-")
                total += int(hi, 16) - int(lo, 16)
    return total


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def close_fds(*fds: int) -> None:
    """Close each fd that is still open here (-1: closed already)."""
    for fd in fds:
        if fd >= 0:
            os.close(fd)
