"""shmshare.segment.sweep: names in /dev/shm of dead creators go, everything else stays."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shmshare.segment import sweep

DIR = "/dev/shm"

pytestmark = pytest.mark.alone  # the dead pids' names it plants would be another worker's leaks; its sweeps take theirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


@pytest.fixture
def live_child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def plant():
    made: list[str] = []

    def make(pid: int, token: str, *, age: float = 0.0, uid: int | None = None) -> str:
        path = f"{DIR}/shmshare_{pid}_{token}"
        with open(path, "wb") as f:
            f.write(b"x")
        if age:
            os.utime(path, (time.time() - age, time.time() - age))
        if uid is not None:
            os.chown(path, uid, -1)
        made.append(path)
        return path

    yield make
    for path in made:
        if os.path.exists(path):
            os.unlink(path)


def test_sweep_removes_names_of_dead_pids_and_keeps_live_ones(plant, live_child):
    dead = plant(_dead_pid(), "dead01")
    live = plant(live_child, "11fe01")
    mine = plant(os.getpid(), "5e1f01")
    assert dead in sweep(dry_run=True)
    assert os.path.exists(dead)  # a dry run removes nothing
    got = sweep()
    assert dead in got and live not in got and mine not in got
    assert not os.path.exists(dead) and os.path.exists(live) and os.path.exists(mine)
    assert dead not in sweep()  # already gone: not reported twice


def test_a_live_pid_that_started_after_the_name_was_written_was_reused(plant, live_child):
    reused = plant(live_child, "01d001", age=86400.0)  # a day older than the process
    assert reused in sweep()
    assert not os.path.exists(reused)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a name of another uid")
def test_names_of_another_user_or_other_shapes_are_never_touched(plant):
    pid = _dead_pid()
    foreign = plant(pid, "f0e1", uid=65534)
    odd = plant(pid, "not-hex")  # not a name shmshare makes
    got = sweep()
    assert foreign not in got and odd not in got
    assert os.path.exists(foreign) and os.path.exists(odd)
