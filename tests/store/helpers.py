"""Pieces the store tests share: seeded contents, the daemon's fds, bounded children, memory
cgroups."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

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


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[str, str]]:
    """A fresh memory cgroup limited to `limit` bytes, as (directory, cgroup.procs), removed
    after (bounded); the test is skipped, with the reason, where none can be made (not root,
    no memory controller). As tests/test_segment_cgroup.py makes one: v2 under the root (an
    inner v2 cgroup may not hold processes), else v1 under this process's own."""
    made = _make_cgroup(limit)
    if isinstance(made, str):
        pytest.skip(made)
    try:
        yield made
    finally:
        _remove_cgroup(made[0])


def _make_cgroup(limit: int) -> tuple[str, str] | str:
    if os.geteuid() != 0:
        return "needs root to create a memory cgroup"
    name = f"shmshare_store_test_{os.getpid()}"
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    v1 = next((ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":")[1].split(",")),
              None)
    tried = []
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        d = f"/sys/fs/cgroup/{name}"
        try:
            _write("/sys/fs/cgroup/cgroup.subtree_control", "+memory")
            os.mkdir(d)
            _write(f"{d}/memory.max", str(limit))
            _write(f"{d}/memory.swap.max", "0")  # shmem would go to swap rather than OOM
            return d, f"{d}/cgroup.procs"
        except OSError as exc:
            tried.append(f"v2: {exc}")
            _remove_cgroup(d)
    if v1 is not None and os.path.isdir("/sys/fs/cgroup/memory"):
        d = os.path.join("/sys/fs/cgroup/memory", v1.lstrip("/"), name)
        try:
            os.mkdir(d)
            _write(f"{d}/memory.limit_in_bytes", str(limit))
            if os.path.exists(f"{d}/memory.memsw.limit_in_bytes"):  # no swapping out either
                _write(f"{d}/memory.memsw.limit_in_bytes", str(limit))
            return d, f"{d}/cgroup.procs"
        except OSError as exc:
            tried.append(f"v1: {exc}")
            _remove_cgroup(d)
    return "no memory cgroup can be made here: " + ("; ".join(tried) or "neither v2 nor v1 memory")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _remove_cgroup(d: str) -> None:
    deadline = time.monotonic() + 10
    while os.path.isdir(d):
        try:
            os.rmdir(d)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # a dead member's charges are still being uncharged
