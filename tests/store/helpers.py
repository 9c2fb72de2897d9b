"""Pieces the store tests share: seeded contents, the daemon's fds, bounded children, memory
cgroups."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from ..cgroup_helpers import memory_cgroup

__all__ = ["WAIT", "pattern", "memfds", "mapped_memfds", "until", "dev_shm", "memory_cgroup"]

WAIT = 30.0  # s: the bound of every wait on a child or a condition


def pattern(seed: int, n: int, dtype: str = "<u4") -> np.ndarray:
    """`n` items derived from `seed` (the same on both sides of a test)."""
    return np.random.default_rng(seed).integers(0, 1 << 31, n).astype(dtype)


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


def until(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Wait (bounded) until `cond()` holds; AssertionError naming `what` if it never does."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.01)


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))
