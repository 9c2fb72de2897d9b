"""The owner's own record of claims (Note [The owner's record of claims]): a block is never
reused while a live process holds an array of it, whatever a peer writes in the shared lease
table and however a receiver's connections come and go."""

from __future__ import annotations

import gc
import mmap
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import shmshare.multiprocessing as smp
from shmshare import ShmshareError, ShmshareTimeout, wire
from shmshare.multiprocessing import _client, _owner, _reduce
from shmshare.multiprocessing._table import CLAIMED, word
from shmshare.testing import kill, wait_until

from .helpers import WAIT

N = 1 << 14  # elements of each small array: 128 KiB, many to a segment


def _owner_behind_a_pause(conn) -> None:
    """Send A, then B (a segment of its own), wait for "go", then C; once the receiver's first
    connection is gone, send D arrays and report how many handles were reclaimed."""
    smp.set_exit_linger(0)  # B is never unpickled: no wait for it at exit
    conn.send(np.full(N, 1.0))
    conn.send(np.full(8 << 20, 2.0))  # 64 MiB: a segment the receiver has not mapped yet
    assert conn.recv() == "go"
    conn.send(np.full(N, 3.0))
    wait_until(lambda: smp.statistics().peers <= 1, "the old connection to end", WAIT, between=gc.collect)
    for i in range(8):
        conn.send(np.full(N, 10.0 + i))
    conn.send(("reclaimed", smp.statistics().reclaimed))
    assert conn.recv() == "bye"


def _all_threads_stopped(pid: int) -> bool:
    task = f"/proc/{pid}/task"
    states = []
    for tid in os.listdir(task):
        with open(f"{task}/{tid}/stat") as f:
            states.append(f.read().rpartition(") ")[2][:1])
    return all(st == "T" for st in states)


def test_a_receiver_that_reconnects_to_a_paused_owner_keeps_its_arrays(monkeypatch):
    """An owner that does not answer a segment request in time (SIGSTOP, ``docker pause``, a
    debugger): the receiver gives the link up and makes a new one. The owner then sees the old
    connection end while the receiver lives and still holds arrays claimed on both links; it
    must not take them back (it did: the next arrays were copied into their blocks)."""
    monkeypatch.setattr(_client, "_REQUEST_WAIT", 0.5)
    ctx = smp.get_context("fork")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_owner_behind_a_pause, args=(there,))
    p.start()
    there.close()
    try:
        a = ForkingPickler.loads(here.recv_bytes())  # claimed over the first link
        raw_b = here.recv_bytes()
        os.kill(p.pid, signal.SIGSTOP)
        # a group stop reaches the fd server thread only once another thread took the signal:
        # under load, it answers for a few ms more
        wait_until(lambda: _all_threads_stopped(p.pid), "the owner's threads to stop", WAIT, between=gc.collect)
        try:
            with pytest.raises(ShmshareTimeout):
                ForkingPickler.loads(raw_b)  # the segment's fd does not come: the link is given up
        finally:
            os.kill(p.pid, signal.SIGCONT)
        here.send("go")
        c = ForkingPickler.loads(here.recv_bytes())  # over a new link; the old one is closed
        later = [ForkingPickler.loads(here.recv_bytes()) for _ in range(8)]
        tag, reclaimed = here.recv()
        assert tag == "reclaimed"
        assert float(a.min()) == float(a.max()) == 1.0, "A's block was reused under it"
        assert float(c.min()) == float(c.max()) == 3.0, "C's block was reused under it"
        assert [float(d[0]) for d in later] == [10.0 + i for i in range(8)]
        assert reclaimed == 0, f"the owner reclaimed {reclaimed} handles of a live receiver"
        here.send("bye")
        p.join(WAIT)
        assert p.exitcode == 0
    finally:
        kill(p)
        here.close()


def _forge(path: str, slot: int, gen: int, how: str, out) -> None:
    """A same-uid peer: write the victim's table word over with our own pid, then release it
    (``how == "release"``) or hang up."""
    conn = wire.connect(path, timeout=5, role="mp-peer")
    conn.send({"k": "t"})
    header, fds = conn.recv(timeout=5)
    table = mmap.mmap(fds[0].fileno(), header["n"] * 8)
    for f in fds:
        f.close()
    me = header["you"]
    table[slot * 8:slot * 8 + 8] = struct.pack("<Q", (gen << 32) | word(0, CLAIMED, me))
    if how == "release":
        conn.send({"k": "r", "l": [slot, gen]})
    table.close()
    conn.close()
    out.put("done")


@pytest.mark.parametrize("how", ["release", "hang up"])
def test_a_peer_that_rewrites_a_claim_cannot_free_another_processs_block(how):
    got = ForkingPickler.loads(ForkingPickler.dumps(np.full(N, 5.0)))  # this process holds it
    ow = _owner.current_owner()
    assert ow is not None
    (slot,) = ow._slots
    gen = ow.table.state(slot)[0]
    ctx = smp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_forge, args=(ow.path, slot, gen, how, out))
    p.start()
    try:
        assert out.get(timeout=WAIT) == "done"
        p.join(WAIT)
        assert p.exitcode == 0
        wait_until(lambda: smp.statistics().peers == 1, "the forger's connection to end", WAIT, between=gc.collect)
        # anything the owner freed would be the first fit for arrays of the same size
        later = [ForkingPickler.loads(ForkingPickler.dumps(np.full(N, 9.0))) for _ in range(4)]
        assert float(got.min()) == float(got.max()) == 5.0, "the victim's block was reused"
        assert smp.statistics().handles_claimed == 5
        del later
    finally:
        kill(p)
        out.close()
        out.join_thread()
    del got
    wait_until(lambda: smp.statistics().handles_claimed == 0, "every release", WAIT, between=gc.collect)


def _handle_of(arr: np.ndarray) -> list:
    """The arguments of the handle that pickling `arr` makes (never unpickled here)."""
    fn, args = _reduce.reduce_ndarray(arr)
    assert fn is _client.rebuild_array
    return list(args)


def _resign(ow: _owner.Owner, args: list) -> list:
    """Sign `args` as the owner would: a peer that knows the key (every peer of the owner does)."""
    if hasattr(_owner.Owner, "sign"):  # (the code before handles were signed: nothing to do)
        _pid, _token, _path, *placed, _dtype, _shape, external, _mac = args
        args[-1] = ow.sign(tuple(placed), external)
    return args


def _rebuild_in_child(first: list | None, args: list, out) -> None:
    if first is not None:
        _client.rebuild_array(*first)  # a good handle first: the segment is mapped here
    try:
        arr = _client.rebuild_array(*args)
        out.put(("read", float(arr.sum())))
    except smp.HandleError as exc:
        out.put(("refused", str(exc)))


def _outcome_in_a_child(args: list, first: list | None = None) -> tuple[str, object]:
    """What a receiver makes of `args` after handle `first` (in a child: the forged handle may
    crash it)."""
    ctx = smp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_rebuild_in_child, args=(first, args, out))
    p.start()
    try:
        p.join(WAIT)
        if p.exitcode != 0:
            return "died", p.exitcode
        return out.get(timeout=WAIT)
    finally:
        kill(p)
        out.close()
        out.join_thread()


def test_a_handle_past_the_end_of_a_mapped_segment_is_refused_not_a_crash():
    """A handle that says its segment is larger than the one the receiver mapped already, and
    points past the mapping's end (signed with the owner's key: the checks behind the signature
    hold too). The receiver crashed with SIGSEGV."""
    first = _handle_of(np.full(N, 1.0))
    ow = _owner.current_owner()
    assert ow is not None
    args = _handle_of(np.full(N, 2.0))
    assert args[3] == first[3]  # one segment: the first handle maps it
    size = args[4]
    args[4] = size + (64 << 20)  # the segment's size, as the handle claims it
    args[5] = size + (32 << 20)  # start: past what is mapped
    outcome = _outcome_in_a_child(_resign(ow, args), first)
    assert outcome[0] == "refused" and "malformed handle" in str(outcome[1]), outcome


def test_a_handle_whose_start_was_moved_does_not_read_the_next_block():
    """A handle whose offset alone was moved by a few bytes (altered on the way): it read into
    the next block of the same segment, another array's bytes."""
    first = np.full(N, 1.0)
    args = _handle_of(first)
    _handle_of(np.full(N, 7.0))  # the next block: another handle's array
    args[5] += 8 * N // 2  # start: half an array on, into the neighbour
    outcome = _outcome_in_a_child(args)
    assert outcome[0] == "refused" and "did not make" in str(outcome[1]), outcome


# -- the fd server's own troubles, and races in one receiver --------------------------------------

_HOLDER_OF_A_DEAD_PROCESSS_CONNECTION = textwrap.dedent("""
    import os, sys, time
    from shmshare import wire
    conn = wire.connect(sys.argv[1], timeout=10, role="mp-peer")
    if os.fork():
        os._exit(0)          # the process that connected is gone ...
    time.sleep(0.5)          # ... while its connection lives on in this child
    conn.send({"k": "t"}, timeout=5)
    try:
        h, fds = conn.recv(timeout=5)
        print("reply", h.get("k"), len(fds), flush=True)
    except Exception as exc:
        print("no reply", type(exc).__name__, flush=True)
""")


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _end(p: subprocess.Popen) -> None:
    kill(p, timeout=WAIT)
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            f.close()


def test_a_connection_that_outlives_its_process_does_not_stop_the_fd_server():
    """A same-uid process connects, forks and exits; its child asks for the table on the
    inherited connection. That reached a claim map already retired for the exited process, and
    the AssertionError ended the server thread: no handle of the owner could be unpickled."""
    _handle_of(np.ones(4096))  # the fd server runs
    ow = _owner.current_owner()
    assert ow is not None
    p = _python(_HOLDER_OF_A_DEAD_PROCESSS_CONNECTION, ow.path)
    try:
        wait_until(lambda: p.poll() is not None, "the connecting process to exit", WAIT, between=gc.collect)
        # its child has sent its request once it printed; read that from the shared stdout
        out = p.stdout.readline()
        assert out.startswith(("reply", "no reply")), (out, p.stderr.read()[-500:])
        assert ow.server._thread.is_alive(), f"the fd server thread died: the peer said {out!r}"
        got = ForkingPickler.loads(ForkingPickler.dumps(np.full(N, 6.0)))  # still served
        assert float(got[0]) == 6.0
    finally:
        _end(p)


def test_a_failed_second_unpickle_racing_the_views_death_does_not_pin_the_block(monkeypatch):
    """One thread unpickles a handle a second time (a HandleError) while another drops the
    first unpickle's array: the failed claim put back the mark the drop had just cleared, and
    the owner kept the block for as long as the receiver lived."""
    real = _client._cas64

    def slow_cas(*a):  # the race's window, widened: the other thread runs right after the swap
        got = real(*a)
        time.sleep(0.002)
        return got

    monkeypatch.setattr(_client, "_cas64", slow_cas)
    n = 200
    handles = [_handle_of(np.full(1024, float(i))) for i in range(n)]
    views: list = [_client.rebuild_array(*h) for h in handles]
    barrier = threading.Barrier(2, timeout=WAIT)
    errors: list[BaseException] = []

    def again() -> None:
        for h in handles:
            barrier.wait()
            try:
                _client.rebuild_array(*h)
            except smp.HandleError:
                pass
            except Exception as exc:  # noqa: BLE001  (reported below)
                errors.append(exc)

    def drop() -> None:
        for i in range(n):
            barrier.wait()
            views[i] = None

    threads = [threading.Thread(target=again), threading.Thread(target=drop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not errors, errors
    wait_until(lambda: smp.statistics().handles_claimed == 0, "every block to come back", WAIT, between=gc.collect)


_OWNER_WITHOUT_MEMORY_FOR_A_CLAIM_MAP = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from multiprocessing.reduction import ForkingPickler
    import shmshare.multiprocessing as smp
    smp.set_exit_linger(0)
    raw = bytes(ForkingPickler.dumps(np.ones(4096)))  # the fd server runs
    vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1])
    resource.setrlimit(resource.RLIMIT_AS, ((vm << 10) + (64 << 10), resource.RLIM_INFINITY))
    print(raw.hex(), flush=True)
    sys.stdin.readline()
""")


def test_an_owner_that_cannot_make_a_claim_map_is_not_reported_as_gone():
    """The owner cannot map a new peer's claim map (RLIMIT_AS here; a full memory cgroup
    alike): the receiver was told that the live owner had exited (OwnerGone)."""
    p = _python(_OWNER_WITHOUT_MEMORY_FOR_A_CLAIM_MAP, stdin=subprocess.PIPE)
    try:
        line = p.stdout.readline().split()
        assert line, p.stderr.read()
        with pytest.raises(ShmshareError) as caught:
            ForkingPickler.loads(bytes.fromhex(line[0]))
        assert not isinstance(caught.value, smp.OwnerGone), caught.value
        assert f"pid {p.pid}" in str(caught.value) and "still good" in str(caught.value)
        assert p.poll() is None
    finally:
        _end(p)
