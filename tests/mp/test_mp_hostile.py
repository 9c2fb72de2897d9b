"""shmshare.multiprocessing against a hostile user: each test is a promise of
docs/multiprocessing.md (or of the stdlib the module stands in for) that real processes break.

Every child is module-level (spawn can find it), every wait is bounded, and every child is
killed by pid in a ``finally``. What a test starts in other processes it cleans up itself;
what it leaves in this process the leak checker (tests/conftest.py) sees.
"""

from __future__ import annotations

import gc
import glob
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import shmshare.multiprocessing as smp
from shmshare.testing import kill, pid_alive, wait_until

WAIT = 30.0


def _socket_dirs(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"shmshare-mp-{pid}-*"))


# Each scenario runs in a helper that returns plain observations, and the test asserts on
# them: a failing assertion then holds no Queue, Pipe or array in its traceback, so that the
# leak checker reports the bug's own failure only.


# -- 1. silent wrong data: share_memory_() storages told apart by address only -------------------

def _send_shared_tensors(w, n: int, count: int) -> None:
    import torch

    for i in range(count):
        t = torch.full((n,), float(i)).share_memory_()
        w.send(t)  # Pipe.send pickles here, now: the handle pins the storage's fd, not its address
        del t  # torch unmaps the storage; the next share_memory_() gets the same address back
    w.send("done")
    time.sleep(WAIT)  # stays alive: the owner must serve the fds


def _receive_shared_tensors(count: int) -> list[float]:
    # spawn: torch's ops hang in a forked child once the parent has used its OpenMP pool
    # (torch's own fork hazard, seen here after the sparse tests), and this child runs torch ops
    ctx = smp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_send_shared_tensors, args=(w, 1 << 16, count))
    p.start()
    got: list = []
    try:
        while True:
            assert r.poll(WAIT), "the producer sent nothing"
            item = r.recv()
            if isinstance(item, str):
                break
            got.append(item)  # held: each keeps its lease (and the owner's entry) alive
        return [float(t[0]) for t in got]
    finally:
        got.clear()
        kill(p)
        r.close()
        w.close()


def test_shared_tensors_sent_one_after_another_arrive_with_their_own_data():
    """The torch idiom ``t = x.share_memory_(); q.put(t); del t`` in a loop.

    What a user sees: the receiver gets tensor 0's data again for tensors 1, 2, ... (silent
    wrong data; and writes through a received tensor go to a dead storage, not to the
    sender's). The promise: "a tensor after share_memory_() goes as a handle to torch's own
    segment: no copy" -- to *its* segment. Cause: ``Owner._externals`` is keyed by the
    storage's data address, and an entry lives while a handle to it is out; a new storage
    that torch maps at the freed address finds the old entry, and its handle names the old
    segment (whose fd the owner still holds).
    """
    pytest.importorskip("torch")
    firsts = _receive_shared_tensors(6)
    assert firsts == [float(i) for i in range(6)], f"received {firsts}"


# -- 2. silent wrong data: an owner drops a live peer on its own error, and reclaims its arrays --

def _owner_runs_out_of_fds(w, cmd, out) -> None:
    w.send(np.full(1024, 1.0))  # in the small pool's segment
    cmd.get(timeout=WAIT)
    w.send(np.full(1 << 20, 2.0))  # a new large segment, its fd not fetched yet
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
    filler = []
    while True:  # the process's fd table is full for a moment (any busy server's can be)
        try:
            filler.append(os.dup(0))
        except OSError:
            break
    out.put("full")
    cmd.get(timeout=WAIT)
    for f in filler:
        os.close(f)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and smp.statistics().peers:
        time.sleep(0.01)  # if the server dropped its peer, let it finish reclaiming
    keep = ForkingPickler.dumps(np.full(1024, 3.0))  # reuses a free block of that size, if any
    out.put("pickled")
    w.send(np.full(4096, 4.0))  # the fd trouble is over: a fresh handle, for the same receiver
    cmd.get(timeout=WAIT)
    del keep


def _fd_trouble() -> dict:
    """What the receiver of an owner that was out of fds for a moment sees."""
    ctx = smp.get_context("fork")
    r, w = ctx.Pipe(duplex=False)
    cmd, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_owner_runs_out_of_fds, args=(w, cmd, out))
    p.start()
    seen: dict = {}
    held = None
    try:
        assert r.poll(WAIT)
        held = r.recv()
        seen["before"] = float(held[0])
        cmd.put("go")
        assert out.get(timeout=WAIT) == "full"
        assert r.poll(WAIT)
        try:
            r.recv()  # the owner cannot dup the segment's fd now: any clear error will do here
            seen["during"] = "received"
        except Exception as exc:  # noqa: BLE001
            seen["during"] = f"{type(exc).__name__}: {exc}"
        cmd.put("go")
        assert out.get(timeout=WAIT) == "pickled"
        seen["held_after"] = (float(held[0]), float(held.min()))
        assert r.poll(WAIT)
        try:
            fresh = r.recv()
            seen["fresh"] = ("received", float(fresh[0]))
            del fresh
        except Exception as exc:  # noqa: BLE001
            seen["fresh"] = (type(exc).__name__, str(exc))
        seen["owner_alive"] = p.is_alive()
        return seen
    finally:
        del held
        cmd.put("stop")
        kill(p)
        r.close()
        w.close()
        cmd.close()
        out.close()


_fd_trouble_seen: dict = {}


@pytest.fixture
def fd_trouble() -> dict:
    """One run of _fd_trouble (5 s: the owner waits out a reclaim its server may have started) read by the
    two tests below, each about one thing it shows. It runs inside the first of them that asks, under that
    test's leak check and mp_shutdown, as it did in each; the second reads what the first saw."""
    if not _fd_trouble_seen:
        _fd_trouble_seen.update(_fd_trouble())
    return _fd_trouble_seen


def test_an_owner_briefly_out_of_fds_never_hands_a_received_array_to_another(fd_trouble: dict):
    """An owner whose fd table is full for a moment when a receiver fetches a segment.

    What a user sees: an array it already holds silently changes to another array's data
    (here 1.0 becomes 3.0). The promises: "arrays already received stay valid" and a block
    "is reused only when every handle on it has come back released, or the process that
    claimed it has gone". Cause: ``Owner.segment``'s ``os.dup`` raises EMFILE inside
    ``Server._answer``; ``Server._serve`` treats every OSError as a broken peer, drops the
    connection and calls ``Owner.reclaim(peer.pid)``, which frees every block the (live)
    receiver holds; the owner's next pickle reuses them.
    """
    seen = fd_trouble
    assert seen["before"] == 1.0
    assert seen["held_after"] == (1.0, 1.0), (
        f"an array received earlier now reads {seen['held_after'][0]}: its block was "
        f"reclaimed from a live receiver and reused (the fetch during the trouble: "
        f"{seen['during']})")


def test_after_an_owner_side_error_the_next_handle_of_the_live_owner_is_received(fd_trouble: dict):
    """After the same moment of fd trouble, the owner (alive, its fds back) sends a fresh array.

    What a user sees: ``OwnerGone: the array's owner, pid N, has exited (or was killed)`` for
    every later array of an owner that is alive and well, for as long as this process
    lives. The promise: OwnerGone is for "a handle unpickled after its owner died". Cause:
    the owner dropped the connection (the test above); the client marks its ``_Link`` dead
    and keeps it in ``Client.links`` under (pid, token) for good, so no later handle of that
    owner ever connects again.
    """
    seen = fd_trouble
    assert seen["owner_alive"]
    assert seen["fresh"] == ("received", 4.0), f"a live owner's fresh handle: {seen['fresh']}"


# -- 3. an owner stopped for a few seconds loses its receivers' releases for good --------------

def _owner_of_many(q, cmd, out, n: int) -> None:
    q.put([np.full(256, float(i)) for i in range(n)])  # 2 KiB each: handles
    while True:
        what = cmd.get(timeout=WAIT)
        if what == "stats":
            out.put(smp.statistics())
        elif what == "more":
            q.put(np.full(4096, 7.0))
        else:
            return


def _paused_owner() -> dict:
    ctx = smp.get_context("fork")
    q, cmd, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_owner_of_many, args=(q, cmd, out, 700))
    p.start()
    stopped = False
    seen: dict = {}
    try:
        arrays = q.get(timeout=WAIT)  # all claimed now, without the owner (a CAS each)
        os.kill(p.pid, signal.SIGSTOP)
        stopped = True
        while arrays:  # released one by one: a release frame each
            arrays.pop()
            time.sleep(0.003)
        time.sleep(5.5)  # the flusher's send waits 5 s for room on the full socket
        os.kill(p.pid, signal.SIGCONT)
        stopped = False
        cmd.put("more")
        try:
            got = q.get(timeout=WAIT)
            seen["more"] = ("received", float(got[0]))
            del got
        except Exception as exc:  # noqa: BLE001
            seen["more"] = (type(exc).__name__, str(exc))
        deadline = time.monotonic() + 2  # a live link delivers them within milliseconds
        while True:
            cmd.put("stats")
            seen["claimed"] = out.get(timeout=WAIT).handles_claimed
            if seen["claimed"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return seen
    finally:
        if stopped:
            os.kill(p.pid, signal.SIGCONT)
        cmd.put("stop")
        kill(p)


def test_an_owner_paused_a_few_seconds_still_gets_every_release_and_serves_after():
    """A receiver drops the arrays of an owner that is stopped (SIGSTOP, a debugger attached,
    a frozen container) for a few seconds -- about 7 s here, what it takes to show.

    What a user sees: once the owner runs again, its next array raises OwnerGone, and the
    owner's ``statistics().handles_claimed`` stays at a few hundred for good: those blocks
    are never given back, though the receiver dropped every array. The promise: "When the
    view's last reference dies, its release is queued ... The block is then reused";
    OwnerGone only for an owner that died. Cause: ``Client.flush`` sends with
    ``timeout=5.0`` and, when the socket stays full that long (nobody reads it in a stopped
    owner), sets ``link.dead = True``: the batch is dropped, later releases are skipped, and
    the dead link answers every later handle of that owner with OwnerGone.
    """
    seen = _paused_owner()
    assert seen["more"] == ("received", 7.0), f"the owner, running again: {seen['more']}"
    assert seen["claimed"] == 0, f"{seen['claimed']} releases never reached the owner"


# -- 4. the socket directory is left behind in /tmp ---------------------------------------------

def _pid_and_array(i: int):
    return os.getpid(), np.full(1 << 12, float(i))


def _busy(marks: str) -> None:
    open(os.path.join(marks, str(os.getpid())), "w").close()
    time.sleep(WAIT)


def _pool_leftovers(busy) -> list[str]:
    ctx = smp.get_context("fork")
    pids: set[int] = set()
    try:
        with ctx.Pool(2) as pool:
            got = pool.map_async(_pid_and_array, range(16), chunksize=1).get(WAIT)
            pids = {pid for pid, _ in got}
            assert all(float(a[0]) == i for i, (_, a) in enumerate(got))
            del got
            for _ in range(2):  # still busy when the block ends (an exception, an early break)
                pool.apply_async(_busy, (str(busy),))
            wait_until(lambda: len(os.listdir(busy)) == 2, "both workers busy", WAIT, between=gc.collect)
        for pid in pids:
            wait_until(lambda pid=pid: not pid_alive(pid), f"worker {pid} gone", 10, between=gc.collect)
        # a SIGTERM runs no finalizer: the next owner of this user to start sweeps what the dead
        # left (here this process's, on its first handle), and never a live process's directory
        ForkingPickler.dumps(np.ones(1 << 12))
        return [d for pid in pids for d in _socket_dirs(pid)]
    finally:
        for pid in pids:
            for d in _socket_dirs(pid):
                shutil.rmtree(d, ignore_errors=True)


def test_pool_workers_leave_no_socket_directory_behind(tmp_path):
    """The doc's own example: ``with mp.Pool(4) as pool: pool.map(...)`` returning arrays.

    What a user sees: a run whose workers are still busy when the ``with`` block ends (an
    exception, an early break out of ``imap``; or any ``Process.terminate()``) leaves one
    ``/tmp/shmshare-mp-<pid>-<token>/`` directory (with its socket) per worker, for good;
    they pile up in /tmp (this host's /tmp had
    76 of them from earlier test runs). The promise (Security): "The directory is removed
    at exit." Cause: ``Pool.__exit__`` is ``terminate()``, which SIGTERMs the workers; no
    finalizer runs, so ``Listener.close`` never removes the directory, and nothing sweeps
    the directories of dead pids (as ``_shmdir.sweep`` does for /dev/shm names).
    """
    left = _pool_leftovers(tmp_path)
    assert not left, f"Pool workers left {left}, and the next owner did not sweep them"


_EXIT_PICKLER = """
import os, sys, threading, time
import numpy as np
import shmshare.multiprocessing as smp
from multiprocessing.reduction import ForkingPickler

def spin():
    while True:
        try:
            ForkingPickler.loads(ForkingPickler.dumps(np.ones(4096)))
        except Exception:
            pass

threading.Thread(target=spin, daemon=True).start()
time.sleep(0.3)
print(os.getpid(), flush=True)
"""


def test_a_daemon_thread_pickling_at_exit_leaves_no_socket_directory():
    """A daemon thread that keeps sending arrays while the main thread returns.

    What a user sees: a ``/tmp/shmshare-mp-<pid>-*`` directory left behind by a process that
    exited normally. The promise: "The directory is removed at exit." Cause: the exit
    finalizer (``_at_exit``) closes the owner, then the daemon thread's next pickle calls
    ``owner()``, which makes a fresh Owner and fd server after the finalizer has run; nobody
    closes that one (nor should a pickle after exit began make a server at all).
    """
    # the linger bounded short: the spinning thread always has a handle just made, unclaimed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), SHMSHARE_MP_LINGER="0.5")
    pid = None
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXIT_PICKLER)], env=env,
                              capture_output=True, text=True, timeout=WAIT)
        assert done.returncode == 0, done.stderr
        pid = int(done.stdout.split()[-1])
        # a keeper serves what is unclaimed for the 0.5 s linger (Note [A keeper after exit]),
        # then removes the directory as it leaves
        wait_until(lambda: not _socket_dirs(pid), "the keeper to leave", WAIT, between=gc.collect)
        left = _socket_dirs(pid)
    finally:
        if pid is not None:
            for d in _socket_dirs(pid):
                shutil.rmtree(d, ignore_errors=True)
    assert not left, f"a process that exited normally left {left}"


# -- 5. bytes of another array show through a structured array's padding -----------------------

def _padded_roundtrip() -> tuple[bytes, bytes, bool]:
    secret = np.full(8192, 0x5A5A5A5A5A5A5A5A, np.uint64)
    got = ForkingPickler.loads(ForkingPickler.dumps(secret))
    del got
    wait_until(lambda: smp.statistics().handles_claimed == 0, "every handle released",
               between=gc.collect)  # its block is a spare now
    dt = np.dtype({"names": ["x"], "formats": ["<i4"], "offsets": [0], "itemsize": 8})
    sent = np.zeros(8192, dt)
    sent["x"] = np.arange(8192)
    got = ForkingPickler.loads(ForkingPickler.dumps(sent))
    try:
        return got.tobytes(), sent.tobytes(), bool(np.array_equal(got["x"], sent["x"]))
    finally:
        del got


def test_a_padded_structured_array_carries_its_own_bytes_not_an_earlier_arrays():
    """A structured dtype with padding (``offsets``/``itemsize``, or ``align=True``).

    What a user sees: ``received.tobytes() != sent.tobytes()``: the padding bytes hold the
    data of an array this process sent before (here 0x5A), where the stdlib's pickle
    carries the array's own bytes. Whatever hashes or compares arrays by their bytes (a
    cache key, a dedup, a checksum) breaks, and another array's contents reach this
    receiver. The promise: a drop-in for multiprocessing; structured dtypes go as a handle.
    Cause: ``Owner._copy_in`` uses ``np.copyto``, which copies the fields only and leaves
    the padding of a reused pool block as the last array left it.
    """
    got, sent, fields_equal = _padded_roundtrip()
    assert fields_equal
    pad = np.frombuffer(got, np.uint8).reshape(8192, 8)[0, 4:].tolist()
    assert got == sent, f"the padding reads {pad}: bytes of an array sent earlier"


# -- 6. a documented allocator setting breaks every handle ---------------------------------------

def _queue_roundtrip() -> str:
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    try:
        q.put(np.arange(1 << 14, dtype=np.float64))
        try:
            got = q.get(timeout=WAIT)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        ok = np.array_equal(got, np.arange(1 << 14, dtype=np.float64))
        del got
        return "equal" if ok else "different"
    finally:
        q.close()
        q.join_thread()
        smp.shutdown()  # before the settings go back: the pool was made with them


def test_arrays_go_and_arrive_with_expandable_segments_set(monkeypatch):
    """``SHMSHARE_ALLOC_CONF=expandable_segments:True``: the allocator's documented setting,
    say for the channels of the same program.

    What a user sees: every ``Queue.get`` of an array raises ``ProtocolError: a segment fd of
    2097152 bytes was announced as 68719476736 bytes``, and the array is lost. The promise:
    an array goes as a handle or, when the pool cannot, by value; the receiver gets it.
    Cause: the owner's ``CachingAllocator`` reads the process-wide settings and makes
    expandable segments (a 64 GiB reservation whose memfd grows as pages are mapped);
    ``Owner.segment`` announces the reserved size, which the receiver's ``check_fd`` rightly
    refuses -- and a growing segment could not be mapped once and cached anyway. The owner
    should make its allocator with expandable segments off (or send them as the channel does).
    """
    from shmshare.memory import _config

    monkeypatch.setenv("SHMSHARE_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(_config, "_current", None)
    assert _queue_roundtrip() == "equal"


# -- 7. a forked child keeps the parent's whole pool alive ---------------------------------------

def _report_inherited(out, cmd) -> None:
    cmd.get(timeout=WAIT)  # after the parent gave its pool back
    gc.collect()
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = [line.strip() for line in f if "memfd:shmshare" in line]
    out.put(([f for f in fds if "memfd:shmshare" in f], maps))


def _fork_after_growing() -> tuple[list[str], list[str]]:
    got = ForkingPickler.loads(ForkingPickler.dumps(np.ones(1 << 22)))  # a 32 MiB block
    del got
    wait_until(lambda: smp.statistics().handles_claimed == 0, "every handle released", between=gc.collect)
    ctx = smp.get_context("fork")
    out, cmd = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_report_inherited, args=(out, cmd))
    p.start()
    try:
        smp.shutdown()  # the parent gives its whole pool back
        cmd.put("look")
        got = out.get(timeout=WAIT)
        p.join(WAIT)
        return got
    finally:
        kill(p)


def test_a_forked_child_does_not_pin_the_parents_pool_after_the_parent_gives_it_back():
    """A long-lived fork child (a Pool worker) made after the parent's pool grew.

    What a user sees: the parent's ``shutdown()`` (or its pool emptying its cache) gives the
    pool back, yet the memory stays committed for as long as any forked child lives: each
    child holds the memfd and mapping of every segment of the parent's pool (here the 32 MiB
    block's segment and the small pool's). The channel's pool does not do this:
    ``ShmProvider.after_fork_in_child`` closes the fds and unmaps what nothing of the child
    uses (Note [At fork]: "what it must not do with them is the parent's business"). Cause:
    the owner's ``_after_fork_in_child`` only forgets the Owner and stops its server; the
    provider's segments keep their fds and mappings in the child, reachable from the child's
    copy of the allocator (and of the client's cached segment mappings).
    """
    fds, maps = _fork_after_growing()
    assert not fds and not maps, (f"a forked child holds {len(fds)} fds and {len(maps)} "
                                  f"mappings of the parent's pool, which the parent gave back: "
                                  f"{fds}")
