"""The DataLoader's pin_memory=True over the driver MODEL: segments page-locked once, fenced reuse.

No GPU (tests/cuda/driver_model.py); numpy mode (no torch tensors on a
device here). What a real GPU adds is torch's ``is_pinned()`` and the DMA
itself: scripts/gpu_check runs those.
"""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import shmshare.loader as L
from tests.loader.loader_datasets import Arrays

from .driver_model import DriverModel


@pytest.fixture(autouse=True)
def numpy_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's numpy mode (Note [Two modes]), whatever other tests imported: torch here is
    a CPU build, so its own mode would pin by torch's rules (no accelerator: a warning)."""
    monkeypatch.setitem(sys.modules, "torch", None)


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
    for b in it:  # every array, the small ones too (never by value: Note [Inline arrays])
        assert all(_in_registered(driver_model, v) for v in b.values()), "a pinned batch outside every registration"
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
    released_before = list(it._rx._releases.items)
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


# --- device= -----------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_device_batches_hold_the_samples_and_their_host_blocks_go_after_the_copy(
        driver_model: DriverModel, workers: int) -> None:
    from shmshare import cuda

    dl = L.DataLoader(Arrays(20, (8,)), batch_size=4, num_workers=workers, device="cuda:0",
                      collate_fn=L.numpy_collate)
    it = iter(dl)
    got = []
    for b in it:
        x = b["x"]
        assert isinstance(x, cuda.DeviceArray) and x.shape == (4, 8) and x.dtype == np.float32
        host = np.frombuffer(driver_model.read(x.address, x.nbytes), np.float32).reshape(4, 8)
        assert (host == host[:, :1]).all()
        got += host[:, 0].astype(int).tolist()
        assert x.stream is not None  # made on the side stream: DLPack consumers wait for it...
        assert "stream" not in x.__cuda_array_interface__  # ...and a CAI consumer gets it ready (synchronized)
        del b, x
    assert got == list(range(20))
    del it
    gc.collect()
    assert driver_model.live()["registered"] == 0


def test_device_copies_run_one_batch_ahead(driver_model: DriverModel) -> None:
    dl = L.DataLoader(Arrays(40, (8,)), batch_size=4, num_workers=1, device=0,
                      collate_fn=L.numpy_collate, persistent_workers=True)
    it = iter(dl)
    first = next(it)
    copies = [c for c, _ in driver_model.calls if c == "cuMemcpyHtoDAsync"]
    assert len(copies) == 2 * 3  # batches 0 and 1 (x, y and pid each): the next one is on its way
    assert it._staged is not None and it._staged[0] == "batch"
    del first
    dl.close()
    gc.collect()


def test_device_host_batches_are_held_until_their_copy_completes(driver_model: DriverModel) -> None:
    dl = L.DataLoader(Arrays(40, (8,)), batch_size=4, num_workers=1, device=0,
                      collate_fn=L.numpy_collate, persistent_workers=True)
    it = iter(dl)
    first = next(it)
    side = int(it._copier.stream)
    driver_model.hold(side)  # the side stream is busy: copies enqueued from now on do not finish
    second = next(it)  # stages the third batch behind the held work
    pending = it._copier.inflight
    assert pending and not pending[-1][0].query()
    host = pending[-1][1]
    assert all(isinstance(a, np.ndarray) for a in host)  # its host arrays, kept from the worker
    driver_model.finish(side)
    third = next(it)
    assert all(e.query() for e, _ in list(it._copier.inflight)[:-1])
    del first, second, third, host, pending
    dl.close()
    gc.collect()


def test_device_needs_a_device_name_torch_knows() -> None:
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda', 'cuda:N', a device ordinal"):
        L.DataLoader(Arrays(4), device="gpu")
    with pytest.raises(ValueError, match="copies batches to CUDA devices only"):
        L.DataLoader(Arrays(4), device="mps")


@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0])
def test_a_cuda_device_where_cuda_cannot_be_used_is_refused_at_construction(device) -> None:
    """The new user's review: the error came at iter(), under a private name, naming a fix
    (pip install shmshare[cuda]) that does not give a machine a GPU."""
    from shmshare import cuda

    if cuda.available():
        pytest.skip("CUDA is present here")
    with pytest.raises(cuda.CudaUnavailable, match=r"Leave device unset") as got:
        L.DataLoader(Arrays(4), device=device)
    assert type(got.value).__module__ == "shmshare.cuda"


@pytest.mark.parametrize("device", ["cpu", "cpu:0", None])
def test_device_cpu_leaves_batches_where_the_workers_made_them(device) -> None:
    """torch's ``.to("cpu")`` is a no-op: so is ``device="cpu"`` (it raised ValueError)."""
    dl = L.DataLoader(Arrays(4), batch_size=2, device=device)
    try:
        assert [type(b) for b in dl] == [type(b) for b in L.DataLoader(Arrays(4), batch_size=2)]
    finally:
        dl.close()
