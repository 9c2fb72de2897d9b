"""Fixtures of the ring tests.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from shmshare.store import Daemon


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = tempfile.mkdtemp(prefix="ss2-")
    dm = Daemon.start(os.path.join(d, "s.sock"))
    try:
        yield dm
    finally:
        dm.stop()
        shutil.rmtree(d, ignore_errors=True)
