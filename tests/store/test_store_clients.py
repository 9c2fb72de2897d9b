"""The daemon's cap on clients connected at once: a newcomer past it is told that the daemon is
full (StoreBusy), never that it is gone -- StoreGone's advice, to start `shmshare serve`
again, would lose every object of a daemon that is alive."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import pytest

from shmshare.store import Daemon, Store, StoreBusy, StoreError, StoreGone
from shmshare.testing import wait_until

from .helpers import WAIT
from .hostile_helpers import _raw, _stopped


def _refused(exc: BaseException, d: Daemon, cap: int) -> None:
    """`exc` says the daemon is full, with its pid, path and cap, and not that it is gone."""
    text = str(exc)
    assert isinstance(exc, StoreBusy) and not isinstance(exc, StoreGone), repr(exc)
    assert f"pid {d.pid}" in text and d.path in text, text
    assert f"maximum of {cap} clients" in text and "close idle Store" in text, text
    assert "shmshare serve` again" not in text and "lost" not in text, text


@pytest.mark.daemon_args(max_clients=2)
def test_a_client_past_the_cap_is_told_the_daemon_is_full(own_daemon: Daemon) -> None:
    """The third client's requests raise StoreBusy; the two others and the objects are as they
    were, and once one of them leaves a newcomer is served."""
    path = own_daemon.path
    with Store(path) as a, Store(path) as b:
        a.put("kept", np.arange(100))
        b.stats()  # both accepted
        with Store(path) as c:
            wait_until(lambda: c._conn.poll(0), "the daemon answers the third client at accept")
            for _ in range(2):  # and says so again, rather than StoreGone, on every request
                with pytest.raises(StoreError) as info:
                    c.stats()
                _refused(info.value, own_daemon, 2)
        assert [int(x) for x in a.get("kept")[:3]] == [0, 1, 2]
        assert b.stats()["connected"] == 2
    with Store(path) as d:
        wait_until(lambda: d.stats()["connected"] == 1, "the first two gone, a newcomer is served")
        d.delete("kept")


@pytest.mark.daemon_args(max_clients=1)
def test_a_refusal_read_after_the_request_was_sent_is_told_as_full(own_daemon: Daemon) -> None:
    """A request that reached the socket before the daemon accepted it reads the refusal frame
    as its reply, and raises StoreBusy too."""
    with Store(own_daemon.path) as a:
        a.stats()
        got: list[Any] = []
        with _stopped(own_daemon.pid):
            c = Store(own_daemon.path)  # connected in the backlog, not accepted yet
            t = threading.Thread(target=lambda: got.append(_call(c)), daemon=True)
            t.start()
            wait_until(lambda: c._conn.statistics().frames_sent == 1 or not t.is_alive(),
                       "the request is sent while the daemon is stopped")
        t.join(WAIT)
        assert not t.is_alive(), "the refused client's request did not end"
        c.close()
        _refused(got[0], own_daemon, 1)


def _call(s: Store) -> BaseException | None:
    try:
        s.stats()
    except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
        return exc
    return None


@pytest.mark.daemon_args(max_clients=1)
def test_a_raw_peer_past_the_cap_gets_a_full_frame(own_daemon: Daemon) -> None:
    """The refusal is a frame of its own ("err", "full" and why), sent before the close."""
    with Store(own_daemon.path) as a:
        a.stats()
        with contextlib.ExitStack() as stack:
            with _stopped(own_daemon.pid):  # connected and sent before the daemon can accept
                raw = stack.enter_context(_raw(own_daemon.path))
                raw.send({"k": "stats"}, timeout=5)
            h, fds = raw.recv(timeout=WAIT)
            for f in fds:
                f.close()
        assert h.get("k") == "err" and h.get("e") == "busy", h
        assert "maximum of 1 clients" in h.get("w", ""), h


@pytest.mark.daemon_args(max_clients=1)
def test_a_get_whose_wait_is_refused_leaves_the_store_usable(own_daemon: Daemon) -> None:
    """A get(timeout=...) waits on a second connection; refused at the cap it raises StoreBusy,
    and the Store's own connection is not marked gone."""
    with Store(own_daemon.path) as a:
        a.put("here", np.arange(3))
        with pytest.raises(StoreError) as info:
            a.get("not yet", timeout=5)
        _refused(info.value, own_daemon, 1)
        assert [int(x) for x in a.get("here")] == [0, 1, 2]
        a.delete("here")
