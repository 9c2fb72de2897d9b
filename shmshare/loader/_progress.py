"""Where an iterator's epoch is, kept by the main process for ``state_dict()`` (Note [Resuming mid-epoch]).

A ``Progress`` is small and outlives its iterator: the loader holds the last
one, so ``loader.state_dict()`` works between epochs and after the program
dropped the iterator, without keeping workers alive.
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any

from . import _resume as r
from ._stats import LoaderStats, WorkerStats

__all__ = ["Progress", "check_layout"]


class Progress:
    """What the last yielded batch leaves: counts, the sampler's state then, and each worker's state."""

    def __init__(self, num_workers: int, base_seed: int | None, len_called: int | None) -> None:
        self.num_workers = num_workers
        self.base_seed = base_seed
        self.len_called = len_called
        self.num_yielded = 0
        self.drawn = 0  # num_workers=0: indices drawn
        self.finished = False
        self.main: tuple[Any, Any, int] = (None, None, 0)  # sampler iter state, index sampler state, draws
        self.last_worker = num_workers - 1  # torchdata's value before any batch
        # per worker: as Capturer.snapshot() made it, or a loaded snapshot (a dict) until the worker sends a batch
        self.snaps: list[Any] = [None] * num_workers
        self.batches = [0] * num_workers  # batches each worker made this epoch, the yielded ones
        self.live: Any = None  # num_workers=0: a function giving the single-process state now
        self.single: dict[str, Any] | None = None  # ... or as the last batch returned left it (device=)
        # Note [Where the time goes] in _stats.py
        self.began = time.time()
        self.began_clock = time.perf_counter()
        self.wait_s = 0.0  # in next(), for a batch not yet there
        self.start_s = 0.0  # in iter(), starting the workers
        self.notes: list[list[Any] | None] = [None] * num_workers  # each worker's last totals
        self.phases: list[list[Any]] = [[] for _ in range(num_workers)]
        self.pids: list[int | None] = [None] * num_workers
        self.waiting: Any = None  # a weak method counting batches received, not yet yielded

    def __getstate__(self) -> dict[str, Any]:
        """A pickled loader carries where it was, not the live iterator's hooks (a weak method, a closure)."""
        state = dict(self.__dict__)
        if state["live"] is not None:  # num_workers=0: the state now, kept as it is
            state["live"] = functools.partial(r.copied, state["live"]())
        state["waiting"] = None
        return state

    def noted(self, worker: int, note: Any) -> None:
        """A worker's totals came with a batch (and its start-up phases with its first)."""
        if type(note) is list and len(note) == 6:
            self.notes[worker] = note
            if note[5] is not None:
                self.phases[worker] = note[5]

    def stats(self) -> LoaderStats:
        """The figures of Note [Where the time goes], now."""
        elapsed = time.perf_counter() - self.began_clock
        workers = []
        for i in range(self.num_workers):
            note = self.notes[i] or [0, 0.0, 0.0, 0.0, 0, None]
            startup = tuple((str(name), float(t) - self.began) for name, t in self.phases[i])
            workers.append(WorkerStats(i, self.pids[i], int(note[0]), float(note[1]), float(note[2]),
                                       float(note[3]), int(note[4]), startup))
        count = self.waiting() if self.waiting is not None else None
        return LoaderStats(self.num_workers, self.num_yielded, elapsed, self.start_s, self.wait_s,
                           self.wait_s / elapsed if elapsed > 0 else 0.0, sum(w.bytes_held for w in workers),
                           int(count() if count is not None else 0), tuple(workers))

    def watch(self, it: Any) -> None:
        """Count `it`'s waiting batches while it lives (no strong reference: the loader keeps this)."""
        self.waiting = weakref.WeakMethod(it._count_waiting)

    def new_epoch(self, len_called: int | None, snaps: list[Any] | None = None) -> None:
        """A persistent iterator's next epoch: the workers' states as they reported them at its start."""
        self.len_called = len_called
        self.num_yielded = 0
        self.finished = False
        self.last_worker = self.num_workers - 1
        self.snaps = snaps if snaps is not None else [None] * self.num_workers
        self.batches = [0] * self.num_workers
        self.began, self.began_clock, self.wait_s, self.start_s = time.time(), time.perf_counter(), 0.0, 0.0
        self.notes = [None] * self.num_workers  # (the workers start their totals afresh too)

    def yielded(self, worker: int, snap: Any, main: tuple[Any, Any, int]) -> None:
        """A batch from `worker` is given to the program: its state becomes the one to resume from."""
        self.last_worker = worker
        self.snaps[worker] = snap
        self.batches[worker] += 1
        self.main = main

    def state_dict(self) -> dict[str, Any]:
        """torchdata's layout: flat with no workers; ``_snapshot`` and two keys with them."""
        if self.live is not None:
            state = self.live() if self.single is None else dict(self.single, **{r.NUM_YIELDED: self.num_yielded})
            state[r.ITERATOR_FINISHED] = self.finished
            return r.copied(state)
        sampler_state, index_state, drawn = self.main
        main = {r.NUM_WORKERS: self.num_workers, r.SAMPLER_ITER_STATE: sampler_state,
                r.INDEX_SAMPLER_STATE: index_state, r.SAMPLER_ITER_YIELDED: drawn,
                r.LEN_CALLED: self.len_called, r.SHARED_SEED: None, r.BASE_SEED: self.base_seed}
        workers = {f"worker_{i}": r.worker_snapshot(i, self.snaps[i], self.batches[i])
                   for i in range(self.num_workers)}
        return r.copied({
            r.SNAPSHOT: {r.SNAPSHOT_STEP: self.num_yielded, r.LAST_WORKER: self.last_worker,
                         r.MAIN_SNAPSHOT: main, r.WORKER_SNAPSHOTS: workers},
            r.STEPS_SINCE: 0,
            r.ITERATOR_FINISHED: self.finished,
        })


def check_layout(state: Any, num_workers: int) -> None:
    """Refuse a state that is no loader state, or one saved with another number of workers."""
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict() takes the dict state_dict() returned, not {type(state).__name__}")
    if num_workers == 0:
        if r.NUM_YIELDED not in state:
            saved = _saved_workers(state)
            raise ValueError(f"this state was saved by a loader with num_workers={saved}; this loader has "
                             "num_workers=0. A state resumes only with the number of workers that saved it "
                             f"(make the loader with num_workers={saved})" if saved is not None else
                             f"not a loader state: no {r.NUM_YIELDED!r} key (a num_workers=0 state has one)")
        return
    snap = state.get(r.SNAPSHOT)
    if not isinstance(snap, dict):
        if r.NUM_YIELDED in state:
            raise ValueError(f"this state was saved by a loader with num_workers=0; this loader has "
                             f"num_workers={num_workers}. A state resumes only with the number of workers "
                             "that saved it (make the loader with num_workers=0)")
        raise ValueError(f"not a loader state: no {r.SNAPSHOT!r} dict (a state with workers has one)")
    try:
        main, workers = snap[r.MAIN_SNAPSHOT], snap[r.WORKER_SNAPSHOTS]
        saved = main[r.NUM_WORKERS]
        for key in (r.SNAPSHOT_STEP, r.LAST_WORKER):
            snap[key]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a loader state: its {r.SNAPSHOT!r} lacks {exc}") from None
    if type(saved) is not int:
        raise ValueError(f"not a loader state: its {r.NUM_WORKERS!r} is {saved!r}, not an int")
    if saved != num_workers:
        raise ValueError(f"this state was saved by a loader with num_workers={saved}; this loader has "
                         f"num_workers={num_workers}. A state resumes only with the number of workers that "
                         f"saved it (make the loader with num_workers={saved})")
    if not isinstance(workers, dict) or sorted(workers) != sorted(f"worker_{i}" for i in range(num_workers)):
        shown = sorted(workers) if isinstance(workers, dict) else workers
        raise ValueError(f"the state's worker snapshots are {shown!r}, not worker_0 .. worker_{num_workers - 1}")
    _check_counts(state, snap, main, num_workers)
    for name, w in workers.items():
        if not isinstance(w, dict):
            raise ValueError(f"the state's {name} snapshot is a {type(w).__name__}, not a dict")
        batches = w.get(r.BATCHES, 0)
        if type(batches) is not int or batches < 0:
            raise ValueError(f"the state's {name} {r.BATCHES!r} is {batches!r}, not a count")
        if w.get(r.RNG) is not None:
            r.check_rng(w[r.RNG], f"the state's {name}")


def _check_counts(state: dict[str, Any], snap: dict[str, Any], main: dict[str, Any], num_workers: int) -> None:
    """The numbers a state with workers holds: counts that are counts, a seed a worker can be seeded with."""
    seed = main.get(r.BASE_SEED)
    if type(seed) is not int or not 0 <= seed < 1 << 64:
        raise ValueError(f"not a loader state: its {r.BASE_SEED!r} is {seed!r}, not a 64-bit seed")
    for where, key, top in ((snap, r.SNAPSHOT_STEP, None), (state, r.STEPS_SINCE, None),
                            (snap, r.LAST_WORKER, num_workers), (main, r.SAMPLER_ITER_YIELDED, None)):
        value = where.get(key, 0) or 0
        if type(value) is not int or value < 0 or (top is not None and value >= top):
            bound = f" below {top}" if top is not None else ""
            raise ValueError(f"not a loader state: its {key!r} is {value!r}, not a count{bound}")


def _saved_workers(state: dict[str, Any]) -> int | None:
    try:
        return int(state[r.SNAPSHOT][r.MAIN_SNAPSHOT][r.NUM_WORKERS])
    except (KeyError, TypeError, ValueError):
        return None
