"""A keeper: what serves a process's unclaimed handles once that process has exited.

Note [A keeper after exit]
    A process that puts an array on a Queue and returns must not take the
    array with it (Note [Exit linger]): the reader may unpickle the handle
    only after ``join()``, as it would a plain pickle. Serving the handle
    from the exiting process itself made that process exit up to the
    linger late (every script that sent an array nobody read ended 10 s
    late), and a reader that joined first waited that long for nothing.

    So at exit, when handles are still unclaimed, the process forks a
    *keeper* and exits at once. The keeper is a copy of the owner: the same
    pool segments, lease table, claim maps, peers' connections and socket,
    the fds and mappings of which it holds for itself. It starts a session
    of its own, closes every other fd it inherited (the exiting process's
    stdout pipe, sockets and files must not stay open behind its back: a
    reader of that pipe would wait for the keeper too), serves from its one
    thread until every handle is claimed or the linger is over, removes the
    socket and exits. Handles claimed by then stay valid for good, as
    always: their receivers map the memfds themselves.

    The keeper runs no code of the program. It is forked with the C
    library's ``fork()`` called with the GIL held (``ctypes.PyDLL``), not
    ``os.fork()``: no ``os.register_at_fork`` handler runs, the program's
    or any library's. The locks it needs (the owner's) are taken before the
    fork by the exiting thread, which is the keeper's only thread, and given
    back on both sides. In the keeper the garbage collector is off (no
    ``__del__`` of the program's garbage runs a second time), every Python
    signal handler is reset to the default, and it leaves with
    ``os._exit`` without closing anything but its socket file. Where the
    fork fails (no memory, a process limit), the exiting process lingers
    itself, as before.
"""

from __future__ import annotations

import ctypes
import gc
import numbers
import os
import signal
import time
from typing import TYPE_CHECKING

from ._common import env_number

if TYPE_CHECKING:
    from ._owner import Owner

__all__ = ["keep_after_exit", "exit_linger", "set_exit_linger"]

_DEFAULT_LINGER = 10.0


def _env_linger() -> float:
    return env_number("SHMSHARE_MP_LINGER", _DEFAULT_LINGER, "seconds")


_linger: float | None = None


def exit_linger() -> float:
    """Seconds an exiting process keeps serving handles not yet unpickled (Note [Exit linger])."""
    return _env_linger() if _linger is None else _linger


def set_exit_linger(seconds: float) -> None:
    """Set :func:`exit_linger` for this process (children made later inherit it through
    ``SHMSHARE_MP_LINGER``, which this sets too)."""
    global _linger
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise ValueError(f"exit linger must be >= 0 seconds, got {seconds!r}")
    value = float(seconds)
    if not value >= 0:
        raise ValueError(f"exit linger must be >= 0 seconds, got {seconds!r}")
    _linger = value
    os.environ["SHMSHARE_MP_LINGER"] = repr(value)


def keep_after_exit(owner: Owner, linger: float) -> bool:
    """At exit: hand `owner`'s unclaimed handles to a keeper for up to `linger` s; True if one
    took them (the caller then leaves the owner to it), False to linger here.

    `owner` is no longer this process's owner (``close_owner`` let go of it first).
    """
    server = owner.server
    if not linger > 0 or server is None or not owner.unclaimed():
        return False
    server.stop_thread()  # first: one process at a time reads the peers' sockets
    # a thread still pickling may hold the owner's lock: the keeper must not start with it held
    if not owner._lock.acquire(timeout=_LOCK_WAIT):
        server.start_thread()
        return False
    try:
        pid = _raw_fork()
    except OSError:
        pid = -1
    if pid != 0:
        owner._lock.release()
        if pid < 0:
            server.start_thread()  # no keeper: we linger ourselves
            return False
        server.disown()  # the keeper serves its sockets now; our copies end with us
        return True
    # the keeper
    owner._lock.release()  # taken by this very thread, the only one here
    _serve_then_exit(owner, time.monotonic() + linger)  # never returns
    return False  # (unreachable)


_LOCK_WAIT = 5.0  # s the exiting thread waits for a pickling thread to let go of the owner


def _raw_fork() -> int:
    """fork(2) with none of os.fork()'s at-fork handlers (the program's code), the GIL held."""
    fork = ctypes.PyDLL(None).fork  # PyDLL: the GIL stays held; no other thread runs meanwhile
    fork.restype = ctypes.c_int
    pid = int(fork())
    if pid < 0:
        raise OSError(ctypes.get_errno(), "fork failed")
    return pid


def _serve_then_exit(owner: Owner, deadline: float) -> None:
    code = 0
    try:
        gc.disable()  # the program's garbage is not ours to finalize (a second time)
        for sig in signal.valid_signals():
            try:
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)  # no handler of the program's runs here
            except (OSError, ValueError, TypeError):
                pass  # SIGKILL, SIGSTOP and the like
        os.setsid()  # no terminal's signals, no process group of the program's
        _close_all_but(owner.fds())
        server = owner.server
        assert server is not None
        server.serve_here(lambda: not owner.unclaimed(), deadline)
        server.remove_socket()  # what a client needs to see we are gone; the rest ends with us
    except BaseException:  # noqa: BLE001 -- nothing of the program's may run here: leave
        code = 1
    finally:
        os._exit(code)


def _close_all_but(keep: set[int]) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd not in keep:
            os.dup2(null, fd)  # a print somewhere goes nowhere, not into a reused fd
    keep = keep | {0, 1, 2}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # listdir's own fd, closed already
