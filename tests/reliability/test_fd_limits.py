"""A receiver with a nearly full fd table (RLIMIT_NOFILE lowered in the child).

One big batch of fds, many senders at once, and idle connects piling up:
the receiver keeps serving the senders it has, raises FdLimitError (never
a bare OSError, never "-1 fds are open") at most once per ``recv()``, and
does not spin. A classic segment costs the receiver no fd once mapped.
"""

from __future__ import annotations

import os
import socket

import pytest

import shmshare
from shmshare.testing import pattern, wait_until

from . import forge
from .helpers import fd_count
from .rxchild import receiver_child

SPARE = 12  # fds the receiver may open beyond those it holds when ready
SHORT, STRESS = {"senders": 6, "idle": 40, "markers": 20}, {"senders": 30, "idle": 400,
                                                           "markers": 200}


def _check_fd_errors(errors: list[dict], where: str, allow: tuple[str, ...] = ()) -> None:
    for e in errors:
        if e["type"] in allow:
            continue
        assert e["type"] == "FdLimitError", f"{where}: recv() raised {e['type']}: {e['msg']}"
        assert "RLIMIT_NOFILE" in e["msg"], f"{where}: {e['msg']}"
        assert "-1 fds" not in e["msg"], f"{where}: {e['msg']}"


def test_one_big_batch_over_the_limit_is_an_fd_limit_error() -> None:
    with receiver_child(nofile_spare=SPARE) as rc:
        rc.connect_good()
        peer = forge.Peer(rc.path).hello()
        fds = [forge.sealed_memfd(4096) for _ in range(wire_max())]
        try:
            new = [[(7 << 32) | i, 4096, False] for i in range(len(fds))]
            peer.msg(forge.batch(new=new), fds)
            assert peer.dropped(10), "the receiver kept the connection whose fds it lost"
            errors = rc.marker(0)  # the good sender is still served
        finally:
            for fd in fds:
                os.close(fd)
            peer.close()
        assert errors, "64 fds into a table with 12 free raised nothing"
        _check_fd_errors(errors, "one big batch")
        rc.finish()


def wire_max() -> int:
    from shmshare import wire

    return wire.MAX_FDS


@pytest.mark.parametrize("size", ["short", pytest.param("stress", marks=pytest.mark.stress)])
def test_idle_connects_do_not_stop_a_connected_sender(size: str) -> None:
    n = SHORT if size == "short" else STRESS
    idle: list[socket.socket] = []
    with receiver_child(nofile_spare=SPARE) as rc:
        rc.connect_good()
        try:
            for _ in range(n["idle"]):  # more than the receiver can ever accept
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                idle.append(s)
                s.settimeout(5)
                try:
                    s.connect(rc.path)
                except OSError:
                    break  # the backlog is full: enough of them
            for case in range(n["markers"]):
                rc.marker(case)
        finally:
            for s in idle:
                s.close()
        bye = rc.finish()
        # Idle peers the receiver did accept and that then closed without a word: PeerDied.
        _check_fd_errors(rc.errors, f"{len(idle)} idle connects", allow=("PeerDied",))
        # No spinning: each recv() raised at most once, and recv() returned (or raised)
        # a bounded number of times, not once per turn of a busy loop.
        assert bye["raised"] <= 4 * n["markers"] + 50, f"recv() raised {bye['raised']} times: {bye}"
        assert bye["calls"] <= 20 * n["markers"] + 500, f"recv() ran {bye['calls']} times: {bye}"


def _many_senders_send(path: str, tag: int) -> None:
    tx = shmshare.connect(path, timeout=10, limit=8 << 20)
    try:
        tx.send({"tag": tag}, timeout=10)
    finally:
        tx.close()


@pytest.mark.parametrize("size", ["short", pytest.param("stress", marks=pytest.mark.stress)])
def test_many_senders_at_the_limit(size: str) -> None:
    n = SHORT if size == "short" else STRESS
    with receiver_child(nofile_spare=SPARE) as rc:
        rc.connect_good()
        senders = []
        try:
            for i in range(n["senders"]):  # each holds a connection and announces a segment
                tx = shmshare.connect(rc.path, timeout=10, limit=8 << 20)
                senders.append(tx)
                tx.send({"case": 1000 + i, "x": pattern(1000 + i, 256)}, timeout=10)
            errors = rc.marker(0)
            for i, tx in enumerate(senders):
                try:
                    tx.send({"case": 2000 + i}, timeout=5)
                except (shmshare.PeerDied, shmshare.ProtocolError):
                    pass  # dropped for want of fds: allowed, as long as it was said so
            errors += rc.marker(1)
        finally:
            for tx in senders:
                tx.close()
        rc.finish()
        _check_fd_errors(rc.errors, f"{n['senders']} senders", allow=("PeerDied",))


def test_classic_segments_cost_the_receiver_no_fd() -> None:
    with receiver_child(hold=True) as rc:
        rc.connect_good()
        before = fd_count(rc.pid)
        peer = forge.Peer(rc.path).hello()
        try:
            for i in range(40):  # 40 segments announced one by one, every array held
                fd = forge.sealed_memfd(4096, fill=1)
                try:
                    seg = (9 << 32) | i
                    peer.msg(forge.batch(new=[[seg, 4096, False]],
                                         tree_bytes=forge.tree({"x": forge.desc(seg, 4096)})), [fd])
                finally:
                    os.close(fd)
                assert rc.next_foreign()["sum"] == 4096
            grown = fd_count(rc.pid) - before
        finally:
            peer.close()
        assert grown <= 2, f"the receiver holds {grown} more fds with 40 segments announced"
        wait_until(lambda: fd_count(rc.pid) <= before + 2,
                   "the receiver holds at most 2 fds more than before the segments were announced", 10)
        rc.finish()
