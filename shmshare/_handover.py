"""An end of a connection in another process: forked with its parent, or handed to a spawned child.

Note [An end in another process]
    A forked child holds the same sockets as its parent. It gets fresh locks
    (a lock held by another thread at fork time would never be released
    there) and introduces itself with a HELLO of its own pid before its first
    message; the parent's goodbye is not the child's to say.

    Rings (Note [Rings] in ``_ring.py``) belong to the process that set them
    up: the child unmaps its copy and uses the socket. A copy of the end that
    *offered* them (a channel's sender, a store client) reads the socket and
    drops the parent's ring frames there (a wake, a carried frame); its peer,
    seeing the HELLO of a process other than the one it set the rings up
    with, writes every later frame on the socket, where any process of this
    end may read it, as before rings. A copy of the end that *answered* (a
    receiver) cannot receive: what its peer sends is in the parent's rings,
    so a recv() there raises ValueError saying so, rather than wait forever.

    Both processes then read one socket, and either may take a frame meant
    for the other, with rings or without: a parent whose peer's HELLO a
    child took uses the peer's kernel credentials in its place; a carried
    frame a child took is passed over by the parent's marker, lost as any
    frame taken by the wrong process is. One process using an end at a
    time (the documented way) meets none of this.

    Handing an end to a spawned (or forkserver) child pickles it the way
    ``multiprocessing.connection`` does: the socket's fd is dup'ed through
    the child's start machinery, never through a pickle stream of ours. An
    end that set up rings in this process cannot be handed over (its rings
    and its place in them stay here): ValueError says to hand ends over
    before their first use.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from . import _fork
from ._handshake import PROTOCOL_VERSION

if TYPE_CHECKING:
    from .wire import Connection

__all__ = ["reduce", "stand_in_hello"]


def reduce(conn: Connection) -> Any:
    """``Connection.__reduce__``: for a multiprocessing child's start only."""
    from multiprocessing import context, reduction

    if context.get_spawning_popen() is None:
        raise TypeError("a Connection can be pickled only to pass it to a multiprocessing "
                        "child; for an unrelated process use Listener/connect")
    if conn._rings is not None:
        raise ValueError(
            f"this end set up rings with its peer in this process (pid {os.getpid()}) at its first "
            "send or receive, and they cannot move to another process: hand an end to a child "
            "before using it, or make a new channel for the child (Note [Rings] in _ring.py)")
    dup = reduction.DupFd(conn.fileno())
    return _rebuild, (dup, conn._role, conn._max_frame, conn._max_fds, tuple(conn._allow_uids))


def _rebuild(dup: Any, role: str, max_frame: int, max_fds: int, allow_uids: tuple[int, ...]) -> Connection:
    from .wire import Connection

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=dup.detach())
    return Connection(sock, role=role, max_frame=max_frame, max_fds=max_fds, allow_uids=allow_uids)


def _after_fork_in_child() -> None:
    from .wire import _live

    for conn in list(_live):
        conn._send_lock = threading.Lock()
        conn._recv_lock = threading.Lock()
        conn._hello_sent = False
        conn._farewell = None  # the parent's goodbye is not the child's to say
        if conn._rings is not None:
            conn._rings_of = None if conn._rings.offered else os.getppid()
            conn._rings.ring.close()  # this process's copy of the mapping only
            conn._forked = True
            conn._rings = None


def _after_fork_in_parent() -> None:
    from .wire import _live

    for conn in list(_live):
        conn._shared = True


def stand_in_hello(conn: Connection) -> dict[str, Any]:
    """The peer's HELLO, read by a forked copy of this end: its kernel credentials stand in."""
    return {"version": PROTOCOL_VERSION, "pid": conn.peer_cred.pid, "role": "?"}


_fork.on_fork_in_child(2, _after_fork_in_child)
_fork.on_fork_in_parent(_after_fork_in_parent)
