"""The loader tests' process-wide state, set up once per module before any leak check."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(scope="module", autouse=True)
def forkserver_running():
    """Start multiprocessing's forkserver (a process-wide singleton, as the resource tracker) before any leak
    check, so the first forkserver test does not count its fds as a leak."""
    from multiprocessing import forkserver

    forkserver.ensure_running()
    yield


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """Move what is alive now (torch, numpy, pytest) out of the collector's sight: the leak checker and these
    tests collect garbage a few times per test, and a full collection of that heap costs ~0.1 s each time.
    Garbage made by the tests themselves is still collected."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
