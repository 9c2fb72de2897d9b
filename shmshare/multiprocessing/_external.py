"""Segments torch made (``share_memory_()``), lent as they are: their fds, kept while handles are out.

A storage torch has put in shared memory (its ``file_descriptor`` strategy)
is a segment of its own, which the owner lends with no copy: the handle
names it by an id of ours, and the owner keeps a dup of torch's fd while
handles to it are out, so that a peer can fetch it (torch closes its own fd
when the storage goes). A segment is known by its inode, not its address:
torch maps the next storage where a freed one was, while our dup keeps the
old one's inode alive.
"""

from __future__ import annotations

import os

from ..memory._shm import _new_id

__all__ = ["External", "TorchSegments"]


class External:
    """One segment torch made: our dup of its fd, its size, and the handles out on it."""

    __slots__ = ("id", "fd", "size", "key", "nbytes", "leases")

    def __init__(self, fd: int, size: int, key: tuple[int, int], nbytes: int) -> None:
        self.id = _new_id()  # the id handles name it by (the pool's segment ids' kind)
        self.fd, self.size, self.key, self.nbytes = fd, size, key, nbytes
        self.leases = 0  # handles out on it


class TorchSegments:
    """The owner's book of torch's segments with handles out (its lock held by the caller)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, int], External] = {}

    def get(self, fd: int, nbytes: int) -> External:
        """The record of torch's segment behind `fd` (a storage of `nbytes`), made on first use."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        ext = self._by_key.get(key)
        if ext is None:
            ext = self._by_key[key] = External(os.dup(fd), st.st_size, key, nbytes)
        return ext

    def drop(self, ext: External) -> bool:
        """Close our fd of `ext` once no handle is out on it; True if it went."""
        if ext.leases:
            return False
        if self._by_key.get(ext.key) is ext:
            del self._by_key[ext.key]
        os.close(ext.fd)
        return True

    def find(self, seg_id: int) -> External | None:
        return next((e for e in self._by_key.values() if e.id == seg_id), None)

    def fds(self) -> set[int]:
        return {e.fd for e in self._by_key.values()}

    def forget(self) -> None:
        """In a forked child: close our copies of the parent's fds."""
        for ext in self._by_key.values():
            os.close(ext.fd)
        self._by_key.clear()

    def all(self) -> list[External]:
        return list(self._by_key.values())
