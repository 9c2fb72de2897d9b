"""Read what a process holds from /proc: fds, shared-memory mappings, /dev/shm names.

Used by ``shmshare doctor``/``demo`` and by the leak checker in
``shmshare.testing``. Every reader tolerates a process that exits while it
is being read (it then reports what it saw, or an empty result).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Mapping", "fds", "shm_mappings", "shm_names", "meminfo_kb", "SHM_MARKERS"]

# What a shared-memory mapping's path looks like in /proc/<pid>/maps.
SHM_MARKERS = ("/memfd:", "/dev/shm/", "/SYSV")


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/<pid>/maps that maps shared memory."""

    start: int
    end: int
    perms: str
    inode: int
    path: str  # "/memfd:shmshare_1_ab (deleted)", "/dev/shm/shmshare_1_cd (deleted)", ...

    @property
    def size(self) -> int:
        """Bytes mapped."""
        return self.end - self.start

    @property
    def deleted(self) -> bool:
        """Whether the object's name is gone (unlinked, or a memfd)."""
        return self.path.endswith(" (deleted)")


def fds(pid: int | str = "self") -> dict[int, str]:
    """Return {fd: readlink target} of process `pid`."""
    base = f"/proc/{pid}/fd"
    out: dict[int, str] = {}
    try:
        names = os.listdir(base)
    except (FileNotFoundError, ProcessLookupError):
        return out
    for name in names:
        try:
            out[int(name)] = os.readlink(f"{base}/{name}")
        except OSError:
            continue  # closed while we looked (the listdir fd itself, for one)
    return out


def shm_mappings(pid: int | str = "self", contains: str = "") -> list[Mapping]:
    """Return the shared-memory mappings of `pid` whose path contains `contains`."""
    out: list[Mapping] = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.readlines()
    except (FileNotFoundError, ProcessLookupError):
        return out
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        path = parts[5].rstrip("\n")
        if not any(m in path for m in SHM_MARKERS) or contains not in path:
            continue
        lo, hi = parts[0].split("-")
        out.append(Mapping(int(lo, 16), int(hi, 16), parts[1], int(parts[4]), path))
    return out


def shm_names(prefix: str = "", directory: str = "/dev/shm") -> set[str]:
    """Return the names in /dev/shm starting with `prefix`."""
    try:
        return {n for n in os.listdir(directory) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def meminfo_kb(field: str = "Shmem") -> int:
    """Return a /proc/meminfo field in kB (``Shmem``: all tmpfs/shm/memfd pages on the host)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"/proc/meminfo has no field {field!r}")
