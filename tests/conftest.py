"""Every test runs under the leak checker (no fd, shm mapping or /dev/shm name left behind)
and from the allocator's default settings."""

from __future__ import annotations

import pytest

from shmshare.testing import check_leaks


@pytest.fixture(scope="session", autouse=True)
def process_wide_singletons():
    """Start what multiprocessing keeps for the whole process (the spawn resource tracker's
    pipe) before any leak check, so it is not mistaken for a test's leak."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    yield


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start every test from PyTorch's allocator defaults, whatever the environment says."""
    from shmshare.memory import _config

    monkeypatch.delenv("SHMSHARE_ALLOC_CONF", raising=False)
    monkeypatch.delenv("SHMSHARE_DEBUG", raising=False)
    monkeypatch.setattr(_config, "_current", None)


@pytest.fixture(autouse=True)
def no_leaks():
    """Check the test process before and after each test, passing tests included."""
    with check_leaks():
        yield
