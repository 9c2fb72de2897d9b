"""/dev/shm and host memory as the segment layer reports them: free space, stale names, hints.

``segment.py`` re-exports :func:`sweep` and :func:`shm_free_bytes`; the doctor
uses :func:`stale_names`. Layer 0: stdlib and the other layer-0 modules only.

Note [Stale shm names]
    A POSIX segment is named ``/shmshare_<pid>_<hex>`` and, with
    ``Flags.UNLINK`` (the default), the name is removed right after
    ``shm_open`` succeeds, so a crash leaves a name only if it falls between
    those two calls -- or if the creator asked for a name that outlives the
    mapping (no UNLINK) and died before ``close()``. :func:`sweep` removes
    names whose creator is gone: the pid in the name has no process
    (``kill(pid, 0)`` says ESRCH), or it has one that started after the name
    was last written (the pid was reused). Only names owned by our uid are
    touched, and only regular files. Removing a name never frees pages that
    someone still maps or holds by fd; it only stops them being opened by
    name. Limitation: /dev/shm shared across pid namespaces (``docker run
    --ipc=host``) makes another namespace's live pids look dead here; run the
    sweep where the creators' pids are visible.
"""

from __future__ import annotations

import errno
import os
import re
import stat

from . import _cgroup

__all__ = ["SHM_DIR", "shm_free_bytes", "stale_names", "sweep", "space_hint"]

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"shmshare_(\d+)_[0-9a-f]+")
_REUSE_SLACK = 2.0  # s: a process that started this long after the name's mtime cannot own it


def shm_free_bytes(path: str = SHM_DIR) -> tuple[int, int]:
    """Return (free, total) bytes of the tmpfs at `path` (``/dev/shm``)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def stale_names(directory: str = SHM_DIR) -> list[tuple[str, int]]:
    """Return (path, bytes) of every ``shmshare_<pid>_*`` name of ours whose creator is gone."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:  # no /dev/shm: nothing can be stale there
        return []
    uid, me = os.geteuid(), os.getpid()
    out = []
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or int(m.group(1)) == me:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # removed while we looked
        if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
            continue  # another user's, or not a regular file: never ours to remove
        if not _alive_since(int(m.group(1)), st.st_mtime):
            out.append((path, st.st_blocks * 512))
    return out


def sweep(dry_run: bool = False, directory: str = SHM_DIR) -> list[str]:
    """Remove the ``/dev/shm/shmshare_<pid>_*`` names whose creator died; return their paths.

    With `dry_run` nothing is removed: the paths that would be are returned.
    See Note [Stale shm names] for what counts as dead and what is kept.
    """
    removed = []
    for path, _ in stale_names(directory):
        if not dry_run:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue  # someone else swept it first: not ours to report
        removed.append(path)
    return removed


def space_hint(backend: str, nbytes: int, err: int) -> str:
    """Say where the memory for a `backend` segment of `nbytes` comes from, and how to get more."""
    if backend == "posix":
        try:
            free, total = shm_free_bytes()
        except OSError as exc:
            return f"{SHM_DIR} cannot be read ({exc.strerror}); use backend='memfd'"
        return (f"{SHM_DIR} has {_fmt(free)} free of {_fmt(total)} (a tmpfs) and {_fmt(nbytes)} "
                f"were asked: enlarge it (docker run --shm-size=8g, or mount -o remount,size=8G "
                f"{SHM_DIR}), remove stale files (`shmshare sweep`), or use backend='memfd', "
                f"which {SHM_DIR}'s size does not cap")
    parts = []
    avail = _mem_available()
    if avail is not None:
        parts.append(f"the host has {_fmt(avail)} available")
    lim = _cgroup.memory_limit(nbytes=nbytes)
    if lim is not None:
        parts.append(f"memory cgroup {lim.path} allows {_fmt(lim.limit)} with {_fmt(lim.usage)} "
                     "in use")
    else:
        parts.append("no memory cgroup limit applies")
    what = "; ".join(parts) + f", and {_fmt(nbytes)} were asked"
    if err == errno.EFBIG:
        what += " (EFBIG: past RLIMIT_FSIZE or the file system's maximum file size)"
    return (f"{what}: free memory (drop arrays from earlier batches, empty_cache()), lower the "
            "pool's limit, or raise the container's memory limit (docker run --memory)")


def _alive_since(pid: int, mtime: float) -> bool:
    """Return whether a process `pid` exists and may have written a name at `mtime`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, under another uid: it may still own the name
    started = _start_time(pid)
    return started is None or started <= mtime + _REUSE_SLACK


def _start_time(pid: int) -> float | None:
    """Return when `pid` started (seconds since the epoch), from /proc; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):  # gone, or no /proc: count it as alive
        return None
    ticks = int(stat.rpartition(")")[2].split()[19])  # field 22, after "comm" (which may hold spaces)
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # no /proc: the hint says less, the error is still raised
        return None
    return None


def _fmt(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"
