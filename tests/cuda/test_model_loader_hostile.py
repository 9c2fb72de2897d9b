"""A second hostile round: channel notes and retirement, pinned/device loaders, main-process paths.

Tests whose comment starts "Was a defect" failed on the code they were written
against (ea1f2f4); each comment names the defect. The rest pin down
behaviour that held up.
"""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import shmshare.loader as L
from shmshare import cuda
from tests.loader.loader_datasets import Arrays

from .driver_model import CUresult, DriverModel


@pytest.fixture
def numpy_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """As tests/cuda/test_model_loader.py: the loader's numpy mode, torch here being a CPU build."""
    monkeypatch.setitem(sys.modules, "torch", None)


class _FailAt(Arrays):
    """Arrays whose sample `bad` raises."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n, (8,))
        self.bad = bad

    def __getitem__(self, i: int):
        if i == self.bad:
            raise KeyError(f"sample {i}")
        return super().__getitem__(i)


def _pinned(**kw):
    return L.DataLoader(Arrays(64, (1024,)), batch_size=4, num_workers=2, pin_memory=True,
                        collate_fn=L.numpy_collate, multiprocessing_context="fork", **kw)


# -- device= -----------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_device_error_in_a_staged_batch_comes_in_its_turn_and_iteration_goes_on(
        driver_model: DriverModel, numpy_mode: None, workers: int) -> None:
    dl = L.DataLoader(_FailAt(40, bad=9), batch_size=4, num_workers=workers, device=0,
                      collate_fn=L.numpy_collate)
    it = iter(dl)
    got = []
    for _ in range(2):
        b = next(it)
        got.append(int(np.frombuffer(driver_model.read(b["x"].address, 4), np.float32)[0]))
    with pytest.raises(KeyError, match="sample 9"):
        next(it)
    rest = []
    for b in it:
        rest.append(int(np.frombuffer(driver_model.read(b["x"].address, 4), np.float32)[0]))
    assert got == [0, 4] and rest == list(range(12, 40, 4))
    del it, b
    gc.collect()
    assert driver_model.live()["registered"] == 0


def test_device_arrays_outlive_the_loader_and_free_their_memory_after(
        driver_model: DriverModel, numpy_mode: None) -> None:
    dl = L.DataLoader(Arrays(16, (256,)), batch_size=4, num_workers=2, device=0,
                      collate_fn=L.numpy_collate)
    kept = list(dl)  # the iterator shut down at its end, its copier closed
    assert len(kept) == 4
    vals = [np.frombuffer(driver_model.read(b["x"].address, 4), np.float32)[0] for b in kept]
    assert vals == [0, 4, 8, 12]
    del kept, dl
    gc.collect()
    cuda.finish_releases()  # the blocks of arrays dropped after the loader closed (docs/loader.md)
    live = driver_model.live()
    assert live["registered"] == 0
    assert live["mallocs"] == 0 and live["mappings"] == 0 and live["phys"] == 0, live


def test_device_persistent_workers_epoch_broken_off_then_a_whole_one(
        driver_model: DriverModel, numpy_mode: None) -> None:
    dl = L.DataLoader(Arrays(24, (8,)), batch_size=4, num_workers=2, device=0,
                      collate_fn=L.numpy_collate, persistent_workers=True)
    it = iter(dl)
    next(it)
    next(it)  # batch 2 is staged now (its copy started): the next epoch drops it
    del it
    seen = []
    for b in dl:
        seen.append(int(np.frombuffer(driver_model.read(b["x"].address, 4), np.float32)[0]))
    assert seen == [0, 4, 8, 12, 16, 20]
    del b
    dl.close()
    gc.collect()
    assert driver_model.live()["registered"] == 0


# -- fences ------------------------------------------------------------------------------------


def test_fences_completing_out_of_order_hold_the_later_ones_too(driver_model: DriverModel,
                                                                 numpy_mode: None) -> None:
    # Fences recorded on different streams may complete in any order; releases still pass in
    # fence order (a later fence done does not jump an earlier one still running).
    dl = _pinned(persistent_workers=True)
    it = iter(dl)
    streams = iter([1, 2])
    it._rx._fences.pin.current_stream = lambda: next(streams, 0)
    a = next(it)
    driver_model.hold(1)
    del a
    gc.collect()
    b = next(it)  # fence 1 on stream 1 (held)
    del b
    gc.collect()
    c = next(it)  # fence 2 on stream 2 (done)
    fences = it._rx._fences
    assert len(fences.fenced) == 2
    fences.take(it._rx)
    assert len(fences.fenced) == 2  # the done one waits behind the running one
    driver_model.finish(1)
    fences.take(it._rx)
    assert not fences.fenced
    del c
    dl.close()
    assert driver_model.live()["registered"] == 0


def test_unregister_failure_at_close_leaks_nothing_else(driver_model: DriverModel,
                                                         numpy_mode: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Was a defect (fixed): Receiver._forget calls Fences.on_unmap (cuMemHostUnregister) unguarded, inside
    # _shut's loop over peers: one failed unregister aborts the loop, so DataLoader.close()
    # raises CudaError and the other workers' sockets, their registered mappings and the
    # epoll selector stay open for good (_closed is already True: a second close() is a no-op).
    dl = _pinned(persistent_workers=True)
    it = iter(dl)
    b = next(it)
    del b
    calls = []
    real_unregister = DriverModel._cuMemHostUnregister

    def failing(self, address):
        calls.append(address)
        return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)[:1]

    monkeypatch.setattr(DriverModel, "_cuMemHostUnregister", failing)
    try:
        dl.close()
    except Exception as exc:  # noqa: BLE001
        print("close raised", type(exc).__name__, exc)
    assert calls, "no unregister was tried"
    workers = it._workers
    rx = it._rx
    assert rx._closed
    assert not rx._peers, f"connections left open after an unregister failed: {rx._peers}"
    del it, dl
    gc.collect()
    assert cuda.pending_releases(), "the unregister that failed was forgotten, not queued for a retry"
    monkeypatch.setattr(DriverModel, "_cuMemHostUnregister", real_unregister)
    cuda.finish_releases()  # the retry unpins, then lets the mapping go
    assert not cuda.pending_releases() and not driver_model.registered
    del workers


def test_a_failed_fence_wait_at_close_still_closes_the_receiver(driver_model: DriverModel,
                                                                 numpy_mode: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Was a defect (fixed): Receiver._shut runs Fences.take(wait=True) before anything else; an event wait
    # that fails (a sticky CUDA error in the program) raises out of close() with _closed still
    # False, every socket, the wake pipe and the selector open; _shutdown_workers' finally
    # calls rx.close() again, which raises again, so the pinner and the workers' sentinels
    # (w.close()) are skipped too: every fd of the loader leaks.
    dl = _pinned(persistent_workers=True)
    it = iter(dl)
    b = next(it)
    driver_model.hold(0)
    del b
    gc.collect()
    c = next(it)  # a fence pending on stream 0
    assert it._rx._fences.fenced

    def failing(self, event):
        return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)[:1]

    monkeypatch.setattr(DriverModel, "_cuEventSynchronize", failing)
    rx, workers = it._rx, list(it._workers)
    try:
        dl.close()
    except Exception as exc:  # noqa: BLE001
        print("close raised", type(exc).__name__, exc)
    monkeypatch.undo()
    driver_model.finish(0)
    alive = [w for w in workers if w._popen is not None and w.is_alive()]
    assert rx._closed and not rx._peers, "the receiver stayed open after a fence wait failed"
    assert not alive
    del c, it, dl
    gc.collect()
