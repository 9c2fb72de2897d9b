"""The system calls behind :class:`shmshare.Segment`, each failure turned into an error with its fix.

Layer 0: ``segment.py`` calls these; they know nothing of segments beyond a
backend's name. Fd exhaustion is always :class:`FdLimitError` (worded in
one place, ``FdLimitError.exhausted``); everything else a
:class:`SegmentError` that keeps ``errno``.

Note [Checking memory before reserving]
    ``posix_fallocate`` inside a memory cgroup does not fail past
    ``memory.max``: the kernel OOM-kills the process. So every reservation
    of pages (a fresh classic segment, a range mapped into an expandable
    one) first asks ``_cgroup.memory_limit`` and refuses with
    ``SegmentError(ENOMEM)`` naming the cgroup, its limit, its usage and the
    request. The check is cached and cheap, and not exact: Note [Checking the
    cgroup before fallocate] in ``_cgroup`` says what can still race.
    Outside any limit the same holds for the host: a memfd lives on the
    kernel's internal tmpfs, which no size caps, so fallocate past the RAM
    and swap the host has does not fail either; the kernel's global OOM
    killer picks a victim, maybe another program. So a request larger than
    ``MemAvailable + SwapFree`` (less ``_HOST_HEADROOM``) is refused too.
    That catches one impossible request, not many that add up past it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Any

import numpy as np

from . import _cgroup
from ._errors import FD_EXHAUSTED, FdLimitError, SegmentError
from ._shmdir import SHM_DIR

__all__ = ["check_cgroup", "describe_fd", "fd_error", "ftruncate", "memfd_create", "sealed_memfd",
           "shm_name", "shm_open", "unlink"]

def shm_name(name: str) -> str:
    """Return `name` as a POSIX shm name (``/x``), or raise ValueError."""
    name = name if name.startswith("/") else "/" + name
    if "/" in name[1:] or len(name) > 255:
        raise ValueError(f"a POSIX shm name is '/' plus up to 254 characters without '/', got {name!r}")
    return name


def shm_open(name: str, oflag: int) -> int:
    """Open ``/dev/shm/<name>`` (what glibc's shm_open does); return the owned fd."""
    try:
        return os.open(SHM_DIR + name, oflag | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno in FD_EXHAUSTED:
            raise fd_error(f"shm_open({name!r})", exc) from exc
        hint = ""
        if exc.errno == errno.ENOENT:
            hint = " (no such shm object: it was never created or was already unlinked)"
        elif exc.errno == errno.EEXIST:
            hint = " (it exists and Flags.EXCLUSIVE was given)"
        raise SegmentError(exc.errno, f"shm_open({name!r}) failed: {exc.strerror}{hint}") from exc


def unlink(backend: str, name: str | None) -> None:
    """Remove a posix or file name; a memfd has none. Idempotent."""
    if not name or backend == "memfd":
        return  # a memfd has no name in any file system
    try:
        os.unlink(SHM_DIR + name if backend == "posix" else name)
    except FileNotFoundError:
        pass  # someone else unlinked it: the goal is met


def describe_fd(fd: int, st: os.stat_result, given: int) -> tuple[str, str | None]:
    """Return (backend, name) of a fd to map, or raise SegmentError if it cannot be mapped."""
    if not stat.S_ISREG(st.st_mode):  # the caller closes `fd`
        raise SegmentError(errno.EINVAL, f"fd {given} is not a regular file or shared memory "
                           f"object (mode {stat.filemode(st.st_mode)}); only those can be mapped")
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "file", None
    if target.startswith("/memfd:"):
        return "memfd", target[len("/memfd:"):].removesuffix(" (deleted)")
    if target.startswith(SHM_DIR + "/"):
        return "posix", target[len(SHM_DIR):].removesuffix(" (deleted)")
    return "file", target.removesuffix(" (deleted)")


def memfd_create(name: str) -> int:
    """Create a sealable, close-on-exec memfd; return the owned fd."""
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        if exc.errno in FD_EXHAUSTED:
            raise fd_error("memfd_create", exc) from exc
        raise SegmentError(exc.errno, f"memfd_create failed: {exc.strerror}; "
                           "use backend='posix' on kernels without memfd") from exc


def sealed_memfd(name: str, size: int, seals: int, allocate: bool = True) -> int:
    """A memfd of `size` bytes, every page allocated (unless not `allocate`: a test's holes),
    sealed with `seals`; the owned fd, closed if any step fails."""
    fd = memfd_create(name)
    try:
        os.ftruncate(fd, size)
        if allocate and size:
            os.posix_fallocate(fd, 0, size)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ftruncate(fd: int, size: int, what: str) -> None:
    """Set the size of `fd` (`what` names it in the error)."""
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        raise SegmentError(exc.errno, f"ftruncate of {what} to {size} bytes failed: "
                           f"{exc.strerror}") from exc


def fd_error(syscall: str, exc: OSError) -> OSError:
    """Return FdLimitError for EMFILE/ENFILE (the one wording, in _errors), else a SegmentError."""
    if exc.errno in FD_EXHAUSTED:
        return FdLimitError.exhausted(syscall, exc, "each kept segment holds one fd")
    return SegmentError(exc.errno, f"{syscall} failed: {exc.strerror}")


_HOST_HEADROOM = 64 << 20  # bytes left to the rest of the host (Note [Checking memory before reserving])


def check_host(nbytes: int, backend: str) -> None:
    """Refuse `nbytes` more than the host's available memory and free swap (Note [Checking memory
    before reserving])."""
    avail = _host_available()
    if avail is None or nbytes <= avail - _HOST_HEADROOM:
        return
    raise SegmentError(errno.ENOMEM, (
        f"cannot reserve {nbytes} bytes for a {backend} segment: the host has {avail} bytes "
        f"available (MemAvailable and SwapFree of /proc/meminfo), and posix_fallocate past that "
        "would set off the kernel's OOM killer, which may kill any process, so it was not tried. "
        "Ask for less, or free memory first (drop arrays of earlier batches, empty_cache())"))


def _host_available() -> int | None:
    got = {}
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key in (b"MemAvailable", b"SwapFree"):
                    got[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None  # no /proc to ask: not checked
    return sum(got.values()) if b"MemAvailable" in got else None


def check_cgroup(nbytes: int, backend: str) -> None:
    """Refuse `nbytes` the memory cgroup cannot take (Note [Checking memory before reserving])."""
    lim = _cgroup.memory_limit(nbytes=nbytes)
    if lim is None or lim.fits(nbytes):
        return
    cache = f", {lim.reclaimable} of them reclaimable page cache" if lim.reclaimable else ""
    raise SegmentError(errno.ENOMEM, (
        f"cannot reserve {nbytes} bytes for a {backend} segment: memory cgroup {lim.path} "
        f"(v{lim.version}, {lim.directory}) has a limit of {lim.limit} bytes and {lim.usage} in "
        f"use{cache}, {lim.slack} kept as headroom; posix_fallocate past the limit would get "
        "this process OOM-killed, so it was not tried. Free memory (drop arrays of earlier "
        "batches, empty_cache()), lower the pool's limit, or raise the cgroup's (docker run "
        "--memory; memory.max, or memory.limit_in_bytes on cgroup v1)"))


def memfd_seals(final: bool, growable: bool) -> int:
    """Return the seals of a new memfd (Note [Seals] in ``segment``): never shrinks."""
    seal = fcntl.F_SEAL_SHRINK | (0 if growable else fcntl.F_SEAL_GROW)
    return seal | (fcntl.F_SEAL_SEAL if final else 0)


def check_nbytes(nbytes: Any) -> int:
    """Return `nbytes` as an int, or raise ValueError unless it is a positive integer."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    return int(nbytes)
