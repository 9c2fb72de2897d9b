"""The one poll server under the stats socket, the fd server and the store daemon: accept, serve,
stop, a silent client's deadline, the cap on clients, frames a poll cannot see, and the one
out-of-fds policy (Note [One poll server], Note [Out of fds] in shmshare/_pollserver.py).

Waits are counted on a PollClock (a clock that moves only while the server polls), never timed.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shmshare import _pollserver, wire
from shmshare._errors import PeerDied
from shmshare._pollserver import ACCEPT_PAUSE, FD_ROOM, PollServer

from .clock_helpers import PollClock

WAIT = 10.0  # s a real wait is bounded by (a thread's join)


class Echo:
    """A service over a PollServer: each request is answered with its kind, one frame a round."""

    def __init__(self, path: str, **kw: Any) -> None:
        self.conns: dict[int, wire.Connection] = {}
        self.answered: list[str] = []
        self.late: list[int] = []
        self.wait: float | None = kw.pop("wait", None)
        self.one_shot: bool = kw.pop("one_shot", False)  # one request a connection, as the stats'
        self.again: Callable[[wire.Connection], bool] = kw.pop("again", lambda conn: False)
        self.server = PollServer(wire.Listener(path, role="echo"), self.accept, **kw)

    def accept(self, conn: wire.Connection) -> None:
        fd = conn.fileno()
        self.conns[fd] = conn
        late = None if self.wait is None else (lambda: self.drop(fd, late=True))
        self.server.add(fd, lambda: self.serve(fd), wait=self.wait, late=late)

    def serve(self, fd: int) -> bool:
        conn = self.conns[fd]
        try:
            got = conn.recv_nowait()
        except PeerDied:
            self.drop(fd)
            return False
        if got is None:
            return self.again(conn)
        header, fds = got
        for f in fds:
            f.close()
        self.answered.append(header["k"])
        conn.send({"k": header["k"]}, timeout=0)
        if self.one_shot:
            self.drop(fd)
            return False
        return self.again(conn)

    def drop(self, fd: int, late: bool = False) -> None:
        if late:
            self.late.append(fd)
        self.server.remove(fd)
        self.conns.pop(fd).close()

    def close(self) -> None:
        for fd in list(self.conns):
            self.drop(fd)
        self.server.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> PollClock:
    clock = PollClock()
    monkeypatch.setattr(_pollserver, "time", clock)
    monkeypatch.setattr(_pollserver, "select", clock.select())
    return clock


@contextlib.contextmanager
def _service(tmp_path: Any, **kw: Any) -> Iterator[Echo]:
    echo = Echo(str(tmp_path / "sock"), **kw)
    try:
        yield echo
    finally:
        echo.close()


@contextlib.contextmanager
def _clients(path: str, n: int) -> Iterator[list[wire.Connection]]:
    conns: list[wire.Connection] = []
    try:
        for _ in range(n):
            conns.append(wire.connect(path, timeout=WAIT, role="echo"))
        yield conns
    finally:
        for c in conns:
            c.close()


def _run(echo: Echo, clock: PollClock, until: Callable[[], bool]) -> None:
    """Serve until `until()`, for at most a minute on the clock or 10,000 polls (a loop that
    stopped the clock: every poll found something ready)."""
    start = clock.polls
    echo.server.run(until=lambda: until() or clock.polls - start > 10_000, deadline=clock.now + 60)
    assert until(), f"not done after {clock.polls - start} polls and {clock.waited} s on the clock"


def test_it_accepts_and_serves_each_client(tmp_path: Any, clock: PollClock) -> None:
    with _service(tmp_path) as echo, _clients(echo.server.listener.path, 3) as conns:
        for i, c in enumerate(conns):
            c.send({"k": f"q{i}"})
        _run(echo, clock, lambda: len(echo.answered) == 3)
        assert sorted(echo.answered) == ["q0", "q1", "q2"]
        assert echo.server.clients == 3
        for i, c in enumerate(conns):
            header, _ = c.recv(timeout=WAIT)
            assert header["k"] == f"q{i}"


def test_a_callback_that_says_more_waits_is_called_again_without_waiting(tmp_path: Any,
                                                                        clock: PollClock) -> None:
    # as the store's for a ring holding frames a poll cannot see: three rounds, no wait between
    calls = []

    def again(conn: wire.Connection) -> bool:
        calls.append(clock.now)
        return len(calls) < 3

    with _service(tmp_path, again=again) as echo, _clients(echo.server.listener.path, 1) as (c,):
        c.send({"k": "one"})
        _run(echo, clock, lambda: len(calls) == 3)
        assert len(set(calls)) == 1, "the server waited in poll between the rounds it was asked for"
        assert echo.answered == ["one"]  # called again, it found nothing more on the socket


def test_stop_from_another_thread_ends_run(tmp_path: Any) -> None:
    polling = threading.Event()

    def tick(now: float) -> None:
        polling.set()

    with _service(tmp_path, tick=tick) as echo:
        t = threading.Thread(target=echo.server.run)
        t.start()
        try:
            assert polling.wait(WAIT)
            echo.server.stop()
        finally:
            t.join(WAIT)
        assert not t.is_alive(), "run() went on after stop()"


def test_a_stop_before_run_ends_that_run_only(tmp_path: Any, clock: PollClock) -> None:
    with _service(tmp_path) as echo, _clients(echo.server.listener.path, 1) as (c,):
        echo.server.stop()  # as a signal between a daemon's start and its run()
        echo.server.run()
        assert clock.polls == 0
        c.send({"k": "after"})
        _run(echo, clock, lambda: bool(echo.answered))
        assert echo.answered == ["after"]


def test_a_silent_client_goes_to_late_once_its_wait_is_over(tmp_path: Any, clock: PollClock) -> None:
    with _service(tmp_path, wait=1.0, one_shot=True) as echo, \
            _clients(echo.server.listener.path, 2) as (silent, asks):
        asks.send({"k": "q"})
        _run(echo, clock, lambda: bool(echo.late))
        assert echo.answered == ["q"] and echo.server.clients == 0
        assert len(echo.late) == 1, "the client that asked in time went to late() too"
        assert 1.0 <= clock.waited < 1.1, f"dropped after {clock.waited} s of polling, not 1 s"
        assert asks.recv(timeout=WAIT)[0]["k"] == "q"
        with pytest.raises(PeerDied):
            silent.recv(timeout=WAIT)  # it sees the end


def test_newcomers_past_max_clients_are_refused(tmp_path: Any, clock: PollClock) -> None:
    refused: list[wire.Connection] = []

    def refuse(conn: wire.Connection) -> None:
        refused.append(conn)
        conn.close()

    with _service(tmp_path, max_clients=2, refuse=refuse) as echo, \
            _clients(echo.server.listener.path, 3) as conns:
        _run(echo, clock, lambda: bool(refused))
        assert echo.server.clients == 2 and len(refused) == 1
        echo.drop(next(iter(echo.conns)))  # one leaves: room for the next newcomer
        with _clients(echo.server.listener.path, 1) as (late,):
            late.send({"k": "in"})
            _run(echo, clock, lambda: bool(echo.answered))
        assert echo.answered == ["in"] and len(refused) == 1
        assert sum(1 for c in conns if c.poll(0)) >= 1  # the refused one sees its end


@contextlib.contextmanager
def _fd_table_with(free: int) -> Iterator[None]:
    """This process's fd table with `free` fds free for the block (a limit large enough that the
    room is FD_ROOM, not an eighth of the table), every fd and the limit restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fill: list[int] = []
    top = max(int(f) for f in os.listdir("/proc/self/fd")) + 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 8 * FD_ROOM, hard))
    try:
        while True:
            try:
                fill.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                break
        for _ in range(free):
            os.close(fill.pop())
        yield
    finally:
        for f in fill:
            os.close(f)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("free", [0, FD_ROOM // 2], ids=["table-full", "under-room"])
def test_out_of_fds_accepting_pauses_and_the_peer_is_served_after(tmp_path: Any, clock: PollClock,
                                                                  free: int) -> None:
    told: list[OSError] = []
    with _service(tmp_path, on_pause=told.append) as echo, \
            _clients(echo.server.listener.path, 1) as (c,):
        c.send({"k": "queued"})  # in the backlog: the server cannot take it now
        with _fd_table_with(free):
            # a second of a readable listener (or 200 polls, where a spin would stop the clock)
            echo.server.run(until=lambda: clock.polls > 200, deadline=clock.now + 1.0)
            paused = echo.server.pauses
        assert echo.answered == [] and echo.server.clients == 0
        # a pause a look: five a second, never a spin on the readable listener
        assert 1 <= paused <= 1.0 / ACCEPT_PAUSE + 1, f"{paused} pauses in a second"
        assert clock.polls <= 3 * paused + 3, f"{clock.polls} polls in a second"
        assert all(isinstance(e, OSError) for e in told) and len(told) == paused
        _run(echo, clock, lambda: bool(echo.answered))
        assert echo.answered == ["queued"]
        assert clock.waited <= 1.0 + ACCEPT_PAUSE + 0.01  # taken at the end of the last pause
        header, _ = c.recv(timeout=WAIT)
        assert header["k"] == "queued"


def test_fds_lists_what_a_keeper_must_keep(tmp_path: Any, clock: PollClock) -> None:
    with _service(tmp_path) as echo, _clients(echo.server.listener.path, 1):
        _run(echo, clock, lambda: echo.server.clients == 1)
        got = echo.server.fds()
        assert echo.server.listener.fileno() in got and set(echo.conns) <= got
        assert len(got) == 4  # the listener, the stop pipe's two ends, the client
