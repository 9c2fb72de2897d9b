"""Fixtures of the allocator tests: fresh process-wide settings, a simulated device."""

from __future__ import annotations

import pytest

from shmshare.memory import SimulatedDevice, _config

GiB = 1 << 30


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start every test from PyTorch's defaults, whatever the environment says."""
    monkeypatch.delenv("SHMSHARE_ALLOC_CONF", raising=False)
    monkeypatch.delenv("SHMSHARE_DEBUG", raising=False)
    monkeypatch.setattr(_config, "_current", None)


@pytest.fixture
def device() -> SimulatedDevice:
    """Return a roomy simulated device (8 GiB)."""
    return SimulatedDevice(8 * GiB)
