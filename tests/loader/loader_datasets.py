"""Datasets for the loader tests, importable by spawned workers (no torch needed here), and a wait."""

from __future__ import annotations

import os
import time

import numpy as np

from shmshare.testing import wait_until


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


class DiesWhileAnotherSleeps(Arrays):
    """Worker 1 writes `where`/started, sleeps `sleep` s, then writes `where`/done; worker 0 exits
    with code 7 once worker 1 has started (a death while another worker is busy)."""

    def __init__(self, where: str, sleep: float = 30.0) -> None:
        super().__init__(8, (2,))
        self.where, self.sleep = where, sleep

    def __getitem__(self, i: int) -> dict[str, object]:
        from shmshare.loader import get_worker_info

        started = os.path.join(self.where, "started")
        if get_worker_info().id == 1:
            open(started, "w").close()
            time.sleep(self.sleep)
            open(os.path.join(self.where, "done"), "w").close()
        else:
            end = time.monotonic() + 30
            while not os.path.exists(started) and time.monotonic() < end:
                time.sleep(0.01)
            os._exit(7)
        return super().__getitem__(i)


class Gated(Arrays):
    """Map-style, with `nbytes` of payload: sample i is payload[4i:4i+4] and i. Unpickling it waits up to
    `wait` s for the file `go` to exist before it reads the payload, so a worker's start that waits for the
    worker to read its dataset cannot return before `go` exists."""

    def __init__(self, n: int, go: str, nbytes: int = 1 << 20, wait: float = 30.0) -> None:
        super().__init__(n, (4,), "uint8")
        self.go, self.wait = go, wait
        self.payload = (np.arange(nbytes) * 7 % 251).astype(np.uint8)

    def __reduce__(self) -> tuple[object, ...]:
        # the gate first: the payload's bytes follow it in the stream
        return _ungate, (_Gate(self.go, self.wait), self.n, self.payload)

    def __getitem__(self, i: int) -> dict[str, object]:  # type: ignore[override]
        return {"x": self.payload[4 * i:4 * i + 4].copy(), "y": i}


class _Gate:
    def __init__(self, go: str, wait: float) -> None:
        self.go, self.wait = go, wait

    def __reduce__(self) -> tuple[object, ...]:
        return _wait_for, (self.go, self.wait)


def _wait_for(go: str, wait: float) -> tuple[str, float]:
    wait_until(lambda: os.path.exists(go), f"{go} to be made", wait)
    return go, wait


def _ungate(gate: tuple[str, float], n: int, payload: np.ndarray) -> Gated:
    ds = Gated.__new__(Gated)
    Arrays.__init__(ds, n, (4,), "uint8")
    ds.go, ds.wait = gate
    ds.payload = payload
    return ds


class Keys:
    """Indexed by anything hashable: returns the index it was given, and its type's name."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, key: object) -> tuple[str, str]:
        return repr(key), type(key).__name__
