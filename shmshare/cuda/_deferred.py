"""Releases that must wait for the GPU, run later: from finalizers, deleters and failed cleanups.

Note [Deferred releases]
~~~~~~~~~~~~~~~~~~~~~~~~
Some memory can be given back only once the GPU work that uses it is done:
a registered host range (``cuMemHostUnregister``, then ``munmap``),
``cuMemHostAlloc`` memory, device memory imported from another process
(``cuMemUnmap`` does not wait). When the last reference goes in a
finalizer or a DLPack deleter (the garbage collector, torch dropping a
tensor: any point of any thread) the release must not wait there. A
``cuCtxSynchronize`` while a CUDA graph is being captured fails with
``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` and invalidates the capture, and
a deleter blocked on the GPU stalls whoever dropped the reference.

So such a release becomes a task in this queue, *fenced* by events:

- An event is recorded on every stream that may use the memory: the
  streams the owner was told about (``record_stream``, a DLPack consumer's
  stream, the stream an array was produced on) and the legacy default
  stream of each context that may touch it. An event on the legacy stream
  completes after the work enqueued before it there *and on every blocking
  stream* of its context (legacy-stream semantics); work on a non-blocking
  stream counts only if that stream was named, as with torch's
  ``record_stream``.
- A stream that is being captured (``cuStreamIsCapturing``) gets no event:
  the task waits and is fenced at a later drain, after the capture.
- The task runs once every event has completed (``cuEventQuery``: never a
  wait, except in :func:`finish_releases`).

Tasks are looked at (drained, without blocking) whenever one is added and
at shmshare.cuda calls that allocate, register, send or receive;
:func:`finish_releases` waits for all of them, and interpreter exit runs it.
A task whose release fails (a sticky error, an unregister the driver
refuses) stays queued and is retried at the next drain: memory still pinned
or mapped is never unmapped, and nothing is forgotten.
:func:`finish_releases` raises the first such error; :func:`pending` says
what is still queued.

An explicit release (``Registration.unregister()``, ``provider.free()``) is
the caller's own call, not a finalizer's, and waits where it must, as
before.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .. import _fork
from ._context import Context, Event, EventPool, stream_handle
from ._driver import CudaError

__all__ = ["drain", "finish_releases", "pending", "release_later"]

_lock = threading.Lock()  # guards _tasks and _pools
_drain_lock = threading.Lock()  # one drain at a time runs tasks
_draining = threading.local()  # a finalizer during a drain must not drain again on the same thread
_tasks: list[_Task] = []
_pools: dict[int, EventPool] = {}  # context handle -> pool of fence events


class _Task:
    """One deferred release: the streams still to fence, the events to wait for, and the action."""

    __slots__ = ("what", "action", "fences", "events", "error")

    def __init__(self, what: str, action: Callable[[], None], fences: list[tuple[Context, int]]) -> None:
        self.what = what  # for pending() and errors: "unregister of 0x7f..+4096"
        self.action = action
        self.fences = fences  # (context, stream handle) still without an event
        self.events: list[Event] = []
        self.error: BaseException | None = None  # the last failure, retried at the next drain


def release_later(what: str, action: Callable[[], None], streams: Iterable[tuple[Context, Any]]) -> None:
    """Queue ``action`` to run once the work enqueued so far on ``streams`` is done.

    Never blocks and never raises: it is called from finalizers and
    deleters (Note [Deferred releases]). ``streams`` are (context, stream)
    pairs; name each context's legacy default stream (0) to cover its
    blocking streams too.
    """
    fences = []
    for context, stream in streams:
        pair = (context, stream_handle(stream))
        if pair not in fences:
            fences.append(pair)
    with _lock:
        _tasks.append(_Task(what, action, fences))
    try:
        drain()
    except Exception:  # noqa: BLE001, S110 - a finalizer has no caller: the task stays queued and says why
        pass


def drain(wait: bool = False) -> int:
    """Fence what can be fenced and run the tasks whose events completed; return how many are left.

    With ``wait``, wait for every fence event (``cuEventSynchronize``);
    streams that are being captured are still not fenced. Errors stay with
    their tasks (see :func:`finish_releases`).
    """
    if getattr(_draining, "active", False) or not _tasks:
        return len(_tasks)
    if not _drain_lock.acquire(blocking=wait):
        return len(_tasks)  # another thread is draining: it will see the new task
    _draining.active = True
    try:
        with _lock:
            tasks = list(_tasks)
        for task in tasks:
            if _advance(task, wait):
                with _lock:
                    _tasks.remove(task)
    finally:
        _draining.active = False
        _drain_lock.release()
    return len(_tasks)


def finish_releases() -> None:
    """Wait for every deferred release and run it; raise the first that failed (it stays queued).

    Call it outside CUDA graph capture, e.g. before checking that nothing
    is left pinned or mapped.
    """
    drain(wait=True)
    with _lock:
        failed = [t for t in _tasks if t.error is not None]
        stuck = [t for t in _tasks if t.error is None]
    if failed:
        first = failed[0]
        raise CudaError(f"{len(failed)} deferred CUDA release(s) failed and stay queued for a retry; "
                        f"the first, {first.what}: {first.error}") from first.error
    if stuck:
        raise CudaError(f"{len(stuck)} deferred CUDA release(s) wait for streams that are being captured "
                        f"into a CUDA graph (the first: {stuck[0].what}); call finish_releases() after "
                        "the capture ends")


def pending() -> list[str]:
    """Return what each queued release is for, with its last error if it failed."""
    with _lock:
        return [t.what + (f" (failed: {t.error})" if t.error is not None else "") for t in _tasks]


def _advance(task: _Task, wait: bool) -> bool:
    """Move ``task`` on as far as it goes now; return True once its action ran."""
    try:
        _fence(task)
        if task.fences:
            return False
        for event in task.events:
            if wait:
                event.synchronize()
            elif not event.query():
                return False
        task.events = []
        task.action()
    except Exception as exc:  # noqa: BLE001 - kept with the task, retried, raised by finish_releases
        task.error = exc
        return False
    task.error = None
    return True


def _fence(task: _Task) -> None:
    """Record an event on each of the task's streams that is not being captured."""
    left = []
    for context, handle in task.fences:
        if context.closed:
            continue  # its streams are gone, and their work with them
        if context.is_capturing(handle):
            left.append((context, handle))
            continue
        try:
            task.events.append(_pool(context).get().record(handle))
        except CudaError as exc:
            if exc.result_name != "CUDA_ERROR_INVALID_HANDLE":
                raise
            # the stream was destroyed since (a destroy waits for nothing, but its work is
            # already enqueued before any later work): nothing further can use the memory there
    task.fences = left


def _pool(context: Context) -> EventPool:
    with _lock:
        pool = _pools.get(context.handle)
        if pool is None or pool.closed:
            pool = _pools[context.handle] = EventPool(context)
        return pool


def _at_exit() -> None:
    try:
        drain(wait=True)
    except Exception:  # noqa: BLE001, S110 - at exit the driver may be gone: the process ends anyway
        pass


def _forget_after_fork() -> None:
    _tasks.clear()  # a forked child cannot use CUDA: the parent runs its own releases
    _pools.clear()


atexit.register(_at_exit)
_fork.on_fork_in_child(3, _forget_after_fork)
