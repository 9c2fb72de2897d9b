"""ShmProvider: the pool contract over real memfd segments, and what only shared memory does."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shmshare import _native
from shmshare._procfs import meminfo_kb, shm_mappings
from shmshare.memory import CachingAllocator, OutOfMemoryError, ProviderOutOfMemory, ShmProvider
from shmshare.testing.pool_contract import PoolContract

MiB = 1 << 20


class TestShmClassic(PoolContract):
    config = "expandable_segments:False"
    live_limit = 128 * MiB
    can_provoke_oom = True

    def make_provider(self) -> ShmProvider:
        return ShmProvider(limit=512 * MiB)


class TestShmExpandable(TestShmClassic):
    config = "expandable_segments:True"


class TestShmPosix(TestShmClassic):
    def make_provider(self) -> ShmProvider:
        return ShmProvider(limit=512 * MiB, backend="posix")


def _fill_and_check(block, value: int) -> None:
    arr = np.ndarray(block.size, np.uint8, buffer=_native.Lease(None, block.address, block.size))
    arr.fill(value)
    assert int(arr[0]) == value and int(arr[-1]) == value


@pytest.mark.parametrize("expandable", [False, True])
def test_blocks_are_real_shared_memory(expandable):
    prov = ShmProvider(limit=256 * MiB)
    alloc = CachingAllocator(prov, f"expandable_segments:{expandable}")
    blocks = [alloc.malloc(n) for n in (1000, 3 * MiB, 25 * MiB)]
    for k, b in enumerate(blocks):
        _fill_and_check(b, k + 1)
    assert shm_mappings(contains=f"shmshare_{os.getpid()}_")
    for b in blocks:
        alloc.free(b)
    alloc.empty_cache()
    alloc.check_invariants()
    assert prov.used == 0 and not prov.segments
    prov.close()


def test_limit_is_an_oom_with_the_numbers():
    prov = ShmProvider(limit=32 * MiB)
    alloc = CachingAllocator(prov)
    b = alloc.malloc(20 * MiB)
    with pytest.raises(OutOfMemoryError, match=r"Tried to allocate 30\.00 MiB") as err:
        alloc.malloc(30 * MiB)
    assert isinstance(err.value.__cause__, ProviderOutOfMemory)
    assert "pool limit of 33554432 bytes" in str(err.value.__cause__)
    alloc.free(b)
    alloc.empty_cache()
    prov.close()


@pytest.mark.alone  # reads the host's Shmem before and after
def test_unmapping_expandable_pages_gives_memory_back_to_the_host():
    prov = ShmProvider()
    alloc = CachingAllocator(prov, "expandable_segments:True")
    shmem0 = meminfo_kb("Shmem")
    b = alloc.malloc(200 * MiB)
    _fill_and_check(b, 9)
    assert meminfo_kb("Shmem") - shmem0 >= 190 * 1024
    (rec,) = prov.segments.values()
    fd, address = rec.fd, rec.address
    alloc.free(b)
    alloc.empty_cache()  # unmaps the pages and punches holes; the reservation may go too
    assert meminfo_kb("Shmem") - shmem0 < 20 * 1024
    alloc.check_invariants()
    assert fd >= 0 and address
    prov.close()


def test_provider_refuses_foreign_handles_and_bad_arguments():
    prov = ShmProvider(limit=MiB)
    with pytest.raises(ValueError, match="not a live segment"):
        prov.free(object())
    with pytest.raises(ValueError, match="limit must be a positive"):
        ShmProvider(limit=0)
    with pytest.raises(ValueError, match="backend must be"):
        ShmProvider(backend="sysv")
    with pytest.raises(ProviderOutOfMemory, match="pool limit of 1048576"):
        prov.allocate(2 * MiB)
    prov.close()


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_a_record_closed_again_touches_nothing_it_no_longer_owns(expandable):
    # A record's __del__ closes it again, maybe much later (a garbage cycle): by then its
    # address range and fd number may belong to a new segment. That second close once
    # unmapped the range and closed the fd a second time (a SIGSEGV in a forked child).
    p = ShmProvider()
    if expandable:
        _, rec = p.reserve(4 << 20)
        p.map(rec, 0, 2 << 20)
    else:
        _, rec = p.allocate(2 << 20)
    old_range, old_fd = (rec.address, rec.address + rec.size), rec.fd
    p.release(rec) if expandable else p.free(rec)
    q = ShmProvider()
    _, new = q.allocate(2 << 20)  # the kernel hands out the range and fd number just freed
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        reused_range = old_range[0] <= new.address < old_range[1]
        if not (reused_range or old_fd in (fd, new.fd)):
            pytest.skip("the kernel reused neither the freed range nor the fd number: "
                        "nothing here for a second close to hit")
        rec.close()
        assert any(m.start == new.address for m in shm_mappings(os.getpid()))  # still mapped
        os.fstat(fd)  # still ours
        os.fstat(new.fd)
    finally:
        os.close(fd)
        q.free(new)
