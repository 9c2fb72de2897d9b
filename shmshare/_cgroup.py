"""The memory cgroup limit this process lives under, read cheaply before pages are reserved.

Shared memory (memfd, ``/dev/shm``) is charged to the memory cgroup of the
process that first touches or ``posix_fallocate``s it. Past ``memory.max``
the kernel does not fail the call: it runs the cgroup's OOM killer, which
kills this process (or another in the cgroup). So the segment layer asks
here first, and refuses a reservation that cannot fit with an error it can
explain (Note [Checking the cgroup before fallocate]).

cgroup v2 (``0::/path`` in ``/proc/self/cgroup``; ``memory.max`` and
``memory.current``) and v1 (the ``memory`` controller's line;
``memory.limit_in_bytes`` and ``memory.usage_in_bytes``) are both read. Every
level from the process's cgroup up to the root is looked at; the level with
the least room wins. This module is layer 0: the stdlib and ``_fork`` only.

Note [Checking the cgroup before fallocate]
    What the check costs: the chain of cgroup directories is resolved once
    per distinct ``/proc/self/cgroup`` (a walk up to the root) and cached; a
    check then reads that file and two small files per *limited* level
    (usually one level, so three files), and ``memory.stat`` only when the quick sum says no (page cache
    counts in the usage but the kernel reclaims it before it kills, so it is
    subtracted before refusing). It runs once per fresh segment or mapped
    range, never per message.

    What it cannot promise: it is a check, then a separate fallocate. Other
    processes of the cgroup may allocate between the two; anonymous memory of
    this process (the interpreter, numpy temporaries) grows too; the kernel
    charges in per-CPU batches, so ``memory.current`` lags by up to a few
    hundred KiB per CPU; and a limit set on a cgroup level that had none when
    the chain was resolved is not seen until :func:`reset` (a process moved
    to another cgroup is seen: ``/proc/self/cgroup`` is read each time). The
    check keeps ``_SLACK`` bytes of headroom for the last two; the first is a
    race only the kernel could close. So an OOM kill stays possible under
    memory pressure from elsewhere; what is gone is the certain one, of a
    pool that grows past the limit on its own.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from . import _fork

__all__ = ["MemoryLimit", "memory_limit", "reset"]

_UNLIMITED = 1 << 60  # v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)
_SLACK_MIN = 4 << 20  # bytes kept free below the limit: per-CPU charge batches, our own growth


@dataclass(frozen=True)
class MemoryLimit:
    """A memory cgroup level that limits this process, as read just now."""

    path: str  # the cgroup, as /proc/self/cgroup names it ("/jobs/42")
    directory: str  # where its files are ("/sys/fs/cgroup/jobs/42")
    version: int  # 1 or 2
    limit: int  # bytes: memory.max / memory.limit_in_bytes
    usage: int  # bytes: memory.current / memory.usage_in_bytes
    reclaimable: int = 0  # bytes of page cache in `usage` (read only when it matters)

    @property
    def room(self) -> int:
        """Bytes that can still be charged before the limit, after reclaiming page cache."""
        return self.limit - (self.usage - self.reclaimable)

    @property
    def slack(self) -> int:
        """Headroom kept below the limit (Note [Checking the cgroup before fallocate])."""
        return max(_SLACK_MIN, self.limit // 64)

    def fits(self, nbytes: int) -> bool:
        """Return whether `nbytes` more can be charged and still leave the slack."""
        return nbytes + self.slack <= self.room


@dataclass(frozen=True)
class _Level:
    path: str
    directory: str
    version: int


_lock = threading.Lock()
# (root, /proc/self/cgroup as read) -> the limited levels, innermost first
_chains: dict[tuple[str, str], tuple[_Level, ...]] = {}


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it: it is not here


_fork.on_fork_in_child(0, _after_fork_in_child)


def memory_limit(root: str = "/", nbytes: int = 0) -> MemoryLimit | None:
    """Return the limiting level with the least room, or None when no memory limit applies.

    `root` is where ``/proc`` and ``/sys/fs/cgroup`` are found (tests pass a
    fake tree). `nbytes` is the request about to be made: when it does not
    fit on the quick read, the level's reclaimable page cache is read too,
    so that only a real shortage is reported.
    """
    best: MemoryLimit | None = None
    for level in _chain(root):
        got = _read_level(level)
        if got is None:  # the cgroup went away (we were moved): resolve again next time
            reset(root)
            continue
        if nbytes and not got.fits(nbytes):
            got = _with_reclaimable(got)
        if best is None or got.room < best.room:
            best = got
    return best


def reset(root: str | None = None) -> None:
    """Forget the cached cgroup chain (all roots when None): after moving to another cgroup."""
    with _lock:
        for key in [k for k in _chains if root is None or k[0] == root]:
            del _chains[key]


# -- internals ----------------------------------------------------------------


def _chain(root: str) -> tuple[_Level, ...]:
    # /proc/self/cgroup is read every time (one small file per fresh segment): a process moved
    # to another cgroup -- a forked child put in one by its parent, say -- is seen at once
    lines = _read(os.path.join(root, "proc/self/cgroup"))
    if lines is None:
        return ()
    chain = _chains.get((root, lines))
    if chain is None:
        chain = _resolve(root, lines)
        with _lock:
            if len(_chains) > 64:  # moved around a lot: keep the cache small
                _chains.clear()
            _chains[(root, lines)] = chain
    return chain


def _resolve(root: str, lines: str) -> tuple[_Level, ...]:
    """Find this process's memory cgroup and keep the levels up to the root that set a limit."""
    v2_path = v1_path = None
    for line in lines.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            v2_path = path or "/"
        elif "memory" in controllers.split(","):
            v1_path = path or "/"
    cg = os.path.join(root, "sys/fs/cgroup")
    if v2_path is not None:
        for base in (cg, os.path.join(cg, "unified")):
            if "memory" in (_read(os.path.join(base, "cgroup.controllers")) or "").split():
                return _limited(base, v2_path, 2)
    if v1_path is not None:
        return _limited(os.path.join(cg, "memory"), v1_path, 1)
    return ()


def _limited(base: str, path: str, version: int) -> tuple[_Level, ...]:
    """Return the levels from `path` up to the hierarchy's root whose limit is finite."""
    out = []
    parts = [p for p in path.split("/") if p]
    while True:
        here = "/" + "/".join(parts)
        directory = os.path.join(base, *parts)
        if os.path.isdir(directory):  # a cgroup namespace may hide the levels above ours
            level = _Level(here, directory, version)
            got = _read_level(level)
            if got is not None and got.limit < _UNLIMITED:
                out.append(level)
        if not parts:
            return tuple(out)
        parts.pop()


def _read_level(level: _Level) -> MemoryLimit | None:
    names = ("memory.max", "memory.current") if level.version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes")
    raw_limit = _read(os.path.join(level.directory, names[0]))
    raw_usage = _read(os.path.join(level.directory, names[1]))
    if raw_limit is None or raw_usage is None or not raw_usage.isdigit():
        return None
    limit = int(raw_limit) if raw_limit.isdigit() else _UNLIMITED  # v2 writes "max"
    return MemoryLimit(level.path, level.directory, level.version, limit, int(raw_usage))


def _with_reclaimable(got: MemoryLimit) -> MemoryLimit:
    """Add the page cache the kernel would reclaim before killing (shmem is not in it)."""
    stat = _read(os.path.join(got.directory, "memory.stat")) or ""
    keys = ("active_file", "inactive_file") if got.version == 2 else (
        "total_active_file", "total_inactive_file")
    fields = dict(line.split(" ", 1) for line in stat.splitlines() if " " in line)
    cache = sum(int(fields[k]) for k in keys if fields.get(k, "").isdigit())
    return MemoryLimit(got.path, got.directory, got.version, got.limit, got.usage,
                       min(cache, got.usage))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # absent (no such controller, or the cgroup was removed): no limit here
        return None
