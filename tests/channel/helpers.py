"""Shared pieces of the channel tests: batches filled with per-message patterns (shmshare.testing's
pattern), sent and checked."""

from __future__ import annotations

import os

import numpy as np

from shmshare.testing import pattern


def send_patterns(tx, count: int, n: int, tag: int = 0, in_place: bool = False) -> None:
    """Send `count` batches whose contents derive from (tag, i); then close."""
    for i in range(count):
        seed = tag * 1_000_003 + i
        if in_place:
            arr = tx.empty(n, np.uint32)
            arr[:] = pattern(seed, n)
        else:
            arr = pattern(seed, n)
        tx.send({"tag": tag, "i": i, "pid": os.getpid(), "x": arr}, timeout=30)
    tx.close()


def check_pattern(batch: dict, n: int) -> bool:
    seed = batch["tag"] * 1_000_003 + batch["i"]
    return batch["x"].shape == (n,) and bool(np.array_equal(batch["x"], pattern(seed, n)))
