"""``wire.connect`` to a listener whose backlog is full: it waits for room within its timeout.

A listener that is alive but not accepting (stopped, hung, busy) keeps connects queued in its
backlog; once that is full, a non-blocking AF_UNIX connect fails with EAGAIN. A connect with a
timeout must wait for room until then and say why it gave up, never raise a bare
BlockingIOError (Note [A full backlog] in ``shmshare/_sockets.py``).
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Iterator

import pytest

from shmshare import wire
from shmshare._errors import ShmshareTimeout
from tests.socket_helpers import fill_backlog

WAIT = 20.0  # s: the bound on every wait that is expected to end much sooner


@pytest.fixture
def full(tmp_path) -> Iterator[tuple[wire.Listener, list[socket.socket]]]:
    """A listener nobody accepts on, with its backlog full (the queued connects with it)."""
    lst = wire.Listener(tmp_path / "sock", backlog=1)
    queued: list[socket.socket] = []
    try:
        queued = fill_backlog(lst.path, 64)  # backlog+1 fit (net.core.somaxconn permitting)
        yield lst, queued
    finally:
        for s in queued:
            s.close()
        lst.close()


def _accept_later(lst: wire.Listener, got: list[wire.Connection], delay: float) -> threading.Thread:
    """Accept one queued connect after `delay` s, in a thread (making room in the backlog)."""
    def run() -> None:
        threading.Event().wait(delay)
        got.append(lst.accept(timeout=WAIT))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("timeout", [WAIT, None], ids=["timeout", "forever"])
def test_connect_to_a_full_backlog_succeeds_once_the_listener_accepts(full, timeout):
    lst, _ = full
    got: list[wire.Connection] = []
    t = _accept_later(lst, got, 0.3)
    try:
        conn = wire.connect(lst.path, timeout=timeout)
        conn.close()
    finally:
        t.join(WAIT)
        for c in got:
            c.close()
    assert not t.is_alive() and len(got) == 1


@pytest.mark.parametrize("timeout", [0, 0.2])
def test_connect_to_a_full_backlog_times_out_saying_the_listener_does_not_accept(full, timeout):
    lst, _ = full
    with pytest.raises(ShmshareTimeout, match=r"backlog is full .*alive but not accepting") as info:
        wire.connect(lst.path, timeout=timeout)
    assert lst.path in str(info.value) and f"{timeout} s" in str(info.value)


class _Interrupted(Exception):
    pass


def test_a_signal_ends_a_connect_that_waits_forever_for_room(full):
    """As ctrl-C would: the handler's exception ends the wait, and the socket is closed."""
    lst, _ = full

    def handler(signum, frame):
        raise _Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with pytest.raises(_Interrupted):
            timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident,
                                                               signal.SIGUSR1))
            timer.start()
            try:
                wire.connect(lst.path, timeout=None)
            finally:
                timer.join(WAIT)
    finally:
        signal.signal(signal.SIGUSR1, old)
