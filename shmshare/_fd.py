"""Fd: an owned file descriptor, the one way shmshare hands out fds it received."""

from __future__ import annotations

import os

from ._lifetime import Closeable

__all__ = ["Fd"]


class Fd(Closeable):
    """An owned file descriptor: closed on ``close()``, on ``__exit__`` or when collected.

    ``take()`` moves ownership out (the Fd forgets the number), so every fd
    has exactly one owner at any moment.
    """

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        """Return the fd number; the Fd still owns it."""
        if self._fd < 0:
            raise ValueError("this Fd was taken or closed")
        return self._fd

    def take(self) -> int:
        """Return the fd number and give up ownership: the caller must close it."""
        fd = self.fileno()
        self._fd = -1
        return fd

    @property
    def closed(self) -> bool:
        """Whether the Fd no longer owns a fd."""
        return self._fd < 0

    def close(self) -> None:
        """Close the fd if still owned. Idempotent."""
        fd, self._fd = self._fd, -1  # forget first: a second close is a no-op, never EBADF
        if fd >= 0:
            os.close(fd)


    def __repr__(self) -> str:
        return f"<Fd {self._fd}>" if self._fd >= 0 else "<Fd closed>"
