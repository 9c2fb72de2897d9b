"""Every test runs under the leak checker (no fd, shm mapping or /dev/shm name left behind)
and from the allocator's default settings."""

from __future__ import annotations

import compileall
import fcntl
import gc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shmshare.testing import LeakError, Leaks, ResourceSnapshot
from tests import devshm_helpers

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


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``pytest -n N``, whole files go to the workers, not single tests (Note [The suite under
    pytest-xdist] in tests/xdist_schedule.py); a --dist other than load and loadfile is left as asked."""
    if config.getvalue("dist") not in ("load", "loadfile"):
        return None
    from tests.xdist_schedule import FileScheduling

    return FileScheduling(config, log)


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
def no_leaks(alone_under_xdist: None):
    """Check the test process before and after each test, passing tests included: its fds, its shared
    mappings, and the /dev/shm names of its own processes (a name another live process made is
    another test's: a pytest-xdist worker beside this one, see tests/devshm_helpers.py). As
    shmshare.testing.check_leaks, a leak is looked for again, garbage collected, for up to 2 s. The
    check is inside the lock of alone_under_xdist: no ``alone`` test runs meanwhile."""
    gc.collect()
    before = ResourceSnapshot.take()
    yield
    deadline = time.monotonic() + 2.0
    while True:
        gc.collect()
        leaks = ResourceSnapshot.take().leaked_since(before)
        if leaks.shm:
            tree = devshm_helpers.process_tree()
            leaks = Leaks(leaks.fds, leaks.mappings, {n for n in leaks.shm if not devshm_helpers.foreign(n, tree)})
        if not leaks or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if leaks:
        raise LeakError(f"leaked in pid {os.getpid()}: {leaks.describe()}")


@pytest.fixture(scope="session")
def worker_locks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int] | None]:
    """Under pytest-xdist, the fds of two lock files that this run's workers share (a turnstile and a
    shared lock, see alone_under_xdist), opened before any leak check; outside xdist, None. The files
    stay in the run's base temporary directory, which pytest removes a few runs later: one worker
    unlinking them while another holds them open would change their fds' targets under its leak check."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield None
        return
    run_dir = tmp_path_factory.getbasetemp().parent  # each worker's basetemp is <the run's>/popen-gw<n>
    fds: list[int] = []
    try:
        for what in ("turnstile", "shared"):
            fds.append(os.open(run_dir / f"xdist-{what}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        yield fds[0], fds[1]
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture(autouse=True)
def alone_under_xdist(request: pytest.FixtureRequest, worker_locks: tuple[int, int] | None) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` runs while no other worker runs a test: it reads the
    host's Shmem (every process's shared memory) before and after, which the others' arrays move, or it
    leaves a /dev/shm name of a dead process there for a while, which the others' leak checks would
    take for their own and their sweeps remove. Every test holds a shared lock while it runs, and those
    an exclusive one; who wants the exclusive lock holds the turnstile meanwhile, which the others pass
    through before each test, so they cannot keep the lock from ever being free. Outside xdist, nothing."""
    if worker_locks is None:
        yield
        return
    turnstile, shared = worker_locks
    alone = request.node.get_closest_marker("alone") is not None
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(shared, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    except BaseException:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        raise
    if not alone:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(shared, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path, removed after the test: a Unix socket's path holds at most
    107 bytes, and pytest's tmp_path under xdist (``.../pytest-N/popen-gw1/<test name>0``) leaves too few."""
    d = Path(tempfile.mkdtemp(prefix="ss-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def home(short_tmp, monkeypatch):
    """A private XDG_RUNTIME_DIR: the stats directory of this test alone (stats sockets, the
    store's default socket); a stats server started in the test is stopped after it."""
    from shmshare import _statsd

    base = short_tmp / "xdg"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.delenv(_statsd.ENV_VAR, raising=False)
    yield base
    _statsd.stop_stats()
