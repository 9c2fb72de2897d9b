"""``shmshare stat`` against what the test's own processes are known to hold."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys

import numpy as np

from shmshare import Segment, _stat, wire

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


def _kill(*procs) -> None:
    for p in procs:
        if p is not None and p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)


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
        _kill(holder, mapper)
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
