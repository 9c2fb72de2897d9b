"""Thin owners of driver objects: a device's primary context, streams, pooled events.

Note [Current context]
    The driver's current context is per thread, and every driver call acts
    on it. shmshare uses each device's *primary* context (the one the CUDA
    runtime, torch and CuPy use too). Its driver calls run inside
    ``with context.active():``, which pushes the context only when another
    one (or none) is current on this thread and pops it afterwards, so the
    caller's current context is what it was: a user working on device 1
    who asks shmshare for a device-0 copy is still on device 1 afterwards.
    (``make_current()`` sets it for good, for callers that want that.)

    Streams and events belong to the context that was current when they
    were made, and the driver refuses to record an event of one context on
    a stream of another (``CUDA_ERROR_INVALID_HANDLE``). So events come from
    a pool per context, and the context is the stream's own:
    :meth:`Context.of_stream` asks ``cuStreamGetCtx``. The legacy and
    per-thread default streams (handles 0, 1, 2) have no context of their
    own: they mean the one that is current, so a caller passes the context
    it means with them.

Note [Event pool]
    ``cuEventCreate`` is slow and, called from many threads, contended
    (PyTorch's ``EventPool`` comment), so events come from a per-context
    pool and go back to it. A pooled :class:`Event` hands its raw event back
    as soon as a query finds it done (it then answers True for ever, as the
    allocator's rules require), or when it is released or collected.

    ``EventPool.close()`` destroys the events in the pool, not those handed
    out: their holders (a pinned block waiting for its copy stream, say) may
    still record, query or wait on them, and a destroyed handle may be
    reused by the driver for another event. So a closed pool destroys each
    of those when it comes back instead of keeping it, and hands out no more.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .. import _fork
from ._driver import call, driver, query

__all__ = ["Context", "Event", "EventPool", "Stream", "active_primaries", "stream_handle"]

_primary: dict[int, Context] = {}
_primary_lock = threading.RLock()  # re-entrant: a finalizer run by a collection under it may ask for a context
_last_events: dict[int, EventPool] = {}  # context handle -> pool of the events owned streams record as they close


class Context:
    """Own one retain of a device's primary context (``cuDevicePrimaryCtxRetain``).

    Parameters
    ----------
    device : int
        Device ordinal, as the driver numbers them (after ``CUDA_VISIBLE_DEVICES``).
    """

    def __init__(self, device: int = 0) -> None:
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"device must be a non-negative int, got {device!r}")
        count = call("cuDeviceGetCount")
        if device >= count:
            raise ValueError(f"device {device} does not exist: the driver sees {count} device(s)")
        self.device = device  # ordinal
        self._dev = call("cuDeviceGet", device)
        self._ctx = call("cuDevicePrimaryCtxRetain", self._dev)
        self.handle = int(self._ctx)  # the CUcontext, as an int

    @classmethod
    def primary(cls, device: int = 0) -> Context:
        """Return the process-wide owner of ``device``'s primary context (retained once)."""
        with _primary_lock:
            ctx = _primary.get(device)
            if ctx is None or ctx.closed:
                ctx = _primary[device] = cls(device)
            return ctx

    @classmethod
    def of_stream(cls, stream: Any, default: Context | None = None) -> Context:
        """Return the primary context that ``stream`` belongs to (``cuStreamGetCtx``).

        The default streams (None, 0, 1, 2) belong to whichever context is
        current, so for them ``default`` is returned (device 0's when None);
        see Note [Current context].
        """
        handle = stream_handle(stream)
        if handle in DEFAULT_STREAMS:
            return default or cls.primary(0)
        if isinstance(stream, Stream):
            return stream.context
        raw = call("cuStreamGetCtx", handle)
        for ctx in list(_primary.values()):
            if ctx.handle == int(raw) and not ctx.closed:
                return ctx
        call("cuCtxPushCurrent", raw)  # ask the context itself which device: retain no other device's
        try:
            device = int(call("cuCtxGetDevice"))
        finally:
            call("cuCtxPopCurrent")
        ctx = cls.primary(device)
        if ctx.handle != int(raw):
            raise ValueError(f"stream 0x{handle:x} belongs to context 0x{int(raw):x}, which is not device "
                             f"{device}'s primary context; shmshare works in primary contexts (the ones torch "
                             "and CuPy use)")
        return ctx

    @property
    def closed(self) -> bool:
        """Whether ``close()`` released the context."""
        return self._ctx is None

    def make_current(self) -> None:
        """Make this context current on the calling thread for good (Note [Current context])."""
        if self._ctx is None:
            raise ValueError(f"context of device {self.device} is closed")
        if int(call("cuCtxGetCurrent")) != self.handle:
            call("cuCtxSetCurrent", self._ctx)

    @contextmanager
    def active(self) -> Iterator[Context]:
        """Make this context current for the ``with`` block, then restore the caller's.

        Pushes only when another context (or none) is current, and pops what
        it pushed (Note [Current context]). On an owner whose retain was
        released (``close()``), the device's process-wide owner stands in: it
        is the same primary context, and work queued on its streams (a
        deferred release's fence) goes on after this object's close.
        """
        own = self if self._ctx is not None else Context.primary(self.device)  # a closed owner: the same
        if int(call("cuCtxGetCurrent")) == own.handle:                       # primary context, retained anew
            yield own
            return
        call("cuCtxPushCurrent", own._ctx)
        try:
            yield own
        finally:
            call("cuCtxPopCurrent")

    def synchronize(self) -> None:
        """Wait for all work of this context, on every stream."""
        with self.active():
            call("cuCtxSynchronize")

    def is_capturing(self, stream: Any = 0) -> bool:
        """Return whether ``stream`` (a stream of this context) is being captured into a CUDA graph.

        For the legacy default stream this is also True while any blocking
        stream of the context captures (the driver's ``CUDA_ERROR_STREAM_CAPTURE_IMPLICIT``).
        """
        drv = driver()
        with self.active():
            out = drv.cuStreamIsCapturing(stream_handle(stream))
        err = int(out[0])
        if err == int(drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT):
            return True
        if err != 0:
            call("cuStreamIsCapturing", stream_handle(stream))  # raises the CudaError, naming the call
        return int(out[1]) != int(drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)

    def attribute(self, name: str) -> int:
        """Return device attribute ``name`` (``"CU_DEVICE_ATTRIBUTE_..."``) as an int."""
        drv = driver()
        return int(call("cuDeviceGetAttribute", getattr(drv.CUdevice_attribute, name), self._dev))

    def total_memory(self) -> int:
        """Return the device's memory in bytes."""
        return int(call("cuDeviceTotalMem", self._dev))

    def memory_info(self) -> tuple[int, int]:
        """Return (free, total) bytes of device memory, as the driver sees them now."""
        with self.active():
            free, total = call("cuMemGetInfo")
        return int(free), int(total)

    def uuid(self) -> bytes:
        """Return the device's 16-byte UUID (its MIG UUID in MIG mode)."""
        return bytes(call("cuDeviceGetUuid", self._dev).bytes)

    def name(self) -> str:
        """Return the device's name."""
        raw = call("cuDeviceGetName", 256, self._dev)
        return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")

    def close(self) -> None:
        """Release the retain (``cuDevicePrimaryCtxRelease``). Idempotent.

        Everything made in the context (streams, events, memory) must be
        gone first; the process-wide owner from :meth:`primary` is normally
        never closed.
        """
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            call("cuDevicePrimaryCtxRelease", self._dev)

    def __repr__(self) -> str:
        return f"<Context device {self.device} 0x{self.handle:x}{' closed' if self.closed else ''}>"


class Stream:
    """Own a stream made with ``cuStreamCreate``, or wrap a handle that someone else owns.

    Streams compare and hash by handle, and equal the int handle itself, so
    a raw handle such as ``torch.cuda.current_stream().cuda_stream`` names
    the same stream in an allocator's books.

    Parameters
    ----------
    context : Context, optional
        The primary context of device 0 when None.
    non_blocking : bool
        ``CU_STREAM_NON_BLOCKING``: do not synchronize with the legacy default stream.
    """

    __slots__ = ("context", "handle", "last_event", "_lock", "_named", "_owned", "_raw")

    def __init__(self, context: Context | None = None, *, non_blocking: bool = True) -> None:
        self.context = context or Context.primary(0)
        flags = int(driver().CUstream_flags.CU_STREAM_NON_BLOCKING) if non_blocking else 0
        with self.context.active():
            self._raw = call("cuStreamCreate", flags)
        self.handle = int(self._raw)  # the CUstream, as an int
        self._owned = True
        self._lock = threading.Lock()  # close() against a drain fencing it
        self._named = False  # a deferred release may name it: close() records last_event then
        self.last_event: Event | None = None  # recorded by close(): the stream's work ends before it

    @classmethod
    def wrap(cls, stream: Any, context: Context | None = None) -> Stream:
        """Return a non-owning Stream for any stream object or handle (see :func:`stream_handle`).

        Its context is ``context``, else the stream's own (``cuStreamGetCtx``;
        device 0's for the default streams).
        """
        self = object.__new__(cls)
        self.handle = stream_handle(stream)
        self.context = context or Context.of_stream(self.handle)
        self._raw = None
        self._owned = False
        self._lock = threading.Lock()
        self._named = False
        self.last_event = None
        return self

    def synchronize(self) -> None:
        """Wait until the work enqueued on the stream has completed."""
        with self.context.active():
            call("cuStreamSynchronize", self.handle)

    def query(self) -> bool:
        """Return whether the work enqueued so far has completed, without blocking."""
        with self.context.active():
            return query("cuStreamQuery", self.handle)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` destroyed the stream (never, for a wrapped one)."""
        return self._owned and self._raw is None

    def name_for_release(self) -> None:
        """Say that a deferred release waits for this stream: ``close()`` then records :attr:`last_event`.

        Named once already closed with no last event, its work may still be
        pending and nothing can be recorded on it any more: this waits for
        its context instead (an explicit call, never a finalizer's).
        """
        with self._lock:
            self._named = True
            if not self.closed or self.last_event is not None:
                return
        self.context.synchronize()

    def fence(self, new_event: Any) -> Event | None:
        """Return an event after the work enqueued so far: ``new_event()`` recorded here, or the last one.

        For a closed stream that is :attr:`last_event` (None: nothing left to
        wait for); the check and the record hold the stream's lock, so a
        concurrent ``close()`` cannot slip between them.
        """
        with self._lock:
            if self.closed:
                return self.last_event
            return new_event().record(self.handle)  # type: ignore[no-any-return]

    def close(self, *, last_event: bool = True) -> None:
        """Destroy the stream if this object created it. Idempotent.

        Its work still runs after the destroy, so when a deferred release
        named it (:meth:`name_for_release`) an event is recorded last
        (:attr:`last_event`), which that release waits for instead (Note
        [Deferred releases]).
        """
        with self._lock:
            raw = self._raw
            if raw is None or not self._owned:
                self._raw = None
                return
            with self.context.active():
                if last_event and self._named:
                    self.last_event = _last_event_pool(self.context).get().record(self.handle)
                self._raw = None
                call("cuStreamDestroy", raw)

    def __cuda_stream__(self) -> tuple[int, int]:
        """Return (0, handle): the CUDA stream protocol of cuda.core and CuPy."""
        return (0, self.handle)

    def __int__(self) -> int:
        return self.handle

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Stream):
            return self.handle == other.handle
        if isinstance(other, int) and not isinstance(other, bool):
            return self.handle == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.handle)

    def __del__(self) -> None:
        try:
            self.close(last_event=False)  # collected: no deferred release names it any more
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown or a dead context: nothing left to free
            pass

    def __repr__(self) -> str:
        return f"<Stream 0x{self.handle:x}{'' if self._owned else ' (wrapped)'}>"


DEFAULT_STREAMS = (0, 1, 2)  # NULL (legacy), CU_STREAM_LEGACY, CU_STREAM_PER_THREAD: the current context's


def stream_handle(stream: Any) -> int:
    """Return the ``CUstream`` handle of any stream object as an int.

    Accepts an int handle (0 is the legacy default stream), a :class:`Stream`,
    a cuda-python ``CUstream``, anything with ``__cuda_stream__()`` (CuPy,
    cuda.core), a torch stream (``.cuda_stream``), a CuPy stream (``.ptr``),
    or None for the legacy default stream.
    """
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise TypeError("a stream cannot be a bool")
    if isinstance(stream, (int, Stream)):
        handle = int(stream)
    elif hasattr(stream, "__cuda_stream__"):
        handle = int(stream.__cuda_stream__()[1])
    elif hasattr(stream, "cuda_stream"):
        handle = int(stream.cuda_stream)
    elif hasattr(stream, "ptr"):
        handle = int(stream.ptr)
    elif type(stream).__name__ == "CUstream":
        handle = int(stream)
    else:
        raise TypeError(f"not a CUDA stream: {stream!r} (pass an int handle, a shmshare Stream, "
                        "a torch or CuPy stream, or a cuda-python CUstream)")
    if handle < 0:
        raise ValueError(f"a stream handle cannot be negative, got {handle}")
    return handle


class EventPool:
    """Hand out events of one context and take them back (Note [Event pool])."""

    def __init__(self, context: Context | None = None) -> None:
        self.context = context or Context.primary(0)
        self._free: list[Any] = []  # raw CUevents ready for reuse
        self._lock = threading.RLock()  # re-entrant: an Event collected under it gives itself back
        self._closed = False  # close() ran: returned events are destroyed, none handed out
        self.created = 0  # events ever created with cuEventCreate
        self.handed_out = 0  # events handed out and not given back yet

    def get(self) -> Event:
        """Return an event, reused from the pool when one is there."""
        with self._lock:
            if self._closed:
                raise ValueError(f"get() on a closed event pool of device {self.context.device}")
            raw = self._free.pop() if self._free else None
            self.handed_out += 1
        if raw is None:
            try:
                flags = int(driver().CUevent_flags.CU_EVENT_DISABLE_TIMING)  # cheaper to record and query
                with self.context.active():
                    raw = call("cuEventCreate", flags)
            except BaseException:
                with self._lock:
                    self.handed_out -= 1
                raise
            with self._lock:
                self.created += 1
        return Event(self, raw)

    def put(self, raw: Any) -> None:
        """Take back a raw event that nobody uses any more; destroy it once the pool is closed."""
        with self._lock:
            self.handed_out -= 1
            if not self._closed:
                self._free.append(raw)
                return
        self._destroy([raw])

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def close(self) -> None:
        """Destroy the pooled events now, and each event handed out when it comes back. Idempotent.

        Events still handed out stay valid until given back: their holders
        may still use them (Note [Event pool]).
        """
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        self._destroy(free)

    def __len__(self) -> int:
        return len(self._free)

    def _destroy(self, raws: list[Any]) -> None:
        """Destroy every one of ``raws``; a failure does not keep the others alive."""
        if not raws:
            return
        error: Exception | None = None
        with self.context.active():
            for raw in raws:
                try:
                    call("cuEventDestroy", raw)
                except Exception as exc:  # noqa: BLE001 - raised below, once the others are destroyed
                    error = error or exc
        if error is not None:
            raise error


class Event:
    """One pooled event: record it on a stream, query it, give it back (Note [Event pool])."""

    __slots__ = ("_pool", "_raw", "_done", "__weakref__")

    def __init__(self, pool: EventPool, raw: Any) -> None:
        self._pool: EventPool | None = pool
        self._raw = raw  # the CUevent, None once given back
        self._done = False  # a query found it complete

    @property
    def context(self) -> Context:
        """The context the event belongs to: only its streams can record it."""
        if self._pool is None:
            raise ValueError("an event without a pool")
        return self._pool.context

    def record(self, stream: Any) -> Event:
        """Record the event on ``stream``, a stream of the event's context; return self."""
        if self._raw is None:
            raise ValueError("record() on an event that was released")
        with self.context.active():
            call("cuEventRecord", self._raw, stream_handle(stream))
        self._done = False
        return self

    def query(self) -> bool:
        """Return whether the work before the event completed; stays True once it is."""
        if self._done:
            return True
        if self._raw is None:
            raise ValueError("query() on an event that was released before completing")
        with self.context.active():
            if not query("cuEventQuery", self._raw):
                return False
        self._done = True
        self.release()
        return True

    def synchronize(self) -> None:
        """Wait until the work before the event has completed."""
        if self._done:
            return
        if self._raw is None:
            raise ValueError("synchronize() on an event that was released before completing")
        with self.context.active():
            call("cuEventSynchronize", self._raw)
        self._done = True
        self.release()

    def wait_on(self, stream: Any, context: Context | None = None) -> None:
        """Make ``stream`` wait for the event (``cuStreamWaitEvent``) without blocking the host.

        ``stream`` may belong to another context (another device): the
        driver allows that; ``context`` is the stream's, the event's when None.
        """
        if self._done:
            return
        if self._raw is None:
            raise ValueError("wait_on() on an event that was released before completing")
        with (context or self.context).active():
            call("cuStreamWaitEvent", stream_handle(stream), self._raw, 0)

    def release(self) -> None:
        """Give the raw event back to its pool. Idempotent."""
        raw, self._raw = self._raw, None
        pool = self._pool
        if raw is not None and pool is not None:
            pool.put(raw)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown, or the context is gone and its events with it
            pass

    def __repr__(self) -> str:
        state = "done" if self._done else "released" if self._raw is None else "pending"
        return f"<Event {state}>"


def active_primaries() -> list[Context]:
    """Return the owner of every device's primary context that is active in this process.

    Active means someone (shmshare, torch, CuPy) retained it: those are the
    contexts whose streams may use host memory this process pinned.
    Inactive ones are not created by asking.
    """
    contexts = []
    for device in range(call("cuDeviceGetCount")):
        _flags, active = call("cuDevicePrimaryCtxGetState", call("cuDeviceGet", device))
        if active:
            contexts.append(Context.primary(device))
    return contexts


def pool_of(table: dict[int, EventPool], context: Context, lock: Any) -> EventPool:
    """Return ``table``'s event pool for ``context`` (made, or made anew if closed, under ``lock``)."""
    with lock:
        pool = table.get(context.handle)
        if pool is None or pool.closed:
            pool = table[context.handle] = EventPool(context)
        return pool


def _last_event_pool(context: Context) -> EventPool:
    return pool_of(_last_events, context, _primary_lock)


def _forget_primary_after_fork() -> None:
    global _primary_lock
    _primary.clear()  # a forked child's contexts are not usable (see Note [Lazy driver])
    _last_events.clear()
    _primary_lock = threading.RLock()  # a thread that held it is gone (Note [At fork])


_fork.on_fork_in_child(3, _forget_primary_after_fork)
