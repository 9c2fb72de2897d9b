"""refs(): the fds and mappings of one object in each process, and its link count, with real processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shmshare import wire
from shmshare.segment import Flags, Segment
from shmshare.testing import refs, start_child

SIZE = 1 << 16
TIMEOUT = 10.0  # s: every recv and join; far above what a step takes


def _holder(conn: wire.Connection, peer: wire.Connection, how: str) -> None:
    """The child: take the segment's fd, hold it (`fd`) or map it and close it (`map`), say which, wait."""
    peer.close()
    header, fds = conn.recv(timeout=TIMEOUT)
    if how == "fd":
        held = fds[0]
        conn.send({"fd": held.fileno()})
    else:
        seg = Segment.from_fd(fds[0].fileno(), header["size"], Flags.FROMFD)  # dups, maps, keeps no fd
        fds[0].close()
        conn.send({"address": seg.address})
    conn.recv(timeout=TIMEOUT)  # "exit", or end of stream if the parent is gone


@pytest.fixture
def child_with(request: pytest.FixtureRequest):
    """Start a child (forked before the segment exists, so the fd reaches it only by the socket)."""
    started = []

    def start(how: str):
        ours, theirs = wire.pipe(role="refs")
        child = start_child(_holder, theirs, ours, how)
        theirs.close()
        started.append((child, ours))
        return child, ours

    yield start
    for child, conn in started:
        conn.close()
        child.stop()  # kills by pid, bounded


def test_a_memfd_segment_is_held_by_its_fd_and_its_mapping_and_has_no_link() -> None:
    with Segment.create(SIZE) as seg:
        r = refs(seg)
        fds, maps = r[os.getpid()]
        assert fds == [seg.fd]
        assert [m.size for m in maps] == [SIZE] and maps[0].shared
        assert r["nlink"] == 0
        assert refs(seg.fd)[os.getpid()] == r[os.getpid()]  # the same object, named by its fd


def test_a_child_holding_the_fd_shows_the_fd_and_no_mapping(child_with) -> None:
    child, conn = child_with("fd")
    with Segment.create(SIZE) as seg:
        conn.send({"size": SIZE}, [seg.fileno()])
        their_fd = conn.recv(timeout=TIMEOUT)[0]["fd"]
        r = refs(seg, pids=[os.getpid(), child.pid])
        assert r[child.pid] == ([their_fd], [])
        assert r[os.getpid()][0] == [seg.fd] and len(r[os.getpid()][1]) == 1
        assert r["nlink"] == 0
        conn.send({"op": "exit"})
        assert child.join(TIMEOUT) == 0
        assert refs(seg, pids=[child.pid])[child.pid] == ([], [])  # a process that is gone holds nothing


def test_a_child_that_mapped_it_and_closed_the_fd_shows_one_mapping(child_with) -> None:
    child, conn = child_with("map")
    with Segment.create(SIZE) as seg:
        conn.send({"size": SIZE}, [seg.fileno()])
        address = conn.recv(timeout=TIMEOUT)[0]["address"]
        fds, maps = refs(seg, pids=[child.pid])[child.pid]
        assert fds == []
        assert [(m.start, m.size) for m in maps] == [(address, SIZE)]
        child.kill()
        assert refs(seg, pids=[child.pid])[child.pid] == ([], [])


def test_a_posix_segment_has_one_link_until_it_is_unlinked() -> None:
    flags = Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.KEEPFD  # no UNLINK: the name stays
    with Segment.create(SIZE, flags, backend="posix") as seg:
        path = f"/dev/shm{seg.name}"
        try:
            assert refs(path)["nlink"] == 1
            assert refs(path)[os.getpid()] == refs(seg)[os.getpid()]
        finally:
            os.unlink(path)
        assert refs(seg)["nlink"] == 0


def test_a_segment_without_a_kept_fd_is_found_by_its_mapping() -> None:
    with Segment.create(SIZE, Flags.SHAREDMEM | Flags.EXCLUSIVE) as seg:
        assert seg.fd is None
        fds, maps = refs(seg)[os.getpid()]
        assert fds == [] and [m.start for m in maps] == [seg.address]


def test_a_file_with_a_second_link_and_two_fds(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    os.link(path, tmp_path / "g")
    a, b = os.open(path, os.O_RDONLY), os.open(tmp_path / "g", os.O_RDONLY)
    try:
        r = refs(path)
        assert r[os.getpid()] == (sorted([a, b]), [])
        assert r["nlink"] == 2
    finally:
        os.close(a)
        os.close(b)


def test_what_is_not_a_shared_object_is_refused() -> None:
    with pytest.raises(TypeError, match="refs"):
        refs(1.5)
    seg = Segment.create(SIZE, Flags.SHAREDMEM | Flags.EXCLUSIVE)
    seg.close()
    with pytest.raises(ValueError, match="closed"):
        refs(seg)
