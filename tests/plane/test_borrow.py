"""The borrowing side of the plane (_plane/borrow.py, Note [One borrower]): what the channel's
receiver, the multiprocessing client and the store's client map of a lender's segments, the
checks of each fd, and the caps on what one lender may make a process hold."""

from __future__ import annotations

import ctypes
import fcntl
import gc
import os
import tempfile

import pytest

from shmshare import ProtocolError, SegmentError
from shmshare._fd import Fd
from shmshare._plane import Borrowed, Caps, Lender
from shmshare._segcalls import sealed_memfd

_PAGE = os.sysconf("SC_PAGE_SIZE")
_SHRINK = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def _memfd(size: int = 4 * _PAGE, fill: int = 7) -> Fd:
    fd = sealed_memfd("borrow-test", size, _SHRINK)
    os.pwrite(fd, bytes([fill]) * size, 0)
    return Fd(fd)


def _bytes(root, n: int) -> bytes:
    return ctypes.string_at(root.address, n)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_mapped_segment_is_kept_by_id_and_holds_no_fd():
    borrowed = Borrowed(Lender("the test lender"), Caps(1 << 30, 8))
    before = _open_fds()
    fd = _memfd()
    root = borrowed.map(3, fd, 4 * _PAGE, writable=False)
    assert fd.closed and _open_fds() == before  # taken, and closed once mapped
    assert borrowed.get(3) is root and 3 in borrowed and len(borrowed) == 1
    assert _bytes(root, 8) == b"\x07" * 8


def test_a_regular_file_is_refused_and_its_fd_closed():
    borrowed = Borrowed(Lender("the test lender"), Caps(1 << 30, 8))
    with tempfile.TemporaryFile() as f:
        f.truncate(4 * _PAGE)
        fd = Fd(os.dup(f.fileno()))
        before = _open_fds()
        with pytest.raises((ProtocolError, SegmentError), match=r"regular file|shared memory"):
            borrowed.map(1, fd, 4 * _PAGE, writable=False)
        assert fd.closed and _open_fds() == before - 1
    assert len(borrowed) == 0


def test_a_segment_sent_twice_is_a_protocol_error_naming_the_lender():
    borrowed = Borrowed(Lender("the test lender"), Caps(1 << 30, 8))
    borrowed.map(1, _memfd(), 4 * _PAGE, writable=False)
    fd = _memfd()
    with pytest.raises(ProtocolError, match="the test lender sent segment 1 again"):
        borrowed.map(1, fd, 4 * _PAGE, writable=False)
    assert fd.closed


def test_past_the_cap_on_segments_the_lender_is_refused_and_a_mapping_gone_gives_its_charge_back():
    lender = Lender("the test lender")
    caps = Caps(1 << 30, 2, hint="drop what you got")
    borrowed = Borrowed(lender, caps)
    borrowed.map(1, _memfd(), 4 * _PAGE, writable=False)
    root = borrowed.map(2, _memfd(), 4 * _PAGE, writable=False)
    assert (lender.nmaps, lender.reserved) == (2, 8 * _PAGE)
    fd = _memfd()
    with pytest.raises(ProtocolError, match=r"the test lender would need 3 mappings.*max_peer_segments=2"):
        borrowed.map(3, fd, 4 * _PAGE, writable=False)
    assert fd.closed and len(borrowed) == 2
    assert borrowed.drop(2) is root  # the lender let go: the view (root) keeps the mapping
    assert _bytes(root, 4) == b"\x07" * 4
    assert lender.nmaps == 2  # charged until the mapping is gone
    del root
    gc.collect()
    borrowed.map(3, _memfd(), 4 * _PAGE, writable=False)  # room again
    assert (lender.nmaps, lender.reserved) == (2, 8 * _PAGE)


def test_the_cap_on_bytes_names_the_hint():
    borrowed = Borrowed(Lender("the test lender"), Caps(6 * _PAGE, 8, hint="drop what you got"))
    borrowed.map(1, _memfd(), 4 * _PAGE, writable=False)
    with pytest.raises(ProtocolError, match=r"max_peer_bytes=.*; drop what you got"):
        borrowed.map(2, _memfd(), 4 * _PAGE, writable=False)


def test_an_uncharged_segment_does_not_count_against_the_caps():
    lender = Lender("the test lender")
    borrowed = Borrowed(lender, Caps(1 << 30, 1))
    for i in range(3):
        borrowed.map(i, _memfd(), 4 * _PAGE, writable=True, charged=False)
    assert (lender.nmaps, lender.reserved, len(borrowed)) == (0, 0, 3)


def test_a_private_mapping_is_copy_on_write():
    borrowed = Borrowed(Lender("the test lender"), Caps(1 << 30, 8))
    fd = _memfd()
    try:
        private = borrowed.map_private(fd, 4 * _PAGE)
        ctypes.memset(private.address, 1, 4)
        assert _bytes(private, 5) == b"\x01\x01\x01\x01\x07"
        assert os.pread(fd.fileno(), 4, 0) == b"\x07" * 4  # the lender's bytes are untouched
        assert len(borrowed) == 0
    finally:
        fd.close()


def test_a_read_only_mapping_refuses_a_writable_view():
    borrowed = Borrowed(Lender("the test lender"), Caps(1 << 30, 8))
    root = borrowed.map(1, _memfd(), 4 * _PAGE, writable=False)
    view = memoryview(root).cast("B")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="read-only"):
        view[0] = 1
    view.release()
