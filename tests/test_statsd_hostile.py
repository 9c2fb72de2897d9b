"""The stats socket and ``shmshare stat`` against hostile users, same-uid processes and fakes.

Each test says in its docstring the defect it shows (or the attack that holds) and what a fix
must do. Every wait is bounded; every process started is killed by its pid.
"""

from __future__ import annotations

import array
import os
import random
import socket
import stat
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import msgpack
import pytest

from shmshare import _registry, _stat, _statask, _statsd, wire
from shmshare.memory import CachingAllocator, CachingHostAllocator, HostFallbackProvider, SimulatedDevice
from shmshare.testing import kill

from .clock_helpers import PollClock
from .stats_helpers import stats_dir as _stats_dir

WAIT = 20.0

# A fake store daemon: its command line says `shmshare serve`; it listens on N sockets in DIR
# and then, by MODE: never accepts ("silent"), answers every request with a BAD error ("bad"),
# with an "ok" that lacks its payload ("nos"), or pages `list` forever ("endless").
FAKE_DAEMON = r"""
import os, sys, time
from shmshare import wire
mode, n, where = sys.argv[3], int(sys.argv[4]), sys.argv[5]
ls = [wire.Listener(os.path.join(where, f"s{i}")) for i in range(n)]
print("ready", flush=True)
if mode == "silent":
    time.sleep(60)
    sys.exit(0)
while True:
    for l in ls:
        try:
            conn = l.accept(timeout=0.05)
        except Exception:
            continue
        i = 0
        try:
            while True:
                h, _ = conn.recv(timeout=30)
                if mode == "bad":
                    conn.send({"k": "err", "e": "bad", "w": "garbage"})
                elif mode == "nos":
                    conn.send({"k": "ok"})
                elif h.get("k") == "stats":
                    conn.send({"k": "ok", "s": {"connected": 1, "objects": 1, "held_bytes": 1,
                                                "deleted_viewed": 0, "limit": 0}})
                else:
                    i += 1
                    conn.send({"k": "ok", "more": True,
                               "l": [[f"n{i:09d}", 1, True, 0, 0.0, "arena", "none", 0]]})
        except Exception:
            conn.close()
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != _statsd.ENV_VAR}


def _run_stat(*args: str, timeout: float = WAIT) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "shmshare", "stat", *args], capture_output=True,
                             text=True, timeout=timeout, env=_env())
    except subprocess.TimeoutExpired:
        pytest.fail(f"`shmshare stat {' '.join(args)}` did not finish within {timeout} s")
    return out, time.monotonic() - t0


def _fake_daemon(tmp_path, mode: str, n: int = 1) -> subprocess.Popen[str]:
    where = tmp_path / f"fake-{mode}"
    where.mkdir()
    child = subprocess.Popen([sys.executable, "-c", FAKE_DAEMON, "shmshare", "serve", mode, str(n),
                              str(where)], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert child.stdout is not None
        import select

        assert select.select([child.stdout], [], [], WAIT)[0], "the fake daemon said nothing"
        assert child.stdout.readline().strip() == "ready"
        return child
    except BaseException:
        _kill(child)
        raise


def _kill(child: subprocess.Popen[str]) -> None:
    kill(child)
    if child.stdout is not None:
        child.stdout.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- stat's time, and fakes that would hang or crash it ------------------------------------


def test_stat_with_50_unresponsive_stats_sockets_waits_one_timeout(home, monkeypatch):
    """Defect: ask_stats asked at most 16 sockets at a time, so 50 silent ones (listening, never
    accepting: a same-uid process makes them for free) cost 4 x 0.5 s, growing without bound
    with their number. A fix must ask every socket at once (or bound stat's total wait): on a
    clock that moves only while stat waits, 50 silent sockets cost one ASK_TIMEOUT in all."""
    d = _stats_dir()
    clock = PollClock()
    monkeypatch.setattr(_statask, "time", clock)
    monkeypatch.setattr(_statask, "select", clock.select())
    socks = []
    try:
        for i in range(50):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            socks.append(s)
            s.bind(os.path.join(d, f"{4_000_000_000 + i}.sock"))
            s.listen(1)
        answers, unanswered = _stat.ask_stats()
    finally:
        for s in socks:
            s.close()
    silent = [u for u in unanswered if os.path.basename(u["socket"]).startswith("4000000")]
    assert len(silent) == 50 and not answers, (answers, unanswered)
    assert all("no answer within" in u["why"] for u in silent), silent
    waited = clock.waited
    assert waited <= _stat.ASK_TIMEOUT + 0.01, f"stat waited {waited:.2f} s for 50 silent stats sockets"


def test_stat_with_a_fake_store_daemon_on_many_sockets_asks_them_at_once(home, tmp_path, monkeypatch):
    """Defect: _stores asked every daemon socket one after another, 0.5 s each, so one process
    whose command line says `shmshare serve` and that listens on 8 sockets but never accepts
    made stat take 4 s (and 100 sockets, 50 s). A fix must ask them at once, against one
    deadline: here each ask waits at a barrier of all 8, which only asks made together pass."""
    from shmshare.store import _find

    child = _fake_daemon(tmp_path, "silent", n=8)
    barrier = threading.Barrier(8)
    deadlines = []
    real = _find.describe

    def describe(path: str, timeout: float, deadline: float | None = None) -> dict[str, Any]:
        deadlines.append(deadline)
        barrier.wait(WAIT)  # BrokenBarrierError: the asks were not made together
        return real(path, timeout, deadline)

    monkeypatch.setattr(_find, "describe", describe)
    try:
        stores = _stat._stores({child.pid})
    finally:
        _kill(child)
    assert len(stores) == 8 and all("error" in st for st in stores), stores
    assert len(set(deadlines)) == 1, f"each socket got its own deadline: {deadlines}"


@pytest.mark.parametrize("mode", ["bad", "nos"])
def test_stat_survives_a_fake_store_daemon_that_answers_garbage(home, tmp_path, mode):
    """Defect: describe() catches only ShmshareError and OSError, so a fake daemon answering an
    err of code "bad" (ValueError from raise_for) or an "ok" without its payload (KeyError)
    crashes `shmshare stat` with a traceback. A fix must turn any failure of one daemon into
    its "error" entry and go on."""
    child = _fake_daemon(tmp_path, mode)
    try:
        out, _ = _run_stat("--json", "--pid", str(child.pid), timeout=WAIT)
    finally:
        _kill(child)
    assert out.returncode == 0, out.stderr[-400:]


def test_stat_does_not_hang_on_a_store_daemon_that_pages_its_list_forever(home, tmp_path):
    """Defect: Store.list() follows "more" for as long as the daemon says so, and _stores cuts
    to _STORE_MAX only after, so a fake daemon that pages one new object at a time forever
    hangs stat (and grows its memory). A fix must stop at _STORE_MAX objects or a deadline."""
    child = _fake_daemon(tmp_path, "endless")
    try:
        out, _ = _run_stat("--json", "--pid", str(child.pid), timeout=6)
    finally:
        _kill(child)
    assert out.returncode == 0, out.stderr[-400:]


@pytest.mark.parametrize(("reply", "args"), [
    ({"k": "stats", "pools": [], "junk": b"\x00"}, ["--json"]),
    ({"k": "stats", "totals": {"by_kind": {"shm": {"pools": 1, "reserved_bytes": "lots"}}}}, []),
    ({"k": "stats", "totals": "nonsense"}, []),
], ids=["bytes-in-json", "str-bytes-in-table", "totals-not-a-dict"])
def test_stat_survives_a_fake_stats_socket_that_answers_garbage(home, reply, args):
    """Defect: stat passes a stats socket's reply on as it came, so a fake socket (any same-uid
    process; for root, any user's /tmp/shmshare-*/stats) that answers bytes crashes --json
    (TypeError: bytes not JSON serializable) and wrong types crash the table. A fix must keep
    only the keys and types it knows from a reply (or report the socket as unanswered)."""
    listener = wire.Listener(os.path.join(_stats_dir(), f"{os.getpid()}.sock"))

    def answer_once() -> None:
        try:
            conn = listener.accept(timeout=WAIT)
            conn.recv(timeout=WAIT)
            conn.send(reply)
            conn.close()
        except Exception:  # noqa: BLE001, S110 -- stat gone: the assertion below says why
            pass

    t = threading.Thread(target=answer_once)
    t.start()
    try:
        out, _ = _run_stat(*args, "--pid", str(os.getpid()), timeout=WAIT)
    finally:
        t.join(WAIT + 1)
        listener.close()
    assert out.returncode == 0, out.stderr[-400:]


def test_stat_escapes_control_characters_in_process_names(home):
    """Defect: the table prints /proc/<pid>/cmdline as it is, so a process that names itself
    with escape sequences (ESC]2;...BEL, ESC[2J) writes them to the terminal of whoever runs
    stat (root sees every user's). A fix must escape non-printable characters in COMMAND."""
    code = ("import signal; from shmshare import _statsd; _statsd.serve_stats(); "
            "print('up', flush=True); signal.pause()")
    child = subprocess.Popen([sys.executable, "-c", code, "\x1b]2;owned\x07\x1b[2J"],
                             stdout=subprocess.PIPE, text=True, env=_env())
    try:
        import select

        assert child.stdout is not None
        assert select.select([child.stdout], [], [], WAIT)[0], "the child said nothing"
        child.stdout.readline()
        text = _stat.render(_stat.scan([child.pid]), width=400)
    finally:
        _kill(child)
    assert str(child.pid) in text
    assert "\x1b" not in text and "\x07" not in text, repr(text)


def test_stat_repeated_against_a_hung_store_daemon_leaks_nothing(home, tmp_path):
    """Holds: what --watch does each round (_stores) against a daemon that never accepts leaves
    no thread and no fd behind."""
    child = _fake_daemon(tmp_path, "silent")
    try:
        _stat._stores({child.pid})
        fds, threads = _fds(), threading.active_count()
        for _ in range(3):
            (got,) = _stat._stores({child.pid})
            assert "error" in got
        assert (_fds(), threading.active_count()) == (fds, threads)
    finally:
        _kill(child)


# -- the stats directory: what a server may remove, and what it must refuse ------------------


@pytest.mark.parametrize("what", ["regular file", "socket bound just now"])
def test_serving_removes_nothing_at_its_name_that_is_not_a_stale_socket(home, what):
    """Defect: _listen unlinks whatever sits at <pid>.sock when connecting to it is refused, and
    a regular file (or a socket another live process -- another pid namespace's same pid --
    has bound but not yet listened on) is refused too; _sweep checks S_ISSOCK and _YOUNG,
    _listen checks neither. A fix must remove only a socket older than _YOUNG there, and else
    take <pid>-<token>.sock."""
    target = os.path.join(_stats_dir(), f"{os.getpid()}.sock")
    holder = None
    if what == "regular file":
        with open(target, "w") as f:
            f.write("not yours")
    else:
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        holder.bind(target)
    before = os.lstat(target).st_ino
    try:
        path = _statsd.serve_stats()
        assert _statsd.ask(path)[0] == os.getpid()
        now = os.lstat(target) if os.path.lexists(target) else None
        survived = now is not None and (stat.S_ISREG(now.st_mode) if holder is None
                                        else now.st_ino == before)  # a freed inode is reused
    finally:
        _statsd.stop_stats()
        if holder is not None:
            holder.close()
        if os.path.lexists(target):
            os.unlink(target)
    assert survived, f"serve_stats removed the {what} at {target}"


@pytest.mark.parametrize("how", ["symlink", "open to others", "another owner"])
def test_a_stats_dir_made_by_someone_else_is_refused(home, tmp_path, how):
    """Holds: a stats directory that is a symlink, mode 0755, or owned by another uid makes
    serve_stats raise PermissionError, starts no thread, and leaves the symlink's target alone."""
    shm = os.path.join(str(home), "shmshare")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / "keep").write_text("x")
    if how == "symlink":
        os.symlink(elsewhere, shm)
    else:
        os.mkdir(shm, 0o700)
        if how == "open to others":
            os.chmod(shm, 0o755)
        else:
            if os.getuid() != 0:
                pytest.skip("needs root to chown")
            os.chown(shm, 12345, 12345)
    with pytest.raises(PermissionError, match="shmshare"):
        _statsd.serve_stats()
    assert _statsd.stats_socket() is None
    assert "shmshare-stats" not in [t.name for t in threading.enumerate()]
    assert sorted(os.listdir(elsewhere)) == ["keep"]
    if how == "another owner":
        os.chown(shm, 0, 0)


# -- fork and exit ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["os._exit", "preexec_fn"])
def test_a_forked_child_leaves_no_socket_behind(home, how):
    """Defect: the at-fork handler starts a server in every forked child of a serving process,
    so a plain fork that leaves by os._exit, and every subprocess started with preexec_fn
    (whose child runs the at-fork hooks, binds and starts a thread, then execs), leave a dead
    <child>.sock until some later server starts. A fix must not bind in a child that execs
    and must have the socket of a child that vanished removed promptly (e.g. by the parent)."""
    d = os.path.dirname(_statsd.serve_stats())
    if how == "os._exit":
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        assert os.waitpid(pid, 0)[0] == pid
    else:
        child = subprocess.Popen(["true"], preexec_fn=lambda: None)
        pid = child.pid
        child.wait(WAIT)
    left = os.path.join(d, f"{pid}.sock")
    deadline = time.monotonic() + 3.0
    while os.path.lexists(left) and time.monotonic() < deadline:
        time.sleep(0.05)
    stale = os.path.lexists(left)
    _statsd.stop_stats()
    if stale:
        os.unlink(left)
    assert not stale, f"the child ({how}) left {left}"


# -- the reporters and the registry --------------------------------------------------------


def test_ten_thousand_pools_made_and_dropped_leave_the_registry_as_it_was():
    """Holds: the registry holds pools weakly and forgets each when it goes."""
    before = len(_registry._entries)
    for _ in range(10_000):
        pool = CachingAllocator(SimulatedDevice(1 << 24))
        pool.free(pool.malloc(4096))
        del pool
    for _ in range(500):
        host = CachingHostAllocator(HostFallbackProvider())
        del host
    assert len(_registry._entries) == before


def test_reports_racing_mallocs_never_fail_and_settle_on_memory_stats():
    """Holds: reporting a pool that four threads malloc and free without pause never raises,
    stays within a block per thread of consistent, and matches memory_stats() once they stop."""
    pool = CachingAllocator(SimulatedDevice(1 << 30))
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        try:
            while not stop.is_set():
                if held and rng.random() < 0.5:
                    pool.free(held.pop(rng.randrange(len(held))))
                else:
                    held.append(pool.malloc(rng.choice((512, 4096, 1 << 20, 3 << 20))))
            for b in held:
                pool.free(b)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            mine = [r for r in _registry.reports()["pools"] if r.get("id") == id(pool)]
            assert len(mine) == 1 and "error" not in mine[0], mine
            r = mine[0]
            assert 0 <= r["allocated_bytes"] <= r["reserved_bytes"] + 4 * (4 << 20), r
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT)
    assert not errors and not any(t.is_alive() for t in threads)
    (r,) = [r for r in _registry.reports()["pools"] if r.get("id") == id(pool)]
    ms = pool.memory_stats()
    assert [r["reserved_bytes"], r["allocated_bytes"], r["peak_reserved_bytes"]] == [
        ms["reserved_bytes.all.current"], ms["allocated_bytes.all.current"],
        ms["reserved_bytes.all.peak"]]
    pool.empty_cache()


def test_hostile_clients_neither_leak_fds_nor_stop_the_server(home):
    """Holds: 200 fds sent with a request, a garbage frame, an oversize frame and 8 idle
    clients leave the server answering and the process's fd count as it was."""
    path = _statsd.serve_stats()
    fds = _fds()
    hello = msgpack.packb([0, {"version": wire.PROTOCOL_VERSION, "pid": os.getpid(), "role": "x"}])
    r, w = os.pipe()
    clients = []
    try:
        for payload, anc in [
            (msgpack.packb([1, {"k": "stats"}]),
             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r] * 200))]),
            (b"\xc1garbage", []),
            (b"x" * (wire.MAX_FRAME + 10), []),
        ]:
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            clients.append(c)
            c.connect(path)
            c.sendmsg([hello])
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            c.sendmsg([payload], anc)
        for _ in range(8):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            clients.append(c)
            c.connect(path)
        time.sleep(1.5)  # past _CLIENT_WAIT: the idle ones are dropped
    finally:
        for c in clients:
            c.close()
        os.close(r)
        os.close(w)
    assert _statsd.ask(path, timeout=2.0)[0] == os.getpid()
    deadline = time.monotonic() + 2.0
    while _fds() != fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fds() == fds
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _statsd.stop_stats()
    assert not os.path.exists(path)
