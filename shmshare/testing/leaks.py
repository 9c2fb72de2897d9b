"""The leak checker: what a process holds before and after, from /proc and /dev/shm."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from .._procfs import Mapping, fds, shm_mappings, shm_names

__all__ = ["ResourceSnapshot", "Leaks", "LeakError", "assert_no_leaks", "check_leaks"]

PREFIX = "shmshare_"


class LeakError(AssertionError):
    """A process holds fds, mappings or /dev/shm names it did not hold before."""


@dataclass(frozen=True)
class Leaks:
    """What appeared between two snapshots."""

    fds: dict[int, str] = field(default_factory=dict)
    mappings: list[Mapping] = field(default_factory=list)
    shm: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.fds or self.mappings or self.shm)

    def describe(self) -> str:
        """Return a readable list of what leaked."""
        lines = [f"fd {n} -> {t}" for n, t in sorted(self.fds.items())]
        lines += [f"mapping {m.start:x}-{m.end:x} {m.perms} {m.path}" for m in self.mappings]
        lines += [f"/dev/shm/{n}" for n in sorted(self.shm)]
        return "; ".join(lines)


@dataclass(frozen=True)
class ResourceSnapshot:
    """The fds, shared-memory mappings and /dev/shm names of one process at one moment."""

    pid: int | str
    fds: dict[int, str]
    mappings: list[Mapping]
    shm: set[str]

    @classmethod
    def take(cls, pid: int | str = "self", prefix: str = PREFIX) -> ResourceSnapshot:
        """Read /proc/<pid>/fd, /proc/<pid>/maps and /dev/shm (names starting with `prefix`)."""
        return cls(pid, fds(pid), shm_mappings(pid), shm_names(prefix))

    def leaked_since(self, before: ResourceSnapshot) -> Leaks:
        """Return what this snapshot holds that `before` did not."""
        new_fds = {n: t for n, t in self.fds.items() if before.fds.get(n) != t}
        old_maps = {(m.start, m.end, m.path) for m in before.mappings}
        new_maps = [m for m in self.mappings if (m.start, m.end, m.path) not in old_maps]
        return Leaks(new_fds, new_maps, self.shm - before.shm)


def assert_no_leaks(before: ResourceSnapshot, settle: float = 2.0) -> None:
    """Raise LeakError if the process of `before` now holds more than it did.

    Garbage is collected first, and the check is retried for up to `settle`
    seconds, because releases may be delivered by another thread or process.
    """
    deadline = time.monotonic() + settle
    while True:
        gc.collect()
        leaks = ResourceSnapshot.take(before.pid).leaked_since(before)
        if not leaks or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if leaks:
        raise LeakError(f"leaked in pid {before.pid}: {leaks.describe()}")


@contextlib.contextmanager
def check_leaks(pid: int | str = "self", settle: float = 2.0) -> Iterator[ResourceSnapshot]:
    """Check that the block leaves `pid` holding nothing new (also when it passes)."""
    gc.collect()
    before = ResourceSnapshot.take(pid)
    yield before
    assert_no_leaks(before, settle)
