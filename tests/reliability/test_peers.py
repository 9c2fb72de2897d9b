"""Per-peer caps, an empty datagram, whose pid PeerDied names, and the directories listen() makes."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import numpy as np
import pytest

import shmshare
from shmshare import PeerDied, ProtocolError
from shmshare.testing import pattern

from . import forge
from .helpers import Kid
from .rxchild import receiver_child


def _send_until_refused(ctl, path: str) -> None:
    tx = shmshare.connect(path, timeout=10, limit=64 << 20)
    try:
        for i in range(8):  # each 4 MiB array in a segment of its own past the cap
            tx.send({"case": 100 + i, "x": pattern(100 + i, 1 << 20)}, timeout=10)
        ctl.send({"ev": "sent", "msg": None})
    except (ProtocolError, PeerDied) as exc:
        ctl.send({"ev": "sent", "type": type(exc).__name__, "msg": str(exc)})
    tx.close()


def test_a_peer_past_its_byte_cap_is_refused_and_told_why() -> None:
    with receiver_child(hold=True, listen_kw={"max_peer_bytes": 8 << 20,
                                              "max_peer_segments": 2}) as rc:
        rc.connect_good()
        with Kid(_send_until_refused, rc.path) as kid:
            res = kid.expect("sent", timeout=60)
            assert kid.join(30) == 0
        rc.marker(0)
        caps = [e for e in rc.errors if e["type"] == "ProtocolError"]
        assert caps and any("max_peer" in e["msg"] for e in caps), rc.errors
        assert res["msg"] and "max_peer" in res["msg"], f"the sender was not told why: {res}"
        rc.finish()


def test_an_empty_datagram_is_a_protocol_error() -> None:
    with receiver_child() as rc:
        rc.connect_good()
        peer = forge.Peer(rc.path).hello()
        try:
            peer.raw(b"")
            assert peer.dropped(10)
            rc.marker(0)
            errors = list(rc.errors)  # all of this test's (marker() files them there too)
        finally:
            peer.close()
        assert [e["type"] for e in errors] == ["ProtocolError"], errors
        rc.finish()


def _send_one_and_die(ctl, tx) -> None:
    tx.send({"x": np.ones(4)}, timeout=10)
    os.kill(os.getpid(), 9)


def test_peer_died_names_the_forked_sender() -> None:
    tx, rx = shmshare.channel()
    try:
        with Kid(_send_one_and_die, tx) as kid:
            tx.close()
            rx.recv(timeout=10)
            with pytest.raises(PeerDied) as info:
                rx.recv(timeout=10)
            assert f"pid {kid.pid}" in str(info.value), str(info.value)
            assert f"pid {os.getpid()}" not in str(info.value), str(info.value)
    finally:
        rx.close()


def test_listen_makes_nested_dirs_0700_and_removes_them() -> None:
    top = tempfile.mkdtemp(prefix="rel_listen_")
    try:
        path = os.path.join(top, "a", "b", "c", "sock")
        rx = shmshare.listen(path)
        try:
            for d in ("a", "a/b", "a/b/c"):
                mode = stat.S_IMODE(os.stat(os.path.join(top, d)).st_mode)
                assert mode == 0o700, f"{d}: {oct(mode)}"
        finally:
            rx.close()
        assert os.listdir(top) == [], f"left behind: {os.listdir(top)}"
    finally:
        shutil.rmtree(top, ignore_errors=True)
