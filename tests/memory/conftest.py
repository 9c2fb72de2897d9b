"""Fixtures of the allocator tests: fresh process-wide settings, a simulated device."""

from __future__ import annotations

import pytest

from shmshare.memory import SimulatedDevice

GiB = 1 << 30


@pytest.fixture
def device() -> SimulatedDevice:
    """Return a roomy simulated device (8 GiB)."""
    return SimulatedDevice(8 * GiB)
