"""``shmshare stat`` against what the test's own processes are known to hold."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np

from shmshare import Segment, _stat, wire
from shmshare.testing import kill

WAIT = 30.0
SIZE = 4 << 20


def _hold_fd_only(conn: wire.Connection, done) -> None:
    _, fds = conn.recv(timeout=WAIT)  # the segment's fd, never mapped
    done.put("holding")
    signal.pause()  # until killed, holding them
    del fds


def _map_only(seg_fd: int, touch: bool, ready) -> None:
    os.close(seg_fd)  # the inherited fd goes: the mapping stays
    assert _seg is not None
    if touch:
        _seg.view(np.uint8, SIZE).sum()  # every page read: resident here too
    ready.put("mapping")
    signal.pause()


_seg: Segment | None = None


def test_stat_sees_who_maps_and_who_holds_a_segment_and_what_is_resident():
    global _seg
    ctx = mp.get_context("fork")
    a, b = wire.pipe()
    done = ctx.Queue()
    holder = ctx.Process(target=_hold_fd_only, args=(b, done))
    holder.start()
    mapper = None
    try:
        _seg = Segment.create(SIZE)
        _seg.view(np.uint8, SIZE)[:] = 1  # every page ours
        a.send({"k": "seg"}, [_seg.fd])
        assert done.get(timeout=WAIT) == "holding"
        ready = ctx.Queue()
        mapper = ctx.Process(target=_map_only, args=(_seg.fd, True, ready))
        mapper.start()
        assert ready.get(timeout=WAIT) == "mapping"
        os.kill(mapper.pid, signal.SIGSTOP)  # a hung process is seen all the same
        me = os.getpid()
        report = _stat.scan([me, holder.pid, mapper.pid])
        st = os.fstat(_seg.fd)
        seg = next(s for s in report.segments if s.inode == st.st_ino)
        assert seg.mapped_by == {me, mapper.pid} and seg.fd_holders == {me, holder.pid}
        assert seg.size == SIZE and "memfd:shmshare_" in seg.name
        procs = {p.pid: p for p in report.processes}
        assert procs[me].fds >= 1 and procs[me].mapped_bytes >= SIZE
        assert procs[me].resident_bytes >= SIZE
        assert {holder.pid, mapper.pid} <= procs[me].shares_with
        assert procs[holder.pid].fds == 1 and procs[holder.pid].mapped_bytes == 0
        assert procs[holder.pid].shares_with >= {me}
        assert procs[mapper.pid].fds == 0 and procs[mapper.pid].mapped_bytes == SIZE
        assert procs[mapper.pid].resident_bytes >= SIZE  # it read every page
        text = _stat.render(report)
        assert str(mapper.pid) in text and "4.0M" in text
    finally:
        if mapper is not None and mapper.pid:
            os.kill(mapper.pid, signal.SIGCONT)
        kill(holder, mapper)
        a.close()
        b.close()
        done.close()
        done.join_thread()
        if _seg is not None:
            _seg.close()
            _seg = None


def test_a_process_without_shmshare_memory_is_not_listed():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        report = _stat.scan([child.pid])
        assert report.processes == [] and report.segments == []
        assert "no process" in _stat.render(report)
    finally:
        child.kill()
        child.wait(10)


def test_the_command_prints_json_for_scripts():
    seg = Segment.create(1 << 20)
    try:
        seg.view(np.uint8, 1 << 20)[:] = 2
        out = subprocess.run([sys.executable, "-m", "shmshare", "stat", "--json", "--pid",
                              str(os.getpid())], capture_output=True, text=True, timeout=WAIT)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        (me,) = got["processes"]
        assert me["pid"] == os.getpid() and me["fds"] >= 1 and me["mapped_bytes"] >= 1 << 20
        assert any(s["size"] == 1 << 20 and os.getpid() in s["fd_holders"] for s in got["segments"])
    finally:
        seg.close()


def test_a_pid_that_is_gone_is_no_error():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    report = _stat.scan([child.pid])
    assert report.processes == []


def test_stat_pid_of_no_process_says_so_and_fails():
    """``shmshare stat --pid N`` of a pid that does not exist said "no process of this host holds
    shmshare memory" and exited 0."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    done = subprocess.run([sys.executable, "-m", "shmshare", "stat", "--pid", str(child.pid)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"no process {child.pid}" in done.stderr, done
    alive = subprocess.run([sys.executable, "-m", "shmshare", "stat", "--pid", "1"],
                           capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0 and "no process asked about (1) holds" in alive.stdout, alive


# A child with the stats socket on: a simulated-device pool, a host pool and a channel whose
# receiver keeps three arrays (three leases out), and one multiprocessing handle never
# unpickled. It prints its own figures, then waits to be killed.
_STATS_CHILD = r"""
import json, pickle, signal, time
import numpy as np
import shmshare
import shmshare.multiprocessing as smp
from multiprocessing.reduction import ForkingPickler
from shmshare.memory import CachingAllocator, CachingHostAllocator, HostFallbackProvider, SimulatedDevice

dev = CachingAllocator(SimulatedDevice(1 << 30))
blocks = [dev.malloc(3 << 20), dev.malloc(1 << 10)]
host = CachingHostAllocator(HostFallbackProvider())
pinned = host.allocate(5000)
tx, rx = shmshare.channel()
for n in (1000, 20000, 300000):
    tx.send(np.ones(n, np.uint8))
kept = [rx.recv(timeout=30) for _ in range(3)]
handle = ForkingPickler.dumps(np.arange(4096, dtype=np.float64))
ds = dev.memory_stats()
tx_stats = tx.statistics()
print(json.dumps({
    "dev": [ds["reserved_bytes.all.current"], ds["allocated_bytes.all.current"]],
    "host": host.host_memory_stats()["allocated_bytes.current"],
    "leases": tx_stats.leases_out, "bytes_leased": tx_stats.bytes_leased,
    "shm": [tx_stats.reserved_bytes, tx_stats.allocated_bytes],
    "owner": smp.statistics().handles_unclaimed, "made": time.monotonic()}), flush=True)
signal.pause()
"""


def _stats_child() -> tuple[subprocess.Popen[str], dict]:
    env = dict(os.environ, SHMSHARE_STATS="1")
    child = subprocess.Popen([sys.executable, "-c", _STATS_CHILD], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        import select

        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], WAIT)
        assert ready, "the child said nothing"
        return child, json.loads(child.stdout.readline())
    except BaseException:
        child.kill()
        child.wait(10)
        raise


def _stat_json(pid: int, timeout: float = WAIT) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SHMSHARE_STATS"}
    out = subprocess.run([sys.executable, "-m", "shmshare", "stat", "--json", "--pid", str(pid)],
                         capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_stat_shows_the_pools_and_leases_a_process_reports_on_its_stats_socket():
    child, own = _stats_child()
    try:
        time.sleep(1.5)  # the leases are at least this old when stat asks
        got = _stat_json(child.pid)
        (proc,) = got["processes"]
        assert proc["pid"] == child.pid and proc["fds"] >= 1  # /proc's part, as before
        stats = proc["stats"]
        kinds = stats["totals"]["by_kind"]
        assert [kinds["simulated"]["reserved_bytes"], kinds["simulated"]["allocated_bytes"]] == own["dev"]
        assert own["dev"][1] == (3 << 20) + (1 << 10)
        assert kinds["host"]["allocated_bytes"] == own["host"] == 8192  # 5000 B, as a power of two
        (sender,) = stats["senders"]
        assert sender["leases_out"] == own["leases"] == 3
        assert sender["bytes_leased"] == own["bytes_leased"]
        assert sender["oldest_lease_s"] >= 1.5 - stats["tick_s"]
        (owner,) = stats["owners"]
        assert owner["handles_unclaimed"] == own["owner"] == 1 and owner["handles_claimed"] == 0
        assert owner["oldest_unclaimed_s"] >= 1.5
        shm = kinds["shm"]  # the channel's pool and the owner's
        assert shm["pools"] == 2 and shm["leases_out"] == 4
        assert shm["reserved_bytes"] >= own["shm"][0] and shm["allocated_bytes"] >= own["shm"][1]
        assert stats["totals"]["oldest_lease_s"] >= 1.5 - stats["tick_s"]
        text = _stat.render(_stat.scan([child.pid]))
        assert "simulated" in text and "host" in text
        assert any(line.split()[:2] == [str(child.pid), "shm"] for line in text.splitlines()), text
        assert got["stats_unanswered"] == []
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()


def test_a_stopped_process_does_not_hang_stat():
    child, _ = _stats_child()
    try:
        os.kill(child.pid, signal.SIGSTOP)
        got = _stat_json(child.pid, timeout=8)  # a hang fails it: TimeoutExpired
        (proc,) = got["processes"]  # seen from /proc all the same
        assert proc["pid"] == child.pid and "stats" not in proc
        (silent,) = got["stats_unanswered"]
        assert silent["pid"] == child.pid and "no answer" in silent["why"]
        report = _stat.scan([child.pid])
        assert "no answer" in _stat.render(report)
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(10)
        child.stdout.close()
