"""Where a fd or a mapping was made: the Python stack of each ``open``, ``socket.__new__`` and ``mmap.__new__``.

Note [One audit hook, recording only while asked]
    ``sys.addaudithook`` cannot be undone, and the hook then runs on every
    audit event of the process (imports, compiles, ``sys._getframe``...).
    So it is installed once, on the first ``recording()``, and returns at
    its first test while no check is active. While one is, it keeps, per
    event, a key to match a leaked resource by (a path, a device and inode,
    a socket object, an anonymous mapping's length) and the stack as
    (file, line, function) triples: never the frames themselves, which
    would keep the test's locals, and its fds, alive. At most
    ``MAX_RECORDS`` are kept: a test that opens a million files loses the
    oldest stacks, not memory. Not every fd has an event: ``os.pipe``,
    ``os.dup``, ``os.memfd_create`` and fds made in C have none, and are
    reported without a stack. ``_busy`` is one flag for all threads: an
    event of another thread that lands while this one records is dropped
    (its leak is still reported, without a stack), never recorded twice.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from .._procfs import dev_of

__all__ = ["recording", "stack_for_path", "stack_for_socket_fd", "stack_for_mapping"]

MAX_RECORDS = 10_000
MAX_FRAMES = 24  # the innermost ones: where the test called, not how pytest got there
_PAGE = os.sysconf("SC_PAGE_SIZE")

Stack = tuple[tuple[str, int, str], ...]  # (file, line, function), outermost first

_installed = False
_active = 0  # how many recording() blocks are open
_busy = threading.local()  # .on: this thread is inside the hook or paused() (their own calls raise events too)
_records: deque[tuple[Any, Stack]] = deque(maxlen=MAX_RECORDS)  # sockets: found by scanning for the live object
_index: dict[Any, Stack] = {}  # path, inode and anonymous keys -> the latest stack (oldest first, MAX_RECORDS)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record the creating stacks of fds and mappings inside the block (install the hook once)."""
    global _installed, _active
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    if not _active:
        _records.clear()
        _index.clear()
    _active += 1
    try:
        yield
    finally:
        _active -= 1


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Record nothing on this thread inside the block (the checker's own reads of /proc)."""
    was = getattr(_busy, "on", False)
    _busy.on = True
    try:
        yield
    finally:
        _busy.on = was


def stack_for_path(path: str) -> Stack | None:
    """Return the stack of the latest ``open`` of `path` (as /proc shows it, " (deleted)" allowed)."""
    return _index.get(("path", path.removesuffix(" (deleted)")))


def stack_for_socket_fd(fd: int) -> Stack | None:
    """Return the stack that made the socket object that still holds `fd`."""
    def match(key: Any) -> bool:
        sock = key[1]() if key[0] == "socket" else None
        try:
            return sock is not None and sock.fileno() == fd
        except OSError:
            return False
    return _latest(match)


def stack_for_mapping(dev: str, inode: int, size: int, anonymous: bool) -> Stack | None:
    """Return the stack of the ``mmap.mmap`` that made a mapping (by its object, or its size if anonymous)."""
    return _index.get(("anon", size) if anonymous else ("inode", dev, inode))


def _latest(match: Callable[[Any], bool]) -> Stack | None:
    with paused():
        return next((stack for key, stack in reversed(_records) if match(key)), None)


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not _active or event not in _KEYS or getattr(_busy, "on", False):
        return
    _busy.on = True  # per thread: the hook's own calls raise events too
    try:
        key = _KEYS[event](args)
        if key is None:
            return
        stack = _stack(sys._getframe(1))
        if key[0] == "socket":
            _records.append((key, stack))
        else:
            _index.pop(key, None)  # the latest last
            _index[key] = stack
            if len(_index) > MAX_RECORDS:
                del _index[next(iter(_index))]
    except Exception:  # noqa: BLE001, S110 - an audit hook that raises would fail the user's own open()
        pass
    finally:
        _busy.on = False


def _stack(frame: FrameType | None) -> Stack:
    out: list[tuple[str, int, str]] = []
    while frame is not None and len(out) < MAX_FRAMES:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(reversed(out))


def _open_key(args: tuple[Any, ...]) -> Any:
    path = args[0]
    if isinstance(path, int) or path is None:
        return None  # open(fd): the fd was made elsewhere
    return ("path", os.path.realpath(os.fsdecode(path)))  # /proc shows the resolved path


def _socket_key(args: tuple[Any, ...]) -> Any:
    return ("socket", weakref.ref(args[0]))


def _mmap_key(args: tuple[Any, ...]) -> Any:
    fileno, length = args[0], args[1]
    if fileno == -1:
        return ("anon", -(-length // _PAGE) * _PAGE)  # the kernel rounds up to whole pages
    st = os.fstat(fileno)
    return ("inode", dev_of(st.st_dev), st.st_ino)


_KEYS = {"open": _open_key, "socket.__new__": _socket_key, "mmap.__new__": _mmap_key}
