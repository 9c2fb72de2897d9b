"""bench_peers' transports: one direction of each, made in the parent, written by one forked child, read by another.

Every transport carries the same message: ``size`` bytes whose first 8 are the sequence number (little-endian)
and whose last byte is that number's low byte. ``fill=True`` (the throughput cells) writes every byte of the payload
first, as a producer that makes its data must; ``fill=False`` (the ping-pong cells) writes the header and the last
byte only. A reader checks both and answers the number.

A transport whose import fails is left out by the caller with :func:`missing`'s reason; nothing here imports a peer
at module level.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import queue
import shutil
import struct
import tempfile
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np

__all__ = ["WAIT", "LINKS", "Link", "missing", "cleanup", "capacity", "stamp", "check"]

WAIT = 60.0  # s: the longest any one send or receive may wait
_HDR = struct.Struct("<Q")
_BACKOFF = (50e-6, 2e-3)  # s: a writer's first and longest sleep while a ring without blocking sends is full


def stamp(view: np.ndarray, seq: int, fill: bool) -> None:
    """Write message `seq` into `view` (uint8): the payload if `fill`, then the last byte and the header."""
    if fill:
        view.fill(seq & 0xFF)
    else:
        view[-1] = seq & 0xFF
    _HDR.pack_into(view, 0, seq)


def check(buf: Any) -> int:
    """The sequence number of a message; RuntimeError if its last byte does not match it."""
    seq: int = _HDR.unpack_from(buf, 0)[0]
    if buf[-1] != seq & 0xFF:
        raise RuntimeError(f"message {seq}: last byte {int(buf[-1])}, expected {seq & 0xFF}")
    return seq


def _deadline_error(what: str) -> TimeoutError:
    return TimeoutError(f"{what}: nothing within {WAIT:g} s")


class Link:
    """One direction: ``writer()`` in one child, ``reader()`` in the other; the parent keeps and closes the rest.

    ``depth``: how many messages the transport may hold between the two ends (its queue or ring).
    """

    label = "?"

    def __init__(self, size: int, depth: int) -> None:
        self.size, self.depth = size, depth

    def writer(self) -> Any:  # an object with send(seq, fill), ready() and close()
        raise NotImplementedError

    def reader(self) -> Any:  # an object with recv() -> seq, ready() and close()
        raise NotImplementedError

    def close(self) -> None:
        """In the parent, once both children are gone."""

    def ready(self) -> None:
        """In a child, after both ends are set up (before the first message)."""

    def send(self, seq: int, fill: bool) -> None:
        raise NotImplementedError

    def recv(self) -> int:
        raise NotImplementedError

    def end(self) -> None:
        """In a child, when it is done with its end."""


# -- shmshare ---------------------------------------------------------------------------------------------------


class ShmshareLink(Link):
    """``shmshare.channel()``: the writer fills ``tx.empty()`` and sends it; the reader ``rx.recv()``s it.

    Rings or not is the environment's ``SHMSHARE_RINGS``, read by the writer at its first send: the caller sets it
    in the parent before this is made and the children forked. The pool's limit is ``depth`` payloads (64 MiB at
    least): the writer waits for the reader's releases past it.
    """

    label = "shmshare"

    def __init__(self, size: int, depth: int) -> None:
        super().__init__(size, depth)
        import shmshare

        self.tx, self.rx = shmshare.channel(limit=max(64 << 20, depth * size + (4 << 20)))

    def writer(self) -> Link:
        self.mine = self.tx
        return self

    def reader(self) -> Link:
        self.mine = self.rx
        return self

    def send(self, seq: int, fill: bool) -> None:
        a = self.tx.empty(self.size, np.uint8, timeout=WAIT)
        stamp(a, seq, fill)
        self.tx.send(a, timeout=WAIT)

    def recv(self) -> int:
        return check(self.rx.recv(timeout=WAIT))  # the array goes here: its block goes back to the writer

    def end(self) -> None:
        self.mine.close()  # only this child's end: the other copy was never used here

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


class ShmshareManyLink(ShmshareLink):
    """As ``shmshare``, the reader taking what has come with ``rx.recv_many(64)`` (at least one, waiting only
    for the first) and handing it out one at a time."""

    label = "shmshare recv_many"

    def __init__(self, size: int, depth: int) -> None:
        super().__init__(size, depth)
        self.got: list[Any] = []

    def recv(self) -> int:
        if not self.got:
            self.got = self.rx.recv_many(64, timeout=WAIT)
            self.got.reverse()
        return check(self.got.pop())


class ShmsharePlainLink(ShmshareLink):
    """As ``shmshare``, the writer filling a plain numpy array (``np.empty``) each message: up to 256 bytes it
    goes by value in the frame (Note [Inline arrays] in shmshare/tensors.py), past that it is copied into the pool."""

    label = "shmshare plain"

    def send(self, seq: int, fill: bool) -> None:
        a = np.empty(self.size, np.uint8)
        stamp(a, seq, fill)
        self.tx.send(a, timeout=WAIT)


# -- iceoryx2 ---------------------------------------------------------------------------------------------------


class IceoryxLink(Link):
    """iceoryx2 publish-subscribe of ``Slice[c_uint8]``: ``loan_slice_uninit`` + fill in place + ``send``.

    Zero-copy both ways: the reader checks the sample in the publisher's segment. A service of one publisher and
    one subscriber, no history, ``depth`` samples in the subscriber's buffer, safe overflow off and
    ``RetryUntilDelivered`` (the publisher waits when the buffer is full, never drops). The reader sleeps on an
    event service's listener, woken by the writer's ``notify()`` after each sample (iceoryx2's own
    event-based-communication pattern): without it a reader could only poll.
    """

    label = "iceoryx2"
    _count = 0

    def __init__(self, size: int, depth: int) -> None:
        super().__init__(size, depth)
        IceoryxLink._count += 1
        self.name = f"shmshare-bench-peers/{os.getpid()}/{IceoryxLink._count}"
        self.objs: list[Any] = []

    def _open(self) -> tuple[Any, Any, Any]:
        import iceoryx2 as iox2

        iox2.set_log_level(iox2.LogLevel.Error)
        node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
        deadline = time.monotonic() + WAIT
        while True:  # both children open_or_create at once: one may find the service half made
            try:
                data = (node.service_builder(iox2.ServiceName.new(self.name))
                        .publish_subscribe(iox2.Slice[ctypes.c_uint8])
                        .max_publishers(1).max_subscribers(1).history_size(0)
                        .subscriber_max_buffer_size(self.depth).subscriber_max_borrowed_samples(1)
                        .enable_safe_overflow(False).open_or_create())
                event = node.service_builder(iox2.ServiceName.new(self.name + "/wake")).event().open_or_create()
                return node, data, event
            except Exception:  # iceoryx2's errors have no common base: retry until the deadline, then re-raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def writer(self) -> Link:
        import iceoryx2 as iox2

        self.iox2 = iox2
        node, data, event = self._open()
        self.pub = (data.publisher_builder().initial_max_slice_len(self.size)
                    .allocation_strategy(iox2.AllocationStrategy.Static).max_loaned_samples(1)
                    .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered).create())
        self.notifier = event.notifier_builder().create()
        self.objs = [self.pub, self.notifier, data, event, node]
        return self

    def reader(self) -> Link:
        import iceoryx2 as iox2

        self.iox2 = iox2
        node, data, event = self._open()
        self.sub = data.subscriber_builder().create()
        self.listener = event.listener_builder().create()
        self.nap = iox2.Duration.from_millis(100)
        self.objs = [self.sub, self.listener, data, event, node]
        return self

    def ready(self) -> None:
        if hasattr(self, "pub"):
            self.pub.update_connections()

    def send(self, seq: int, fill: bool) -> None:
        sample = self.pub.loan_slice_uninit(self.size)
        view = np.frombuffer(sample.payload().as_memory_view(), np.uint8)
        stamp(view, seq, fill)
        del view
        sample.assume_init().send()
        self.notifier.notify()

    def recv(self) -> int:
        deadline = None
        while True:
            sample = self.sub.receive()
            if sample is not None:
                seq = check(np.frombuffer(sample.payload().as_memory_view(), np.uint8))
                sample.delete()  # back to the publisher now, not at the next collection
                return seq
            deadline = deadline or time.monotonic() + WAIT
            if time.monotonic() > deadline:
                raise _deadline_error("iceoryx2 receive")
            self.listener.timed_wait(self.nap)

    def end(self) -> None:
        # A forked child leaves by os._exit: no destructor would run. Drop the ports, services and node now,
        # so that iceoryx2 removes their files.
        for obj in self.objs:
            if hasattr(obj, "delete"):
                obj.delete()
        self.objs.clear()
        for attr in ("pub", "notifier", "sub", "listener"):
            self.__dict__.pop(attr, None)
        gc.collect()


# -- faster-fifo --------------------------------------------------------------------------------------------------


class FasterFifoLink(Link):
    """``faster_fifo.Queue`` of bytes: ``put(payload.tobytes())`` / ``get()``, raw (no pickling either way).

    Its circular buffer (shared memory, pthread mutex and condition variables) holds ``depth`` messages. The
    writer fills a reused numpy buffer and puts its bytes (one copy to bytes, one into the queue); the reader gets
    an owned ``bytes`` (one copy out of the queue, one to bytes).
    """

    label = "faster-fifo"

    def __init__(self, size: int, depth: int) -> None:
        super().__init__(size, depth)
        import faster_fifo

        self.q = faster_fifo.Queue(max_size_bytes=depth * (size + 64) + 4096, dumps=_same, loads=bytes)

    def writer(self) -> Link:
        self.buf = np.empty(self.size, np.uint8)
        return self

    def reader(self) -> Link:
        return self

    def send(self, seq: int, fill: bool) -> None:
        stamp(self.buf, seq, fill)
        self.q.put(self.buf.tobytes(), timeout=WAIT)

    def recv(self) -> int:
        try:
            return check(self.q.get(timeout=WAIT))
        except queue.Empty:
            raise _deadline_error("faster-fifo get") from None


def _same(x: Any) -> Any:
    return x


# -- tachyon-ipc --------------------------------------------------------------------------------------------------


class TachyonLink(Link):
    """tachyon-ipc's ``TachyonBus``: ``acquire_tx`` + fill in place + commit + ``flush``, ``acquire_rx`` zero-copy.

    The reader listens on a Unix socket (it makes the ring) and the writer connects. The reader publishes its
    progress only every 32 messages (the core's BATCH_SIZE; Python has no call to do it sooner), so the ring must
    hold 32 messages or the writer never sees room again: its capacity is the power of two that holds 34. A full
    ring is an error at ``acquire_tx`` (no blocking send): the writer sleeps 50 us, doubling to 2 ms, and tries
    again. The reader spins 10000 times (tachyon's default) before it sleeps on a futex.
    """

    label = "tachyon-ipc"
    _count = 0
    _dir: str | None = None

    def __init__(self, size: int, depth: int) -> None:
        super().__init__(size, depth)
        if TachyonLink._dir is None:
            TachyonLink._dir = tempfile.mkdtemp(prefix="bench-peers-")
        TachyonLink._count += 1
        self.path = os.path.join(TachyonLink._dir, f"t{TachyonLink._count}.sock")
        self.capacity = capacity(size)

    def writer(self) -> Link:
        import tachyon

        self.err = tachyon.TachyonError
        self.bus = tachyon.TachyonBus()
        deadline = time.monotonic() + WAIT
        while True:  # until the reader listens
            try:
                self.bus.connect(socket_path=self.path)
                return self
            except (ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)

    def reader(self) -> Link:
        import tachyon

        self.bus = tachyon.TachyonBus()
        self.bus.listen(socket_path=self.path, capacity=self.capacity)  # returns once the writer connected
        return self

    def send(self, seq: int, fill: bool) -> None:
        nap, deadline = _BACKOFF[0], None
        while True:
            try:
                tx = self.bus.acquire_tx(self.size)
                break
            except self.err:  # full (or closed: the deadline says so)
                deadline = deadline or time.monotonic() + WAIT
                if time.monotonic() > deadline:
                    raise
                time.sleep(nap)
                nap = min(nap * 2, _BACKOFF[1])
        with tx:
            with memoryview(tx) as m:
                view = np.frombuffer(m, np.uint8, count=self.size)
                stamp(view, seq, fill)
                del view
            tx.actual_size = self.size
        self.bus.flush()

    def recv(self) -> int:
        with self.bus.acquire_rx() as rx, memoryview(rx) as m:
            return check(np.frombuffer(m, np.uint8, count=rx.actual_size))

    def end(self) -> None:
        self.bus.destroy()

    def close(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def capacity(size: int) -> int:
    """The tachyon ring for 34 messages of `size` (64-byte header, 64-byte alignment), a power of two."""
    need = 34 * (((size + 63) & ~63) + 64)
    return 1 << (need - 1).bit_length()


# -- multiprocessing.Queue ------------------------------------------------------------------------------------------


class MpQueueLink(Link):
    """``multiprocessing.Queue(maxsize=depth)`` of bytes: ``put(payload.tobytes())`` / ``get()`` (pickled, pipe)."""

    label = "mp.Queue"

    def __init__(self, size: int, depth: int) -> None:
        super().__init__(size, depth)
        self.q = mp.get_context("fork").Queue(maxsize=depth)

    def writer(self) -> Link:
        self.buf = np.empty(self.size, np.uint8)
        return self

    def reader(self) -> Link:
        return self

    def send(self, seq: int, fill: bool) -> None:
        stamp(self.buf, seq, fill)
        self.q.put(self.buf.tobytes(), timeout=WAIT)

    def recv(self) -> int:
        try:
            return check(self.q.get(timeout=WAIT))
        except queue.Empty:
            raise _deadline_error("mp.Queue get") from None

    def end(self) -> None:
        self.q.close()
        self.q.join_thread()  # the feeder has written everything (the reader has it all by now)

    def close(self) -> None:
        self.q.close()


# -- the hand-rolled ring --------------------------------------------------------------------------------------------


class RingLink(Link):
    """A hand-rolled ring: ``depth`` reused stdlib ``SharedMemory`` slots, message k in slot k % depth.

    The SPSC index protocol is two counting semaphores (POSIX, futex-backed): ``free`` (slots the writer may fill,
    ``depth`` at first) and ``filled``. Writer: acquire ``free``, fill slot, release ``filled``; reader: acquire
    ``filled``, read the slot in place, release ``free``. Each side counts its own index. The slots are made and
    faulted in by the parent, as a ring is warm by design.
    """

    label = "ring"

    def __init__(self, size: int, depth: int) -> None:
        super().__init__(size, depth)
        self.slots = [shared_memory.SharedMemory(create=True, size=size) for _ in range(depth)]
        self.views = [np.ndarray(size, np.uint8, buffer=s.buf) for s in self.slots]
        for v in self.views:
            v.fill(0)
        ctx = mp.get_context("fork")
        self.free, self.filled = ctx.Semaphore(depth), ctx.Semaphore(0)
        self.n = 0

    def writer(self) -> Link:
        return self

    def reader(self) -> Link:
        return self

    def send(self, seq: int, fill: bool) -> None:
        if not self.free.acquire(timeout=WAIT):
            raise _deadline_error("ring: a free slot")
        stamp(self.views[self.n % self.depth], seq, fill)
        self.n += 1
        self.filled.release()

    def recv(self) -> int:
        if not self.filled.acquire(timeout=WAIT):
            raise _deadline_error("ring: a filled slot")
        seq = check(self.views[self.n % self.depth])
        self.n += 1
        self.free.release()
        return seq

    def close(self) -> None:
        self.views.clear()  # the exports go before the slots close
        for s in self.slots:
            s.close()
            s.unlink()


# name: (class, the module it needs, environment for the cell)
LINKS: dict[str, tuple[type[Link], str, dict[str, str]]] = {
    "shmshare": (ShmshareLink, "shmshare", {"SHMSHARE_RINGS": "1"}),
    "shmshare no-rings": (ShmshareLink, "shmshare", {"SHMSHARE_RINGS": "0"}),
    "shmshare recv_many": (ShmshareManyLink, "shmshare", {"SHMSHARE_RINGS": "1"}),
    "shmshare plain": (ShmsharePlainLink, "shmshare", {"SHMSHARE_RINGS": "1"}),
    "iceoryx2": (IceoryxLink, "iceoryx2", {}),
    "faster-fifo": (FasterFifoLink, "faster_fifo", {}),
    "tachyon-ipc": (TachyonLink, "tachyon", {}),
    "mp.Queue": (MpQueueLink, "multiprocessing", {}),
    "ring": (RingLink, "multiprocessing.shared_memory", {}),
}

_WHY_NOT = {"tachyon": "needs gcc 14"}


def missing(module: str) -> str:
    """'' if `module` imports, else why not: '<pip name>: not installed (...)'."""
    try:
        __import__(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import means the transport is left out, with why
        dist = {"faster_fifo": "faster-fifo", "tachyon": "tachyon-ipc"}.get(module, module)
        hint = _WHY_NOT.get(module, f"{type(exc).__name__}: {exc}")
        return f"{dist}: not installed ({hint})"
    return ""


def cleanup() -> None:
    """In the parent at the end: the folder of tachyon's sockets."""
    if TachyonLink._dir is not None:
        shutil.rmtree(TachyonLink._dir, ignore_errors=True)
        TachyonLink._dir = None
