"""A Store made while its daemon is alive but not accepting (stopped, with its backlog full):
it waits for room within its timeout, and says what happened when the timeout runs out."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from shmshare import ShmshareTimeout
from shmshare.store import Daemon, Store, StoreError
from shmshare.testing import pattern

from ..socket_helpers import fill_backlog
from .helpers import WAIT


@contextmanager
def _stopped_and_full(d: Daemon) -> Iterator[None]:
    """SIGSTOP the daemon and fill its listen backlog; SIGCONT it (and close ours) after."""
    queued: list[socket.socket] = []
    os.kill(d.pid, signal.SIGSTOP)
    try:
        queued = fill_backlog(d.path, 10_000)  # its backlog (256) + 1 fit; then EAGAIN
        yield
    finally:
        os.kill(d.pid, signal.SIGCONT)
        for s in queued:
            s.close()


def test_a_store_connects_to_a_stopped_daemon_that_resumes_within_its_timeout(own_daemon):
    with _stopped_and_full(own_daemon):
        resume = threading.Timer(0.3, os.kill, (own_daemon.pid, signal.SIGCONT))
        resume.start()
        try:
            st = Store(own_daemon.path, timeout=WAIT)
        finally:
            resume.join(WAIT)
    try:
        assert st.daemon_pid == own_daemon.pid
        want = pattern(7, 1000)
        st.put("a", want)
        assert np.array_equal(st.get("a"), want)
        st.delete("a")
    finally:
        st.close()


def test_a_store_whose_daemon_stays_stopped_times_out_naming_the_full_backlog(own_daemon):
    with _stopped_and_full(own_daemon), pytest.raises(StoreError) as info:
        Store(own_daemon.path, timeout=0.2)
    assert isinstance(info.value.__cause__, ShmshareTimeout)
    assert "backlog is full" in str(info.value) and "alive but not accepting" in str(info.value)
    assert "shmshare serve" not in str(info.value)  # never the advice to start another daemon


@pytest.mark.parametrize("timeout", [0, -1, float("nan")])
def test_a_store_timeout_that_leaves_no_time_to_answer_is_refused(timeout):
    """Store(timeout=0) connected, then no request could ever be answered ("did not answer a
    get within 0 s", one more reply owed each time)."""
    with pytest.raises(ValueError, match="seconds > 0"):
        Store("/nonexistent/store.sock", timeout=timeout)


def test_a_store_at_a_path_that_is_no_socket_says_what_is_there(tmp_path):
    """It said "Connection refused (nobody is accepting); start one with `shmshare serve`"."""
    with pytest.raises(StoreError, match="is a directory, not a store daemon's socket"):
        Store(str(tmp_path))
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(StoreError, match="is a regular file, not a store daemon's socket"):
        Store(str(plain))
