"""Where a loader's time goes: ``loader.stats()``, and the same figures for ``shmshare stat``.

Note [Where the time goes]
    Each worker keeps its totals: seconds in fetching samples
    (``__getitem__``, ``__getitems__`` or ``next()`` of an iterable dataset),
    in collating them, and in sending the batch. Sending includes waiting for
    room: in its pool while the program holds the batches, or on its socket
    while the main process is not taking them. It also keeps the times of its
    start-up phases. The totals ride on each batch it sends (a few numbers)
    and the phases on its first batch, so nothing is asked for and nothing
    waits. The main process adds its own: seconds ``iter()`` spent starting
    the workers, seconds waiting in ``next()`` for a batch that has not
    come, the batches yielded, and the bytes in flight (the pool bytes that
    the main process holds: batches on their way, waiting their turn, or
    kept by the program). An input-bound run shows a
    ``wait_fraction`` near 1, with workers busy fetching. A run bound by the
    program shows workers waiting for room and the main process hardly
    waiting at all. The figures of a batch still being made come with the
    next batch.

    The iterator registers with ``_registry`` ("loaders"), so a process
    serving stats (``SHMSHARE_STATS=1``) shows its loaders in ``shmshare stat``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["LoaderStats", "WorkerStats", "WorkerClock", "process_start", "report"]

_HELD_EVERY = 0.2  # s between a worker's looks at the bytes the main process holds of its pool


@dataclass(frozen=True)
class WorkerStats:
    """One worker's totals (seconds), as its last batch reported them."""

    worker_id: int
    pid: int | None
    batches: int  # batches it sent (this iterator)
    fetch_s: float  # fetching samples: the dataset's own time
    collate_s: float  # collating them into the batch
    send_s: float  # sending: mostly waiting for room (its pool full of held batches, or its socket)
    bytes_held: int  # its pool's bytes the main process holds (in flight, waiting, kept)
    startup: tuple[tuple[str, float], ...]  # (phase, seconds after iter() began) in order


@dataclass(frozen=True)
class LoaderStats:
    """What a loader's current (or last) iterator spent; ``loader.stats()``."""

    num_workers: int
    batches: int  # yielded to the program this epoch
    elapsed_s: float  # since the iterator began
    start_s: float  # of which iter() spent starting the workers (under spawn: until they were forked)
    wait_s: float  # the main process waiting for batches: start_s, and in next() for one not yet there
    wait_fraction: float  # wait_s / elapsed_s: near 1, the input pipeline is the bottleneck
    bytes_in_flight: int  # pool bytes of all workers the main process holds
    batches_waiting: int  # received, not yet yielded (they wait for an earlier one, in order)
    workers: tuple[WorkerStats, ...]

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (JSON-able), as ``shmshare stat --json`` shows it."""
        out = dict(self.__dict__)
        out["workers"] = [dict(w.__dict__, startup=[list(p) for p in w.startup]) for w in self.workers]
        return out


class WorkerClock:
    """A worker's totals, and its start-up phases (wall clock, from ``time.time()``)."""

    __slots__ = ("batches", "fetch", "collate", "send", "phases", "sent_phases", "held", "held_at")

    def __init__(self, phases: list[tuple[str, float]]) -> None:
        self.batches = 0
        self.fetch = self.collate = self.send = 0.0
        self.phases = phases
        self.sent_phases = False
        self.held = 0
        self.held_at = -_HELD_EVERY

    def timed(self, collate: Any) -> Any:
        """`collate`, with its time added to ``collate`` (and so taken out of the fetch's)."""
        def run(data: Any) -> Any:
            t = time.perf_counter()
            try:
                return collate(data)
            finally:
                self.collate += time.perf_counter() - t
        return run

    def note(self, tx: Any) -> list[Any]:
        """What the next batch carries: [batches, fetch, collate, send, held, phases or None]. The
        bytes held are asked of the sender at most every _HELD_EVERY s (the books cost ~0.1 ms)."""
        phases = None
        if not self.sent_phases:
            phases, self.sent_phases = [list(p) for p in self.phases], True
        now = time.monotonic()
        if self.batches <= 8 or now - self.held_at >= _HELD_EVERY:  # (an epoch's first batches: always)
            self.held, self.held_at = int(tx.statistics().bytes_leased), now
        return [self.batches, self.fetch, self.collate, self.send, self.held, phases]


def process_start() -> float:
    """This process's start (wall clock, to a clock tick: 10 ms), from /proc; now if /proc does not say."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22: since boot, in ticks
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def report(progress: Any) -> dict[str, Any] | None:
    """The registry's reporter (Note [Reporters]): a loader's stats as a dict."""
    stats = progress.stats()
    return None if stats is None else dict(stats.as_dict(), pid=os.getpid())
