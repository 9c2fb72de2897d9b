"""``get(..., populate=True)`` (Note [Populate on request] in _plane/borrow.py): every page of the object
is in this process's page tables when the get returns, so reading it all takes no page fault."""

from __future__ import annotations

import resource

import numpy as np
import pytest

from shmshare.store import Store
from shmshare.store._protocol import LARGE


def _faults_reading_every_page(arr: np.ndarray) -> tuple[int, int]:
    """(minor faults taken, sum) reading one byte of every page of `arr` (uint8, C order)."""
    pages = arr[::4096]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    total = int(pages.sum(dtype=np.int64))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, total


@pytest.mark.parametrize("size", [300_000, 32 << 20])  # a pool block; an object with its own memfd (threads)
def test_a_populated_get_reads_every_page_without_a_fault(store: Store, size: int) -> None:
    pages = -(-size // 4096)
    store.put("plain", np.full(size, 3, np.uint8))
    store.put("populated", np.full(size, 5, np.uint8))
    faults, total = _faults_reading_every_page(store.get("plain"))
    assert total == 3 * pages
    if size >= LARGE:  # a new mapping, faulted in as read: 16 pages a fault (fault-around), 512 a huge page
        assert faults >= 8, faults
    faults, total = _faults_reading_every_page(store.get("populated", populate=True))
    assert total == 5 * pages and faults <= 4, faults


def test_populate_takes_a_bool(store: Store) -> None:
    store.put("x", np.ones(10))
    with pytest.raises(TypeError, match=r"get\(populate=\.\.\.\) takes True or False, got 1"):
        store.get("x", populate=1)  # type: ignore[arg-type]


def test_a_populated_torch_object_is_its_private_copy_as_without(store: Store) -> None:
    torch = pytest.importorskip("torch")
    store.put("t", torch.arange(LARGE // 4, dtype=torch.float32))
    got = store.get("t", populate=True)
    assert isinstance(got, torch.Tensor) and float(got[-1]) == LARGE // 4 - 1
    got[0] = 7  # a tensor is writable: a private copy (docs/store.md)
    assert float(store.get("t")[0]) == 0
