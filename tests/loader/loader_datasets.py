"""Datasets for the loader tests, importable by spawned workers (no torch needed here), and a wait."""

from __future__ import annotations

import os
import time

import numpy as np


class Arrays:
    """Map-style: sample i is an array of `shape` filled with i, its label, and its worker's pid."""

    def __init__(self, n: int, shape: tuple[int, ...] = (4, 5), dtype: str = "float32") -> None:
        self.n, self.shape, self.dtype = n, shape, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"x": np.full(self.shape, i, self.dtype), "y": i, "pid": os.getpid()}


class Slow(Arrays):
    """Each sample takes `delay` s (a worker to kill while it works)."""

    def __init__(self, n: int, delay: float = 0.02) -> None:
        super().__init__(n, (2,))
        self.delay = delay

    def __getitem__(self, i: int) -> dict[str, object]:
        time.sleep(self.delay)
        return super().__getitem__(i)


class Keys:
    """Indexed by anything hashable: returns the index it was given, and its type's name."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, key: object) -> tuple[str, str]:
        return repr(key), type(key).__name__


def gone(pid: int, within: float) -> bool:
    """Wait up to `within` s for `pid` to exit (a zombie of ours counts); return whether it did."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie of ours counts as gone
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False
