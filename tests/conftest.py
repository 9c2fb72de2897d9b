"""Every test runs under the leak checker (no fd, shm mapping or /dev/shm name left behind)
and from the allocator's default settings."""

from __future__ import annotations

import compileall
import gc
import sys
from pathlib import Path

import pytest

from shmshare.testing import check_leaks

ROOT = Path(__file__).resolve().parents[1]

# Note [Bytecode in a checkout under PYTHONDONTWRITEBYTECODE]
#     These machines set PYTHONDONTWRITEBYTECODE, so nothing writes bytecode and every Python process the
#     suite starts (store daemons, spawn and forkserver children, pytester runs, the command line: several
#     hundred) compiled shmshare's ~110 modules from source again, ~0.45 s each; and pytest rewrote the
#     asserts of every test module at each collection (17 s of the suite's start, 6 s with its cache). So
#     shmshare's and the tests' bytecode is compiled here first, as ``pip install`` does and as torch's is
#     (scripts/bench_loader.py does the same), and pytest writes its assertion-rewrite cache while it
#     collects. Only what is stale is compiled; a source changed during the run is still read, not its old
#     bytecode (the pyc records the source's mtime and size).
for _tree in ("shmshare", "tests"):
    try:
        compileall.compile_dir(ROOT / _tree, quiet=2)  # a syntax error is pytest's to report, at its import
    except OSError:
        pass  # a read-only checkout: each process compiles from source, as before
_DONT_WRITE_BYTECODE = sys.dont_write_bytecode
sys.dont_write_bytecode = False  # while the test modules are collected (and rewritten): see pytest_collection_finish


def pytest_collection_finish(session: pytest.Session) -> None:
    sys.dont_write_bytecode = _DONT_WRITE_BYTECODE


@pytest.fixture(scope="session", autouse=True)
def process_wide_singletons():
    """Start what multiprocessing keeps for the whole process (the spawn resource tracker's
    pipe) before any leak check, so it is not mistaken for a test's leak."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    yield


_frozen_in: list[Path] = []  # the directory whose modules the frozen heap has been kept for


@pytest.fixture(scope="module", autouse=True)
def frozen_heap(request: pytest.FixtureRequest):
    """Move what is alive when a module starts (torch, numpy, hypothesis, pytest, the modules' own objects)
    out of the collector's sight: the leak checker collects garbage before and after every test, as do many
    tests, and a full collection of that heap costs 0.2-1 s each time (more than half the suite's time went
    there). Garbage made by the tests and their fixtures is still collected, as before.

    The heap is unfrozen and collected in full when the tests move to another directory, not at every
    module: that full collection cost as much again, ~130 times a run. What was alive when a module of a
    directory started and becomes cyclic garbage later is collected when the tests leave the directory; at
    each module's start the garbage of the module before is collected (it was never frozen) and what it
    left alive is frozen with the rest."""
    here = request.path.parent
    if _frozen_in != [here]:
        gc.unfreeze()
        _frozen_in[:] = [here]
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="session", autouse=True)
def unfrozen_at_the_end():
    """Give the collector back the whole heap when the session ends (pytest's own teardown, atexit)."""
    yield
    gc.unfreeze()
    _frozen_in.clear()


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


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private XDG_RUNTIME_DIR: the stats directory of this test alone (stats sockets, the
    store's default socket); a stats server started in the test is stopped after it."""
    from shmshare import _statsd

    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.delenv(_statsd.ENV_VAR, raising=False)
    yield base
    _statsd.stop_stats()
