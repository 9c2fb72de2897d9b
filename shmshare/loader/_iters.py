"""The loader's iterator over a pool of workers (``_iter_base.py`` has the one with none).

The multi-process iterator follows torch's ``_MultiProcessingDataLoaderIter``
(``torch/utils/data/dataloader.py``) in everything a program can observe:
tasks go to workers round-robin, at most ``prefetch_factor`` per worker in
flight, batches come back in order (a batch that arrives early waits in
``_task_info``) or as they come with ``in_order=False``, an exhausted
IterableDataset worker is skipped from then on, an exception raised in a
worker is re-raised here (and iteration can go on), and persistent workers
start each new epoch with a resume message. What differs is the way a batch
travels (Note [A worker's one socket] in ``_worker.py``) and what a dead
worker costs: its socket's end is seen at once, its exit code within
``_CHECK_EVERY`` s, and the error is torch's.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from .. import _registry, wire
from .._errors import FdLimitError, PeerDied, PeerRefused, ProtocolError, SegmentError, ShmshareTimeout
from ..channel import Receiver
from . import _resume as r
from ._batch import unpack
from ._iter_base import BaseIter, SingleProcessIter, replay_index
from ._pin import pin_by_copy
from ._starting import close_sentinel, pickle_hint, start_one
from ._stats import report
from ._worker import WorkerSpec
from ._zygote import can_fork_from_one, start_zygote

__all__ = ["SingleProcessIter", "MultiProcessIter", "close_inherited"]

_CHECK_EVERY = 0.1  # s: a wait for a batch looks this often whether a worker died
_JOIN_WAIT = 5.0  # s shutdown waits for the workers to exit, then terminates them
_EXIT_WAIT = 1.0  # s to wait for the exit code of a worker whose socket ended
_INT64 = (-(1 << 63), 1 << 63)
_PART = 8192  # ints (at most 9 bytes each in msgpack) or pickle bytes in one note: < wire.MAX_FRAME

_live: weakref.WeakSet[MultiProcessIter] = weakref.WeakSet()


def close_inherited() -> None:
    """In a forked worker: close the main process's loader sockets (never the worker's to use)."""
    for it in list(_live):
        it._close_in_child()


class MultiProcessIter(BaseIter):
    """Workers collating into their pools; batches arrive as leases on those pools."""

    def __init__(self, loader: Any, state: dict[str, Any] | None = None) -> None:
        if loader.prefetch_factor <= 0:  # before anything that holds resources is made
            raise AssertionError("prefetch_factor must be greater than 0 for "
                                 "MultiProcessingDataLoaderIter")
        super().__init__(loader, state)
        resumes: list[Any] = [None] * self._num_workers
        self._replay = 0  # batches to take again after starting (a torchdata state of another kind)
        if state is not None and self._iterable and r.stateless_iterable(state):
            self._replay = int(state[r.SNAPSHOT][r.SNAPSHOT_STEP])  # torchdata's: again from the start
        elif state is not None:
            snap = state[r.SNAPSHOT]
            self._base_seed = self._progress.base_seed = int(snap[r.MAIN_SNAPSHOT][r.BASE_SEED])
            resumes = [snap[r.WORKER_SNAPSHOTS][f"worker_{i}"] for i in range(self._num_workers)]
        self._rng_seen: list[bytes | None] = [None] * self._num_workers  # each worker's RNG state, last sent
        self._task_main: dict[int, tuple[Any, Any, int]] = {}  # task -> the sampler's state once drawn
        self._prefetch_factor: int = loader.prefetch_factor
        self._in_order = loader.in_order
        self._owner = os.getpid()
        self._shutdown = False
        self._failed: BaseException | None = None
        ctx = loader.multiprocessing_context or multiprocessing.get_context()
        self._workers: list[Any] = []
        conns: list[wire.Connection] = []
        self._conns = conns  # our ends: a worker forked while they are made closes them too
        self._rx: Receiver | None = None
        _live.add(self)
        self._zygote: Any = None  # spawn, forkserver: the process the workers are forked from
        ends: list[wire.Connection] = []  # the workers' ends, until they are started
        try:
            specs = []
            for i in range(self._num_workers):
                a, b = wire.pipe()
                a._role, b._role = "sender", "receiver"
                conns.append(b)
                ends.append(a)
                specs.append(WorkerSpec(self._iterable, self._dataset, self._auto_collation,
                                        self._collate_fn, self._drop_last, self._base_seed,
                                        loader.worker_init_fn, i, self._num_workers, self._use_torch,
                                        loader._pool_limit, resumes[i], replay_index(loader)))
            with pickle_hint():
                if (loader.worker_start == "one" and self._num_workers > 1 and ctx.get_start_method() != "fork"
                        and can_fork_from_one()):  # (one worker: the zygote would only add a fork)
                    self._zygote = start_zygote(ctx, ends, specs)  # Note [Workers forked from one process]
                    self._workers.extend(self._zygote.workers)
                else:
                    for a, spec_i in zip(ends, specs, strict=True):
                        self._workers.append(start_one(ctx, a, spec_i))
            self._rx = Receiver(conns, writable=True, pin=self._pinner)
            self._progress.pids = [w.pid for w in self._workers]
            self._progress.start_s = time.perf_counter() - self._progress.began_clock
            self._progress.wait_s += self._progress.start_s  # waiting for workers is waiting for batches
            self._progress.watch(self)
            _registry.register("loaders", self._progress, report)
        except BaseException:
            for a in ends:
                a.close()  # (those handed to a worker are closed already)
            if self._rx is None:
                for c in conns:
                    c.close()
            self._shutdown_workers()
            raise
        self._reset(loader, first_iter=True, state=None if self._replay else state)
        if state is not None:
            for _ in range(self._replay + int(state.get(r.STEPS_SINCE) or 0)):  # as torchdata replays
                try:
                    next(self)
                except StopIteration:  # (the epoch had fewer batches: it is over)
                    break
            self._progress.finished = bool(state.get(r.ITERATOR_FINISHED))

    # -- epochs ------------------------------------------------------------------

    def _reset(self, loader: Any, first_iter: bool = False, state: dict[str, Any] | None = None) -> None:
        super()._reset(loader, first_iter)
        self._send_idx = 0  # the next task to hand out
        self._rcvd_idx = 0  # the next task to return
        self._task_info: dict[int, tuple[Any, ...]] = {}  # task -> (worker,) or (worker, message)
        self._task_main.clear()
        self._tasks_outstanding = 0
        n = self._num_workers
        self._workers_status = [True] * n
        self._workers_num_tasks = [0] * n
        self._worker_cycle = itertools.cycle(range(n))
        if state is not None:
            self._resume_main(state)
        if not first_iter:
            if self._failed is not None:
                self._shutdown_workers()  # a persistent loader's iterator that failed
                raise self._failed
            for i in range(n):
                self._tell(i, ["r", 0])
            waiting = n
            snaps: list[Any] = [None] * n
            while waiting:  # batches of the last epoch still coming are dropped
                worker, msg = self._get_data()
                if msg[1] == "r":
                    waiting -= 1
                    snaps[worker] = snap = msg[4]
                    if snap is not None and type(snap[1]) is int:  # a big dataset state, in the pool
                        snap[1] = msg[3].pop().tobytes()
            self._progress.new_epoch(self._len_called, snaps)
        if state is None:  # the epoch's start, before any draw: a state_dict() now resumes at it, in this epoch
            self._progress.main = (r.state_of(self._sampler_iter), r.state_of(self._index_sampler), 0)
        self._unordered: tuple[set[int], tuple[Any, Any, int]] = (set(), self._progress.main)
        self._unordered_next = 0
        self._iter_stateful = r.stateful(self._sampler_iter)
        self._index_stateful = r.stateful(self._index_sampler)
        for _ in range(self._prefetch_factor * n):
            self._try_put_index()

    def _resume_main(self, state: dict[str, Any]) -> None:
        """Where the saved epoch was: the sampler, the counts, the worker the next batch comes from."""
        snap = state[r.SNAPSHOT]
        main = snap[r.MAIN_SNAPSHOT]
        self._sampler_iter, self._drawn = r.restore_sampler(self._index_sampler, main)
        p = self._progress
        self._num_yielded = p.num_yielded = int(snap[r.SNAPSHOT_STEP])
        self._len_called = p.len_called = main.get(r.LEN_CALLED)
        p.main = (main.get(r.SAMPLER_ITER_STATE), main.get(r.INDEX_SAMPLER_STATE), self._drawn)
        p.last_worker = int(snap[r.LAST_WORKER]) % self._num_workers
        for i in range(self._num_workers):
            w = snap[r.WORKER_SNAPSHOTS][f"worker_{i}"]
            p.snaps[i] = w
            p.batches[i] = int(w.get(r.BATCHES) or 0)
        for _ in range(p.last_worker + 1):  # the next task goes to the worker after the last one's
            next(self._worker_cycle)

    # -- batches -----------------------------------------------------------------

    def _next_data(self) -> Any:
        if self._failed is not None:
            self._shutdown_workers()  # told to stop when it failed: now they are reaped
            raise self._failed
        while True:
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx)
                if info:
                    if len(info) == 2 or self._workers_status[info[0]]:
                        break  # it arrived, or its worker may still send it
                    del self._task_info[self._rcvd_idx]  # its worker ran out
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            if len(self._task_info[self._rcvd_idx]) == 2:
                worker, msg = self._task_info.pop(self._rcvd_idx)
                self._rcvd_idx += 1
                return self._process(msg, worker)
            if self._shutdown or self._tasks_outstanding <= 0:
                raise AssertionError("Invalid iterator state: shutdown or no outstanding tasks when "
                                     "fetching next data")
            worker, msg = self._get_data()
            self._tasks_outstanding -= 1
            idx = msg[0]
            if msg[1] == "t":  # an IterableDataset worker ran out
                if self._persistent_workers:
                    self._workers_status[worker] = False
                else:
                    self._mark_unavailable(worker)
                self._try_put_index()
                continue
            if idx != self._rcvd_idx:
                if not self._in_order:
                    self._task_info.pop(idx)
                    return self._process(msg, worker)
                self._task_info[idx] += (msg,)
            else:
                self._task_info.pop(idx)
                self._rcvd_idx += 1
                return self._process(msg, worker)

    def _process(self, msg: list[Any], worker: int) -> Any:
        rx = self._rx
        if rx is not None:
            # Batches dropped since the last one go back before the next task does (the worker
            # takes them in before it collates: Note [Releases before tasks] in _worker.py);
            # pinned ones only once their fences complete.
            rx.fence_releases()
            rx.flush_releases()
        self._workers_num_tasks[worker] -= 1
        self._try_put_index()
        payload, arrays = msg[2], msg[3]
        if payload is None:  # a big pickle, in the pool: the last array
            payload = arrays.pop().tobytes()
        snap = msg[4]
        if snap is not None and type(snap[1]) is int:  # a big dataset state, in the pool: the array before
            snap[1] = arrays.pop().tobytes()
        if msg[1] == "e":
            pickle.loads(payload).reraise()
        task = msg[0]
        if self._in_order:
            self._pending = (worker, msg[4], self._task_main.pop(task, None) or self._progress.main)
            if len(self._task_main) > 2 * self._prefetch_factor * self._num_workers:  # skipped tasks' states
                for stale in [t for t in self._task_main if t < task]:
                    del self._task_main[stale]
        else:
            self._pending = (worker, msg[4], self._unordered_main(task))
        if self._copier is not None:
            return self._on_device(payload, arrays)
        data = unpack(payload, arrays)
        return pin_by_copy(data) if self._pin_memory else data

    def _unordered_main(self, task: int) -> tuple[Any, Any, int]:
        """in_order=False: the sampler's state after every task before the first one not yet yielded.

        A resumed run then draws again from there: it yields again the batches that came out of order
        before the state was taken, rather than losing those still in flight (state_dict() warns)."""
        done, main = self._unordered
        done.add(task)
        while self._unordered_next in done:
            done.discard(self._unordered_next)
            main = self._task_main.pop(self._unordered_next, main)
            self._unordered_next += 1
        self._unordered = (done, main)
        return main

    def _try_put_index(self) -> None:
        max_tasks = self._prefetch_factor * self._num_workers
        if self._tasks_outstanding >= max_tasks:
            raise AssertionError("Number of outstanding tasks exceeded maximum allowed tasks")
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):  # the next active worker, if any
            worker = next(self._worker_cycle)
            if self._workers_status[worker] and (
                    self._in_order
                    or self._workers_num_tasks[worker] < max_tasks // sum(self._workers_status)):
                break
        else:
            return
        self._tell_task(worker, self._send_idx, index if _plain(index) else pickle.dumps(index))
        it: Any = self._sampler_iter
        self._task_main[self._send_idx] = (it.state_dict() if self._iter_stateful else None,
                                           self._index_sampler.state_dict() if self._index_stateful else None,
                                           self._drawn)
        self._task_info[self._send_idx] = (worker,)
        self._workers_num_tasks[worker] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _tell_task(self, worker: int, task: int, index: Any) -> None:
        """Send a task; an index too big for one frame (a huge batch) goes in parts before it."""
        size = len(index) if type(index) in (list, bytes) else 0
        if size > _PART:
            *heads, index = [index[at:at + _PART] for at in range(0, size, _PART)]
            for head in heads:
                self._tell(worker, ["p", task, head])
        self._tell(worker, ["i", task, index])

    def _tell(self, worker: int, note: list[Any]) -> None:
        assert self._rx is not None
        try:
            self._rx.tell(worker, note)
        except PeerDied as exc:
            self._fail(worker, exc)

    def _get_data(self) -> tuple[int, list[Any]]:
        """Return (worker, message): the next thing a worker sent; raise as torch does."""
        began = time.perf_counter()
        try:
            return self._wait_data()
        finally:
            self._progress.wait_s += time.perf_counter() - began

    def _count_waiting(self) -> int:
        return sum(len(info) == 2 for info in list(self._task_info.values()))

    def _wait_data(self) -> tuple[int, list[Any]]:
        assert self._rx is not None
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            step = _CHECK_EVERY if deadline is None else min(_CHECK_EVERY,
                                                             max(0.0, deadline - time.monotonic()))
            try:
                worker, msg = self._rx.recv_from(timeout=step)
                if type(msg) is not list or len(msg) < 2 or (msg[1] in ("d", "e", "r") and (
                        len(msg) != 6 or not _snap_ok(msg[4]))):
                    raise RuntimeError(f"DataLoader worker {worker} sent a malformed message")
                snap = msg[4] if len(msg) == 6 else None
                if len(msg) == 6 and msg[5] is not None:
                    self._progress.noted(worker, msg[5])
                if snap is not None:  # its RNG state comes only when it changed (Capturer in _resume.py)
                    if snap[0] is None:
                        snap[0] = self._rng_seen[worker]
                    else:
                        self._rng_seen[worker] = snap[0]
                return worker, msg
            except ShmshareTimeout:
                self._check_workers()
                if deadline is not None and time.monotonic() >= deadline:
                    raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds") from None
            except (ProtocolError, FdLimitError, SegmentError, PeerRefused) as exc:
                # a batch this process could not take in (a full fd table, no address space):
                # the receiver dropped its worker, so this epoch cannot be whole any more
                bad = getattr(exc, "sender", None)
                pid = self._workers[bad].pid if isinstance(bad, int) else "?"
                exc.add_note(f"shmshare: receiving a batch from DataLoader worker {bad} (pid {pid}); "
                             "the loader stops its workers")
                self._failed = exc
                self._tell_all_to_stop()  # and raise now (Note [Raise first, reap after])
                raise
            except PeerDied as exc:
                who: int | None = getattr(exc, "sender", None)
                if who is None:  # the last one left: see which
                    self._check_workers(wait=_EXIT_WAIT)
                    self._fail(None, exc)
                self._fail(who, exc)

    def _check_workers(self, wait: float = 0.0) -> None:
        for i, w in enumerate(self._workers):
            if self._workers_status[i] or self._persistent_workers:
                if wait:
                    w.join(wait)
                if w.exitcode is not None:
                    self._fail(i, None)

    def _death_of(self, worker: int) -> RuntimeError | None:
        w = self._workers[worker]
        w.join(_EXIT_WAIT)  # its socket ended: its exit code follows
        code = w.exitcode
        if code is None:
            return RuntimeError(f"DataLoader worker (pid {w.pid}) closed its connection to the "
                                "main process unexpectedly")
        if code < 0:
            name = signal.strsignal(-code) or f"signal {-code}"
            msg = f"DataLoader worker (pid {w.pid}) is killed by signal: {name}. "
            if -code == signal.SIGBUS:
                msg += ("It is possible that dataloader's workers are out of shared memory. "
                        "Please try to raise your shared memory limit.")
            return RuntimeError(msg)
        if code > 0:
            return RuntimeError(f"DataLoader worker (pid {w.pid}) exited unexpectedly with exit code "
                                f"{code}. Details are lost due to multiprocessing. Rerunning with "
                                "num_workers=0 may give better error trace.")
        return None  # exited 0 without being told to: "exited unexpectedly" says it all

    def _fail(self, worker: int | None, cause: BaseException | None) -> NoReturn:
        """A worker died: raise now and on every later call; tell the others to stop.

        As torch's loader does when its SIGCHLD handler fires during a wait: a
        RuntimeError that the worker "exited unexpectedly", caused by what its
        exit status says ("... is killed by signal: Killed.", "... exited
        unexpectedly with exit code 1. ...").

        Note [Raise first, reap after]
            The other workers are told to stop (a note sent with timeout=0)
            but not joined here: one busy in a slow ``__getitem__`` would
            hold the error back for _JOIN_WAIT. torch's ``_try_get_data``
            raises the same way, marking the dead worker unavailable without
            joining it, and joins in ``_shutdown_workers``: here that runs at
            the next ``next()`` (which then raises the same error), on
            ``loader.close()``, and when the iterator is collected. A worker
            that finishes its task reads the note and exits before that; one
            that does not is terminated after _JOIN_WAIT, as at any shutdown.
        """
        if worker is None:
            top = RuntimeError("DataLoader workers exited unexpectedly")
            top.__cause__ = cause
        else:
            top = RuntimeError(f"DataLoader worker (pid(s) {self._workers[worker].pid}) exited "
                               "unexpectedly")
            why = self._death_of(worker)
            if why is not None:
                why.__cause__ = cause
                top.__cause__ = why
            else:
                top.__cause__ = cause
        self._failed = top
        self._tell_all_to_stop()
        raise top

    def _mark_unavailable(self, worker: int) -> None:
        self._workers_status[worker] = False
        self._tell_stop(worker)

    def _tell_all_to_stop(self) -> None:
        """After a failure: every worker is told to stop, without waiting on any."""
        for i in range(len(self._workers)):
            self._workers_status[i] = False
            self._tell_stop(i)

    def _tell_stop(self, worker: int) -> None:
        if self._rx is None:
            return
        try:
            self._rx.tell(worker, ["s"], timeout=0)
        except (PeerDied, ShmshareTimeout, OSError, ValueError):
            pass  # gone already, or too busy to hear it: shutdown ends it

    # -- the end -----------------------------------------------------------------

    def _shutdown_workers(self) -> None:
        if self._shutdown or os.getpid() != self._owner or sys.is_finalizing():
            return
        self._shutdown = True
        rx = self._rx
        try:
            for i in range(len(self._workers)):
                self._tell_stop(i)  # dead, or not reading: it is terminated below
            # Our ends go before the joins: a worker waiting for pool room (the program holds
            # its batches) or for room on its socket sees the end now, not after _JOIN_WAIT.
            if self._copier is not None:
                self._copier.close()  # its copies are done before the blocks go back
            if rx is not None:
                rx.close()  # batches still held stay valid: their mappings go with them
            end = time.monotonic() + _JOIN_WAIT
            for w in self._workers:
                w.join(max(0.0, end - time.monotonic()))
        finally:
            self._finish_shutdown(rx)

    def _finish_shutdown(self, rx: Receiver | None) -> None:
        """Whatever failed before (a device error in close): end every worker, close everything."""
        for w in self._workers:
            if w.is_alive():
                w.terminate()
                w.join(_EXIT_WAIT)
            if w.is_alive():
                w.kill()
                w.join()
        error: Exception | None = None
        steps: list[Callable[[], None]] = [c.close for c in (self._copier, rx, self._pinner)
                                           if c is not None]
        steps += [functools.partial(close_sentinel, w) for w in self._workers]
        if self._zygote is not None:
            steps.append(self._zygote.close)
        for close in steps:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - the rest must close all the same
                error = error or exc
        if error is not None:
            raise error

    def _close_in_child(self) -> None:
        if os.getpid() == self._owner:
            return
        if self._rx is not None:
            self._rx.close()
            self._rx = None
        for c in self._conns:  # made before the receiver, or while workers were started
            c.close()

    def __del__(self) -> None:
        if getattr(self, "_owner", None) is not None:
            self._shutdown_workers()


def _snap_ok(snap: Any) -> bool:
    """Whether a worker's snapshot is as Capturer.snapshot() makes it: None, or [bytes | None, bytes | int | None]."""
    return snap is None or (type(snap) is list and len(snap) == 2 and (snap[0] is None or type(snap[0]) is bytes)
                            and (snap[1] is None or type(snap[1]) in (bytes, int)))


def _plain(index: Any) -> bool:
    """Whether `index` goes as msgpack: an int64, or a list of them (anything else is pickled)."""
    lo, hi = _INT64
    if type(index) is int:
        return lo <= index < hi
    return type(index) is list and all(type(i) is int and lo <= i < hi for i in index)
