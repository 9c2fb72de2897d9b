"""Memory cgroups for the tests that fill one (root only; skipped with the reason elsewhere)."""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator

import pytest

__all__ = ["memory_cgroup", "make_memory_cgroup", "remove_cgroup"]

_count = itertools.count()


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[str, str]]:
    """A fresh memory cgroup limited to `limit` bytes, as (directory, cgroup.procs), removed
    after (bounded); the test is skipped, with the reason, where none can be made (not root,
    no memory controller): v2 under the root (an inner v2 cgroup may not hold processes), else
    v1 under this process's own."""
    made = make_memory_cgroup(limit)
    if isinstance(made, str):
        pytest.skip(made)
    try:
        yield made
    finally:
        remove_cgroup(made[0])


def make_memory_cgroup(limit: int) -> tuple[str, str] | str:
    if os.geteuid() != 0:
        return "needs root to create a memory cgroup"
    name = f"shmshare_test_{os.getpid()}_{next(_count)}"
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
            remove_cgroup(d)
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
            remove_cgroup(d)
    return "no memory cgroup can be made here: " + ("; ".join(tried) or "neither v2 nor v1 memory")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def remove_cgroup(d: str) -> None:
    deadline = time.monotonic() + 10
    while os.path.isdir(d):
        try:
            os.rmdir(d)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # a dead member's charges are still being uncharged
