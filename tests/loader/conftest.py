"""The loader tests' process-wide state, set up once per module before any leak check (the frozen heap is
the root conftest's, for every module)."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="module", autouse=True)
def forkserver_running():
    """Start multiprocessing's forkserver (a process-wide singleton, as the resource tracker) before any leak
    check, so the first forkserver test does not count its fds as a leak.

    The server imports torch before it forks a worker (as ``set_forkserver_preload`` is for): a worker of a
    loader made where torch is imported, as every loader of these tests is, imports torch anyway when it
    starts, ~4 s of CPU on this machine for each of the dozen forkserver workers the tests start; this way
    once. What a forkserver worker does not share with the test's process is kept: it is not the test
    process's child, and it sees none of that process's state (a module attribute set in the test)."""
    import multiprocessing
    from multiprocessing import forkserver

    if sys.modules.get("torch") is not None:  # else a loader here is torch-free, and so are its workers
        multiprocessing.set_forkserver_preload(["__main__", "torch"])
    forkserver.ensure_running()
    yield
