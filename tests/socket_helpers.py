"""A listen backlog filled on purpose: what a listener that does not accept looks like to a
connecting peer (EAGAIN on a non-blocking AF_UNIX connect)."""

from __future__ import annotations

import os
import socket

__all__ = ["fill_backlog"]


def fill_backlog(path: str | os.PathLike[str], most: int) -> list[socket.socket]:
    """Connect to `path` without being accepted until the kernel says the backlog is full; return
    the queued sockets (the caller closes them). AssertionError if `most` connects never fill it."""
    queued: list[socket.socket] = []
    try:
        for _ in range(most):
            s = socket.socket(socket.AF_UNIX,
                              socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            try:
                s.connect(os.fspath(path))
            except BlockingIOError:
                s.close()
                return queued
            queued.append(s)
    except BaseException:
        for s in queued:
            s.close()
        raise
    for s in queued:
        s.close()
    raise AssertionError(f"{most} connects never filled the backlog of {os.fspath(path)!r}")
