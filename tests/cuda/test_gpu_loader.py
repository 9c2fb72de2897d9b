"""shmshare.DataLoader's CUDA paths on a real GPU: pin_memory=True batches page-locked, device= batches.

Marked ``cuda``: skipped, with the reason, where no GPU can be used
(tests/cuda/conftest.py). The torch-mode tests also need torch with CUDA
and skip without it. tests/cuda/test_model_loader.py runs the same paths
over the driver model; what only a GPU shows is checked here: torch's
``is_pinned()``, the driver's view of the memory, and the bytes after a
real DMA. Over the model (``-p tests.cuda.model_plugin``) only the numpy
mode runs, as a smoke run of this code.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmshare
from shmshare import cuda
from shmshare.loader import numpy_collate
from tests.loader.loader_datasets import Arrays

from .gpu_helpers import page_locked, torch_with_cuda, warm_torch

pytestmark = pytest.mark.cuda
N, BATCH, SHAPE = 40, 4, (3, 64, 64)  # 10 batches of 4 x 48 KiB


@pytest.fixture(scope="module", autouse=True)
def torch_warmed_up() -> Iterator[None]:
    """Before the first test's leak check (a module fixture is set up before the root conftest's
    per-test ``no_leaks``): torch's lazily opened CUDA state is the process's, not a test's leak.
    conftest.py's session fixture ``warm_driver`` has warmed up the driver already."""
    if cuda.available():
        warm_torch()
    yield


@pytest.fixture
def torch() -> Any:
    module = torch_with_cuda()
    if module is None:
        pytest.skip("needs torch with CUDA (torch is missing, or a CPU build)")
    return module


@pytest.fixture
def numpy_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's numpy mode (Note [Two modes]), whatever other tests imported."""
    monkeypatch.setitem(sys.modules, "torch", None)


def _expected(torch: Any) -> list[Any]:
    """torch's own loader over the same dataset: what every batch must equal."""
    from torch.utils.data import DataLoader

    return list(DataLoader(Arrays(N, SHAPE), batch_size=BATCH, num_workers=0, pin_memory=True))


# --- torch mode ------------------------------------------------------------------------------------


def test_pinned_batches_are_page_locked_and_equal_torchs(torch: Any) -> None:
    expected = _expected(torch)
    assert all(b["x"].is_pinned() for b in expected)  # torch's path works here: the anchor
    dl = shmshare.DataLoader(Arrays(N, SHAPE), batch_size=BATCH, num_workers=2, pin_memory=True)
    got = 0
    for mine, theirs in zip(dl, expected, strict=True):
        x = mine["x"]
        assert x.is_pinned(), "a pin_memory=True batch torch does not see as pinned"
        assert page_locked(x.data_ptr())
        assert torch.equal(x, theirs["x"]) and torch.equal(mine["y"], theirs["y"])
        on_device = x.to("cuda", non_blocking=True)  # a DMA straight from the worker's pages
        assert torch.equal(on_device.cpu(), theirs["x"])
        got += 1
        del mine, x, on_device
    assert got == N // BATCH
    dl.close()
    gc.collect()


def test_device_batches_are_cuda_tensors_equal_to_torchs(torch: Any) -> None:
    expected = _expected(torch)
    dl = shmshare.DataLoader(Arrays(N, SHAPE), batch_size=BATCH, num_workers=2, device="cuda:0")
    got = 0
    for mine, theirs in zip(dl, expected, strict=True):
        x, y = mine["x"], mine["y"]
        assert x.is_cuda and x.device.index == 0 and y.is_cuda
        assert x.dtype == theirs["x"].dtype and x.shape == theirs["x"].shape
        assert torch.equal(x.cpu(), theirs["x"]) and torch.equal(y.cpu(), theirs["y"])
        assert float((x * 2).sum().item()) == float(theirs["x"].sum().item()) * 2  # a kernel reads it
        got += 1
        del mine, x, y
    assert got == N // BATCH
    dl.close()
    gc.collect()


# --- numpy mode ----------------------------------------------------------------------------------


def test_numpy_pinned_batches_lie_in_page_locked_memory(numpy_mode: None) -> None:
    dl = shmshare.DataLoader(Arrays(N, SHAPE), batch_size=BATCH, num_workers=2, pin_memory=True,
                             collate_fn=numpy_collate)
    device = cuda.CudaDeviceProvider()
    nbytes = BATCH * int(np.prod(SHAPE)) * 4
    target, handle = device.allocate(nbytes)
    stream = cuda.Stream()
    seen = []
    try:
        for b in dl:
            x = b["x"]
            assert isinstance(x, np.ndarray) and x.shape == (BATCH, *SHAPE)
            assert page_locked(x.__array_interface__["data"][0]), "a pinned batch in pageable memory"
            cuda.copy_host_to_device(target, x, nbytes, stream=stream)  # async: from page-locked pages
            stream.synchronize()
            out = np.empty((BATCH, *SHAPE), np.float32)
            cuda.copy_device_to_host(out, target, nbytes)
            assert (out == x).all() and (out == out[:, :1, :1, :1]).all()
            seen += out[:, 0, 0, 0].astype(int).tolist()
            del b, x
    finally:
        stream.close()
        device.free(handle)
        device.close()
    assert seen == list(range(N))
    dl.close()
    gc.collect()


@pytest.mark.parametrize("workers", [0, 2])
def test_numpy_device_batches_hold_the_samples(numpy_mode: None, workers: int) -> None:
    dl = shmshare.DataLoader(Arrays(N, SHAPE), batch_size=BATCH, num_workers=workers, device="cuda:0",
                             collate_fn=numpy_collate)
    seen = []
    for b in dl:
        x = b["x"]
        assert isinstance(x, cuda.DeviceArray) and x.shape == (BATCH, *SHAPE) and x.dtype == np.float32
        assert x.stream is not None, "a device batch made on no side stream"
        assert "stream" not in x.__cuda_array_interface__  # the interface synchronized the side stream
        out = np.empty(x.shape, x.dtype)
        cuda.copy_device_to_host(out, x, x.nbytes)
        assert (out == out[:, :1, :1, :1]).all()
        seen += out[:, 0, 0, 0].astype(int).tolist()
        del b, x
    assert seen == list(range(N))
    dl.close()
    gc.collect()
