"""How ``pytest -n N`` (pytest-xdist) shares the suite among its workers: a test file at a time.

Note [The suite under pytest-xdist]
    ``./scripts/test`` runs the suite in two worker processes (``-n 2``; ``-n 0`` runs it in one).
    What makes that safe:

    - A file is one unit of work, run whole by one worker in its own order: its module fixtures
      (a store daemon, a launch of torch.distributed whose result later tests compare against)
      are made once, as in a serial run, and a test that reads what an earlier test of its file
      left finds it.
    - A test marked ``alone`` runs while the other workers wait between two tests (the
      ``alone_under_xdist`` fixture in tests/conftest.py): it reads the host's Shmem, which
      their arrays move, or it leaves a /dev/shm name of a dead process for a while, which their
      leak checks would take for their own and their sweeps remove.
    - The leak check and the tests that look for names left in /dev/shm count the names of their
      own processes only (tests/devshm_helpers.py), and tests that make Unix sockets make them in
      short directories (the ``short_tmp`` fixture; a worker's tmp_path is 10 bytes deeper).

    The files are handed out a directory at a time, the slowest directories first, and in each the
    slowest files first (``SLOW_FIRST``, by their time on this 2-core machine), then the others by
    how many tests they hold, most first, as xdist's own ``--dist loadfile`` does: so no worker is
    left running a long file alone at the end, and each worker changes directory about as often
    as a serial run does (the ``frozen_heap`` fixture collects the whole heap at each change, up to
    a second: at every file that cost more than a minute of CPU). The order changes no result.
"""

from __future__ import annotations

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

__all__ = ["FileScheduling", "SLOW_FIRST"]

SLOW_FIRST = (  # the slowest directories and files, slowest first (seconds of one worker, load ~2 beside)
    "tests/loader",
    "tests/loader/test_torch_parity_workers.py",
    "tests/loader/test_loader.py",
    "tests/loader/test_torch_parity.py",
    "tests/loader/test_distributed.py",
    "tests/mp",
    "tests/mp/test_owners_and_links.py",
    "tests/mp/test_mp_hostile.py",
    "tests/testing",
    "tests/testing/test_pytest_plugin.py",
    "tests/testing/test_leaks_hostile.py",
    "tests/testing/test_plugin_multiprocessing.py",
    "tests/testing/test_leaks_doc.py",
    "tests",
    "tests/test_cli.py",
    "tests/test_statsd_hostile.py",
    "tests/store",
    "tests/memory",
    "tests/channel",
)


class FileScheduling(LoadFileScheduling):
    """xdist's ``loadfile``, a directory at a time, the ``SLOW_FIRST`` directories and files first."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        self._ordered = False

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self._ordered:  # the queue is full now, and nothing has been handed out yet
            self._ordered = True
            rank = {unit: i for i, unit in enumerate(SLOW_FIRST)}

            def order(unit: tuple[str, dict[str, bool]]) -> tuple[int, str, int, int]:
                path, tests = unit
                where = path.rpartition("/")[0]
                return rank.get(where, len(rank)), where, rank.get(path, len(rank)), -len(tests)

            units = sorted(self.workqueue.items(), key=order)
            self.workqueue.clear()
            self.workqueue.update(units)
        super()._assign_work_unit(node)
