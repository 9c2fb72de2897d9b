"""The reliability suite kills processes on purpose: what a killed child leaves in /dev/shm
is asserted on by the test itself, then removed here, so one failure does not spill into
the leak checks of the tests after it."""

from __future__ import annotations

import os

import pytest

from shmshare.testing import pid_alive

from .helpers import shm_left


@pytest.fixture(autouse=True)
def remove_names_of_killed_children():
    before = shm_left()
    yield
    for name in shm_left() - before:
        try:
            pid = int(name.split("_")[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not pid_alive(pid):
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
