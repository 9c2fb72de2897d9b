"""An owner whose fd server's listen backlog is full when a handle is unpickled: the receiver
waits for room (wire.connect within its timeout) and gets the array; nothing is lost."""

from __future__ import annotations

import os
import signal
import socket
import threading

import numpy as np

import shmshare.multiprocessing as smp
from shmshare.multiprocessing import _owner
from shmshare.testing import kill

from ..socket_helpers import fill_backlog
from .helpers import WAIT


def _owner_sends(q, ready, inq) -> None:
    q.put(np.full(1 << 14, 4.0))  # SimpleQueue: pickled and written here, now
    ready.put(_owner.current_owner().path)
    assert inq.get() == "bye"


def test_a_handle_unpickled_while_its_owners_backlog_is_full_arrives():
    ctx = smp.get_context("fork")
    q, ready, inq = ctx.SimpleQueue(), ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=_owner_sends, args=(q, ready, inq))
    p.start()
    queued: list[socket.socket] = []
    got: list[object] = []
    try:
        path = ready.get()
        os.kill(p.pid, signal.SIGSTOP)  # it accepts nobody while stopped
        try:
            queued = fill_backlog(path, 4096)
            t = threading.Thread(target=lambda: got.append(_get(q)), daemon=True)
            t.start()
            t.join(0.5)  # the unpickle is waiting for room by now (or failed at once)
        finally:
            os.kill(p.pid, signal.SIGCONT)
        t.join(WAIT)
        assert not t.is_alive()
        assert len(got) == 1 and isinstance(got[0], np.ndarray), got
        assert float(got[0].min()) == float(got[0].max()) == 4.0
        got.clear()
        inq.put("bye")
        p.join(WAIT)
        assert p.exitcode == 0
    finally:
        for s in queued:
            s.close()
        kill(p)
        for sq in (q, ready, inq):
            sq.close()


def _get(q) -> object:
    try:
        return q.get()
    except Exception as exc:  # noqa: BLE001  (what the user would have seen instead of the array)
        return exc
