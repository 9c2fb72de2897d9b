"""The loader tests' process-wide state, set up once per module before any leak check (the frozen heap is
the root conftest's, for every module)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def forkserver_running():
    """Start multiprocessing's forkserver (a process-wide singleton, as the resource tracker) before any leak
    check, so the first forkserver test does not count its fds as a leak."""
    from multiprocessing import forkserver

    forkserver.ensure_running()
    yield
