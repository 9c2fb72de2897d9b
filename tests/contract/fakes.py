"""Fake peers for the hostile tests of the transport contract: an owner's fd server and a store daemon
that answer as the real ones do, with forged fds and descriptors (tests/mp and tests/store forge what
those send the other way)."""

from __future__ import annotations

import os
import threading

from shmshare import ShmshareError, wire
from shmshare.testing.transport_contract import sealed_memfd


class Handle:
    """Pickles as a handle with the arguments it was given: what a hostile peer puts on a Queue."""

    def __init__(self, args):
        self.args = tuple(args)

    def __reduce__(self):
        from shmshare.multiprocessing._client import rebuild_array

        return rebuild_array, self.args


class FakeOwner:
    """An fd server that answers as an owner does (its lease table, signed handles) and sends `fd` as
    every segment."""

    def __init__(self, where, fd, size, wait):
        from shmshare.multiprocessing import _table

        self.fds = [fd, sealed_memfd(4096), sealed_memfd(4096)]  # the segment, the table, our claim map
        self.size, self.wait, self.secret = size, wait, os.urandom(16)
        self.sign = _table.sign
        self.listener = wire.Listener(os.path.join(where, "owner.sock"))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def handle(self, start, span):
        mac = self.sign(self.secret, 1, self.size, start, span, 0, 0, 1, False)
        return (os.getpid(), 7, self.listener.path, 1, self.size, start, span, 0, (1,), 0, 1, "|u1", (span,),
                False, mac)

    def _serve(self):
        from shmshare.multiprocessing._common import KIND, SEGMENT, TABLE

        try:
            conn = self.listener.accept(timeout=self.wait)
        except (ShmshareError, OSError):
            return
        try:
            while True:
                h, fds = conn.recv(timeout=self.wait)
                for f in fds:
                    f.close()
                if h.get(KIND) == TABLE:
                    conn.send({KIND: TABLE, "n": 512, "pid": os.getpid(), "you": os.getpid(), "m": self.secret},
                              self.fds[1:], timeout=self.wait)
                elif h.get(KIND) == SEGMENT:
                    conn.send({KIND: SEGMENT, "i": h.get("i"), "n": self.size}, self.fds[:1], timeout=self.wait)
        except (ShmshareError, OSError):
            pass  # the client hung up
        finally:
            conn.close()

    def close(self):
        import shmshare.multiprocessing as smp

        smp.shutdown()  # our link to it: its connection ends, and so does the thread
        self.thread.join(self.wait)
        self.listener.close()
        for fd in self.fds:
            os.close(fd)


class FakeDaemon:
    """Answers every get with `reply` (a header sent with `fds`, or raw bytes), on one connection."""

    def __init__(self, path, reply, fds, wait):
        self.listener, self.reply, self.fds, self.wait = wire.Listener(path), reply, fds, wait
        self.path = path
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            conn = self.listener.accept(timeout=self.wait)
        except (ShmshareError, OSError):
            return
        try:
            while True:
                h, fds = conn.recv(timeout=self.wait)
                for f in fds:
                    f.close()
                if h.get("k") != "get":
                    continue  # its releases: nothing to answer
                if isinstance(self.reply, bytes):
                    conn._sock.send(self.reply)
                else:
                    conn.send(self.reply, self.fds, timeout=self.wait)
        except (ShmshareError, OSError):
            pass  # the client hung up
        finally:
            conn.close()

    def close(self):
        self.thread.join(self.wait)
        self.listener.close()
        for fd in self.fds:
            os.close(fd)
