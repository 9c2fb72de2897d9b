"""The DataLoader's pin_memory=True over the driver MODEL: segments page-locked once, fenced reuse.

No GPU (tests/cuda/driver_model.py); numpy mode (no torch tensors on a
device here). What a real GPU adds is torch's ``is_pinned()`` and the DMA
itself: scripts/gpu_check runs those.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import shmshare.loader as L
from tests.loader.loader_datasets import Arrays

from .driver_model import DriverModel


def _in_registered(model: DriverModel, arr: np.ndarray) -> bool:
    addr = arr.__array_interface__["data"][0]
    return any(start <= addr and addr + arr.nbytes <= start + size
               for start, size in model.registered.items())


def _loader(**kw):
    return L.DataLoader(Arrays(64, (1024,)), batch_size=4, num_workers=2, pin_memory=True,
                        collate_fn=L.numpy_collate, multiprocessing_context="fork", **kw)


def test_batches_lie_in_segments_registered_once(driver_model: DriverModel) -> None:
    it = iter(_loader())
    seen = 0
    for b in it:
        assert _in_registered(driver_model, b["x"]), "a pinned batch outside every registration"
        seen += 1
    assert seen == 16
    registers = [c for c, _ in driver_model.calls if c == "cuMemHostRegister"]
    assert 0 < len(registers) <= 6  # once per pool segment (x, y and pid arrays), never per batch
    del it, b
    gc.collect()
    assert driver_model.live()["registered"] == 0  # the loader closed: every range unpinned


def test_a_dropped_batch_goes_back_only_after_its_fence_completes(driver_model: DriverModel) -> None:
    dl = _loader(persistent_workers=True)
    it = iter(dl)
    first = next(it)
    driver_model.hold(0)  # a copy from `first` is still running on the current stream
    del first
    gc.collect()
    second = next(it)  # recv fences the release: an event recorded on stream 0, not yet complete
    fences = it._rx._fences
    assert fences.fenced and not fences.unfenced
    held = sum(len(items) for _, items in fences.fenced)
    assert held >= 1
    released_before = list(it._rx._released)
    assert all(lease not in [x[1] for _, items in fences.fenced for x in items]
               for _, lease in released_before)
    driver_model.finish(0)  # the copy is done
    third = next(it)
    assert len(fences.fenced) == 0  # passed on to the worker
    del second, third
    dl.close()
    assert driver_model.live()["registered"] == 0


def test_close_waits_for_fences_before_the_workers_take_their_blocks_back(
        driver_model: DriverModel) -> None:
    dl = _loader(persistent_workers=True)
    it = iter(dl)
    b = next(it)
    driver_model.hold(0)
    del b
    gc.collect()
    next(it)
    assert it._rx._fences.fenced
    syncs = len([c for c, _ in driver_model.calls if c == "cuEventSynchronize"])
    dl.close()
    assert len([c for c, _ in driver_model.calls if c == "cuEventSynchronize"]) > syncs
    assert driver_model.live()["registered"] == 0


def test_without_cuda_pin_memory_warns_as_torch_does() -> None:
    from shmshare import cuda

    if cuda.available():
        pytest.skip("CUDA is present here")
    with pytest.warns(UserWarning, match="no accelerator is found"):
        assert len(list(_loader())) == 16
