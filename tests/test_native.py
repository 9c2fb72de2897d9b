"""shmshare._native: the primitives and the Lease buffer type."""

from __future__ import annotations

import gc
import io
import os

import numpy as np
import pytest

from shmshare import _native
from shmshare._procfs import shm_mappings

PAGE = _native.PAGE_SIZE


@pytest.fixture
def memfd():
    fd = os.memfd_create("shmshare_native_test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 16 * PAGE)
    yield fd
    os.close(fd)


def test_reserve_map_unmap_release(memfd):
    addr = _native.reserve(16 * PAGE)
    try:
        _native.map_fd(addr, 4 * PAGE, memfd, 0)
        _native.map_fd(addr + 8 * PAGE, 4 * PAGE, memfd, 4 * PAGE)
        lease = _native.Lease(None, addr, 16 * PAGE)
        arr = np.frombuffer(lease, dtype=np.uint8)
        arr[0] = 1
        arr[8 * PAGE] = 2
        # the second mapping shows file offset 4 pages: write through the fd and read back
        assert os.pread(memfd, 1, 4 * PAGE) == b"\x02"
        assert len(shm_mappings(contains="shmshare_native_test")) == 2
        del arr, lease
        _native.unmap(addr, 16 * PAGE)  # back to a PROT_NONE reservation
        assert shm_mappings(contains="shmshare_native_test") == []
    finally:
        _native.unmap(addr, 16 * PAGE, release=True)


def test_errors_name_the_call_and_argument(memfd):
    with pytest.raises(ValueError, match="page size"):
        _native.map_fd(_native.reserve(PAGE) + 1, PAGE, memfd)
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        _native.reserve(0)
    with pytest.raises(OSError, match=r"mmap failed: Bad file descriptor .*fd 12345") as err:
        _native.mmap(PAGE, 12345)
    assert err.value.errno == 9
    with pytest.raises(OSError, match="fallocate failed"):
        _native.punch_hole(12345, 0, PAGE)
    with pytest.raises(ValueError, match="threads"):
        _native.prefault(_native.reserve(PAGE), PAGE, threads=0)


def test_mmap_private_is_copy_on_write(memfd):
    os.pwrite(memfd, b"abc", 0)
    addr = _native.mmap(PAGE, memfd, shared=False)
    try:
        lease = _native.Lease(None, addr, PAGE)
        mv = memoryview(lease)
        assert bytes(mv[:3]) == b"abc"
        mv[0] = ord("z")
        assert os.pread(memfd, 3, 0) == b"abc"
        mv.release()
        del lease
    finally:
        _native.unmap(addr, PAGE, release=True)


def test_punch_hole_gives_pages_back(memfd):
    os.pwrite(memfd, b"x" * PAGE, 0)
    before = os.fstat(memfd).st_blocks
    _native.punch_hole(memfd, 0, PAGE)
    assert os.fstat(memfd).st_blocks < before
    assert os.pread(memfd, 1, 0) == b"\x00"
    assert os.fstat(memfd).st_size == 16 * PAGE


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("writable", [False, True])
def test_prefault_populates_and_keeps_data(memfd, threads, writable):
    os.pwrite(memfd, b"\x07", 5 * PAGE)
    addr = _native.mmap(16 * PAGE, memfd)
    try:
        _native.prefault(addr, 16 * PAGE, threads=threads, writable=writable)
        lease = _native.Lease(None, addr, 16 * PAGE)
        arr = np.frombuffer(lease, dtype=np.uint8)
        assert arr[5 * PAGE] == 7 and arr.sum() == 7
        del arr, lease
        if writable:
            assert os.fstat(memfd).st_blocks * 512 >= 16 * PAGE
    finally:
        _native.unmap(addr, 16 * PAGE, release=True)


def test_madvise(memfd):
    addr = _native.mmap(16 * PAGE, memfd)
    try:
        _native.madvise(addr, 16 * PAGE, _native.MADV_SEQUENTIAL)
        with pytest.raises(OSError, match="madvise failed"):
            _native.madvise(addr, 16 * PAGE, 12345)
    finally:
        _native.unmap(addr, 16 * PAGE, release=True)


class Owner:
    pass


def test_lease_calls_back_once_after_last_export():
    calls = []
    buf = bytearray(b"hello world!")
    owner = Owner()
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    lease = _native.Lease(owner, addr, len(buf), readonly=False, on_release=lambda: calls.append(1))
    views = [memoryview(lease), np.frombuffer(lease, dtype=np.uint8)]
    assert lease.exports == 2 and lease.owner is owner and lease.nbytes == len(buf)
    assert bytes(views[0][:5]) == b"hello"
    views[1][0] = ord("j")
    assert buf[:5] == b"jello"
    del lease
    assert calls == []  # the views keep it alive
    views.pop()  # numpy's view goes first
    gc.collect()
    assert calls == []
    views[0].release()
    views.clear()
    gc.collect()
    assert calls == [1]
    del buf


def test_lease_readonly_refuses_writable_exports():
    buf = bytearray(8)
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    lease = _native.Lease(buf, addr, 8, readonly=True)
    arr = np.frombuffer(lease, dtype=np.uint8)
    assert not arr.flags.writeable
    assert memoryview(lease).readonly
    with pytest.raises(TypeError):
        io.BytesIO(b"ab").readinto(lease)  # asks for a writable buffer (w*)
    get_buffer = ctypes.pythonapi.PyObject_GetBuffer
    get_buffer.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_int]
    view = ctypes.create_string_buffer(256)  # room for a Py_buffer
    with pytest.raises(BufferError, match="read-only; receive with writable=True"):
        get_buffer(lease, ctypes.addressof(view), 1)  # PyBUF_WRITABLE
    del arr, lease


def test_lease_callback_errors_are_reported_not_raised(monkeypatch):
    seen = []
    monkeypatch.setattr("sys.unraisablehook", lambda info: seen.append(info.exc_type))
    buf = bytearray(8)
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    lease = _native.Lease(buf, addr, 8, on_release=lambda: 1 / 0)
    del lease
    gc.collect()
    assert seen == [ZeroDivisionError]


def test_lease_in_a_cycle_still_calls_back():
    calls = []
    buf = bytearray(8)
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    holder = Owner()
    holder.lease = _native.Lease(holder, addr, 8, on_release=lambda: calls.append(1))
    del holder
    gc.collect()
    assert calls == [1]


def test_lease_bad_arguments():
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        _native.Lease(None, 4096, -1)
    with pytest.raises(ValueError, match="address 0"):
        _native.Lease(None, 0, 10)
    with pytest.raises(TypeError, match="callable"):
        _native.Lease(None, 4096, 1, on_release=3)
    empty = _native.Lease(None, 0, 0)
    assert np.frombuffer(empty, dtype=np.uint8).size == 0


def test_torch_frombuffer_keeps_lease_alive():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    calls = []
    buf = bytearray(range(16))
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    lease = _native.Lease(buf, addr, 16, on_release=lambda: calls.append(1))
    t = torch.frombuffer(lease, dtype=torch.uint8)
    del lease
    gc.collect()
    assert calls == [] and int(t[3]) == 3
    del t
    gc.collect()
    assert calls == [1]


def test_lease_unmaps_and_closes_only_after_the_last_view(memfd):
    dup = os.dup(memfd)
    addr = _native.mmap(16 * PAGE, memfd)
    lease = _native.Lease(None, addr, 16 * PAGE, unmap=True, fd=dup)
    mv = memoryview(lease)
    del lease
    gc.collect()
    assert len(shm_mappings(contains="shmshare_native_test")) == 1 and os.fstat(dup)
    mv.release()
    assert shm_mappings(contains="shmshare_native_test") == []
    with pytest.raises(OSError):
        os.fstat(dup)  # the lease owned it and closed it
    with pytest.raises(ValueError, match="page-aligned"):
        _native.Lease(None, addr + 1, 10, unmap=True)


def test_a_view_in_a_garbage_cycle_stays_readable_in_del():
    from shmshare import Segment

    seg = Segment.create(1 << 20)
    seg.view(np.uint64, 8)[:] = 7
    mv = seg.buffer
    seg.close()
    seen = []

    class Holder:
        def __del__(self):
            seen.append(bytes(self.mv[:8]))  # runs in the collector, after the lease's finalizer

    h = Holder()
    h.mv, h.me = mv, h
    del mv, h
    gc.collect()
    assert seen == [b"\x07" + b"\x00" * 7]
    gc.collect()


def test_prefault_of_a_range_it_cannot_touch_raises_instead_of_crashing():
    addr = _native.reserve(16 * PAGE)  # PROT_NONE
    try:
        with pytest.raises(OSError, match="madvise failed"):
            _native.prefault(addr, 16 * PAGE, threads=2)
    finally:
        _native.unmap(addr, 16 * PAGE, release=True)


@pytest.mark.parametrize("make", [
    lambda: np.zeros(10),
    lambda: np.arange(24, dtype=np.int32).reshape(4, 6)[::-2, 1::2],
    lambda: np.zeros((3, 0)),
    lambda: np.array(3.0),
    lambda: np.zeros(4, "M8[ns]"),
    lambda: np.zeros(3, [("a", "<i4"), ("b", "<f8", (2,))]),
    lambda: np.zeros(5, "U7")[::-1],
    lambda: np.broadcast_to(np.ones(3), (4, 3)),
], ids=["plain", "strided", "empty", "0-d", "datetime", "structured", "reversed", "broadcast"])
def test_extent_is_where_an_arrays_bytes_lie(make):
    from shmshare import tensors

    arr = make()
    address, lo, span = _native.extent(arr)
    assert address == arr.__array_interface__["data"][0]
    assert (lo, span) == tensors.span(arr.itemsize, arr.shape, arr.strides)
    arr.flags.writeable = False
    assert _native.extent(arr) == (address, lo, span)  # read-only buffers too


def test_extent_refuses_what_has_no_buffer_or_cannot_be_addressed():
    from numpy.lib.stride_tricks import as_strided

    with pytest.raises(TypeError):
        _native.extent([1, 2, 3])
    with pytest.raises(OverflowError, match="span more bytes than an address can"):
        _native.extent(as_strided(np.zeros(1), (3,), (1 << 62,)))
    assert _native.extent(as_strided(np.zeros(1), (3, 0), (1 << 62, 8)))[1:] == (0, 0)
