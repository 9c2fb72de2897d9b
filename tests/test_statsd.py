"""The stats socket (``_statsd.py``): off by default, private, removed at exit, unhurt by hostile
clients, one per forked process; and the reporters behind it (``_registry.py``)."""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import msgpack

from shmshare import _registry, _statsd, wire
from shmshare.channel._report import SenderReport, oldest_key
from shmshare.memory import CachingAllocator, CachingHostAllocator, HostFallbackProvider, SimulatedDevice
from shmshare.memory._report import kind_of, report_allocator, report_host_allocator

WAIT = 30.0

# A child that makes a pool and a channel, says where it answers, then obeys stdin: "exit"
# (a clean exit), "fork" (a forked child reports the paths), "ping" (answers "pong").
CHILD = r"""
import json, os, sys, threading
import numpy as np
import shmshare
from shmshare import _statsd
from shmshare.memory import CachingAllocator, SimulatedDevice

pool = CachingAllocator(SimulatedDevice(1 << 30))
block = pool.malloc(3 << 20)
tx, rx = shmshare.channel()
tx.send(np.ones(1000))
kept = rx.recv(timeout=30)
print(json.dumps({"socket": _statsd.stats_socket(),
                  "threads": sorted(t.name for t in threading.enumerate())}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "ping":
        print("pong", flush=True)
    elif cmd == "fds":
        print(len(os.listdir("/proc/self/fd")), flush=True)
    elif cmd == "fork":
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            mine = _statsd.stats_socket()
            try:
                asked = _statsd.ask(mine)[0] if mine else None
            except Exception as exc:
                asked = repr(exc)
            os.write(w, json.dumps({"pid": os.getpid(), "socket": mine, "asked": asked}).encode())
            _statsd.stop_stats()
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            got = f.read()
        os.waitpid(pid, 0)
        print(got, flush=True)
    elif cmd == "exit":
        break
tx.close(); rx.close()
"""


def _start(stats: bool) -> tuple[subprocess.Popen[str], dict[str, object]]:
    env = dict(os.environ)
    env.pop(_statsd.ENV_VAR, None)
    if stats:
        env[_statsd.ENV_VAR] = "1"
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        return child, json.loads(_line(child))
    except BaseException:
        _end(child)
        raise


def _line(child: subprocess.Popen[str], timeout: float = WAIT) -> str:
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    assert ready, f"pid {child.pid} said nothing within {timeout} s"
    line = child.stdout.readline()
    assert line, f"pid {child.pid} exited (rc {child.poll()})"
    return line


def _say(child: subprocess.Popen[str], cmd: str) -> None:
    assert child.stdin is not None
    child.stdin.write(cmd + "\n")
    child.stdin.flush()


def _end(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        os.kill(child.pid, signal.SIGCONT)
        os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    for f in (child.stdin, child.stdout):
        if f is not None:
            f.close()


def test_off_by_default_no_socket_and_no_thread():
    child, said = _start(stats=False)
    try:
        assert said["socket"] is None
        assert "shmshare-stats" not in said["threads"]
        assert not [p for p in _statsd.stats_sockets() if os.path.basename(p).startswith(f"{child.pid}")]
    finally:
        _end(child)


def test_the_socket_is_private_answers_and_is_removed_at_exit():
    child, said = _start(stats=True)
    try:
        path = said["socket"]
        assert isinstance(path, str) and os.path.basename(path) == f"{child.pid}.sock"
        assert "shmshare-stats" in said["threads"]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(path).st_mode)
        d = os.path.dirname(path)
        for part in (d, os.path.dirname(d)):
            st = os.lstat(part)
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, part
            assert st.st_uid == os.getuid()
        pid, reply = _statsd.ask(path)
        assert pid == child.pid == reply["pid"] and reply["v"] == _statsd.VERSION
        kinds = reply["totals"]["by_kind"]
        assert kinds["simulated"]["allocated_bytes"] == 3 << 20
        assert kinds["shm"]["leases_out"] == 1 and reply["senders"][0]["leases_out"] == 1
        _say(child, "exit")
        assert child.wait(WAIT) == 0
        assert not os.path.exists(path)
    finally:
        _end(child)


def test_hostile_clients_are_dropped_and_the_process_goes_on():
    child, said = _start(stats=True)
    path = str(said["socket"])
    socks: list[socket.socket] = []
    try:
        _say(child, "fds")
        fds_before = int(_line(child))

        def raw() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(5)
            s.connect(path)
            socks.append(s)
            return s

        raw().send(b"\xc1garbage, not msgpack")
        big = raw()
        big.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        with contextlib.suppress(OSError):  # a frame over MAX_FRAME: dropped (or refused here)
            big.send(b"\x00" * (wire.MAX_FRAME + (64 << 10)))
        raw()  # connects and never says anything
        hello = msgpack.packb([0, {"version": wire.PROTOCOL_VERSION, "pid": 1, "role": "x"}])
        ask = msgpack.packb([1, {"k": "stats"}])
        for _ in range(12):  # ask, and never read the answer; more of them than it serves at once
            s = raw()
            s.send(hello)
            s.send(ask)
        r, w = os.pipe()
        try:  # fds it did not ask for
            raw().sendmsg([hello], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r, w]))])
        finally:
            os.close(r)
            os.close(w)
        t0 = time.monotonic()
        reply = None
        while reply is None and time.monotonic() - t0 < 10:
            try:
                reply = _statsd.ask(path)[1]
            except Exception:  # noqa: BLE001 -- turned away while it was full: ask again
                time.sleep(0.2)
        assert reply is not None and reply["totals"]["leases_out"] == 1
        _say(child, "ping")
        assert _line(child).strip() == "pong"
        for s in socks:
            s.close()
        socks.clear()
        # the server drops the ones that never asked within its wait (_CLIENT_WAIT, 1 s): until it has, bounded
        deadline = time.monotonic() + 10
        while True:
            _say(child, "fds")
            fds_now = int(_line(child))
            if fds_now <= fds_before + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert fds_now <= fds_before + 1
        assert child.poll() is None
    finally:
        for s in socks:
            s.close()
        _end(child)


def test_a_forked_child_serves_its_own_socket():
    child, said = _start(stats=True)
    try:
        _say(child, "fork")
        got = json.loads(_line(child))
        assert got["socket"] != said["socket"]
        assert os.path.basename(got["socket"]) == f"{got['pid']}.sock"
        assert got["asked"] == got["pid"]  # its own thread answers, under its own pid
        assert not os.path.exists(got["socket"])  # stop_stats removed it
        assert _statsd.ask(str(said["socket"]))[0] == child.pid  # the parent's still answers
    finally:
        _end(child)


def test_serve_stats_and_stop_stats_in_this_process():
    pool = CachingAllocator(SimulatedDevice(1 << 30))
    block = pool.malloc(1 << 20)
    path = _statsd.serve_stats()
    try:
        assert _statsd.serve_stats() == path == _statsd.stats_socket()  # idempotent
        pid, reply = _statsd.ask(path)
        assert pid == os.getpid()
        mine = [p for p in reply["pools"] if p["id"] == id(pool)]
        assert mine and mine[0]["allocated_bytes"] == 1 << 20 and mine[0]["kind"] == "simulated"
    finally:
        _statsd.stop_stats()
    assert _statsd.stats_socket() is None and not os.path.exists(path)
    assert "shmshare-stats" not in {t.name for t in threading.enumerate()}
    pool.free(block)


def test_a_reply_too_large_for_one_frame_is_cut_but_its_totals_are_whole():
    class Big:
        pass

    objs = [Big() for _ in range(4000)]
    for o in objs:
        _registry.register("pools", o, lambda o: {"id": id(o), "kind": "test", "reserved_bytes": 1,
                                                  "allocated_bytes": 1, "pad": "x" * 40})
    path = _statsd.serve_stats()
    try:
        reply = _statsd.ask(path)[1]
        assert reply["truncated"] > 0 and len(reply["pools"]) < 4000
        assert reply["totals"]["by_kind"]["test"]["pools"] == 4000
    finally:
        _statsd.stop_stats()
    del objs, o
    assert not [e for e in _registry.entries() if e[0] == "pools" and isinstance(e[1], Big)]


def test_a_failing_reporter_says_why_and_a_stuck_one_does_not_keep_the_socket():
    class Odd:
        pass

    def broken(o: object) -> dict[str, object]:
        raise ZeroDivisionError("no figures today")

    stuck = threading.Event()

    def slow(o: object) -> dict[str, object]:
        stuck.wait(5)
        return {}

    odd, late = Odd(), Odd()
    _registry.register("owners", odd, broken)
    path = _statsd.serve_stats()
    try:
        reply = _statsd.ask(path)[1]
        assert {"error": "ZeroDivisionError: no figures today"} in reply["owners"]
        assert "totals" in reply  # the others are there all the same
        _registry.register("owners", late, slow)
        with contextlib.suppress(Exception):
            _statsd.ask(path, timeout=0.3)  # the thread is now stuck in `slow`
        stopper = threading.Thread(target=_statsd.stop_stats)
        stopper.start()
        stopper.join(4)  # a bounded wait: stop_stats must not wait for the stuck thread
        assert not stopper.is_alive() and not os.path.exists(path)  # gone though it is stuck
    finally:
        stuck.set()
        _statsd.stop_stats()
        for t in threading.enumerate():
            if t.name == "shmshare-stats":
                t.join(10)  # it closes its own fds as it ends
    del odd, late


def test_an_error_in_the_thread_removes_the_socket(monkeypatch):
    def boom(now: float) -> None:
        raise RuntimeError("a bug")

    path = _statsd.serve_stats()
    try:
        monkeypatch.setattr(_statsd._registry, "tick", boom)
        t0 = time.monotonic()
        # the thread forgets its socket, then removes the file: wait for both
        while ((_statsd.stats_socket() is not None or os.path.exists(path))
               and time.monotonic() - t0 < 5):
            time.sleep(0.05)
        assert _statsd.stats_socket() is None and not os.path.exists(path)
    finally:
        _statsd.stop_stats()


def test_a_stale_socket_is_swept_by_the_next_server():
    d = _statsd._make_dir()
    stale = os.path.join(d, "999999999.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(stale)
    s.close()  # bound, nobody listens: a process killed
    old = time.time() - 60
    os.utime(stale, (old, old))
    path = _statsd.serve_stats()
    try:
        assert not os.path.exists(stale)
    finally:
        _statsd.stop_stats()
        if os.path.lexists(stale):
            os.unlink(stale)
    assert not os.path.exists(path)


# -- the reporters ---------------------------------------------------------------------


def test_pool_kinds_and_reports_without_a_gpu():
    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

    # The CUDA pools are a CachingAllocator over CudaDeviceProvider ("cuda device") and a
    # CachingHostAllocator over CudaHostProvider ("cuda host"): the same two reporters as here.
    assert kind_of(Named("cuda device")) == "device" and kind_of(Named("cuda host")) == "pinned"
    assert kind_of(SimulatedDevice(1 << 20)) == "simulated" and kind_of(Named("other")) == "other"
    pool = CachingAllocator(SimulatedDevice(1 << 30))
    a = pool.malloc(5 << 20)
    got = report_allocator(pool)
    assert got["allocated_bytes"] == 5 << 20 == got["peak_allocated_bytes"]
    assert got["reserved_bytes"] == pool.memory_stats()["reserved_bytes.all.current"] > 0
    pool.free(a)
    assert report_allocator(pool)["allocated_bytes"] == 0
    with CachingHostAllocator(HostFallbackProvider()) as host:
        b = host.allocate(3000)
        got = report_host_allocator(host)
        hs = host.host_memory_stats()
        assert got["kind"] == "host" and got["allocated_bytes"] == hs["allocated_bytes.current"] == 4096
        assert got["reserved_bytes"] == hs["reserved_bytes.current"]
        assert any(e[1] is host for e in _registry.entries())  # registered when made
        host.free(b)


class _FakeSender:
    def __init__(self) -> None:
        self._leases: dict[int, object] = {}


def test_lease_age_notes_bound_the_oldest_lease_from_below():
    sender, rep = _FakeSender(), SenderReport()
    base = 7 << 32
    sender._leases[base + 1] = 1
    rep.tick(sender, 100.0)  # lease 1 made before 100
    sender._leases[base + 2] = 1
    rep.tick(sender, 100.5)
    assert rep.age(base + 1, 103.0) == 3.0
    del sender._leases[base + 1]
    rep.tick(sender, 101.0)  # lease 1 came back: its note goes
    assert rep.age(base + 2, 103.0) == 2.5
    sender._leases[base + 3] = 1
    assert oldest_key(sender._leases) == base + 2 and rep.age(base + 2, 103.0) == 2.5
    assert rep.age(base + 3, 103.0) == 0.0  # made after the last note: under a tick
    sender._leases.clear()
    rep.tick(sender, 102.0)
    assert not rep.notes and rep.age(None, 103.0) is None
    sender._leases[base + 10] = 1
    for i in range(1, 1000):  # a lease held long while new ones come and go: few notes, a bound
        sender._leases[base + 10 + i] = 1
        if i > 1:
            del sender._leases[base + 10 + i - 1]
        rep.tick(sender, 200.0 + i)  # lease 10 is out from the first of these on: 1099 s at 1300
    assert len(rep.notes) <= 64
    got = rep.age(base + 10, 1300.0)
    assert got == 1099.0  # its note stays, however many go
