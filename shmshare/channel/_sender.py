"""The sending end of a channel: a shm pool, leases, back-pressure.

Note [Leases]
    A block sent is *leased* to the receiver: the receiver's arrays hold a
    ``_native.Lease`` each, and when an array's last view dies its lease id
    comes back in a release frame. The pool reuses a block only when every
    lease on it is back and no local view (``empty()``) is alive -- the
    caching allocator's "a block used on another stream waits for its events",
    with a release message as the event (docs/architecture.md). Leases are counted
    per block here rather than as stream-ordered events in the allocator because
    releases come back in any order (Note [Streams of the shm provider] in
    ``memory/_shm.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .. import _empty_args, _fork, _native, _registry, tensors, wire
from .._errors import PeerDied, PeerRefused, ProtocolError, ShmshareTimeout
from .._lifetime import Closeable
from .._plane import SPARE_BYTES, LendingPool, host_cause
from .._plane.forks import ForkBook
from .._plane.pool import check_limit
from .._ring import BrokenRing
from .._timeouts import check_timeout
from ..memory import CachingAllocator, OutOfMemoryError, ShmSegment
from . import _lane
from ._announce import announce
from ._blocks import SenderStatistics, ViewDied, cannot_fit, exhausted
from ._inbox import Inbox
from ._overflow import Overflow
from ._protocol import BATCH, BYE, KIND, TREE
from ._report import SenderReport

__all__ = ["Sender", "DEFAULT_LIMIT", "SenderStatistics"]

DEFAULT_LIMIT = 1 << 30  # bytes of shared memory one sender's pool may hold
_POLL_SLICE = 0.05  # s: back-pressure waits in slices, so local views dying elsewhere count too
# s between looks at the socket for releases: they come in batches (receiver's _MAX_AGE), so
# looking on every send would cost a syscall a message for nothing
_DRAIN_EVERY = 0.0005
_DRAIN_FRAMES = 256  # frames one drain takes in at most (the rest wait for the next)
_BYE_WAIT = 30.0  # s close() waits for room for its goodbye behind batches still queued
# bytes of arrays one batch sends by value at most (Note [Inline arrays] in tensors.py): with the
# frame's own bytes they fit a ring slot (508), where a larger frame would go by the socket
INLINE_BYTES = 256


class Sender(Closeable):
    """Send numpy arrays, torch CPU tensors and nested batches of them, without copies.

    Made by :func:`shmshare.channel` or :func:`shmshare.connect`. One process
    uses a sender at a time (a forked child gets a fresh pool of its own).

    Parameters
    ----------
    conn : wire.Connection
        The connection to the receiver; the sender owns it.
    limit : int
        Bytes of shared memory the pool may hold; ``send``/``empty`` wait for
        releases past it and raise :class:`PoolExhausted` after their timeout.
    config : str, optional
        Allocator settings in ``SHMSHARE_ALLOC_CONF`` syntax (e.g.
        ``"expandable_segments:True"``).
    backend : {"memfd", "posix"}
        Shared memory for classic segments.
    on_overflow : callable, optional
        A pool full of what the receiver holds then goes past it, no wait (Note [Past the pool]).
    """

    LIMIT = "limit="  # the setting to name in errors (the loader's workers: pool_limit=)
    INLINE = INLINE_BYTES  # bytes of small arrays a batch sends by value (Note [Inline arrays]); 0: none
    _lock: threading.RLock
    _pool: LendingPool  # the blocks lent, their segments and spares (_plane/pool.py)
    _forks: ForkBook  # blocks a forked child may map (Note [Blocks a child inherits])
    _alloc: CachingAllocator  # _pool's, and its provider's
    _in_send: bool  # this thread is inside send(): a nested send() is refused
    _offered: bool  # rings offered on the connection (at the first send of this process)
    _last_drain: float
    _copied: int  # arrays copied into the pool by send(), and sent from it as they were
    _in_place: int
    _taken: list[int]
    _deadline: float | None
    _encoder: tensors.Encoder
    _refused: str | None  # why the connection ended on purpose (a REFUSE frame, a broken peer)

    def __init__(self, conn: wire.Connection, *, limit: int = DEFAULT_LIMIT,
                 config: str | None = None, backend: str = "memfd",
                 on_overflow: Callable[[int], None] | None = None) -> None:
        check_limit(limit)
        self._conn = conn
        self._limit, self._config, self._backend, self._on_overflow = limit, config, backend, on_overflow
        self._closed = False
        self._closing = False  # close() was called, maybe from another thread: waits stop
        self._peer_dead = False
        self._new_pool()
        self._conn.set_farewell({KIND: BYE})  # Note [Finalizers and goodbyes]; see close()
        _live.add(self)

    # -- public API -----------------------------------------------------------

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """Send `obj`: an array, a CPU tensor, or a dict/list/tuple of them and plain values.

        Arrays from :meth:`empty`/:meth:`zeros` go as they are; any other array is copied into
        the pool once. Waits up to `timeout` s for pool space (PoolExhausted after) and room to send.
        """
        if timeout is not None:
            check_timeout(timeout, "send")
        if type(obj) is np.ndarray and self._send_now(obj):
            return
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        with self._lock:
            if self._closed or self._peer_dead or self._in_send:
                self._check_usable()
            if now - self._last_drain >= _DRAIN_EVERY:
                self._last_drain = now
                self._drain()
                if self._peer_dead:
                    self._check_usable()
            elif self._pool.local_done:
                self._pool.drain_local()
            if not self._offered:  # at the first send of the process that sends (Note [Rings])
                self._offered = True
                with contextlib.suppress(ShmshareTimeout, OSError):  # a full socket or fd table
                    self._conn.offer_ring(timeout=0)  # the socket it stays
            taken = self._taken = []
            self._deadline = deadline
            self._inline_left, self._batch_inlined = self.INLINE, 0
            self._in_send = True
            self._pushing = False  # set while the frame may be going out (_send_draining)
            try:
                counts = self._copied, self._in_place
                tree = self._encoder.encode(obj)  # calls _place for each array
                if self._batch_inlined and len(tree) > self._conn.max_frame - 64:  # too large by value:
                    self._pool.give_back(taken)  # the pool for all of them (each lent once, again)
                    taken.clear()
                    self._inline_left, self._batch_inlined = 0, 0
                    self._copied, self._in_place = counts
                    tree = self._encoder.encode(obj)
                ann = self._ann
                if ann.to_announce or ann.grow or ann.drop:
                    header, fds = announce(ann, {KIND: BATCH, TREE: tree})
                else:  # the usual message: nothing to announce
                    header, fds = {KIND: BATCH, TREE: tree}, _NO_FDS
                self._send_draining(header, fds, deadline)
            except PeerDied as exc:
                self._take_refusal()
                self._on_peer_death()
                if self._refused is not None:
                    raise self._refusal() from exc
                raise PeerDied(_GONE) from exc
            except BrokenRing as exc:
                self._pool.give_back(taken)  # the push failed: nothing went
                raise self._broken(exc) from None
            except BaseException as exc:
                # nothing was sent: nothing is lent. A signal handler's exception raised while
                # the frame may have gone leaves the leases out (the receiver may have its arrays)
                if not self._pushing or isinstance(exc, (ShmshareTimeout, ProtocolError, ValueError)):
                    self._pool.give_back(taken)
                raise
            finally:
                self._in_send = False
            if fds or len(header) > 2:
                self._ann.commit()
            if not self._sent:  # a finalizer says goodbye too (Note [Finalizers and goodbyes])
                self._conn.set_farewell({KIND: BYE})
            self._sent += 1
            self._inlined += self._batch_inlined

    def send_many(self, objs: Iterable[Any], timeout: float | None = None) -> None:
        """Send each of `objs` (an iterable of batches) as its own batch, in order: ``send()`` in a
        loop, with less work per batch for arrays from :meth:`empty`. `timeout` bounds the waits
        for room of the whole call; when it raises, the batches before the failing one were sent."""
        if isinstance(objs, (dict, str, bytes, np.ndarray)) or tensors.is_torch_tensor(objs):
            raise TypeError(f"send_many takes an iterable of batches, got one {type(objs).__name__}; "
                            "send one batch with send()")
        check_timeout(timeout, "send_many")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            for obj in objs:
                if not (type(obj) is np.ndarray and self._send_now(obj)):
                    self.send(obj, _remaining(deadline))

    def empty(self, shape: Any, dtype: Any = np.float64, timeout: float | None = None) -> Any:
        """Return an uninitialized array in the pool: fill it, then send it with no copy.

        `dtype` may be a torch dtype, to get a torch tensor.
        """
        if timeout is not None:
            check_timeout(timeout, "empty")
        np_dtype, torch_dtype = _empty_args.alloc_dtypes(dtype)
        shp, nbytes = _empty_args.alloc_shape(shape, np_dtype.itemsize)
        want = nbytes or 1
        with self._lock:  # (not acquire/try: a signal's exception between the two would keep it held)
            if self._closed or self._peer_dead:
                self._check_usable()
            pool = self._pool
            if pool.local_done:
                pool.drain_local()  # releases from the receiver are taken in by send()
            held = pool.spare(want, self._sent)  # no drain: send() takes releases in often enough
            if held is None:
                deadline = None if timeout is None else time.monotonic() + timeout
                held = pool.take(want, self._sent, lambda n: self._malloc(n, deadline), True,
                                 self._drain_for_room())
            else:
                held.local = True
        # positional: keyword parsing costs more than the rest of the call
        lease = _native.Lease(self._alloc if held.free_to is None else held.free_to.alloc,
                              held.block.address, nbytes, False, ViewDied(pool.local_done, self, held))
        arr = np.ndarray(shp, np_dtype, lease)  # type: ignore[arg-type]  # positional: keywords cost
        return arr if torch_dtype is None else _empty_args.allocated(arr, torch_dtype)

    def zeros(self, shape: Any, dtype: Any = np.float64, timeout: float | None = None) -> Any:
        """Return a zero-filled array in the pool (a reused block is not zero by itself)."""
        out = self.empty(shape, dtype, timeout)
        out.fill(0) if isinstance(out, np.ndarray) else out.zero_()
        return out

    def recv_note(self, timeout: float | None = None) -> Any:
        """Return the next note sent by ``Receiver.tell``, waiting up to `timeout` s (releases are taken
        in meanwhile). ShmshareTimeout: none came; PeerDied: the receiver is gone, every note read."""
        check_timeout(timeout, "recv_note")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._closed:
                    self._check_usable()
                self._drain()  # releases sent before the note are taken in before it is read
                if self._notes:
                    return self._notes.popleft()
                if self._peer_dead:
                    self._check_usable()
            left = _remaining(deadline)
            if left is not None and left <= 0:
                raise ShmshareTimeout("no note from the receiver before the timeout")
            try:
                self._conn.poll(_POLL_SLICE if left is None else min(left, _POLL_SLICE))
            except ValueError:  # closed meanwhile, by another thread
                self._check_usable()

    def poll_releases(self) -> int:
        """Take in the receiver's releases now; return the leases still out."""
        with self._lock:
            if not self._closed:
                self._drain()
            return len(self._leases)

    def statistics(self) -> SenderStatistics:
        """Return what this sender holds now (releases that came are taken in first)."""
        with self._lock:
            if not self._closed:
                self._drain()
            stats = self._alloc.memory_stats()
            return SenderStatistics(
                self._sent, self._copied, self._in_place, len(self._leases),
                sum(h.block.size for h in set(self._leases.values())), self._ann.count,
                stats["reserved_bytes.all.current"], stats["allocated_bytes.all.current"],
                self._pool.spare_bytes, sum(h.block.size for h in self._pool.retired), self._inlined)

    def memory_stats(self) -> dict[str, int]:
        """Return the pool's statistics with PyTorch's key names."""
        return self._alloc.memory_stats()

    def empty_cache(self) -> None:
        """Give cached, unused segments back to the host."""
        with self._lock:
            self._drain()
            self._pool.free_spares()
            self._alloc.empty_cache()
            if self._pool.overflow is not None:
                self._pool.overflow.empty_cache()

    @property
    def allocator(self) -> CachingAllocator:
        """The caching allocator behind the pool (snapshots, stats, invariants)."""
        return self._alloc

    def close(self) -> None:
        """Say goodbye, close the connection and give back every block not in local use.

        The goodbye (so that the receiver sees a clean end, not a crash) is
        sent only if this process sent something on this sender.
        """
        self._closing = True  # a send() waiting (holding the lock) for room gives up within 0.1 s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Goodbye from a process that sent, or that made this sender and never handed it to
            # a child: a parent closing its copy of an end a child uses must not end the
            # child's stream, and a producer with nothing to send has not died.
            if not self._peer_dead and (self._sent or (self._owner == os.getpid()
                                                       and not self._handed)):
                try:  # behind every batch still queued: wait (taking releases in) for room
                    self._send_draining({KIND: BYE}, [], time.monotonic() + _BYE_WAIT,
                                        closing=True)
                except (PeerDied, ShmshareTimeout, OSError, ProtocolError):
                    pass  # the receiver will see a crash rather than a goodbye: it stopped reading
            self._conn.close()
            self._release_all()
        self._reap_closed()

    def _finalize(self) -> None:
        """Collected unclosed: warn, say goodbye only if it goes without waiting, release."""
        if self._closed:
            return
        if self._owner == os.getpid():
            warnings.warn(f"unclosed {self!r}; call close() or use it as a context manager",
                          ResourceWarning, stacklevel=2)
        self._closing = True
        with self._lock:  # free: nothing else can hold a sender that is being collected
            self._closed = True
            self._conn.close_nowait()  # the farewell, if the socket has room now
            self._release_all()
        self._reap_closed()

    def _release_all(self) -> None:
        """After the connection closed: every lease is void; give back all not in local use."""
        self._on_peer_death()
        self._pool.free_retired()
        for block in self._forks.free_now(force=True):  # a forked child's mapping keeps its pages
            self._pool.free_block(block)  # (past the pool: to its overflow)
        self._pool.drain_local()
        self._pool.free_spares()
        self._alloc.empty_cache()
        self._reap = True  # from now on a dying local view gives its block back at once

    def _reap_closed(self) -> None:
        """After close: free what local views that died left, and the segments they held.

        Runs from the views' callbacks, in any thread and in the middle of
        any bytecode (the garbage collector), so it only tries its lock: a
        thread that fails leaves the work to the holder, who looks again
        after letting go (Note [Callbacks from the garbage collector]).
        """
        while self._pool.local_done and not _fork.forking():  # (after a fork: the next death's)
            if not self._reap_lock.acquire(blocking=False):
                return
            try:
                self._pool.drain_local()
                self._alloc.empty_cache()
            finally:
                self._reap_lock.release()

    def __reduce__(self) -> Any:
        self._hand_over()  # a spawned child uses it now (without on_overflow: a callable of ours)
        return _rebuild, (self._conn, self._limit, self._config, self._backend)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("peer dead" if self._peer_dead else "open")
        return f"<shmshare Sender {state} leases={len(self._leases)} limit={self._limit}>"

    # -- placing arrays ---------------------------------------------------------

    def _place(self, obj: Any) -> Any:
        """The encoder's callback for each array: lease it to the receiver, copying it if needed."""
        if type(obj) is np.ndarray:
            arr, tdt = obj, b""
        else:
            arr, name = tensors.as_numpy(obj)
            tdt = name.encode() if name else b""
        dt = _DTYPE_BYTES.get(arr.dtype)
        if dt is None:
            dt = tensors.desc_dtype_bytes(arr.dtype)
        ptr, lo, span = _native.extent(arr)
        if span == 0:
            return tensors.pack_desc(0, 0, 0, dt, arr.shape, arr.strides, tdt)
        held = self._pool.find(ptr + lo, span)
        if held is None and 0 < arr.nbytes <= self._inline_left:  # by value (Note [Inline arrays])
            self._inline_left -= arr.nbytes
            self._batch_inlined += 1
            return tensors.pack_inline(dt, arr.shape, arr.dtype.itemsize, tensors.c_bytes(arr), tdt)
        if held is None:
            held = self._pool.copy_in(arr, ptr, span, self._sent,
                                      lambda n: self._malloc(n, self._deadline), self._drain_for_room())
            strides = tensors.c_strides(arr.dtype.itemsize, arr.shape)
            ptr = held.block.address
            self._copied += 1
        else:
            strides = arr.strides
            self._in_place += 1
        lease = self._pool.lend(held)
        self._taken.append(lease)
        seg = held.seg
        ann = self._ann
        if seg.id not in ann.announced and seg not in ann.to_announce:
            ann.to_announce.append(seg)
        return tensors.pack_desc(seg.id, lease, ptr - seg.address, dt, arr.shape, strides, tdt)

    def _send_now(self, arr: np.ndarray) -> bool:
        """The fast lane (Note [Fast lane]): `arr` lies in a block of an announced segment and
        the ring has room now. False: nothing was lent or sent; send() it the usual way."""
        with self._lock:
            if self._closed or self._peer_dead or self._in_send or not self._offered:
                return False
            pool = self._pool
            now = time.monotonic()
            if now - self._last_drain >= _DRAIN_EVERY:
                self._last_drain = now
                self._drain()
                if self._peer_dead:
                    return False
            elif pool.local_done:
                pool.drain_local()
            dt = _DTYPE_BYTES.get(arr.dtype)
            ptr, lo, span = _native.extent(arr)
            held = pool.held.get(ptr + lo)  # the whole block, as empty() gave it: no search
            if held is None or held.spare or span > held.block.size or not span or dt is None:
                held = pool.find(ptr + lo, span) if span and dt is not None else None
            ann = self._ann
            if held is None and dt is not None and 0 < arr.nbytes <= self.INLINE:  # Note [Inline arrays]
                try:
                    if not self._conn.send_now(_lane.frame_by_value, dt, arr):
                        return False
                except BrokenRing as exc:
                    raise self._broken(exc) from None
                self._inlined += 1
            elif held is None or held.seg.id not in ann.announced or ann.to_announce or ann.grow \
                    or ann.drop:
                return False
            else:
                seg, lease = held.seg, pool.lend(held)
                try:
                    sent = self._conn.send_now(_lane.frame, seg.id, lease, ptr - seg.address, dt,
                                               arr.shape, arr.strides)
                except BrokenRing as exc:
                    pool.give_back((lease,))  # nothing went out
                    raise self._broken(exc) from None
                if not sent:
                    pool.give_back((lease,))  # nothing went out
                    return False
                self._in_place += 1
            if not self._sent:
                self._conn.set_farewell({KIND: BYE})
            self._sent += 1
            return True

    def _drain_for_room(self) -> Callable[[], None] | None:
        """What the pool runs for want of a spare: take in the releases queued (if any can come)."""
        return self._drain if self._leases and not self._peer_dead else None

    def _send_draining(self, header: dict[str, Any], fds: list[int], deadline: float | None,
                       closing: bool = False) -> None:
        """Send one frame; while the socket is full, keep taking in the receiver's releases.

        A receiver whose own releases cannot get through would otherwise wait
        on us while we wait on it. Unless `closing` (close()'s goodbye), a
        close() from another thread ends the wait with ValueError.
        """
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._pushing = True
                self._conn.send(header, fds, _POLL_SLICE if left is None or left > _POLL_SLICE
                                else left)
                return
            except ShmshareTimeout:
                if left is not None and left <= _POLL_SLICE:
                    raise
                if self._closing and not closing:
                    raise ValueError("this Sender was closed while send() waited for room on "
                                     "the socket") from None
                self._drain()
                if self._peer_dead:
                    raise PeerDied("the receiver went away while the socket was full") from None

    def _malloc(self, nbytes: int, deadline: float | None) -> Any:
        if nbytes > self._limit:
            raise cannot_fit(nbytes, self._limit, None, None, self.LIMIT)
        while True:
            try:
                return self._alloc.malloc(nbytes)
            except OutOfMemoryError as exc:
                if self._pool.spare_bytes:
                    self._pool.free_spares()  # blocks kept for other sizes: give them back first
                    continue
                host = host_cause(exc)
                if self._pool.overflow is not None and host is None:  # full of what the receiver holds
                    return self._pool.overflow.malloc(nbytes, self._drain, self._alloc)
                if not self._pool.held and not self._pool.local_done:  # empty: no wait helps
                    raise cannot_fit(nbytes, self._limit, exc.size, host, self.LIMIT) from host or exc
                left = _remaining(deadline)
                if left is not None and left <= 0:
                    raise exhausted(nbytes, self._limit, self._leases, self._pool.held, host,
                                    self.LIMIT) from exc
                if self._peer_dead:  # nothing comes back, and nothing could be sent
                    raise PeerDied("the receiver went away while this sender waited for room in its pool") from exc
                self._conn.poll(_POLL_SLICE if left is None else min(left, _POLL_SLICE))  # a release, a view
                if self._closing:
                    raise ValueError("this Sender was closed while it waited for room in its pool") from exc
                self._drain()

    # -- leases and releases ----------------------------------------------------

    def _drain(self) -> None:
        """Take in local views that died and every release frame already queued."""
        self._pool.drain_local()
        if self._peer_dead:
            return
        try:
            for _ in range(_DRAIN_FRAMES):  # bounded: a receiver flooding frames stalls no send
                if (got := self._conn.recv_nowait()) is None:
                    break
                self._inbox.take(*got)
                if self._inbox.refused is not None:
                    self._refused = self._inbox.refused
        except PeerDied:
            self._on_peer_death()
        except (ProtocolError, PeerRefused, TypeError) as exc:
            self._broken(exc)

    def _broken(self, exc: Exception) -> ProtocolError:
        """The receiver broke the protocol: the connection ends here, once; every later call says why."""
        self._refused = f"the receiver broke the protocol, so this sender closed the connection: {exc}"
        self._conn.close()
        self._on_peer_death()
        return self._refusal()

    def _take_refusal(self) -> None:
        """The receiver hung up: read what it said before (a REFUSE frame says why)."""
        if self._refused is None:
            self._refused = self._inbox.refusal(self._conn)

    def _refusal(self) -> ProtocolError:
        return ProtocolError(self._refused)

    def _on_peer_death(self) -> None:
        """The receiver is gone: every lease is back (its mapping, not us, keeps its arrays).

        It may have closed the channel and kept its arrays, so the pages of
        every segment it saw must never be hole-punched, only unmapped here:
        its mapping keeps them for as long as it needs them.
        """
        self._peer_dead = True
        for seg in self._provider.segments.values():
            if self._ann.knows(seg):
                seg.keep_pages = True
        self._pool.borrower_gone()  # its arrays may still be read: their blocks are retired

    # -- lifecycle ---------------------------------------------------------------

    def _new_pool(self) -> None:
        self._lock = threading.RLock()
        self._reap_lock = threading.Lock()  # _reap_closed only
        self._reap = False  # closed and released: dying local views free at once
        self._refused = None  # why the connection ended on purpose
        self._owner = os.getpid()
        self._handed = False  # a child may use it too (forked or spawned): see close()
        pool = self._pool = LendingPool(self._limit, self._backend, self._config,
                                        min(self._limit // 8, SPARE_BYTES))
        self._provider, self._ann, self._alloc = pool.provider, pool.segments, pool.alloc
        self._leases = pool.leases  # lease id -> held block (the pool's)
        self._forks = pool.retirer = ForkBook()  # Note [Blocks a child inherits]
        self._inbox = Inbox(pool)  # what comes back: releases, notes, a refusal
        self._notes = self._inbox.notes  # Receiver.tell's, unread
        self._sent = self._copied = self._in_place = self._inlined = 0
        self._inline_left = self._batch_inlined = 0  # what the send in progress may still inline, and did
        self._last_drain = 0.0
        self._encoder = tensors.Encoder(self._place)
        self._taken = []  # lease ids the send in progress took (under the lock)
        self._deadline = None  # the send in progress's deadline
        self._in_send = False  # this thread is inside send(): a nested send() is refused
        self._offered = False
        pool.overflow = None if self._on_overflow is None else Overflow(
            self._backend, self._config, self._ann.on_segment_event, self._on_overflow)
        _registry.register("senders", self, SenderReport())  # again in a fork child: its own notes

    def _after_fork_in_child(self) -> None:
        # Never the parent's blocks: a pool of its own. The provider forgets the parent's fds and keeps
        # mapped only the segments an array from empty() may point into (Note [Segments in a forked child]).
        in_use = {h.seg.id for h in self._pool.held.values() if h.local}
        _inherited.append(self._provider.after_fork_in_child(in_use))  # never reused
        if self._pool.overflow is not None:
            _inherited.append(self._pool.overflow.after_fork_in_child(in_use))
        self._new_pool()
        self._owner = os.getppid()  # its parent made it: a child that never sends says no goodbye

    def _hand_over(self) -> None:
        """A child may use this sender now: this process says goodbye only if it sent."""
        self._handed = True
        if not self._sent:
            self._conn.set_farewell(None)

    def _check_usable(self) -> None:
        if self._in_send:
            raise RuntimeError("send() was called while this thread's send() was still packing a "
                               "batch (from a callback or __del__); send from the outside instead")
        if self._closed:
            raise ValueError("this Sender is closed")
        if self._peer_dead:
            if self._refused is not None:
                raise self._refusal()
            raise PeerDied(_GONE)


_live: weakref.WeakSet[Sender] = weakref.WeakSet()
_inherited: list[list[ShmSegment]] = []  # in a forked child: parent segments still mapped


def _after_fork() -> None:
    for sender in list(_live):
        sender._after_fork_in_child()


def _after_fork_in_parent() -> None:
    for sender in list(_live):
        sender._hand_over()
        # The child maps the blocks of its arrays from empty(): not reused. Without the lock: a
        # thread holding it may wait for a local view's block, which no lender frees until this
        # handler is done (Note [At fork]); no block stops being local meanwhile.
        sender._forks.forked([addr for addr, h in list(sender._pool.held.items()) if h.local])


_fork.on_fork_in_child(5, _after_fork)
_fork.on_fork_in_parent(_after_fork_in_parent)


def _rebuild(conn: wire.Connection, limit: int, config: str | None, backend: str) -> Sender:
    return Sender(conn, limit=limit, config=config, backend=backend)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


_DTYPE_BYTES = tensors.DTYPE_BYTES  # the descriptor bytes of dtypes seen: a dict on the hot path
_NO_FDS: list[int] = []
_GONE = "the receiver is gone; its arrays stay valid, but nothing more can be sent on this channel"
