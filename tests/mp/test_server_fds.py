"""The fd server under a full fd table: it stops accepting for a moment (its PollServer's, the
one out-of-fds policy of every poll server: Note [Out of fds]) instead of spinning on a readable
listener, and serves the waiting peer once fds are free again."""

from __future__ import annotations

import os
import resource
import socket
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np

import shmshare.multiprocessing as smp
from shmshare import wire
from shmshare.multiprocessing import _owner
from shmshare.testing import kill

from .helpers import WAIT


def _owner_out_of_fds(inq, out) -> None:
    calls = [0]
    accept = wire.Listener.accept

    def counted(self, timeout=None):
        calls[0] += 1
        return accept(self, timeout)

    wire.Listener.accept = counted  # this child's own: how often the server tries
    smp.set_exit_linger(0)  # the handle below is never unpickled: no wait for it at exit
    ForkingPickler.dumps(np.ones(4096))  # the fd server runs
    ow = _owner.current_owner()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1, hard))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass  # the table is full
    out.put(("full", ow.path))
    assert inq.get(timeout=WAIT) == "waiting"  # a peer is in the backlog now
    time.sleep(1.0)  # a second with a readable listener and no fd to take it with
    tried = calls[0]
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    out.put(("tried", tried))
    assert inq.get(timeout=WAIT) == "bye"


def test_an_owner_out_of_fds_pauses_accepting_and_serves_the_peer_after():
    ctx = smp.get_context("fork")
    inq, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_owner_out_of_fds, args=(inq, out))
    p.start()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        tag, path = out.get(timeout=WAIT)
        assert tag == "full"
        raw.connect(path)  # queued in the backlog: the owner cannot accept it
        inq.put("waiting")
        tag, tried = out.get(timeout=WAIT)
        assert tag == "tried"
        # a pause of 0.2 s is 5 tries a second; spinning was tens of thousands
        assert tried <= 20, f"the fd server tried to accept {tried} times in a second"
        conn = wire.Connection(raw, role="mp-peer")  # taken once fds are free again
        raw = None
        conn.send({"k": "t"})
        header, fds = conn.recv(timeout=WAIT)
        for f in fds:
            f.close()
        conn.close()
        assert header["k"] == "t" and header["pid"] == p.pid
        inq.put("bye")
        p.join(WAIT)
        assert p.exitcode == 0
    finally:
        if raw is not None:
            raw.close()
        kill(p)
        for q in (inq, out):
            q.close()
            q.join_thread()
