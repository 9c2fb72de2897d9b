"""The pytest plugin: ``pytest --leaks`` fails a test that leaves fds, mappings, names, children or threads.

Registered by the ``pytest11`` entry point, so installing shmshare loads
it into every pytest run; it does nothing until asked, in one of three
ways:

- ``pytest --leaks``: every test;
- ``@pytest.mark.leakcheck``: the marked tests (or modules, with ``pytestmark``);
- the ``no_leaks`` fixture: the tests that request it.

A checked test that leaves anything behind (see Note [What counts as a leak,
and what does not] in ``_census.py``) errors at teardown, as every failing
teardown does in pytest, with a table of what it left and the Python stack
that made each fd or mapping an audit event saw (``_audit.py``).

The check wraps the test and its function-scoped fixtures: it is an autouse
fixture of the plugin, so it is set up before the other function-scoped
fixtures and torn down after them; fixtures of a wider scope are set up
before it, and what they hold is not the test's. ``--leaks-settle`` bounds
how long a release that is still on its way (from another thread or
process) is waited for.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["no_leaks"]

_SETTLE = 2.0  # s: as shmshare.testing.check_leaks; a passing test does not wait
_CHECKED = pytest.StashKey[bool]()  # the autouse fixture checks this item


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shmshare", "leak checks (shmshare)")
    group.addoption("--leaks", action="store_true", default=False,
                    help="fail every test that leaves fds, shared mappings, /dev/shm names, child processes "
                         "or threads behind (without it: only tests marked leakcheck or using no_leaks)")
    group.addoption("--leaks-settle", type=float, default=_SETTLE, metavar="SECONDS",
                    help=f"wait at most this long for releases still on their way (default {_SETTLE})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "leakcheck: fail the test if it leaves fds, shared mappings, /dev/shm "
                                       "names, child processes or threads behind (as --leaks does for all)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A test that requests this plugin's no_leaks is checked by the autouse fixture, which runs first,
    # so its other fixtures are inside the check whatever order they are named in. A no_leaks of the
    # test's own conftest (the name is natural) shadows ours and is left alone.
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).get("no_leaks", ())
        if defs and getattr(defs[-1], "func", None) is _no_leaks_impl:
            item.stash[_CHECKED] = True


@pytest.fixture(autouse=True)
def _shmshare_leakcheck(request: pytest.FixtureRequest) -> Iterator[None]:
    item = request.node
    if not (request.config.getoption("leaks") or item.get_closest_marker("leakcheck")
            or item.stash.get(_CHECKED, False)):
        yield
        return
    item.stash[_CHECKED] = True
    yield from _check(request)


def _no_leaks_impl(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if it leaves fds, shared mappings, /dev/shm names, child processes or threads behind."""
    if request.node.stash.get(_CHECKED, False):
        yield  # the autouse fixture checks it already, from before every function-scoped fixture
        return
    yield from _check(request)


no_leaks = pytest.fixture(name="no_leaks")(_no_leaks_impl)


def _check(request: pytest.FixtureRequest) -> Iterator[None]:
    from . import _audit, _census  # only when asked: an inert plugin imports nothing of its own

    settle: Any = request.config.getoption("leaks_settle")
    _start_process_wide_helpers()
    before = _census.Census.take()
    with _audit.recording():
        yield
        leaks = _census.wait_for_leaks(before, float(settle))
        if leaks and _shut_process_wide_pools():
            leaks = _census.wait_for_leaks(before, float(settle))
    if leaks:
        pytest.fail(f"LeakError: {len(leaks)} resource(s) left behind by {request.node.nodeid} "
                    f"(after {settle:g} s of retries):\n{_census.table(leaks)}", pytrace=False)


def _start_process_wide_helpers() -> None:
    """Start multiprocessing's resource tracker before the first census: it lives as long as the process.

    The first test to use a spawn or forkserver context starts it (a child
    process and a pipe), and it would be blamed for them.
    """
    from multiprocessing import resource_tracker

    try:
        resource_tracker.ensure_running()
    except Exception:  # noqa: BLE001, S110 - no tracker here (a platform without one): nothing to blame on tests
        pass


def _shut_process_wide_pools() -> bool:
    """What a test left in shmshare.multiprocessing's process-wide pool, server and links (a
    Queue's handles, a link's mapping): shut them down, as a program's exit does, so that only
    what the test itself still holds is reported. True if there was something to shut."""
    mp = sys.modules.get("shmshare.multiprocessing")
    if mp is None:
        return False
    mp.shutdown()
    return True
