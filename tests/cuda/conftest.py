"""Fixtures of the CUDA tests: the ``cuda`` marker's skip, a warmed-up driver, the driver model.

Tests marked ``cuda`` need a GPU; without one they are skipped with the
reason from :func:`shmshare.cuda.why_unavailable`, never silently.

The driver opens fds (``/dev/nvidia*``, event fds) and threads on first use.
The session fixture below makes that first use happen before any test's leak
check starts, as the root conftest does for multiprocessing's tracker.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmshare import Segment, cuda, wire
from shmshare.cuda import _array, _context, _deferred, _driver, _pinned

from .driver_model import DriverModel


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``cuda`` test, with the reason, where CUDA cannot be used."""
    reason = cuda.why_unavailable()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def warm_driver() -> Iterator[None]:
    """Open what the driver keeps for the whole process before the first leak check."""
    if cuda.available():
        _warm_up()
    yield


@pytest.fixture
def driver_model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[DriverModel]:
    """Install the driver model (tests/cuda/driver_model.py) in place of cuda-python: NOT a GPU.

    Parametrize it indirectly to build it otherwise:
    ``@pytest.mark.parametrize("driver_model", [{"devices": 2}], indirect=True)``.
    The test fails at teardown if the model saw a race between streams (even
    where the library swallowed the AssertionError) or if pinned memory was
    munmapped while still registered.
    """
    options: dict[str, Any] = getattr(request, "param", None) or {}
    yield from _installed(monkeypatch, **options)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[DriverModel]:
    """The driver model with two devices, installed as ``driver_model`` is: NOT a GPU."""
    yield from _installed(monkeypatch, devices=2)


def _installed(monkeypatch: pytest.MonkeyPatch, **options: Any) -> Iterator[DriverModel]:
    if cuda.available():
        pytest.skip("a real driver is present here; the model would shadow it (the cuda tests cover this)")
    model = DriverModel(_real_binding(), **options)
    monkeypatch.setattr(_driver, "_state", (model, None))
    monkeypatch.setattr(_driver, "_forked_after_init", False)
    monkeypatch.setattr(_context, "_primary", {})
    monkeypatch.setattr(_context, "_last_events", {})
    monkeypatch.setattr(_pinned, "_default_pool", None)
    monkeypatch.setattr(_array, "_pools", {})
    monkeypatch.setattr(_deferred, "_pools", {})
    monkeypatch.setattr(_deferred, "_tasks", [])
    yield model  # leaked fds (an exported chunk's, say) are the root conftest's leak check's to find
    _deferred.drain(wait=True)  # what the test left deferred, before the leak check looks
    assert not model.violations, model.violations
    gc.collect()  # run the finalizers of what the test dropped, then look for pinned memory they unmapped
    stale = model.stale_registrations()
    assert not stale, f"munmapped while still cuMemHostRegister'ed (a stale DMA target): {stale}"


@pytest.fixture
def pipe() -> Iterator[tuple[wire.Connection, wire.Connection]]:
    """A connected pair of wire ends, closed after the test."""
    a, b = wire.pipe()
    yield a, b
    a.close()
    b.close()


def _real_binding() -> Any:
    """Return cuda-python's driver module when installed (for signature checks), else None."""
    try:
        return _driver._import_driver()
    except ImportError:
        return None


def _warm_up() -> None:
    """Touch each driver path once: context, streams, events, both pinned paths, a registered
    segment, both device paths, copies and fills, and a VMM chunk exported as a fd."""
    ctx = cuda.Context.primary(0)
    stream = cuda.Stream(ctx)
    pool = cuda.EventPool(ctx)
    pool.get().record(stream).synchronize()
    for register in (False, True):
        host = cuda.CudaHostProvider(ctx, register=register)
        host.free(host.allocate(1 << 20)[1])
        host.close()
    shareable = ctx.attribute("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED") == 1
    for ipc in {False, shareable}:
        device = cuda.CudaDeviceProvider(ipc=ipc, context=ctx)
        address, handle = device.allocate(2 << 20)
        buffer = np.zeros(4096, np.uint8)
        cuda.memset_device(address, 1, 4096, stream=stream)
        cuda.copy_device_to_host(buffer, address, 4096, stream=stream)
        cuda.copy_host_to_device(address, buffer, 4096)
        stream.synchronize()
        if ipc:
            _, fds = device.range_of(address)[0].export(0, 2 << 20)
            for fd in fds:
                os.close(fd)
        device.free(handle)
        device.close()
    with Segment.create(1 << 20) as seg:
        cuda.register_segment(seg, ctx).unregister()
    stream.close()
    pool.close()
    cuda.finish_releases()
    _warm_up_torch()


def _warm_up_torch() -> None:
    """Initialize torch's CUDA too (its allocator, streams, cuBLAS handle), where torch has it."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    torch.cuda.init()
    x = torch.ones(256, 256, device="cuda")
    (x @ x).sum().item()
    torch.from_dlpack(torch.utils.dlpack.to_dlpack(x))
    x.cpu().pin_memory()
    torch.cuda.synchronize()
