"""``shmshare stat`` shows the store's objects, checked against what the test's processes hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from shmshare.store import Daemon, Store
from shmshare.store._protocol import LARGE
from shmshare.testing import pattern, procs

from .helpers import WAIT


def _holder(path: str) -> None:
    s = Store(path)
    view = s.get("big")
    view.view(np.uint8)[::4096].sum()  # every page resident in this process too
    s.put("holding", 1)
    time.sleep(WAIT)  # killed here
    os._exit(3)


def _stat_json(*args: str) -> dict:
    got = subprocess.run([sys.executable, "-m", "shmshare", "stat", "--json", *args],
                         capture_output=True, text=True, timeout=WAIT)
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def test_stat_lists_the_stores_objects_with_their_refs_and_who_maps_them(store: Store,
                                                                          daemon: Daemon) -> None:
    store.put("big", pattern(1, LARGE), immutable=True)  # 4 MiB: a memfd of its own
    store.put("small", pattern(2, 100))
    with procs.start_child(_holder, daemon.path) as child:
        store.get("holding", timeout=WAIT)
        report = _stat_json()
        child_pid = child.pid
    mine = [st for st in report["stores"] if st["pid"] == daemon.pid]
    assert len(mine) == 1 and mine[0]["path"] == daemon.path
    objs = {o["name"]: o for o in mine[0]["objects"]}
    assert objs["big"]["size"] == LARGE * 4 and objs["big"]["refs"] == 1
    assert objs["big"]["holders"] == 1 and objs["big"]["kind"] == "memfd"
    assert objs["big"]["write_seal"] == "full"
    assert objs["small"]["refs"] == 0 and objs["small"]["kind"] == "arena"
    assert mine[0]["stats"]["objects"] == 3 and mine[0]["stats"]["connected"] == 2
    # the /proc side: the child maps the object's memfd, which the daemon holds a fd of
    procs_by_pid = {p["pid"]: p for p in report["processes"]}
    assert procs_by_pid[child_pid]["mapped_bytes"] >= LARGE * 4
    assert procs_by_pid[child_pid]["resident_bytes"] >= LARGE * 4
    assert daemon.pid in procs_by_pid[child_pid]["shares_with"]
    assert procs_by_pid[daemon.pid]["fds"] >= 2  # the memfd object, the pool's segment


def test_stat_of_a_pid_shows_only_that_daemon_and_the_table_names_objects(store: Store,
                                                                          daemon: Daemon,
                                                                          sockdir: str) -> None:
    store.put("weights", np.zeros(3 << 20, np.uint8), immutable=True)
    store.put("warm", np.zeros(2 << 20, np.uint8))  # a block of the pool
    with Daemon.start(os.path.join(sockdir, "other.sock")) as other:
        report = _stat_json("--pid", str(daemon.pid))
        assert [st["pid"] for st in report["stores"]] == [daemon.pid]
        got = subprocess.run([sys.executable, "-m", "shmshare", "stat"], capture_output=True,
                             text=True, timeout=WAIT, env={**os.environ, "COLUMNS": "250"})  # the whole path
        assert f"store pid {daemon.pid}: " in got.stdout and f"clients, at {daemon.path}" in got.stdout
        assert f"store pid {other.pid}: 0 objects" in got.stdout and f"at {other.path}" in got.stdout
        row = next(line for line in got.stdout.splitlines() if line.endswith(" weights"))
        assert "3.0M" in row and "memfd" in row and "full" in row
        row = next(line for line in got.stdout.splitlines() if line.endswith(" warm"))
        assert "2.0M" in row and "arena" in row and "none" in row
