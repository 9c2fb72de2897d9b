"""What stat keeps of the answers it gets (``_statask.py``, ``store/_find.py``), what a stats
server may take as its name, and when a forked child starts its own (``_statsd.py``)."""

from __future__ import annotations

import json
import os
import socket

import pytest

from shmshare import _sockets, _stat, _statask, _statsd, wire
from shmshare.memory import CachingAllocator, SimulatedDevice
from shmshare.store import _find

from .clock_helpers import PollClock
from .stats_helpers import stats_dir as _stats_dir


def test_a_reply_keeps_the_keys_stat_knows_each_of_its_type():
    reply = {"k": "stats", "v": 1, "pid": 12, "junk": b"\x00", "uptime_s": 1.5,
             "pools": [{"id": 1, "kind": "shm", "nan": float("nan"), "deep": {"a": [1, "x"]}}],
             "totals": {"by_kind": {"shm": {"pools": 1, "reserved_bytes": 10, "oldest_lease_s": None,
                                            "other": b"dropped"}}, "leases_out": 0}}
    got = _statask.check_reply(reply)
    assert got == {"pid": 12, "uptime_s": 1.5,
                   "pools": [{"id": 1, "kind": "shm", "nan": None, "deep": {"a": [1, "x"]}}],
                   "totals": {"by_kind": {"shm": {"pools": 1, "reserved_bytes": 10,
                                                  "oldest_lease_s": None}}, "leases_out": 0}}
    json.dumps(got, allow_nan=False)


@pytest.mark.parametrize("reply", [
    {"pools": [{"id": b"\x00"}]},
    {"pools": "many"},
    {"pools": [{1: "a key not a str"}]},
    {"pools": [{"a": [[[[[[[[1]]]]]]]]}]},
    {"totals": []},
    {"totals": {"by_kind": {"shm": {"reserved_bytes": "lots"}}}},
    {"totals": {"by_kind": {"shm": {"pools": True}}}},
    {"truncated": float("inf")},
], ids=["bytes", "not-a-list", "int-key", "too-deep", "totals-list", "str-number", "bool-number",
        "inf"])
def test_a_reply_of_the_wrong_types_is_malformed(reply):
    with pytest.raises(_statask.Malformed):
        _statask.check_reply(reply)


def test_a_line_of_proc_net_unix_that_fails_to_parse_is_skipped():
    lines = ["Num       RefCount Protocol Flags    Type St Inode Path\n",
             "0000: 00000002 00000000 00010000 0005 01 12 /run/a.sock\n",
             "0000: 00000002 00000000 0001zzzz 0005 01 13 /run/bad-flags.sock\n",
             "0000: 00000002 00000000 00010000 0005 01 x14 /run/bad-inode.sock\n",
             "short line\n",
             "0000: 00000002 00000000 00010000 0005 01 15 /run/with a space.sock\n",
             "0000: 00000002 00000000 00000000 0005 01 16 /run/not-listening.sock\n"]
    assert _find._parse_unix(lines) == {12: "/run/a.sock", 15: "/run/with a space.sock"}


def test_a_directory_at_its_name_makes_the_server_take_the_token_name(home):
    target = os.path.join(_stats_dir(), f"{os.getpid()}.sock")
    os.mkdir(target)
    try:
        path = _statsd.serve_stats()
        assert os.path.basename(path).startswith(f"{os.getpid()}-")
        assert _statsd.ask(path)[0] == os.getpid()
        assert os.path.isdir(target)
    finally:
        _statsd.stop_stats()
        os.rmdir(target)


def test_a_forked_child_serves_from_its_first_pool_not_from_the_fork(home):
    d = os.path.dirname(_statsd.serve_stats())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover -- the child
        code = 1
        try:
            os.close(r)
            before = os.path.exists(os.path.join(d, f"{os.getpid()}.sock"))
            pool = CachingAllocator(SimulatedDevice(1 << 20))
            path = _statsd._server.path if _statsd._server is not None else None
            ok = (not before and path == os.path.join(d, f"{os.getpid()}.sock")
                  and _statsd.ask(path)[0] == os.getpid())
            del pool
            _statsd.stop_stats()
            os.write(w, b"ok" if ok and not os.path.exists(path or "") else b"no")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            said = f.read()
    finally:
        assert os.waitpid(pid, 0)[1] == 0
    assert said == b"ok"


def test_many_silent_and_one_full_backlog_cost_one_timeout(home, monkeypatch):
    """200 silent stats sockets (more than _AT_ONCE) and one whose backlog is full cost one
    timeout in all: on a clock that moves only while stat waits -- its poll loop, and whatever
    a connection or a connect waits -- ask_stats(timeout=0.3) waits 0.3 s, not a timeout per
    _AT_ONCE sockets or per full backlog."""
    clock = PollClock()
    for module in (_statask, wire):
        monkeypatch.setattr(module, "time", clock)
        monkeypatch.setattr(module, "select", clock.select())
    monkeypatch.setattr(_sockets, "time", clock)
    d = _stats_dir()
    socks = []
    try:
        for i in range(200):  # more than _AT_ONCE
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            socks.append(s)
            s.bind(os.path.join(d, f"{4_000_000_000 + i}.sock"))
            s.listen(0)
        for _ in range(3):  # fill the first one's backlog
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
            socks.append(c)
            try:
                c.connect(os.path.join(d, "4000000000.sock"))
            except BlockingIOError:
                break
        fds = len(os.listdir("/proc/self/fd"))
        answers, unanswered = _stat.ask_stats(timeout=0.3)
    finally:
        for s in socks:
            s.close()
    waited = clock.waited
    assert waited <= 0.3 + 0.01, f"stat waited {waited:.2f} s for 200 silent stats sockets"
    mine = [u for u in unanswered if os.path.dirname(u["socket"]) == d]
    assert len(mine) == 200 and not [p for p in answers if p == os.getpid()]
    assert sum("backlog stayed full" in u["why"] for u in mine) == 1  # retried, not holding a slot
    assert sum("not asked" in u["why"] for u in mine) == 200 - 128 - 1
    assert len(os.listdir("/proc/self/fd")) <= fds
