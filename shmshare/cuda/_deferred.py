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

So such a release becomes a task in this queue, and queuing it is all a
finalizer does: no driver call at all, so nothing there can break a
capture, deadlock on the driver, or wait.

The queue is drained at shmshare.cuda calls a program makes (allocations,
registrations, sends and receives) and by :func:`finish_releases`, with
this thread's capture interaction mode set to relaxed for the while
(``cuThreadExchangeStreamCaptureMode``), so that the drain's own calls are
not refused (and do not invalidate) while another stream captures in
global mode. A drain *fences* each task by events:

- An event is recorded on every stream that may use the memory: the
  streams the owner was told about (``record_stream``, a DLPack consumer's
  stream, the stream an array was produced on) and the legacy default
  stream of each context that may touch it (of every active primary
  context, for host memory). An event on the legacy stream completes after
  the work enqueued before it there *and on every blocking stream* of its
  context (legacy-stream semantics); work on a non-blocking stream counts
  only if that stream was named, as with torch's ``record_stream``. A
  named :class:`Stream` is kept alive by the task until it is fenced, and
  one closed before that is fenced by the event its ``close()`` recorded
  last. A raw handle of a stream someone else destroys must stay valid
  until then, as with torch's ``record_stream``.
- A stream that is being captured (``cuStreamIsCapturing``) gets no event:
  the task waits and is fenced at a later drain, after the capture.
- The task runs once every event has completed (``cuEventQuery``: never a
  wait, except in :func:`finish_releases`).

A task whose release fails (a sticky error, an unregister the driver
refuses) stays queued and is retried at the next drain: memory still pinned
or mapped is never unmapped, and nothing is forgotten.
:func:`finish_releases` raises the first such error; :func:`pending` says
what is still queued. At interpreter exit the queue is drained once
without waiting (a hung kernel must not hang the exit; the process's end
frees the rest). A forked child cannot use CUDA: there a release only
drops what the child itself holds (its view of a mapping), at once.

An explicit release (``Registration.unregister()``, ``provider.free()``) is
the caller's own call, not a finalizer's, and waits where it must, as
before.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from .. import _fork
from . import _driver
from ._context import Context, Event, EventPool, Stream, active_primaries, pool_of, stream_handle
from ._driver import CudaError, call, driver

__all__ = ["drain", "finish_releases", "pending", "release_later"]

_lock = threading.RLock()  # guards _tasks, _pools, _generation; re-entrant: a collection may run a finalizer under it
_drain_lock = threading.Lock()  # one drain at a time runs tasks
_draining = threading.local()  # a drain that makes a finalizer run must not drain again on the same thread
_tasks: list[_Task] = []
_pools: dict[int, EventPool] = {}  # context handle -> pool of fence events
_generation = 0  # tasks ever queued: a drain goes round again when it grew during a pass

Fence = tuple[Context, int, Any]  # (context, stream handle, the Stream object kept alive, or None)


class _Task:
    """One deferred release: the streams still to fence, the events to wait for, and the action."""

    __slots__ = ("what", "action", "fences", "every_context", "events", "error")

    def __init__(self, what: str, action: Callable[[], None], fences: list[Fence], every_context: bool) -> None:
        self.what = what  # for pending() and errors: "unregister of 0x7f..+4096"
        self.action = action
        self.fences = fences  # streams still without an event
        self.every_context = every_context  # add each active primary context's legacy stream at the first fence
        self.events: list[Event] = []
        self.error: BaseException | None = None  # the last failure, retried at the next drain


def release_later(what: str, action: Callable[[], None], streams: Iterable[tuple[Context, Any]] = (), *,
                  events: Iterable[Event] = (), every_context: bool = False,
                  in_forked_child: Callable[[], None] | None = None) -> None:
    """Queue ``action`` to run once the work enqueued so far on ``streams`` is done.

    Makes no driver call, never blocks and never raises: it is called from
    finalizers and deleters (Note [Deferred releases]). ``streams`` are
    (context, stream) pairs; name a context's legacy default stream (0) to
    cover its blocking streams too, or pass ``every_context`` for the legacy
    stream of every active primary context; ``events`` already recorded are
    waited for too. In a forked child, which cannot use CUDA,
    ``in_forked_child`` runs instead (dropping what the child holds).
    """
    global _generation
    if _driver._forked_after_init:
        if in_forked_child is not None:
            try:
                in_forked_child()
            except Exception:  # noqa: BLE001, S110 - a finalizer has no caller
                pass
        return
    fences: list[Fence] = []
    for context, stream in streams:
        handle = stream_handle(stream)
        if not any(f[0] is context and f[1] == handle for f in fences):
            fences.append((context, handle, stream if isinstance(stream, Stream) else None))
    task = _Task(what, action, fences, every_context)
    task.events.extend(events)
    with _lock:
        _tasks.append(task)
        _generation += 1


def drain(wait: bool = False) -> int:
    """Fence what can be fenced and run the tasks whose events completed; return how many are left.

    With ``wait``, wait for every fence event (``cuEventSynchronize``);
    streams that are being captured are still not fenced. Errors stay with
    their tasks (see :func:`finish_releases`). Not for finalizers.
    """
    if getattr(_draining, "active", False) or not _tasks:
        return len(_tasks)
    blocking = wait
    while _drain_lock.acquire(blocking=blocking):
        _draining.active = True
        try:
            with _relaxed():
                while True:
                    with _lock:
                        tasks, generation = list(_tasks), _generation
                    for task in tasks:
                        if _advance(task, wait):
                            with _lock:
                                _tasks.remove(task)
                    if _generation == generation:
                        break
        finally:
            _draining.active = False
            _drain_lock.release()
        if _generation == generation:
            break
        blocking = False  # queued between the last pass and the release: go round unless another drain has it
    return len(_tasks)  # when the lock was busy, the thread holding it goes round again for what was added


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
    if task.every_context:
        for context in active_primaries():
            if not any(f[0] is context and f[1] == 0 for f in task.fences):
                task.fences.append((context, 0, None))
        task.every_context = False
    left: list[Fence] = []
    error: CudaError | None = None
    for fence in task.fences:
        context, handle, stream = fence
        try:
            if isinstance(stream, Stream) and stream.closed:  # closed before this fence: its last event stands in
                if stream.last_event is not None:
                    task.events.append(stream.last_event)
                continue
            if context.is_capturing(handle):
                left.append(fence)
                continue
            if isinstance(stream, Stream):  # the check and the record under its lock: a close cannot slip in
                event = stream.fence(_pool(context).get)
                if event is not None:
                    task.events.append(event)
                continue
            task.events.append(_pool(context).get().record(handle))
        except CudaError as exc:
            if stream is None and exc.result_name == "CUDA_ERROR_INVALID_HANDLE":
                continue  # a foreign stream destroyed since: its owner vouched for its work (as for record_stream)
            left.append(fence)  # retried at the next drain
            error = error or exc
    task.fences = left
    if error is not None:
        raise error


@contextmanager
def _relaxed() -> Iterator[None]:
    """Run the block in relaxed capture interaction mode, then restore this thread's mode."""
    if _driver.why_unavailable() is not None:
        yield  # no driver: the tasks can hold no driver work
        return
    relaxed = driver().CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = call("cuThreadExchangeStreamCaptureMode", relaxed)
    try:
        yield
    finally:
        call("cuThreadExchangeStreamCaptureMode", previous)


def _pool(context: Context) -> EventPool:
    return pool_of(_pools, context, _lock)


def _at_exit() -> None:
    try:
        drain(wait=False)  # what is done; no wait for the rest (Note [Deferred releases])
    except Exception:  # noqa: BLE001, S110 - at exit the driver may be gone: the process ends anyway
        pass


def _forget_after_fork() -> None:
    global _lock, _drain_lock, _draining, _tasks, _pools
    _lock, _drain_lock, _draining = threading.RLock(), threading.Lock(), threading.local()  # Note [At fork]
    _tasks, _pools = [], {}  # a forked child cannot use CUDA: the parent runs its own releases


atexit.register(_at_exit)
_fork.on_fork_in_child(3, _forget_after_fork)
