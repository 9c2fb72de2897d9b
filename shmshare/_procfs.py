"""Read what a process holds from /proc: fds, shared-memory mappings, /dev/shm names; whether it lives.

Used by ``shmshare doctor``/``demo`` and by the leak checker in
``shmshare.testing``. Every reader tolerates a process that exits while it
is being read (it then reports what it saw, or an empty result).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Mapping", "fds", "mappings", "shm_mappings", "dev_of", "holders", "shm_names", "meminfo_kb", "SHM_MARKERS",
           "pid_alive"]

# What a shared-memory mapping's path looks like in /proc/<pid>/maps.
SHM_MARKERS = ("/memfd:", "/dev/shm/", "/SYSV")


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/<pid>/maps."""

    start: int
    end: int
    perms: str
    inode: int
    path: str  # "/memfd:shmshare_1_ab (deleted)", "/dev/shm/shmshare_1_cd (deleted)", "" if anonymous ...
    dev: str = ""  # "00:01": the object's device as maps prints it (hex major:minor), see dev_of()

    @property
    def size(self) -> int:
        """Bytes mapped."""
        return self.end - self.start

    @property
    def shared(self) -> bool:
        """Whether it is a MAP_SHARED mapping (writes reach the object and every other mapping of it)."""
        return self.perms[3:4] == "s"

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
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return out  # gone, or another user's: nothing we can see
    for name in names:
        try:
            out[int(name)] = os.readlink(f"{base}/{name}")
        except OSError:
            continue  # closed while we looked (the listdir fd itself, for one)
    return out


def mappings(pid: int | str = "self") -> list[Mapping]:
    """Return every mapping of `pid`, anonymous ones included (path "")."""
    return [m for line in _maps_lines(pid) if (m := _parse_mapping(line)) is not None]


def shm_mappings(pid: int | str = "self", contains: str = "") -> list[Mapping]:
    """Return the shared-memory mappings of `pid` whose path contains `contains`."""
    # Only the path of a maps line can hold a "/" or a marker, so the lines are filtered before
    # they are parsed: a process with torch loaded has ~2000 mappings and a few shared ones, and
    # the leak checker reads this before and after every test.
    lines = [ln for ln in _maps_lines(pid) if any(k in ln for k in SHM_MARKERS)]
    return [m for ln in lines if (m := _parse_mapping(ln)) is not None
            and any(k in m.path for k in SHM_MARKERS) and contains in m.path]


def _maps_lines(pid: int | str) -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read().split("\n")  # as readlines() splits (after newline translation), less the "\n"s
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []  # gone, or another user's: nothing we can see


def _parse_mapping(line: str) -> Mapping | None:
    parts = line.split(maxsplit=5)
    if len(parts) < 5:
        return None
    path = parts[5] if len(parts) == 6 else ""
    lo, hi = parts[0].split("-")
    return Mapping(int(lo, 16), int(hi, 16), parts[1], int(parts[4]), path, parts[3])


def dev_of(st_dev: int) -> str:
    """Return a device number as /proc/<pid>/maps prints it ("00:1b")."""
    return f"{os.major(st_dev):02x}:{os.minor(st_dev):02x}"


def holders(pid: int | str, dev: int, ino: int) -> tuple[list[int], list[Mapping], int | None]:
    """Return (fds, mappings, nlink) by which process `pid` holds the object (dev, ino).

    The fds are matched by ``stat`` through ``/proc/<pid>/fd`` (the object itself, not the link's
    text), the mappings by the device and inode that maps shows; nlink is None if no fd was seen.
    """
    found, nlink = [], None
    for n in sorted(fds(pid)):
        try:
            st = os.stat(f"/proc/{pid}/fd/{n}")  # follows the link to the object itself
        except OSError:
            continue  # closed while we looked
        if (st.st_dev, st.st_ino) == (dev, ino):
            found.append(n)
            nlink = st.st_nlink
    key = dev_of(dev)
    maps = [m for m in mappings(pid) if m.inode == ino and m.dev == key]
    return found, maps, nlink


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


def pid_alive(pid: int) -> bool:
    """Return whether process `pid` exists (in our pid namespace) and has not exited.

    A zombie, exited but not reaped yet by its parent, has exited. A process of
    another user (``EPERM``) exists. A pid that is not a positive int is no process (0 and
    -1 name process groups to ``kill``, and a peer's word may be anything).
    """
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b") ")[2][:1] not in (b"Z", b"X")
    except OSError:
        return True  # no procfs to ask: it exists
