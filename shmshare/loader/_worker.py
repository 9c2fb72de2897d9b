"""A loader worker: takes tasks from the main process, fetches and collates into its pool, sends.

Note [A worker's one socket]
    Each worker has one connection to the main process, a channel: batches
    go out as the channel sends arrays (leases on the worker's pool blocks),
    and tasks come in the other way as notes (``Receiver.tell``,
    ``Sender.recv_note``), beside the releases that give blocks back. So the
    main process holds, per worker, that socket and the process's sentinel,
    whatever the number of batches in flight.

Note [Releases before tasks]
    The main process sends the releases of the batches the program dropped
    before it sends the next task (``Receiver.flush_releases``), and
    ``recv_note`` takes in every release queued ahead of a note. So when a
    worker collates, the block of the batch dropped last is already back in
    its pool, and is reused: a worker's pool holds the batches in flight and
    the one the program holds, not one more for a release still on its way.

Messages (notes are msgpack; a batch is a channel batch of a list)::

    main -> worker   ["i", task, index]      fetch `index` (an int or list of ints as is,
                     ["i", task, b"pickle"]   any other index pickled)
                     ["p", task, part]       a part of the next "i"'s index (list or bytes):
                                             one frame holds at most 128 KiB
                     ["r", epoch]            a new epoch (persistent workers): fresh fetcher
                     ["s"]                   stop
    worker -> main   [task, "d", pickle, [arrays], snap, note]  a batch (Note [Batches as pickles ...]),
                                                      the worker's state after it (Note [Resuming
                                                      mid-epoch] in _resume.py) and its totals
                                                      (Note [Where the time goes] in _stats.py)
                     [task, "e", pickle, [], None, None]        an exception (a WorkerError)
                     [task, "d"|"e", None, [..., p], s, n]      the same, its pickle `p` (uint8) in
                                                                the pool: a big one (past 32 KiB)
                     [task, "t"]                                an IterableDataset ran out
                     [-1, "r", b"", [], snap, None]             the new epoch began, from this state
"""

from __future__ import annotations

import functools
import mmap
import os
import pickle
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import wire
from .._errors import PeerDied, ProtocolError, ShmshareTimeout
from .._fd import Fd
from .._lifetime import Closeable
from ..channel import Sender
from . import _collate, _pool, _resume, _stats
from ._batch import pack
from ._fetch import make_fetcher
from ._seeding import seed_worker
from ._wrap import capture

__all__ = ["WorkerSpec", "SpecHandoff", "WorkerInfo", "worker_main", "get_worker_info",
           "WATCH_INTERVAL"]

WATCH_INTERVAL = 1.0  # s between a waiting worker's looks at whether its parent is alive
_INLINE = 32 << 10  # bytes of a batch's pickle sent in its frame; more go through the pool


@dataclass(frozen=True)
class WorkerInfo:
    """What ``get_worker_info()`` tells a worker (torch's ``WorkerInfo`` when torch is in use)."""

    id: int
    num_workers: int
    seed: int
    dataset: Any
    rng: Any = None
    worker_method: str | None = "multiprocessing"


_info: Any = None
# this process's start-up, (phase, wall clock) in order (Note [Where the time goes] in _stats.py); a worker
# forked by the zygote inherits the zygote's and adds its fork
_phases: list[tuple[str, float]] = []
_parent: int | None = None  # a worker forked by the zygote: the zygote's pid, set before the worker runs


def get_worker_info() -> Any:
    """Return this worker's WorkerInfo in a loader worker, None in the main process.

    With torch in use, it is the object ``torch.utils.data.get_worker_info()``
    returns there too.
    """
    return _info


@dataclass
class WorkerSpec:
    """Everything a worker is started with (pickled under spawn and forkserver)."""

    iterable: bool
    dataset: Any
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    base_seed: int
    init_fn: Any
    worker_id: int
    num_workers: int
    use_torch: bool
    pool_limit: int
    resume: dict[str, Any] | None = None  # this worker's snapshot to resume from (Note [Resuming mid-epoch])
    replay_index: Any = None  # what one task's index is, to replay an iterable dataset's batches


class SpecHandoff(Closeable):
    """A worker's spec on its way to the worker: as is under fork, in a memfd under spawn and forkserver.

    Note [The spec beside the start pipe]
        A spawn or forkserver ``Process.start()`` pickles the process object
        and writes it into a pipe that the child reads only once it has
        started Python, imported the main module and imported whatever the
        pickle names before the bytes that follow (the target's module;
        torch, for torch's ``default_collate``). A pipe holds 64 KiB: with a
        dataset bigger than that, ``start()`` blocks until the child has
        read nearly all of it, so the workers start one after the other,
        each after the last one's imports. torch's loader does so too: with
        a 5 MB dataset, its 4 spawned workers had read their datasets at
        2.4, 4.7, 6.9 and 9.8 s, and its first batch came at 9.9 s.
        Here the spec is pickled during that same start (``__reduce__`` runs
        inside it, so ``DupFd`` and the ``assert_spawning`` of
        multiprocessing locks and queues in a dataset work as they do in the
        pipe), into a memfd (no name to clean up, gone with its last fd)
        handed to the child beside the pipe: the pipe gets a few hundred
        bytes, ``start()`` returns at once, and the workers start together.
        The parent closes its fd once ``start()`` has returned (``close()``);
        the child maps the memfd, unpickles the spec and closes it before
        ``worker_main`` runs. Under fork nothing is pickled. Pickled outside
        a start, or where no memfd (or no fd) can be had, the spec goes
        in-band, as before. The price: each worker's pickled dataset is held
        in shared memory until that worker has read it, so N workers
        starting together hold N copies for a moment, where the pipes held
        one at a time.
    """

    __slots__ = ("spec", "_fd")

    def __init__(self, spec: WorkerSpec | list[WorkerSpec]) -> None:
        self.spec = spec  # (a list: every worker's, for the zygote, Note [Workers forked from one process])
        self._fd: Fd | None = None  # the memfd of the last pickling, until start() returns

    def __reduce__(self) -> Any:
        from multiprocessing import context, reduction

        if context.get_spawning_popen() is None:
            return SpecHandoff, (self.spec,)
        data = reduction.ForkingPickler.dumps(self.spec)
        first = self.spec[0] if isinstance(self.spec, list) else self.spec
        use_torch = bool(first.use_torch) if first is not None else False
        try:
            fd = Fd(os.memfd_create("shmshare-loader-spec", os.MFD_CLOEXEC))
        except OSError:  # no memfds here, or no fd left: the pipe takes it, at its pace
            return _spec_from_pickle, (data,)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd.fileno(), view):]
            dup = reduction.DupFd(fd.fileno())
        except BaseException:
            fd.close()
            raise
        self.close()
        self._fd = fd
        return _load_spec, (dup, len(data), use_torch)

    def close(self) -> None:
        """Close the parent's fd of the memfd (after ``start()``: the child has its own). Idempotent."""
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            fd.close()


def _spec_from_pickle(data: bytes) -> SpecHandoff:
    return SpecHandoff(pickle.loads(data))


def _load_spec(dup: Any, size: int, use_torch: bool = False) -> SpecHandoff:
    """In the child, as the process object is unpickled: the spec, from the memfd beside the pipe."""
    _phases[:] = [("process", _stats.process_start())]
    if use_torch:
        import torch  # noqa: F401 - the dataset's pickle would import it: timed as an import of its own
    _phases.append(("imports", time.time()))
    fd = Fd(dup.detach())
    try:
        with mmap.mmap(fd.fileno(), size, prot=mmap.PROT_READ) as data:
            spec = pickle.loads(data)
    finally:
        fd.close()
    _phases.append(("dataset", time.time()))
    return SpecHandoff(spec)


def worker_main(conn: wire.Connection, handoff: SpecHandoff) -> None:
    """The worker process: run until told to stop, or until the main process is gone."""
    global _info
    spec = handoff.spec
    assert isinstance(spec, WorkerSpec)
    from . import _iters

    _iters.close_inherited()  # a forked worker holds the main process's loader sockets
    try:
        # held batches never stall the loader: past the pool, memory outside it (Note [Past the pool])
        past = functools.partial(_past_the_pool, spec.pool_limit) if PAST_THE_POOL else None
        tx = _WorkerSender(conn, limit=spec.pool_limit, on_overflow=past)
    except BaseException:
        conn.close()
        raise
    try:
        if spec.use_torch:
            import torch
            from torch.utils.data._utils import worker as torch_worker

            torch.set_num_threads(1)
        seed = seed_worker(spec.base_seed, spec.worker_id)  # torch too, once imported
        if spec.use_torch:
            _info = torch_worker.WorkerInfo(id=spec.worker_id, num_workers=spec.num_workers,
                                            seed=seed, dataset=spec.dataset)
            torch_worker._worker_info = _info
        else:
            _info = WorkerInfo(spec.worker_id, spec.num_workers, seed, spec.dataset)
        _pool.set_pool(tx)
        _serve(tx, spec)
    except KeyboardInterrupt:
        pass  # the main process handles Ctrl-C; its shutdown stops us
    except (PeerDied, ProtocolError):
        pass  # the main process closed, died or refused us while we sent: it reports that
    finally:
        _pool.set_pool(None)
        tx.close()


def _serve(tx: Sender, spec: WorkerSpec) -> None:
    # Our parent now: the main process (fork, spawn) or the forkserver. A child is reparented
    # when its parent dies (and the forkserver exits with the main process).
    parent = _parent or os.getppid()  # (a zygote's worker: the zygote, even if it died before this line)
    where = f"in DataLoader worker process {spec.worker_id}"
    collate = _collate.default_collate if _collate.is_torch_default(spec.collate_fn) else spec.collate_fn
    clock = _stats.WorkerClock(list(_phases) or [("process", _stats.process_start())])
    collate = clock.timed(collate)
    init_error = None
    fetcher: Any = None
    make = functools.partial(make_fetcher, spec.iterable, spec.dataset, spec.auto_collation, collate,
                             spec.drop_last)
    try:
        if spec.init_fn is not None:
            spec.init_fn(spec.worker_id)
        if spec.resume is not None:
            fetcher = _resume.restore_worker(spec.resume, spec.dataset, make, spec.iterable,
                                             spec.replay_index)
        else:
            fetcher = make()
    except Exception:  # noqa: BLE001 - reported with the first batch, as torch's worker does
        init_error = capture(where)
    snapshots = _resume.Capturer(spec.use_torch)  # a snapshot carries the RNG state only when it changed
    ended = False  # this epoch's IterableDataset ran out: later tasks are ignored
    parts: list[Any] = []  # a big index's parts so far
    while True:
        try:
            note = tx.recv_note(timeout=WATCH_INTERVAL)
        except ShmshareTimeout:
            if os.getppid() != parent:
                return  # orphaned: the main process died without a word
            continue
        except PeerDied:
            return
        kind = note[0]
        if kind == "s":
            return
        if kind == "r":
            ended = False
            fetcher = make()
            snapshots = _resume.Capturer(spec.use_torch)  # the whole RNG state: the main process starts anew
            clock.batches, clock.fetch, clock.collate, clock.send = 0, 0.0, 0.0, 0.0  # this epoch's totals
            _send(tx, -1, "r", b"", snap=snapshots.snapshot(spec.dataset, fetcher, spec.iterable))
            continue
        if ended:
            continue
        if kind == "p":  # the first parts of a big index (Note [A worker's one socket])
            parts.append(note[2])
            continue
        task, index = note[1], note[2]
        if parts:
            parts.append(index)
            index = b"".join(parts) if type(index) is bytes else [i for p in parts for i in p]
            parts = []
        if type(index) is bytes:
            index = pickle.loads(index)
        if init_error is not None:
            _send(tx, task, "e", init_error)
            init_error = None
            continue
        t = time.perf_counter()
        collated = clock.collate
        try:
            data = fetcher.fetch(index)
            clock.fetch += time.perf_counter() - t - (clock.collate - collated)
            if clock.batches == 0:
                clock.phases.append(("first sample", time.time()))
            payload, arrays = pack(data)
            del data
            snap = snapshots.snapshot(spec.dataset, fetcher, spec.iterable)
        except StopIteration:
            if not spec.iterable:
                _send(tx, task, "e", capture(where))
                continue
            ended = True
            tx.send([task, "t"])
            continue
        except Exception:  # noqa: BLE001 - the main process re-raises it, type and traceback
            _send(tx, task, "e", capture(where))
            continue
        try:
            clock.batches += 1
            t = time.perf_counter()
            _send(tx, task, "d", payload, arrays, timeout=_pool.POOL_WAIT, snap=snap,
                  note=clock.note(tx))
            clock.send += time.perf_counter() - t
        except PeerDied:
            return
        except Exception:  # noqa: BLE001 - a batch the channel cannot take (a full pool, a dtype)
            del arrays
            _send(tx, task, "e", capture(where))
            continue
        del arrays, payload


def _send(tx: Sender, task: int, kind: str, payload: bytes, arrays: list[Any] | None = None,
          timeout: float | None = None, snap: list[Any] | None = None, note: list[Any] | None = None) -> None:
    """Send a batch or an error: a pickle past _INLINE bytes goes through the pool, not the frame.

    A frame holds 128 KiB; a batch of strings (documents, paths) or a long
    traceback can be more. The main process reads a None payload from the
    last array.
    """
    arrays = list(arrays or ())
    if snap is not None and snap[1] is not None and len(snap[1]) > _INLINE:  # a big dataset state: the pool
        state = tx.empty(len(snap[1]), np.uint8, timeout=timeout)
        state[:] = np.frombuffer(snap[1], np.uint8)
        arrays.append(state)
        snap = [snap[0], len(snap[1])]  # (an int: "the array before the payload's")
        del state
    if len(payload) > _INLINE:
        buf = tx.empty(len(payload), np.uint8, timeout=timeout)
        buf[:] = np.frombuffer(payload, np.uint8)
        arrays.append(buf)
        del buf
        tx.send([task, kind, None, arrays, snap, note], timeout=timeout)
    else:
        tx.send([task, kind, payload, arrays, snap, note], timeout=timeout)


class _WorkerSender(Sender):
    LIMIT = "pool_limit= (a DataLoader keyword)"  # what its errors tell the user to raise
    # Nothing by value (Note [Inline arrays]): a batch lies in the worker's pool, shared as torch's
    # workers' batches are (is_shared()), and pinned where it lies with pin_memory=True
    INLINE = 0


# False: a full pool waits for releases instead (what a host out of shared memory still does;
# the tests of that wait turn this off)
PAST_THE_POOL = True


def _past_the_pool(limit: int, nbytes: int) -> None:
    """Said once per worker, the first time its pool is full of batches the program holds."""
    warnings.warn(f"shmshare DataLoader worker pid {os.getpid()}: its pool of {limit} bytes is "
                  "full of batches the main process still holds (kept in a list, a cache, ...); "
                  "the batches after go in shared memory outside the pool, given back when each "
                  f"is dropped. Pass a larger pool_limit= (now {limit}) to keep them pooled.",
                  UserWarning, stacklevel=1)  # (where it is said: nothing of the user's is on the stack)
