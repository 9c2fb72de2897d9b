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

    The keeper runs no code of the program: it forks inside the exit
    function, runs only the server loop, and leaves with ``os._exit``.
    Where the fork fails (no memory, a process limit), the exiting process
    lingers itself, as before.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._owner import Owner

__all__ = ["keep_after_exit"]


def keep_after_exit(owner: Owner, linger: float) -> bool:
    """At exit: hand `owner`'s unclaimed handles to a keeper for up to `linger` s; True if one
    took them (the caller then leaves the owner to it), False to linger here.

    `owner` is no longer this process's owner (``close_owner`` let go of it first), so the
    fork handlers of the multiprocessing layer leave it as it is in the keeper.
    """
    server = owner.server
    if not linger > 0 or server is None or not owner.unclaimed():
        return False
    server.stop_thread()  # first: one process at a time reads the peers' sockets
    try:
        pid = os.fork()
    except OSError:
        server.start_thread()  # no keeper: we linger ourselves
        return False
    if pid == 0:
        _serve_then_exit(owner, time.monotonic() + linger)  # never returns
    server.disown()  # the keeper serves its sockets now; our copies end with us
    return True


def _serve_then_exit(owner: Owner, deadline: float) -> None:
    code = 0
    try:
        os.setsid()  # no terminal's signals, no process group of the program's
        _close_all_but(owner.fds())
        server = owner.server
        assert server is not None
        server.serve_here(lambda: not owner.unclaimed(), deadline)
        owner.close(0)  # the socket and its directory go, and the pool
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
