"""Expandable segments as Segments: reserve, map_range, unmap_range, a receiver's side, fork."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os

import numpy as np
import pytest

from shmshare import Flags, Segment, SegmentError, _cgroup, _native
from shmshare._fd import Fd
from shmshare._procfs import fds, shm_mappings
from shmshare.memory import ShmProvider
from shmshare.memory._shm import ShmSegment
from shmshare.testing import wait_exit

PAGE = _native.PAGE_SIZE
MiB = 1 << 20


def _mapped(seg: Segment) -> int:
    """Bytes of `seg`'s memfd mapped in this process."""
    return sum(m.size for m in shm_mappings(contains=seg.name))


def test_reserve_maps_grows_and_punches_piece_by_piece():
    with Segment.reserve(64 * MiB) as seg:
        assert seg.expandable and seg.size == 64 * MiB and seg.fd is not None
        assert os.fstat(seg.fd).st_size == 0 and _mapped(seg) == 0
        assert seg.seals & fcntl.F_SEAL_SHRINK and not seg.seals & fcntl.F_SEAL_GROW
        seg.map_range(2 * MiB, 2 * MiB)
        assert os.fstat(seg.fd).st_size == 4 * MiB and _mapped(seg) == 2 * MiB
        seg.view(np.uint8, 2 * MiB, offset=2 * MiB)[:] = 5
        seg.unmap_range(2 * MiB, 2 * MiB)  # no punch: a peer may still read the pages
        assert _mapped(seg) == 0
        seg.map_range(2 * MiB, 2 * MiB)
        assert int(seg.view(np.uint8, 1, offset=3 * MiB)[0]) == 5
        seg.unmap_range(2 * MiB, 2 * MiB, punch=True)  # memory back to the host
        seg.map_range(2 * MiB, 2 * MiB)
        assert int(seg.view(np.uint8, 2 * MiB, offset=2 * MiB).max()) == 0
    assert seg.closed and _mapped(seg) == 0


def test_a_receiver_reserves_and_maps_what_the_peer_announces():
    with Segment.reserve(16 * MiB) as seg:
        seg.map_range(0, 4 * MiB)
        seg.view(np.uint32, MiB)[:] = 9
        got = Fd(os.dup(seg.fd))
        rx = Segment.from_fd(got, 16 * MiB, Flags.FROMFD | Flags.READONLY, reserve=True)
        assert got.closed and rx.fd is not None and rx.expandable
        assert _mapped(rx) == 4 * MiB  # the sender's mapping only: the receiver maps nothing yet
        rx.map_range(0, 4 * MiB)
        arr = rx.view(np.uint32, MiB)
        assert int(arr[-1]) == 9 and not arr.flags.writeable
        with pytest.raises(SegmentError, match="past its end would SIGBUS") as err:
            rx.map_range(4 * MiB, PAGE)  # the peer never grew the memfd this far
        assert err.value.errno == errno.EINVAL
        rx.close()
        assert int(arr[0]) == 9  # the array keeps the mapping after close()
        del arr
    assert _mapped(seg) == 0


def test_map_range_is_all_or_nothing(monkeypatch):
    with Segment.reserve(8 * MiB) as seg:
        def full(fd: int, offset: int, nbytes: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(SegmentError, match="cannot reserve 2097152 bytes") as err:
            seg.map_range(0, 2 * MiB)
        assert err.value.errno == errno.ENOSPC and _mapped(seg) == 0


def test_a_cgroup_without_room_refuses_before_fallocate(monkeypatch):
    tight = _cgroup.MemoryLimit("/job/7", "/sys/fs/cgroup/job/7", 2, 64 * MiB, 62 * MiB)
    monkeypatch.setattr(_cgroup, "memory_limit", lambda root="/", nbytes=0: tight)
    called = []
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: called.append(a))
    with Segment.reserve(8 * MiB) as seg:
        with pytest.raises(SegmentError, match=r"memory cgroup /job/7 \(v2") as err:
            seg.map_range(0, 2 * MiB)
        assert err.value.errno == errno.ENOMEM
    with pytest.raises(SegmentError, match="limit of 67108864 bytes and 65011712 in use") as err:
        Segment.create(2 * MiB)
    assert err.value.errno == errno.ENOMEM and "OOM-killed" in str(err.value)
    assert not called  # never tried: past the limit the kernel kills instead of failing


@pytest.mark.parametrize("offset, nbytes", [(-PAGE, PAGE), (1, PAGE), (0, 1), (0, 0),
                                            (8 * MiB, PAGE)])
def test_ranges_must_be_whole_pages_inside_the_reservation(offset, nbytes):
    with Segment.reserve(8 * MiB) as seg, pytest.raises(ValueError, match="must be whole pages"):
        seg.map_range(offset, nbytes)
    with Segment.create(PAGE) as classic, pytest.raises(ValueError, match="for expandable segments"):
        classic.map_range(0, PAGE)


def test_reserve_and_from_fd_reserve_check_their_arguments():
    with pytest.raises(ValueError, match="KEEPFD"):
        Segment.reserve(MiB, Flags.SHAREDMEM)
    with Segment.reserve(MiB) as seg:
        got = Fd(os.dup(seg.fd))
        number = got.fileno()
        with pytest.raises(ValueError, match="needs nbytes"):
            Segment.from_fd(got, reserve=True)
        assert got.closed and number not in fds()  # taken, and closed on the error


def test_provider_records_hold_a_segment_and_no_fd_of_their_own():
    assert "fd" not in {f.name for f in dataclasses.fields(ShmSegment)}
    prov = ShmProvider()
    _, classic = prov.allocate(MiB)
    _, grow = prov.reserve(32 * MiB)
    prov.map(grow, 0, 2 * MiB)
    for rec in (classic, grow):
        assert rec.fd == rec.segment.fd and rec.address == rec.segment.address
    assert grow.expandable and not classic.expandable and grow.mapped == {0: 2 * MiB}
    numbers = {classic.fd, grow.fd}
    prov.free(classic)
    prov.release(grow)
    assert classic.fd == grow.fd == -1 and not numbers & set(fds())
    prov.close()


def test_a_forked_child_forgets_every_fd_and_keeps_only_the_mappings_in_use():
    prov = ShmProvider()
    _, used = prov.allocate(MiB)
    _, idle = prov.allocate(MiB)
    _, grow = prov.reserve(32 * MiB)
    prov.map(grow, 0, 2 * MiB)
    np.ndarray(MiB, np.uint8, buffer=used.segment.lease)[:] = 3
    parent_fds = {used.fd, idle.fd, grow.fd}
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only, never return into pytest
        code = 1
        try:
            kept = prov.after_fork_in_child({used.id})
            ok = [kept == [used], not prov.segments, not parent_fds & set(fds()),
                  all(r.fd == -1 for r in (used, idle, grow)),
                  int(np.ndarray(MiB, np.uint8, buffer=_native.Lease(None, used.address, MiB))[7]) == 3,
                  not any(m.start == idle.address for m in shm_mappings()),
                  not any(m.start == grow.address for m in shm_mappings())]
            code = 0 if all(ok) else 10 + ok.index(False)
        finally:
            os._exit(code)
    assert wait_exit(pid, 30) == 0  # killed and failed past the bound
    assert all(os.fstat(fd) for fd in parent_fds)  # the parent's own fds are untouched
    for rec in (used, idle):
        prov.free(rec)
    prov.release(grow)
    prov.close()
