"""The owner's own record of who holds what: one claim map per receiving process.

Note [The owner's record of claims]
    The lease table (``_table.py``) is mapped read-write by every peer, so
    its words say only what some peer last wrote: good for deciding which
    of two unpickles of the same bytes wins (the compare-and-swap), never
    for deciding that a block is free. A same-uid peer could write a
    victim's slot over with its own pid and release it, or hang up, and the
    owner would reuse the block under the victim's live array.

    So each receiving process gets a claim map of its own from the owner:
    one byte per table slot, in a memfd that only that process is given.
    The receiver sets its byte *before* its compare-and-swap and clears it
    when the array's last view dies, before the release is queued. The
    owner gives a claimed block back only when no live process's map marks
    its slot; a release frame, or the end of a process, is only the moment
    to look. What a peer writes in the shared table can then make the owner
    keep a block longer (or steal an unclaimed handle: the rightful
    receiver gets a clear "already unpickled" error), never free one that a
    live process marks.

    A process is gone when its pidfd says so, not when a connection ends:
    a receiver that gave up on an owner that did not answer (stopped,
    paused, GIL-starved) makes a new connection and closes the old one
    while it still holds arrays, and their blocks must stay. Where no
    pidfd can be had (a peer whose pid our namespace cannot see, or no fd
    free) the map lives as long as that peer's connections, and each such
    connection gets a map of its own.

    What this cannot stop: a same-uid process that reads another's
    ``/proc/<pid>/fd`` or ptraces it, or that writes into the pool's
    segments directly (each peer maps them writable, as torch's shared
    tensors are). Those are out of any owner's reach.
"""

from __future__ import annotations

import os
import select

import numpy as np

from ..segment import Flags, Segment

__all__ = ["ClaimMap", "ClaimBook"]


class ClaimMap:
    """One receiving process's marks: byte `slot` is 1 while it holds that slot's array."""

    __slots__ = ("key", "pid", "pidfd", "segment", "marks", "conns")

    def __init__(self, key: int, pid: int, pidfd: int | None, slots: int) -> None:
        self.key = key  # the book's key: the pid, or a negative number for a peer without one
        self.pid = pid  # as SO_PEERCRED gave it (0: not visible from our namespace)
        self.pidfd = pidfd  # readable once the process has exited; None: lives with its conns
        self.segment = Segment.create(slots, Flags.SHAREDMEM | Flags.KEEPFD)
        self.marks = np.frombuffer(self.segment.buffer, np.uint8)  # ours to read, its to write
        self.conns = 0  # its open connections to our fd server

    @property
    def fd(self) -> int:
        fd = self.segment.fd
        assert fd is not None
        return fd

    @property
    def closed(self) -> bool:
        return self.segment.closed

    def exited(self) -> bool:
        """Whether the process is gone, as its pidfd says (False without one: see conns)."""
        if self.pidfd is None:
            return False
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        return bool(p.poll(0))

    def close(self) -> None:
        self.marks = np.zeros(0, np.uint8)
        self.segment.close()
        fd, self.pidfd = self.pidfd, None
        if fd is not None:
            os.close(fd)


class ClaimBook:
    """Every receiving process's ClaimMap, by pid (Note [The owner's record of claims])."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.maps: dict[int, ClaimMap] = {}
        self._anon = 0  # keys for peers without a pidfd: -1, -2, ...

    def join(self, pid: int) -> tuple[ClaimMap, ClaimMap | None]:
        """The map of a newly connected process, and the one it replaces (a dead process whose
        pid came back before we saw its pidfd): the caller reclaims that one's slots."""
        got = self.maps.get(pid) if pid > 0 else None
        if got is not None and not got.exited():
            got.conns += 1
            return got, None
        stale = self.maps.pop(pid) if got is not None else None  # retired by the caller
        pidfd = _pidfd(pid)
        if pidfd is None:
            self._anon -= 1
            key = self._anon
        else:
            key = pid
        try:
            new = ClaimMap(key, pid, pidfd, self.slots)
        except BaseException:
            if pidfd is not None:
                os.close(pidfd)
            if stale is not None:
                self.maps[pid] = stale
            raise
        new.conns = 1
        self.maps[key] = new
        return new, stale

    def retire(self, cm: ClaimMap) -> np.ndarray:
        """Drop `cm` from the book; return the slots it marked (to look at again)."""
        if self.maps.get(cm.key) is cm:
            del self.maps[cm.key]
        marked = np.flatnonzero(cm.marks)
        cm.close()
        return marked

    def held(self, slot: int) -> bool:
        """Whether a live process's map marks `slot`."""
        return any(m.marks[slot] for m in self.maps.values())

    def close(self) -> None:
        for cm in list(self.maps.values()):
            cm.close()
        self.maps.clear()

    def forget_in_child(self) -> None:
        """In a forked child: close our copies of the parent's maps and pidfds."""
        for cm in self.maps.values():
            cm.segment._forget_after_fork()
            cm.close()
        self.maps.clear()


def _pidfd(pid: int) -> int | None:
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None  # gone already (its conns decide), no fd free, or a kernel without pidfds
