"""The channel across real processes: fork and spawn, fan-in, SIGKILL of either side, fork safety."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmshare
from shmshare import PeerDied
from shmshare.testing import pattern, start_child
from tests.channel.helpers import check_pattern, send_patterns
from tests.devshm_helpers import names_of

N = 4096  # uint32 per message: 16 KiB


def _produce(tx, count, tag, in_place):
    send_patterns(tx, count, N, tag, in_place)


@pytest.mark.parametrize("backend", ["memfd", "posix"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in_place"])
def test_child_sends_to_parent_in_order(method, in_place, backend):
    tx, rx = shmshare.channel(limit=16 << 20, backend=backend)
    with start_child(_produce, tx, 300, 7, in_place, method=method) as child:
        tx.close()  # the child has its own copy of the sending end
        got = [rx.recv(timeout=60) for _ in range(300)]
        assert [b["i"] for b in got] == list(range(300))
        assert all(check_pattern(b, N) for b in got)
        assert {b["pid"] for b in got} == {child.pid}
        del got
        with pytest.raises(PeerDied, match="closed the channel"):
            rx.recv(timeout=30)
        assert child.join(30) == 0
    rx.close()


def _consume(rx, results_tx, count):
    total = 0
    for _ in range(count):
        batch = rx.recv(timeout=60)
        total += int(check_pattern(batch, N))
    results_tx.send({"ok": total})
    results_tx.close()
    rx.close()


@pytest.mark.parametrize("backend", ["memfd", "posix"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_parent_sends_to_child(method, backend):
    tx, rx = shmshare.channel(limit=4 << 20, backend=backend)  # small: blocks are reused under back-pressure
    res_tx, res_rx = shmshare.channel()
    with start_child(_consume, rx, res_tx, 500, method=method) as child:
        rx.close()
        res_tx.close()
        send_patterns(tx, 500, N, tag=3)
        assert res_rx.recv(timeout=60) == {"ok": 500}
        assert child.join(30) == 0
    res_rx.close()


def _connect_and_send(path, count, tag):
    tx = shmshare.connect(path, timeout=30, limit=8 << 20)
    send_patterns(tx, count, N, tag)


def test_fan_in_from_unrelated_senders_keeps_order_per_sender():
    rx = shmshare.listen()
    children = [start_child(_connect_and_send, rx.path, 200, tag) for tag in range(3)]
    try:
        seen = {0: [], 1: [], 2: []}
        for _ in range(600):
            b = rx.recv(timeout=60)
            assert check_pattern(b, N)
            seen[b["tag"]].append(b["i"])
        assert all(seen[t] == list(range(200)) for t in seen)
        for c in children:
            assert c.join(30) == 0
        with pytest.raises(shmshare.ShmshareTimeout):
            rx.recv(timeout=0.2)  # clean goodbyes are silent in fan-in
    finally:
        for c in children:
            c.stop()
        rx.close()


def _send_forever(tx, ready_tx):
    arr = pattern(11, N)
    ready_tx.send({"ready": True})
    i = 0
    while True:
        tx.send({"tag": 0, "i": i, "x": arr if i else pattern(0, N)}, timeout=60)
        i += 1


def test_sender_sigkilled_mid_stream():
    tx, rx = shmshare.channel(limit=32 << 20)
    ctl_tx, ctl_rx = shmshare.channel()
    with start_child(_send_forever, tx, ctl_tx) as child:
        tx.close()
        ctl_tx.close()
        assert ctl_rx.recv(timeout=30) == {"ready": True}
        first = rx.recv(timeout=30)
        assert check_pattern(first, N)
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        n = 0
        with pytest.raises(PeerDied, match=r"the sender \(pid \d+\) died"):
            while True:  # everything queued before the crash is still delivered
                b = rx.recv(timeout=30)
                assert b["i"] == n + 1
                n += 1
        assert check_pattern(first, N)  # arrays held past the sender's death stay valid
        assert not names_of({os.getpid(), child.pid})  # (others' names: another test's, beside this one)
    del first
    ctl_rx.close()
    rx.close()


def _recv_and_hold(rx, ctl_tx):
    held = []
    while True:
        held.append(rx.recv(timeout=60))
        if len(held) == 20:
            ctl_tx.send({"holding": 20})


def test_receiver_sigkilled_mid_stream_voids_every_lease_and_close_frees_the_blocks():
    tx, rx = shmshare.channel(limit=64 << 20)
    ctl_tx, ctl_rx = shmshare.channel()
    with start_child(_recv_and_hold, rx, ctl_tx) as child:
        rx.close()
        ctl_tx.close()
        for i in range(20):
            tx.send({"i": i, "x": pattern(i, N)})
        assert ctl_rx.recv(timeout=30) == {"holding": 20}
        assert tx.poll_releases() == 20
        child.kill()
        with pytest.raises(PeerDied, match="receiver is gone"):
            for _ in range(1000):
                tx.send({"x": np.ones(4)})
                time.sleep(0.001)
        assert tx.statistics().leases_out == 0
        # a receiver that closed (rather than died) may still read them: the blocks it held are
        # retired, never handed out again, and close() frees them
        assert tx.memory_stats()["allocated_bytes.all.current"] > 0
    tx.close()
    assert tx.memory_stats()["allocated_bytes.all.current"] == 0
    ctl_rx.close()


def _use_inherited_sender(tx, parent_seg_ids):
    tx.send({"from": "child", "x": np.arange(1000, dtype=np.int64)})
    own = set(tx._provider.segments)
    tx.send({"overlap": sorted(own & set(parent_seg_ids))})
    tx.close()
    os._exit(0)


def test_forked_child_gets_a_fresh_pool():
    tx, rx = shmshare.channel()
    keep = tx.empty(1000, np.int64)
    keep[:] = 3
    tx.send({"from": "parent", "x": keep})
    first = rx.recv(timeout=10)
    parent_ids = list(tx._provider.segments)
    with start_child(_use_inherited_sender, tx, parent_ids) as child:
        b = rx.recv(timeout=30)
        assert b["from"] == "child" and b["x"].sum() == sum(range(1000))
        assert rx.recv(timeout=30) == {"overlap": []}  # never the parent's segments
        assert child.join(30) == 0
    assert first["x"].sum() == 3000 and keep.sum() == 3000  # the parent's blocks untouched
    del b, first, keep
    gc.collect()
    tx.close()
    rx.close()


def _keep_sending(tx):
    i = 1
    while True:
        tx.send({"tag": 0, "i": i, "x": pattern(i, N)}, timeout=60)
        i += 1


def test_a_parents_goodbye_does_not_hide_its_forked_childs_crash():
    tx, rx = shmshare.channel(limit=32 << 20)
    tx.send({"tag": 0, "i": 0, "x": pattern(0, N)})
    with start_child(_keep_sending, tx) as child:
        tx.close()  # the parent sent before the fork, so it says goodbye for itself
        seen = [rx.recv(timeout=30) for _ in range(50)]
        assert [b["i"] for b in seen] == list(range(50)) and all(check_pattern(b, N) for b in seen)
        del seen
        assert child.exitcode is None  # still sending: it did not crash on its own
        child.kill()
        with pytest.raises(PeerDied, match="died"):
            for _ in rx:  # iteration must not end as if the channel were closed on purpose
                pass
    rx.close()


def _drop_listener_copy(rx):
    rx.close()  # the child's copy: the socket file belongs to the parent
    os._exit(0)


def test_a_forked_child_closing_its_copy_keeps_the_listener():
    rx = shmshare.listen()
    with start_child(_drop_listener_copy, rx) as child:
        assert child.join(30) == 0
    tx = shmshare.connect(rx.path, timeout=10)
    tx.send({"still": "listening"})
    assert rx.recv(timeout=10) == {"still": "listening"}
    tx.close()
    rx.close()


def test_a_fork_after_a_listening_receiver_closed_runs_every_handler_cleanly(tmp_path):
    """A closed listen() receiver stayed among the live ones: every later fork's child said "a fork handler
    failed ... Invalid file descriptor: -1", and the receivers after it in the loop missed their fix-ups."""
    script = textwrap.dedent(f"""
        import os, numpy as np, shmshare
        closed = shmshare.listen({str(tmp_path / "a.sock")!r}); closed.close()
        rx = shmshare.listen({str(tmp_path / "b.sock")!r}); tx = shmshare.connect({str(tmp_path / "b.sock")!r})
        tx.send(np.zeros(300)); rx.recv(timeout=30)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        tx.close(); rx.close()
        print("ok")
    """)
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr
    assert "fork handler failed" not in got.stderr, got.stderr
