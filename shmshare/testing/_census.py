"""Everything a test can leave behind, of any origin: fds, shared mappings, /dev/shm names, children, threads.

The pytest plugin's checker (``pytest --leaks``). ``leaks.py`` is the
project's own, narrower one (shmshare's names only); this one looks at
whatever the process holds, so it reports what the test's own code, the
stdlib or any library left.

Note [What counts as a leak, and what does not]
    A leak is something present after the test (and after ``settle``
    seconds of retries with garbage collected) that was not there before:

    - a fd (any kind: file, socket, pipe, memfd, eventfd...);
    - a shared mapping (``MAP_SHARED``: every ``mmap.mmap``, every segment,
      anonymous shared memory) or any mapping of a memfd or /dev/shm object.
      Private file mappings are not counted: a library imported during the
      test maps its ``.so`` for the rest of the process;
    - a /dev/shm name owned by our uid that no other process (one outside
      this process and its children) made or holds, open or mapped (another
      process's name, made while the test ran, is not ours: a name that
      carries its maker's pid, as torch's ``torch_<pid>_...`` and ours
      ``shmshare_<pid>_...`` do, is the maker's; so a concurrent run,
      pytest-xdist's other workers say, is not blamed);
    - a child process (psutil's children, recursively) still alive, or a
      zombie nobody reaped;
    - a thread still alive (daemon or not) that was not alive before.
"""

from __future__ import annotations

import gc
import linecache
import os
import re
import stat
import threading
import time
from dataclasses import dataclass

import psutil

from .._procfs import Mapping, fds, mappings, shm_mappings, shm_names
from . import _audit

__all__ = ["Census", "Leak", "leaks_since", "wait_for_leaks", "table"]


@dataclass(frozen=True)
class Census:
    """What this process holds at one moment."""

    fds: dict[int, str]
    mappings: list[Mapping]
    shm: set[str]
    children: set[int]
    threads: set[threading.Thread]

    @classmethod
    def take(cls) -> Census:
        """Read /proc/self, /dev/shm, our children and our threads."""
        with _audit.paused():
            try:
                kids = {p.pid for p in psutil.Process().children(recursive=True)}
            except psutil.Error:
                kids = set()
            shared = [m for m in mappings() if m.shared or m.path.startswith(("/memfd:", "/dev/shm/"))]
            uid = os.getuid()
            return cls(fds(), shared, {n for n in shm_names() if _owner(n) == uid}, kids, set(threading.enumerate()))


@dataclass(frozen=True)
class Leak:
    """One row of the report."""

    number: str  # the fd, the address range, the pid, the thread ident
    kind: str  # "socket fd", "shared mapping", "/dev/shm name", "child process", "thread"
    target: str  # what /proc says it is
    size: str  # bytes, or "-"
    stack: _audit.Stack | None = None  # where Python made it, when an audit event saw it


def leaks_since(before: Census) -> list[Leak]:
    """Return what this process holds now that it did not hold in `before`."""
    now = Census.take()
    with _audit.paused():
        out = [_fd_leak(n, t) for n, t in sorted(now.fds.items()) if before.fds.get(n) != t]
        old = {(m.start, m.end, m.path) for m in before.mappings}
        out += [_map_leak(m) for m in now.mappings if (m.start, m.end, m.path) not in old]
        new_names = {n for n in now.shm - before.shm
                     if not _made_elsewhere(n, before.children | now.children)}
        held = _held_elsewhere(new_names, before.children | now.children) if new_names else set()
        out += [_shm_leak(n) for n in sorted(new_names - held)]
        out += [leak for pid in sorted(now.children - before.children) if (leak := _child_leak(pid))]
        new_threads = sorted(now.threads - before.threads, key=lambda t: t.ident or 0)
        out += [_thread_leak(t) for t in new_threads if t.is_alive()]
    return out


def wait_for_leaks(before: Census, settle: float) -> list[Leak]:
    """Return the leaks that remain after up to `settle` s of collecting garbage and looking again."""
    deadline = time.monotonic() + settle
    while True:
        gc.collect()
        found = leaks_since(before)
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)


def table(leaks: list[Leak]) -> str:
    """Return the leaks as a table, then the stack that made each one that has one."""
    rows = [("number", "kind", "target", "size")] + [(x.number, x.kind, x.target, x.size) for x in leaks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3] for r in rows]
    for x in leaks:
        if x.stack:
            lines.append(f"{x.kind} {x.target if x.number == '-' else x.number} was made at (most recent call last):")
            lines += _frames(x.stack)
    return "\n".join(lines)


def _frames(stack: _audit.Stack) -> list[str]:
    """Format a stack as tracebacks do, without pytest's and pluggy's own frames."""
    out = []
    for f, n, fn in stack:
        if any(part in f for part in _HIDDEN):
            continue
        out.append(f'    File "{f}", line {n}, in {fn}')
        if src := linecache.getline(f, n).strip():
            out.append(f"      {src}")
    return out


_HIDDEN = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}")


def _fd_leak(n: int, target: str) -> Leak:
    kind, size, stack = "fd", "-", None
    try:
        st = os.stat(f"/proc/self/fd/{n}")
    except OSError:
        st = None
    if target.startswith("socket:"):
        kind, stack = "socket fd", _audit.stack_for_socket_fd(n)
    elif target.startswith("pipe:"):
        kind = "pipe fd"
    elif target.startswith("anon_inode:"):
        kind = f"{target.removeprefix('anon_inode:').strip('[]')} fd"
    elif target.startswith("/memfd:"):
        kind = "memfd fd"
    elif target.startswith("/dev/shm/"):
        kind, stack = "/dev/shm fd", _audit.stack_for_path(target)
    elif st is not None:
        kind = {stat.S_IFREG: "file fd", stat.S_IFDIR: "directory fd", stat.S_IFCHR: "char device fd",
                stat.S_IFIFO: "fifo fd"}.get(stat.S_IFMT(st.st_mode), "fd")
        stack = _audit.stack_for_path(target)
    if st is not None and (stat.S_ISREG(st.st_mode) or target.startswith("/memfd:")):
        size = str(st.st_size)
    return Leak(str(n), kind, target, size, stack)


def _map_leak(m: Mapping) -> Leak:
    anonymous = m.path in ("", "/dev/zero (deleted)") or m.path.startswith("[")
    stack = _audit.stack_for_mapping(m.dev, m.inode, m.size, anonymous)
    kind = f"{'shared' if m.shared else 'private'} mapping {m.perms}"
    return Leak(f"{m.start:x}-{m.end:x}", kind, m.path or "[anonymous]", str(m.size), stack)


def _shm_leak(name: str) -> Leak:
    path = f"/dev/shm/{name}"
    try:
        size = str(os.stat(path).st_size)
    except OSError:
        size = "-"
    return Leak("-", "/dev/shm name", path, size, _audit.stack_for_path(path))


def _child_leak(pid: int) -> Leak | None:
    status: str
    try:
        p = psutil.Process(pid)
        status = p.status()
        cmd = " ".join(p.cmdline()) if status != psutil.STATUS_ZOMBIE else p.name()
    except psutil.NoSuchProcess:
        return None  # gone (reaped) since the census
    except psutil.Error:
        status, cmd = "?", "?"
    what = "zombie: exited, never reaped" if status == psutil.STATUS_ZOMBIE else status
    return Leak(str(pid), "child process", f"{cmd[:80]} ({what})", "-")


def _thread_leak(t: threading.Thread) -> Leak:
    target = getattr(t, "_target", None)  # threading keeps it until run() returns
    code = getattr(target, "__code__", None)
    name = getattr(target, "__qualname__", "?")
    where = f" running {name} ({code.co_filename}:{code.co_firstlineno})" if code else ""
    daemon = ", daemon" if t.daemon else ""
    return Leak(str(t.ident), "thread", f"{t.name!r}{where}{daemon}", "-")


def _owner(name: str) -> int:
    try:
        return os.stat(f"/dev/shm/{name}").st_uid
    except OSError:
        return -1  # removed while we looked


_PID_IN_NAME = re.compile(r"[A-Za-z]+_(\d{1,10})_")  # torch_<pid>_..., shmshare_<pid>_...


def _made_elsewhere(name: str, ours: set[int]) -> bool:
    """Whether a /dev/shm name says another process made it: not us, not one of our children."""
    m = _PID_IN_NAME.match(name)
    return m is not None and int(m.group(1)) != os.getpid() and int(m.group(1)) not in ours


def _held_elsewhere(names: set[str], ours: set[int]) -> set[str]:
    """Return which of these /dev/shm names a process outside ours (this one and the test's
    children) holds open or mapped: then it is that process's. C's usual shm_open, mmap, close
    leaves a mapping and no fd. A file of the name that was unlinked (" (deleted)") or, mapped,
    has another inode is not the one the name now has."""
    me, uid, held = os.getpid(), os.getuid(), set()
    inodes = {}
    for name in names:
        try:
            inodes[name] = os.stat(f"/dev/shm/{name}").st_ino
        except OSError:
            continue  # removed while we looked
    for pid in psutil.pids():
        if pid == me or pid in ours:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue  # another user's: its fds are not ours to read, and a name of ours it holds is rare
        except OSError:
            continue  # gone while we looked
        for target in fds(pid).values():
            name = target.removeprefix("/dev/shm/")
            if name in inodes and name != target:
                held.add(name)
        for m in shm_mappings(pid, "/dev/shm/"):
            name = m.path.removeprefix("/dev/shm/")
            if inodes.get(name) == m.inode:
                held.add(name)
        if len(held) == len(inodes):
            break
    return held
