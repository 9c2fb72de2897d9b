"""A second hostile review of issue 11 (deferred releases after aa7bd7e) over the driver model. NOT a GPU.

Each test here FAILS on the library as reviewed: it shows one defect. Where
the model is kinder than the driver (a destroyed stream handle), the test
makes the model stricter for itself and says why.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest

from shmshare import Segment, cuda
from shmshare.cuda import _context, _deferred, _pinned
from shmshare.cuda._driver import call
from shmshare.memory._host import CachingHostAllocator

from .driver_model import DriverModel
from .driver_model_streams import CUresult, Refused

MiB = 1 << 20


def _destroyed_handles_are_invalid(model: DriverModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the model answer CUDA_ERROR_INVALID_HANDLE for a destroyed stream, as _deferred expects the
    driver to (it drops such a fence: "a foreign stream destroyed since"); the model asserts instead."""
    original = model._stream

    def stream(handle: Any) -> Any:
        number = int(handle)
        if number not in (0, 1, 2) and number not in model.streams:
            raise Refused(CUresult.CUDA_ERROR_INVALID_HANDLE)
        return original(handle)

    monkeypatch.setattr(model, "_stream", stream)


def _finish_then_repair(own: cuda.Context) -> str | None:
    """finish_releases(); return its error, after reopening `own` so the wedged tasks can run for teardown."""
    try:
        cuda.finish_releases()
        error = None
    except cuda.CudaError as exc:
        error = str(exc)
    own._ctx = call("cuDevicePrimaryCtxRetain", own._dev)  # the test's repair, not a fix
    cuda.finish_releases()
    own.close()
    return error


# --- B1. a user's own Context object, closed, wedges every deferred release of its device ---------------


def test_closing_a_users_own_context_object_does_not_wedge_other_releases(driver_model: DriverModel) -> None:
    # _deferred._pool (and _context._last_event_pool) key the fence-event pools by context HANDLE, but
    # an EventPool remembers the Context OBJECT that first asked. A user's cuda.Context(0) is a second
    # owner of the same primary context (same handle): when its release is the first to be fenced, the
    # pool of device 0 belongs to it. After own.close() (normal: the user drops their retain; the primary
    # context stays active, retained by Context.primary(0)), every later fence on device 0 calls
    # own.active(), which raises ValueError("context ... is closed"): not a CudaError, so _fence does not
    # catch it, _advance keeps it as the task's error, and every deferred release of the device fails
    # at every drain for ever, its memory still pinned.
    own = cuda.Context(0)
    first = Segment.create(MiB)
    cuda.register_segment(first, own)
    del first
    gc.collect()
    cuda.finish_releases()  # fenced and run: the device-0 pool now belongs to `own`
    own.close()
    second = Segment.create(MiB)
    cuda.register_segment(second)  # the process-wide primary owner, never closed
    del second
    gc.collect()
    error = _finish_then_repair(own)
    assert error is None, f"a closed Context object wedged other releases of its device: {error}"


def test_a_registration_made_with_a_users_context_object_is_released_after_that_object_closes(
        driver_model: DriverModel) -> None:
    # Registration._defer's unpin runs `with context.active()` on the Context object it was made with.
    # Once the user closes that object (the primary context lives on), the action raises ValueError at
    # every drain: the unregister can never run, the range stays pinned, and the segment's mapping is
    # held (the Lease) for the life of the process. _fence also skips every fence of a closed Context
    # object ("its streams are gone, and their work with them"), though the primary context, its streams
    # and their work are all still there (see B2).
    own = cuda.Context(0)
    segment = Segment.create(MiB)
    cuda.register_segment(segment, own)
    del segment
    gc.collect()
    own.close()
    error = _finish_then_repair(own)
    assert error is None, f"the unregister can never run: {error}"


def test_closing_a_named_primary_stream_works_after_a_users_context_object_closed(
        driver_model: DriverModel) -> None:
    # The same root cause in _context._last_event_pool: keyed by handle, the pool of Stream.close()'s
    # last events belongs to whichever Context object first closed a named stream. After that object
    # is closed, closing any named stream of the device raises ValueError and leaves it undestroyed.
    own = cuda.Context(0)
    first, second = cuda.Stream(own), cuda.Stream()  # the second in the process-wide primary owner
    first.name_for_release()
    second.name_for_release()
    first.close()  # its last event comes from a pool of `own`
    own.close()
    try:
        second.close()
        error = None
    except ValueError as exc:
        error = exc
    finally:
        _context._last_events.clear()
        second.close()
    assert error is None, f"Stream.close() of a primary-context stream failed: {error!r}"


def test_a_fence_on_a_closed_context_object_still_waits_for_the_streams_work(driver_model: DriverModel) -> None:
    # _fence: `if context.closed: continue  # its streams are gone, and their work with them`. A Context
    # object closed is one retain dropped, not the context destroyed: while Context.primary(0) (or torch)
    # retains it, the stream and the copy enqueued on it live on. The fence is dropped, and the range is
    # unpinned while the stream's work that reads it is still pending.
    own = cuda.Context(0)
    segment = Segment.create(MiB)
    registration = cuda.register_segment(segment, cuda.Context.primary(0))
    side = cuda.Stream(own)  # a non-blocking stream of the same primary context
    registration.record_stream(side, own)
    driver_model.hold(side.handle)  # a long kernel reading the range, still running
    queue = driver_model.streams[side.handle].queue
    del segment, registration
    gc.collect()
    own.close()  # the user is done with their handle on the context; the stream is still busy
    _deferred.drain()  # no wait: the work on `side` is pending, so the unregister must wait too
    assert not (queue and driver_model.live()["registered"] == 0), (
        "the range was unpinned while the work on a named stream was still pending")
    driver_model.finish(side.handle)
    side.close()


# --- B2. Stream.close() racing a drain: the fence is dropped and the last event ignored -----------------


def test_a_stream_closed_while_a_drain_fences_it_is_still_waited_for(
        driver_model: DriverModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # _fence reads `stream.closed` (False), asks is_capturing, then records on the handle. Another
    # thread's Stream.close() in between records last_event and destroys the stream; the record then
    # fails with CUDA_ERROR_INVALID_HANDLE, which _fence takes for "a foreign stream destroyed since:
    # its owner vouched for its work" and drops the fence, never looking at last_event. The release
    # runs while the stream's work is still pending (on a driver the handle may even be reused by a
    # new stream, and the event lands there). The interleaving is forced by closing the stream from
    # inside is_capturing, exactly where a concurrent close() can land; the GIL allows it.
    _destroyed_handles_are_invalid(driver_model, monkeypatch)
    segment = Segment.create(MiB)
    registration = cuda.register_segment(segment)
    side = cuda.Stream()
    registration.record_stream(side)
    driver_model.hold(side.handle)  # the copy from the range, in flight
    queue = driver_model.streams[side.handle].queue
    del segment, registration
    gc.collect()
    original = cuda.Context.is_capturing

    def is_capturing(self: cuda.Context, stream: Any = 0) -> bool:
        answer = original(self, stream)
        if _context.stream_handle(stream) == side.handle and not side.closed:
            side.close()  # the other thread's close(), between the check and the record
        return answer

    monkeypatch.setattr(cuda.Context, "is_capturing", is_capturing)
    _deferred.drain()
    assert side.last_event is not None
    assert not (queue and driver_model.live()["registered"] == 0), (
        "the range was unpinned while the work on the stream (closed during the drain) was pending")
    driver_model.finish(0)
    driver_model.settle()


# --- B3. a Stream closed before it is named is fenced by nothing -----------------------------------------


def test_a_stream_closed_before_it_was_named_is_still_waited_for(driver_model: DriverModel) -> None:
    # Stream.close() records last_event only when the stream was named already. Named afterwards (the
    # copy was enqueued, the stream closed, then record_stream(stream): the order a "with stream:"
    # block gives), _fence finds it closed with no last_event and drops the fence silently: its work
    # still runs after cuStreamDestroy (as the Note says) and the range is unpinned under it.
    # record_stream accepts a closed Stream without a word.
    segment = Segment.create(MiB)
    registration = cuda.register_segment(segment)
    side = cuda.Stream()
    driver_model.hold(side.handle)  # the copy from the range, in flight
    queue = driver_model.streams[side.handle].queue
    side.close()
    registration.record_stream(side)
    del segment, registration
    gc.collect()
    _deferred.drain()
    assert not (queue and driver_model.live()["registered"] == 0), (
        "the range was unpinned while the work on a stream named after its close() was pending")
    driver_model.settle()


# --- B4. the pinned provider's last events grow with every stream ever used --------------------------------


def test_the_pinned_providers_last_events_do_not_grow_with_every_stream(driver_model: DriverModel) -> None:
    # CudaHostProvider._last (now _recent, bounded) mapped (context, stream handle) -> the last Event
    # recorded there, and nothing ever removed an entry: a program that uses a fresh stream per
    # request/batch (and closes it) grew it by one entry, and one Event object, per stream, for the
    # provider's life. Every range dropped unclosed then copied the whole dict into its task's events.
    provider = cuda.CudaHostProvider(register=False)
    pool = CachingHostAllocator(provider, "")
    for _ in range(1000):
        stream = cuda.Stream()
        block = pool.allocate(4096)
        pool.record_event(block, stream)
        pool.free(block)
        stream.synchronize()
        pool.process_events()
        stream.close()
    grown = len(provider._recent)
    pool.close()
    assert grown <= _pinned.RECENT_STREAMS, f"{grown} last-event entries after 1000 short-lived streams"


# --- B5. a task queued just as a drain finishes waits for some later call ----------------------------------


class _Handoff:
    """Stands for _drain_lock: when the drain releases it, another thread first queues and drains."""

    def __init__(self, inner: Any, on_release: Any) -> None:
        self.inner, self.on_release, self.fired = inner, on_release, False

    def acquire(self, blocking: bool = True) -> bool:
        return self.inner.acquire(blocking)

    def release(self) -> None:
        if not self.fired and threading.current_thread() is threading.main_thread():
            self.fired = True
            other = threading.Thread(target=self.on_release)
            other.start()
            other.join(10)
        self.inner.release()


def test_a_release_queued_as_a_drain_ends_is_not_left_for_a_later_call(
        driver_model: DriverModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # H5's fix checks _generation once more before leaving, but the check and the release of
    # _drain_lock are not atomic: a task queued after the check, whose own drain() finds the lock still
    # held, returns at once ("another thread is draining, and goes round again"); the draining thread
    # does not go round again. The task, ready at once, waits for some later shmshare call.
    ran: list[str] = []

    def other_thread() -> None:
        _deferred.release_later("ready at once", lambda: ran.append("late"), [])
        _deferred.drain()  # the lock is still held: returns without running it

    _deferred.release_later("first", lambda: ran.append("first"), [])
    monkeypatch.setattr(_deferred, "_drain_lock", _Handoff(_deferred._drain_lock, other_thread))
    _deferred.drain()
    assert ran == ["first", "late"], f"ran {ran}; still queued: {_deferred.pending()}"


# --- B7. a pinned range dropped unclosed waits for STALE events of its streams -----------------------------


def test_a_dropped_pinned_pool_waits_for_work_enqueued_after_its_last_event(driver_model: DriverModel) -> None:
    # aa7bd7e replaced "fence every stream the provider recorded events on" (a fresh event at the drain)
    # by "wait for the provider's last event on each stream" (_release_dropped: events=list(last.values())).
    # But CachingHostAllocator records events only at free(): work enqueued on the stream after that
    # event (a copy from a block still allocated, whose pool and block are dropped together, say by an
    # exception unwinding the frames holding them) is covered by nothing. The event found is complete, the
    # non-blocking stream is not covered by the legacy fence, and cuMemFreeHost runs under the copy.
    # Note [Pinned ranges outlive their owners] still says "fenced ... on every stream the provider
    # recorded events on".
    side = cuda.Stream()  # non-blocking, as torch's copy streams are
    provider = cuda.CudaHostProvider(register=False)
    pool = CachingHostAllocator(provider, "")
    block = pool.allocate(4096)
    pool.record_event(block, side)
    pool.free(block)  # the provider's last event on `side`
    side.synchronize()
    block = pool.allocate(4096)  # used again on the same stream
    pool.record_event(block, side)
    driver_model.hold(side.handle)  # the copy from it, in flight
    queue = driver_model.streams[side.handle].queue
    del block, pool, provider
    gc.collect()
    _deferred.drain()
    assert not (queue and driver_model.live()["host"] == 0), (
        "the pinned range was freed while a copy from it on a stream the provider knew was pending")
    driver_model.settle()
    side.close()


# --- B8. the stream an imported array was produced on is not fenced ----------------------------------------


def test_imported_memory_is_not_unmapped_under_the_stream_its_array_was_produced_on(
        driver_model: DriverModel, pipe: Any) -> None:
    # Note [Deferred releases] lists "the stream an array was produced on" among the fences, but
    # ImportedDeviceMemory.array(stream=...) only stores the stream in the DeviceArray: nothing names it
    # to the _Mapping (only __dlpack__ consumers and record_stream do). When the array and the memory
    # are dropped while a kernel on that (non-blocking) stream still writes the memory, the unmap is
    # fenced by the legacy stream only, and cuMemUnmap runs under the kernel.
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle = provider.allocate(2 * MiB)
    cuda.send_device_memory(pipe[0], provider, address, 2 * MiB, timeout=10)
    imported = cuda.recv_device_memory(pipe[1], timeout=10)
    producer = cuda.Stream()  # non-blocking, as torch's side streams are
    arr = imported.array(stream=producer)  # "the data is produced on `producer`"
    driver_model.hold(producer.handle)  # the kernel writing it, still running
    mappings = driver_model.live()["mappings"]
    del arr
    imported.close()
    gc.collect()
    _deferred.drain()
    assert driver_model.live()["mappings"] == mappings, (
        "the imported range was unmapped while the stream its array was produced on was still running")
    driver_model.finish(producer.handle)
    cuda.finish_releases()
    producer.close()
    provider.free(handle)
    provider.close()
