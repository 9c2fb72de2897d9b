"""Fixtures of the store tests: real daemons (``python -m shmshare serve``) on sockets in
fresh short directories.

``daemon`` is one daemon per test module (starting one takes most of a second); the
``store`` fixture connects to it and, after its test, deletes every object and checks that
the daemon holds nothing any more -- a test that leaks references or bytes in the daemon
fails there. Tests that kill, limit or otherwise change a daemon make their own
(``own_daemon``).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from shmshare.store import Daemon, Store
from shmshare.testing import wait_until


@pytest.fixture(scope="module")
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="ss-")  # short: a socket path is at most 107 bytes
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _stopped(d: Daemon) -> None:
    rc = d.stop()
    assert rc == 0, f"the daemon exited with {rc}"
    assert not os.path.exists(d.path), "the daemon left its socket behind"


@pytest.fixture(scope="module")
def daemon(sockdir: str) -> Iterator[Daemon]:
    d = Daemon.start(os.path.join(sockdir, "store.sock"))
    try:
        yield d
    finally:
        _stopped(d)


@pytest.fixture
def own_daemon(sockdir: str, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A daemon of this test's own (the `daemon_args` marker gives Daemon.start keywords)."""
    mark = request.node.get_closest_marker("daemon_args")
    kw = dict(mark.kwargs) if mark else {}
    d = Daemon.start(os.path.join(sockdir, f"own-{os.getpid()}-{id(request)}.sock"), **kw)
    try:
        yield d
    finally:
        _stopped(d)


def _empty(path: str) -> None:
    with Store(path) as s:
        for o in s.list():
            s.delete(o.name)

        def nothing_held() -> bool:
            st = s.stats()
            return st["objects"] == 0 and st["deleted_viewed"] == 0 and st["memfd_bytes"] == 0
        wait_until(nothing_held, "the daemon holds nothing once every object is deleted and every "
                   "view is gone", timeout=10)


@pytest.fixture
def store(daemon: Daemon) -> Iterator[Store]:
    s = Store(daemon.path)
    try:
        yield s
    finally:
        s.close()
        gc.collect()
        _empty(daemon.path)
