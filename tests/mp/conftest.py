"""Each test of shmshare.multiprocessing ends with this process's pool server and links shut
down (before the leak checker looks), with no linger: what a test left unclaimed is its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def mp_shutdown() -> Iterator[None]:
    import shmshare.multiprocessing as smp

    yield
    smp.shutdown()
