"""The driver model's streams, events and graph capture: work runs in stream order (see driver_model.py).

Note [Stream order in the model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every stream is a FIFO queue of operations (copies, memsets, event
records, waits, the "long kernel" a test enqueues with ``hold``). An
operation executes as soon as it is at the head of its queue and nothing
blocks it: a hold not yet finished, a host word not yet written
(``cuStreamWaitValue32``), or an operation of another stream it must follow
(``cuStreamWaitEvent``, legacy default stream semantics). Copies and
memsets touch memory only when they execute, so a held stream holds them.
After every call, ``finish`` and ``settle`` the queues are run to a fixed
point. A synchronous wait (``cuStreamSynchronize``, ``cuEventSynchronize``,
``cuCtxSynchronize``, a copy that must complete) completes everything it
waits for, holds included, since a kernel finishes eventually; only a host
word wait needs the host to write the word (polled for up to 120 s).
Queries never force anything.

When an operation that touches a physical allocation executes while an
operation enqueued earlier on another stream, still pending, writes it
(or reads it, when this one writes), the two are unordered: a race on a
GPU. The model raises AssertionError naming both streams and keeps the
message in ``violations`` (the fixture fails the test on it, in case the
library swallowed the exception).
"""

from __future__ import annotations

import ctypes
import enum
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

WAIT_LIMIT = 120.0  # s: a synchronous wait on a host word fails the test after this long


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908


class CaptureStatus(enum.IntEnum):  # CUstreamCaptureStatus
    CU_STREAM_CAPTURE_STATUS_NONE = 0
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2


class CaptureMode(enum.IntEnum):  # CUstreamCaptureMode
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
    CU_STREAM_CAPTURE_MODE_RELAXED = 2


STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit ordering with the legacy stream
STREAM_FLAGS = STREAM_NON_BLOCKING
EVENT_FLAGS = 1 | 2 | 4  # BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS
EVENT_DISABLE_TIMING, EVENT_INTERPROCESS = 2, 4
LEGACY_HANDLES = (0, 1)  # the NULL stream and CU_STREAM_LEGACY: the current context's legacy stream
PER_THREAD_HANDLE = 2  # CU_STREAM_PER_THREAD
IPC_HANDLE_SIZE = 64  # CU_IPC_HANDLE_SIZE
IPC_EVENT_MAGIC = b"driver-model-event"  # then the exported event's handle: valid in this model (and its forks)

# Calls that fail with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and invalidate every active
# capture, while a stream captures in GLOBAL mode (or THREAD_LOCAL mode, from that thread).
# Deliberately at least as strict as the driver (RELAXED mode lets some of them through
# there): code that runs from finalizers or deleters must not make them during a capture.
# The stream- and event-specific cases (synchronizing or querying a capturing stream, or an
# event recorded in a capture) are checked in their calls, in every mode.
# Event and stream queries are among them: torch's allocators defer theirs during a capture
# because cudaEventQuery is illegal then in GLOBAL mode. A thread whose interaction mode is
# RELAXED (cuThreadExchangeStreamCaptureMode) is not prohibited from any of them.
UNSAFE_DURING_CAPTURE = frozenset({
    "cuCtxSynchronize", "cuMemAlloc", "cuMemFree", "cuMemHostAlloc", "cuMemFreeHost",
    "cuMemHostRegister", "cuMemHostUnregister", "cuMemcpyHtoD", "cuMemcpyDtoH", "cuMemsetD8",
    "cuEventQuery", "cuEventSynchronize", "cuStreamQuery",
})


class Refused(Exception):
    """Raised inside the model to make the current call return ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = int(code)


@dataclass(eq=False)
class Op:
    """One operation in a stream's queue."""

    seq: int  # enqueue order over the whole model
    stream: Stream  # the queue it is in
    label: str  # what it is, for messages ("cuMemcpyHtoDAsync", "hold", ...)
    effect: Callable[[], None] | None = None  # what executing it does (writes memory)
    reads: frozenset[int] = frozenset()  # physical allocations it reads
    writes: frozenset[int] = frozenset()  # physical allocations it writes
    after: list[Op] = field(default_factory=list)  # operations of other streams it follows
    held: bool = False  # a hold: runs until finish() or a synchronous wait
    word: tuple[int, int] | None = None  # (host address, value): waits for *address >= value
    span: tuple[int, int] | None = None  # (device address, bytes) it reads or writes
    done: bool = False  # executed


@dataclass(eq=False)
class Capture:
    """A stream capture in progress (cuStreamBeginCapture)."""

    mode: int  # CUstreamCaptureMode
    thread: int  # threading.get_ident() of the caller of cuStreamBeginCapture
    status: CaptureStatus = CaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    ops: list[Op] = field(default_factory=list)  # captured, never executed


@dataclass(eq=False)
class Stream:
    """A stream: a queue of operations of one context."""

    handle: int  # what the caller sees (0 for a context's legacy stream)
    context: int  # the context current when it was created
    blocking: bool  # created without CU_STREAM_NON_BLOCKING: ordered with the legacy stream
    legacy: bool = False  # the context's legacy default stream
    queue: deque[Op] = field(default_factory=deque)  # pending operations, oldest first
    capture: Capture | None = None  # while capturing


@dataclass(eq=False)
class Event:
    """An event: complete once its latest record has executed (or when never recorded)."""

    handle: int
    context: int  # the context current when it was created
    flags: int
    record: Op | None = None  # the latest record outside a capture
    captured: Capture | None = None  # the capture its latest record went into
    source: Event | None = None  # for one opened by cuIpcOpenEventHandle: the exported event it stands for


class StreamsMixin:
    """Streams, events, stream-ordered execution and capture of the driver model (a mixin of
    DriverModel only so that no file grows past a few hundred lines; the state is DriverModel's)."""

    # --- the engine -----------------------------------------------------------------------------

    def _enqueue(self, stream: Stream, label: str, **kw: Any) -> Op:
        """Append an operation to ``stream`` (or its capture) and run what can run."""
        ctx = self.contexts[stream.context]
        after = list(kw.pop("after", []))
        if stream.legacy:
            capturing = [s for s in self._context_streams(stream.context) if s.blocking and s.capture]
            if capturing:  # work on the legacy stream would join their capture implicitly
                self._invalidate([s.capture for s in capturing if s.capture is not None])
                raise Refused(CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
            after += [s.queue[-1] for s in self._context_streams(stream.context)
                      if s.blocking and not s.legacy and s.queue]
        elif stream.blocking and stream.capture is None and ctx.legacy.queue:
            after.append(ctx.legacy.queue[-1])
        op = Op(next(self._seq), stream, label, after=after, **kw)
        if stream.capture is not None:
            stream.capture.ops.append(op)
            return op
        stream.queue.append(op)
        self._queues.add(stream)
        self._progress()
        return op

    def _context_streams(self, context: int) -> list[Stream]:
        """Return the context's streams, destroyed ones with work still pending included."""
        ctx = self.contexts[context]
        own = {s: None for s in [*self.streams.values(), *self._queues] if s.context == context and not s.legacy
               and s is not ctx.per_thread}
        return [ctx.legacy, ctx.per_thread, *own]

    def _progress(self) -> None:
        """Execute every operation that can execute, until none can."""
        moved = True
        while moved:
            moved = False
            for stream in list(self._queues):
                while stream.queue and self._ready(stream.queue[0]):
                    self._execute(stream.queue.popleft())
                    moved = True
                if not stream.queue:
                    self._queues.discard(stream)

    @staticmethod
    def _ready(op: Op) -> bool:
        if op.held:
            return False
        if op.word is not None and ctypes.c_uint32.from_address(op.word[0]).value < op.word[1]:
            return False
        return all(prior.done for prior in op.after)

    def _execute(self, op: Op) -> None:
        race = self._race(op)
        if op.effect is not None:
            op.effect()
        op.done = True
        if race is not None:
            self.violations.append(race)
            raise AssertionError(race)

    def _race(self, op: Op) -> str | None:
        """Name an earlier pending operation of another stream that ``op`` is unordered with."""
        if not (op.reads or op.writes):
            return None
        for stream in self._queues:
            if stream is op.stream:
                continue
            for other in stream.queue:
                if other.seq < op.seq and (other.writes & (op.reads | op.writes) or other.reads & op.writes):
                    return (f"unordered access: {op.label} on stream {self._name(op.stream)} ran while "
                            f"{other.label} enqueued earlier on stream {self._name(stream)} was pending on "
                            f"the same device memory (order them with an event, or synchronize)")
        return None

    def _name(self, stream: Stream) -> str:
        kind = "legacy" if stream.legacy else ("per-thread" if stream.handle == PER_THREAD_HANDLE else "")
        return f"{kind or hex(stream.handle)} of context 0x{stream.context:x}"

    def _force(self, targets: Iterable[Op], what: str) -> None:
        """Complete ``targets`` and all they wait for, holds included; poll host words."""
        targets = [op for op in targets if not op.done]
        deadline = time.monotonic() + WAIT_LIMIT
        while True:
            needed = self._closure(targets)
            if not needed:
                return
            for op in needed:
                op.held = False  # a kernel finishes eventually
            self._progress()
            if all(op.done for op in targets):
                return
            words = [op for op in needed if not op.done and op.word is not None]
            waits = ", ".join(f"host word 0x{op.word[0]:x} >= {op.word[1]} on stream {self._name(op.stream)}"
                              for op in words if op.word is not None)
            assert words, f"{what} never completed, and it waits for no host word"
            if time.monotonic() >= deadline:  # a bound on the wait (a hang guard), not a speed check
                raise TimeoutError(f"{what} never completed: it waits for {waits}")
            self._lock.release()  # let other threads call the model (or write the word) meanwhile
            try:
                time.sleep(0.001)
            finally:
                self._lock.acquire()

    @staticmethod
    def _closure(targets: Iterable[Op]) -> set[Op]:
        """Return the pending operations that ``targets`` wait for, themselves included."""
        needed: set[Op] = set()
        work = list(targets)
        while work:
            op = work.pop()
            if op.done or op in needed:
                continue
            needed.add(op)
            queue = op.stream.queue
            for prior in queue:
                if prior is op:
                    break
                work.append(prior)
            work.extend(op.after)
        return needed

    def _pending_on(self, start: int, size: int) -> list[Op]:
        """Return the pending operations (any stream, any context) touching device [start, start + size)."""
        return [op for stream in self._queues for op in stream.queue
                if op.span is not None and op.span[0] < start + size and start < op.span[0] + op.span[1]]

    # --- lookups --------------------------------------------------------------------------------

    def _stream(self, handle: Any) -> Stream:
        """Return the stream ``handle`` names for the current context; INVALID_HANDLE if another's."""
        number, current = int(handle), self._current()
        if number in LEGACY_HANDLES:
            return self.contexts[current].legacy
        if number == PER_THREAD_HANDLE:
            return self.contexts[current].per_thread
        stream = self.streams.get(number)
        assert stream is not None, f"unknown (or destroyed) stream 0x{number:x}"
        if stream.context != current:
            raise Refused(CUresult.CUDA_ERROR_INVALID_HANDLE)
        return stream

    def _event(self, handle: Any, own_context: bool = True) -> Event:
        event = self.events.get(int(handle))
        assert event is not None, f"unknown (or destroyed) event 0x{int(handle):x}"
        if own_context and event.context != self._current():
            raise Refused(CUresult.CUDA_ERROR_INVALID_HANDLE)
        return event

    # --- capture ---------------------------------------------------------------------------------

    def _captures(self) -> list[Capture]:
        streams = [*self.streams.values(), *(c.per_thread for c in self.contexts.values())]
        return [s.capture for s in streams if s.capture is not None
                and s.capture.status == CaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE]

    def _invalidate(self, captures: Iterable[Capture]) -> None:
        for capture in captures:
            capture.status = CaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED

    def _refuse_if_capturing(self, name: str) -> None:
        """Fail an unsafe call while a capture forbids it (UNSAFE_DURING_CAPTURE)."""
        me = threading.get_ident()
        mode = getattr(self._tls, "capture_mode", CaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        if mode == CaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED:
            return  # this thread chose to make potentially unsafe calls during captures
        active = self._captures()
        if mode == CaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL:
            active_here = [c for c in active if c.thread == me and c.mode != CaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED]
            if active_here:
                self._invalidate(active)
                raise Refused(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
            return
        if any(c.mode == CaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
               or (c.mode == CaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL and c.thread == me)
               for c in active):
            self._invalidate(active)
            raise Refused(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)

    def _refuse_capturing_stream(self, stream: Stream) -> None:
        if stream.capture is not None:
            self._invalidate(self._captures())
            raise Refused(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)

    def _cuStreamBeginCapture(self, stream: Any, mode: Any) -> Any:
        if int(stream) in LEGACY_HANDLES:
            return self._err(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)[:1]
        target = self._stream(stream)
        if target.capture is not None:
            return self._err(CUresult.CUDA_ERROR_ILLEGAL_STATE)[:1]
        target.capture = Capture(int(mode), threading.get_ident())
        return self._ok()[:1]

    def _cuStreamEndCapture(self, stream: Any) -> Any:
        target = self._stream(stream)
        capture = target.capture
        if capture is None:
            return self._err(CUresult.CUDA_ERROR_ILLEGAL_STATE)
        if capture.mode != CaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED and capture.thread != threading.get_ident():
            return self._err(CUresult.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
        target.capture = None
        if capture.status == CaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED:
            return self._err(CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        graph = next(self._ids)
        self.graphs[graph] = capture.ops
        return self._ok(self._wrap("CUgraph", graph))

    def _cuThreadExchangeStreamCaptureMode(self, mode: Any) -> Any:
        old = getattr(self._tls, "capture_mode", CaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        self._tls.capture_mode = CaptureMode(int(mode))
        return self._ok(self.types.CUstreamCaptureMode(int(old)))

    def _cuStreamIsCapturing(self, stream: Any) -> Any:
        target = self._stream(stream)
        if target.legacy and any(s.blocking and s.capture for s in self._context_streams(target.context)):
            return self._err(CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
        status = target.capture.status if target.capture is not None else CaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        return self._ok(self.types.CUstreamCaptureStatus(int(status)))

    def _cuGraphDestroy(self, graph: Any) -> Any:
        assert self.graphs.pop(int(graph), None) is not None, f"destroy of unknown graph {graph}"
        return self._ok()[:1]

    # --- streams -----------------------------------------------------------------------------------

    def _cuStreamCreate(self, flags: int) -> Any:
        if int(flags) & ~STREAM_FLAGS:
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)
        handle = next(self._ids)
        self.streams[handle] = Stream(handle, self._current(), blocking=not int(flags) & STREAM_NON_BLOCKING)
        return self._ok(self._wrap("CUstream", handle))

    def _cuStreamDestroy(self, stream: Any) -> Any:
        target = self._stream(stream)
        assert not target.legacy and target.handle != PER_THREAD_HANDLE, "destroy of a default stream"
        del self.streams[target.handle]  # its pending work still runs, as on a GPU
        return self._ok()[:1]

    def _cuStreamGetCtx(self, stream: Any) -> Any:
        number = int(stream)
        if number in (*LEGACY_HANDLES, PER_THREAD_HANDLE):
            if not self._current():
                return self._err(CUresult.CUDA_ERROR_INVALID_CONTEXT)
            return self._ok(self._wrap("CUcontext", self._current()))
        target = self.streams.get(number)
        assert target is not None, f"unknown (or destroyed) stream 0x{number:x}"
        return self._ok(self._wrap("CUcontext", target.context))

    def _cuStreamSynchronize(self, stream: Any) -> Any:
        target = self._stream(stream)
        self._refuse_capturing_stream(target)
        self._force(list(target.queue), f"cuStreamSynchronize({self._name(target)})")
        return self._ok()[:1]

    def _cuStreamQuery(self, stream: Any) -> Any:
        target = self._stream(stream)
        self._refuse_capturing_stream(target)
        return self._ok()[:1] if not target.queue else self._err(CUresult.CUDA_ERROR_NOT_READY)[:1]

    def _cuStreamWaitValue32(self, stream: Any, address: Any, value: int, flags: int) -> Any:
        assert int(flags) == 0, "only CU_STREAM_WAIT_VALUE_GEQ waits in this model"
        self._enqueue(self._stream(stream), "cuStreamWaitValue32", word=(int(address), int(value)))
        return self._ok()[:1]

    def _cuStreamWaitEvent(self, stream: Any, event: Any, flags: int) -> Any:
        target, waited = self._stream(stream), self._shared(self._event(event, own_context=False))  # any context's
        record = waited.record  # the latest record at the time of this call; a later one does not count
        self._enqueue(target, "cuStreamWaitEvent", after=[record] if record is not None else [])
        return self._ok()[:1]

    def _cuCtxSynchronize(self) -> Any:
        pending = [op for s in self._context_streams(self._current()) for op in s.queue]
        self._force(pending, "cuCtxSynchronize")
        return self._ok()[:1]

    # --- events ------------------------------------------------------------------------------------

    def _cuEventCreate(self, flags: int) -> Any:
        flags = int(flags)
        if flags & ~EVENT_FLAGS or (flags & EVENT_INTERPROCESS and not flags & EVENT_DISABLE_TIMING):
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)
        handle = next(self._ids)
        self.events[handle] = Event(handle, self._current(), flags)
        return self._ok(self._wrap("CUevent", handle))

    def _cuEventDestroy(self, event: Any) -> Any:
        del self.events[self._event(event).handle]
        return self._ok()[:1]

    def _cuEventRecord(self, event: Any, stream: Any) -> Any:
        target, own = self._stream(stream), self._event(event, own_context=False)
        if own.context != target.context:
            return self._err(CUresult.CUDA_ERROR_INVALID_HANDLE)[:1]
        recorded = self._shared(own)
        op = self._enqueue(target, "cuEventRecord")
        if target.capture is not None:
            recorded.captured = target.capture
        else:
            recorded.record, recorded.captured = op, None
        return self._ok()[:1]

    def _event_in_capture(self, event: Event) -> None:
        capture = event.captured
        if capture is not None and capture.status == CaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            self._invalidate(self._captures())
            raise Refused(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)

    def _cuEventQuery(self, event: Any) -> Any:
        waited = self._shared(self._event(event))
        self._event_in_capture(waited)
        if waited.record is None or waited.record.done:
            return self._ok()[:1]
        return self._err(CUresult.CUDA_ERROR_NOT_READY)[:1]

    def _cuEventSynchronize(self, event: Any) -> Any:
        waited = self._shared(self._event(event))
        self._event_in_capture(waited)
        if waited.record is not None:
            self._force([waited.record], "cuEventSynchronize")
        return self._ok()[:1]

    @staticmethod
    def _shared(event: Event) -> Event:
        return event.source if event.source is not None else event

    def _cuIpcGetEventHandle(self, event: Any) -> Any:
        own = self._event(event)
        if own.flags & (EVENT_INTERPROCESS | EVENT_DISABLE_TIMING) != EVENT_INTERPROCESS | EVENT_DISABLE_TIMING:
            return self._err(CUresult.CUDA_ERROR_INVALID_HANDLE)  # needs INTERPROCESS | DISABLE_TIMING
        raw = IPC_EVENT_MAGIC + self._shared(own).handle.to_bytes(8, "little")
        buffer = ctypes.create_string_buffer(raw.ljust(IPC_HANDLE_SIZE, b"\0"), IPC_HANDLE_SIZE)
        self._keep.append(buffer)  # the handle points into it
        if self.real is None:
            return self._ok(types.SimpleNamespace(getPtr=lambda: ctypes.addressof(buffer)))
        return self._ok(self.real.CUipcEventHandle(ctypes.addressof(buffer)))

    def _cuIpcOpenEventHandle(self, handle: Any) -> Any:
        raw = ctypes.string_at(int(handle.getPtr()), IPC_HANDLE_SIZE)
        if not raw.startswith(IPC_EVENT_MAGIC):
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)
        source = self.events.get(int.from_bytes(raw[len(IPC_EVENT_MAGIC):len(IPC_EVENT_MAGIC) + 8], "little"))
        assert source is not None, "open of an interprocess event its exporter destroyed"
        number = next(self._ids)
        self.events[number] = Event(number, self._current(), source.flags, source=source)
        return self._ok(self._wrap("CUevent", number))
