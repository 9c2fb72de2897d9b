"""The receiving end of a channel: segments mapped once, arrays as leases, releases in batches.

The books of each sender (its segments and what they cost) are in ``_books.py``,
the releases' way back (Note [Releases]) in ``_releases.py``, and what a
receiver checks of what it is sent in ``_plane/trust.py``.
"""

from __future__ import annotations

import collections
import itertools
import os
import select
import selectors
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Generic

import numpy as np

from .. import _fork, _native, tensors, wire
from .._errors import (
    FdLimitError,
    PeerDied,
    PeerRefused,
    ProtocolError,
    SegmentError,
    ShmshareError,
    ShmshareTimeout,
    making_fds,
)
from .._lifetime import Closeable
from .._listen import ACCEPT_PAUSE
from .._plane.trust import check_fd_room, default_max_peer_bytes, default_max_peer_segments
from .._timeouts import check_timeout
from .._typevars import T
from . import _lane
from ._books import Caps, Peer
from ._fences import FencedRelease, Fences, Pinning
from ._mapping import grow_and_drop, map_new, segment_of
from ._protocol import (
    BATCH,
    BYE,
    DROP,
    GROW,
    KIND,
    NEW,
    NOTE,
    REFUSE,
    TREE,
    VALUE,
    WHY,
)
from ._releases import Release, ReleaseQueue

__all__ = ["Receiver"]

_CLOSE_CHECK = wire._CLOSE_CHECK  # s: a wait looks this often whether close() was called
_WHY_MAX = 2000  # characters of a refusal told to the sender
_MAX_PEERS = 256  # connections a listen() receiver keeps at once, by default


class Receiver(Closeable, Generic[T]):
    """Receive batches sent by one sender (``channel()``) or many (``listen()``).

    ``recv()`` returns the batch with the same structure; arrays are views of
    the sender's pages, mapped read-only (``PROT_READ``) unless `writable`.
    Torch tensors come back as torch tensors: sharing that memory when
    `writable`, else as private copies (torch has no read-only tensors, and a
    write into a read-only mapping would be SIGSEGV); in a process that has
    not imported torch, as numpy arrays (Note [Tensors to a process without
    torch] in ``tensors.py``). A receiver is
    iterable, and ``fileno()``/``poll()`` let it sit in a selector.

    ``Receiver[T]`` is a receiver of `T`s for the type checker, as
    ``multiprocessing.Queue[T]`` is: the program says what its senders send
    (``rx: Receiver[dict[str, np.ndarray]]``), nothing checks it at run
    time, and an unparameterized ``Receiver`` receives ``Any``. Say
    ``np.ndarray`` for a tensor that may reach a process without torch.

    Parameters
    ----------
    writable : bool
        Map the senders' pages writable: received arrays may be changed in
        place, and the change is visible to the sender (it is its pool).
    trust_unsealed : bool
        Also map unsealed shared memory (POSIX shm, the ``backend="posix"``
        senders): the receiver trusts its senders not to truncate it, which
        would kill the receiver with SIGBUS (Note [Trust no fd]).
    max_peer_bytes, max_peer_segments : int, optional
        Caps on the address space and mappings one sender may make this
        receiver hold (Note [Caps per peer]); defaults follow the host. All
        senders together may hold four times as much.
    max_peers : int, optional
        Senders a ``listen()`` receiver keeps connected at once (256); more
        wait in the listen backlog until one leaves.
    pin : optional
        Page-lock each segment once it is mapped, and hold each release
        until a fence on the current stream says the device is done with it
        (Note [Fenced releases] in ``_fences.py``; the loader's, with CUDA).
    """

    def __init__(self, conns: Any = (), listener: wire.Listener | None = None, *,
                 writable: bool = False, trust_unsealed: bool = False,
                 max_peer_bytes: int | None = None, max_peer_segments: int | None = None,
                 max_peers: int | None = None, pin: Pinning | None = None) -> None:
        self._listener = listener
        self._fences = None if pin is None else Fences(pin)  # Note [Fenced releases]
        self._owner = os.getpid()
        self._writable = writable
        self._trust_unsealed = trust_unsealed
        self._caps = Caps(_positive(max_peer_bytes, "max_peer_bytes") or default_max_peer_bytes(),
                          _positive(max_peer_segments, "max_peer_segments")
                          or default_max_peer_segments())
        self._max_peers = _positive(max_peers, "max_peers") or _MAX_PEERS
        self._accept_paused_until = 0.0  # Note [A full fd table]
        self._numbers = itertools.count()
        self._peers: list[Peer] = [Peer(c, next(self._numbers)) for c in conns]
        self._sel: selectors.BaseSelector | None = None  # many senders: ready ones are selected
        self._ready: collections.deque[Peer] = collections.deque()
        self._closed = False
        self._releases = ReleaseQueue()  # Note [Releases]
        self._bye_seen = False
        self._later: Exception | None = None  # recv_many's error after its first batch
        if listener is not None or len(self._peers) > 1:
            self._sel = making_fds("epoll_create", selectors.DefaultSelector)
            if listener is not None:
                self._sel.register(listener, selectors.EVENT_READ, None)
            for p in self._peers:
                self._sel.register(p.conn._poll_fd(), selectors.EVENT_READ, p)
        _live.add(self)

    @property
    def path(self) -> str | None:
        """The socket path senders connect to (``listen()`` only)."""
        return self._listener.path if self._listener else None

    # -- receiving -------------------------------------------------------------

    def recv(self, timeout: float | None = None) -> T:
        """Return the next batch; raise PeerDied when the (or a) sender is gone.

        Everything a sender sent before it went is delivered first. With
        many senders (``listen()``, or several `conns`), a sender that closed
        on purpose just leaves; one that died raises PeerDied once, and the
        receiver goes on with the others.
        """
        return self._recv(timeout)[1]

    def recv_many(self, max_count: int, timeout: float | None = None) -> list[T]:
        """Return at least one and at most `max_count` batches: the first as ``recv()`` does, then
        those already there. An error met after the first is raised by the next receive."""
        if type(max_count) is not int or max_count < 1:
            raise ValueError(f"max_count must be a positive int, got {max_count!r}")
        out = [self._recv(timeout)[1]]
        try:
            while len(out) < max_count and self._ready_now():
                out.append(self._recv(0)[1])
        except ShmshareTimeout:
            pass  # what was there was not a batch (a goodbye, a wake-up)
        except Exception as exc:  # noqa: BLE001 - kept for the next call: nothing is lost
            self._later = exc
            while exc is not None:  # tracebacks keep this frame, whose `out` would pin the batches
                exc.__traceback__, exc = None, exc.__cause__ or exc.__context__  # type: ignore[assignment]
            self._later.add_note("shmshare: met by recv_many() after its first batch")
        return out

    def recv_from(self, timeout: float | None = None) -> tuple[int, T]:
        """Return ``(sender, batch)``: the next batch and the number of the sender that sent it.

        Senders are numbered from 0 in the order of `conns`, then in the order
        ``listen()`` accepts them. A PeerDied raised here names the sender in
        its ``sender`` attribute.
        """
        peer, batch = self._recv(timeout)
        return peer.number, batch

    def tell(self, sender: int, value: Any, timeout: float | None = None) -> None:
        """Send `value`, plain msgpack data (no arrays), to `sender`'s ``Sender.recv_note``.

        PeerDied: that sender is gone; ShmshareTimeout: its socket stayed full.
        """
        check_timeout(timeout, "tell")
        self._check_open()
        for peer in self._peers:
            if peer.number == sender:
                peer.conn.send({KIND: NOTE, VALUE: value}, timeout=timeout)
                return
        exc = PeerDied(f"sender {sender!r} is gone (or never was)")
        exc.sender = sender  # type: ignore[attr-defined]
        raise exc

    def flush_releases(self) -> None:
        """Send the releases queued so far now, without waiting (a full socket keeps them queued)."""
        if self._releases.items:
            self._flush()

    def fence_releases(self) -> None:
        """A pinned receiver: fence the releases since the last call, pass on the completed ones.
        ``recv`` does this too; call it where batches are dropped between receives (Note [Fenced
        releases])."""
        if self._fences is not None:
            self._fences.take(self)

    def _recv(self, timeout: float | None) -> tuple[Peer, T]:
        if timeout is not None:
            check_timeout(timeout, "recv")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._check_open()
        if self._later is not None:  # recv_many met it after its first batch
            exc, self._later = self._later, None
            raise exc
        if self._fences is not None:
            self._fences.take(self)
        if self._releases.due():
            self._flush()
        while True:
            if self._closed:
                raise ValueError("this Receiver was closed while recv() waited")
            try:
                peer = self._next_peer(deadline)
            except ValueError:
                if self._closed:  # by another thread, while we waited
                    raise ValueError("this Receiver was closed while recv() waited") from None
                raise
            try:
                now: Any = peer.conn.recv_now(_lane.HEAD)  # in the ring now: no wait (Note [Fast lane])
                got = (None if now is not None else peer.conn.recv(_left(deadline))
                       if self._sel is None else peer.conn.recv_nowait())
            except ValueError:
                if self._closed:
                    raise ValueError("this Receiver was closed while recv() waited") from None
                raise
            except PeerDied as exc:
                self._forget(peer)
                if self._sel is not None and peer.bye:
                    continue
                how = "closed the channel" if peer.bye else "died"
                died = PeerDied(f"{peer.who} {how}")
                died.sender = peer.number  # type: ignore[attr-defined]
                raise died from exc
            except (ProtocolError, FdLimitError, PeerRefused) as exc:  # PeerRefused: a HELLO of another version
                raise self._drop(peer, exc) from None
            if now is None and got is None:
                continue
            if self._sel is not None and peer.conn.pending() and peer not in self._ready:
                self._ready.append(peer)  # frames in its ring: a selector would not say so
            if type(now) is bytes:  # a batch of the lane's shape: one array, short (Note [Fast lane])
                peer.bye = False  # (a batch, whatever its tree)
                try:
                    desc = _lane.desc_of(now)
                    if desc is not None:
                        if self._releases.thread is None:
                            self._releases.start(self)
                        return peer, self._view(peer, *tensors.parse_desc(desc))
                    data = _lane.inline_of(now)  # one small array by value (Note [Inline arrays])
                    if data is not None:
                        return peer, _lane.by_value(*tensors.parse_inline(data), self._writable)
                    now = _lane.header_of(now)
                except Exception as exc:  # noqa: BLE001 - any failure of a hostile batch drops its sender
                    raise self._drop(peer, exc) from None
            header, fds = (now, _NO_FDS) if now is not None else got  # type: ignore[misc]  # not both None
            kind = header.get(KIND)
            if kind == BATCH:
                peer.bye = False  # someone still sends (a goodbye from a parent that forked does not count)
                try:
                    return peer, self._decode(peer, header, fds)
                except Exception as exc:  # noqa: BLE001 - any failure of a hostile batch drops its sender
                    raise self._drop(peer, exc) from None
            for f in fds:
                f.close()
            if kind == BYE:
                peer.bye = True
                continue
            raise self._drop(peer, ProtocolError(f"unexpected message kind {kind!r}"))

    def __iter__(self) -> Iterator[T]:
        """Yield batches until the sender closes the channel (PeerDied if it died)."""
        while True:
            try:
                yield self.recv()
            except PeerDied:
                if self._listener is None and self._bye_seen and not self._peers:
                    return
                raise

    def _ready_now(self) -> bool:
        """Whether a message is there now, taking nothing (recv() reads it, and says what breaks)."""
        if self._ready or self._closed:
            return bool(self._ready)
        if self._sel is None:  # a ring's frames, or the socket's
            return bool(self._peers) and (self._peers[0].conn.pending() or bool(select.select(
                [self._peers[0].conn.fileno()], [], [], 0)[0]))
        return bool(self._sel.select(0))

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Return whether ``recv`` would find something (a batch or an event) within `timeout`."""
        check_timeout(timeout, "poll")
        self._check_open()
        if self._ready:
            return True
        if self._sel is None:
            return bool(self._peers) and self._peers[0].conn.poll(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # in slices: Note [Closing from another thread] in wire
            left = _left(deadline)
            if self._sel.select(_CLOSE_CHECK if left is None else min(left, _CLOSE_CHECK)):
                return True
            if self._closed:
                raise ValueError("this Receiver was closed while poll() waited")
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def fileno(self) -> int:
        """Return a fd that is readable when ``recv`` has something (for selectors)."""
        if self._sel is not None:
            fileno: int = self._sel.fileno()  # type: ignore[attr-defined]  # DefaultSelector is epoll here
            return fileno
        return self._peers[0].conn.fileno()

    # -- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Send pending releases, stop the flusher, close every connection.

        Arrays already received stay valid: their mappings go with their last views.
        """
        if self._closed:
            return
        self._shut(join=True)

    def _finalize(self) -> None:
        """Collected unclosed: warn, and release without waiting (no join, no goodbye)."""
        if self._closed:
            return
        if self._owner == os.getpid():  # a forked child's copy was never the child's to close
            warnings.warn(f"unclosed {self!r}; call close() or use it as a context manager",
                          ResourceWarning, stacklevel=2)
        self._shut(join=False)

    def _shut(self, join: bool) -> None:
        if self._fences is not None and join:
            self._fences.wait_all(self)
        self._flush()  # never waits (timeout=0 sends)
        self._closed = True
        self._releases.wake.poke()  # the flusher sees _closed (and closes the pipe if not joined)
        flusher = self._releases.thread
        if flusher is None:
            self._releases.wake.close()
        elif join and flusher is not threading.current_thread():
            flusher.join(5)
            self._releases.wake.close()
        for p in list(self._peers):
            self._forget(p)
        if self._sel is not None:
            self._sel.close()
        if self._listener is not None:
            self._listener.close()
        if self._fences is not None and self._fences.error is not None and join:
            # everything is closed; pinned ranges that failed stay mapped. Not kept here: its
            # traceback's frames hold whatever the caller held (a loader's batches)
            error, self._fences.error = self._fences.error, None
            raise error

    def __repr__(self) -> str:
        where = f" on {self.path!r}" if self._listener is not None else ""
        state = "closed" if self._closed else f"{len(self._peers)} senders"
        return f"<shmshare Receiver{where} {state}>"

    def __reduce__(self) -> Any:
        if self._listener is not None:
            raise TypeError("a listening Receiver cannot be handed to another process; "
                            "listen() there instead")
        if len(self._peers) != 1:
            raise TypeError(f"a Receiver of {len(self._peers)} senders cannot be handed to another "
                            "process; hand over the connections and make one there")
        return _rebuild, (self._peers[0].conn, self._writable, self._trust_unsealed,
                          self._caps.max_peer_bytes, self._caps.max_peer_segments)

    # -- internals -----------------------------------------------------------------

    def _next_peer(self, deadline: float | None) -> Peer:
        if self._listener is None and not self._peers:
            raise PeerDied("the sender is gone and everything it sent was received"
                           if self._sel is None else "every sender is gone and everything they sent "
                           "was received")
        if self._sel is None:
            return self._peers[0]
        while not self._ready:
            if self._closed:
                raise ValueError("this Receiver is closed")
            left = _left(deadline)  # in slices: Note [Closing from another thread] in wire
            step = _CLOSE_CHECK if left is None else min(left, _CLOSE_CHECK)
            if self._accept_paused_until:
                step = min(step, max(0.0, self._accept_paused_until - time.monotonic()))
                self._maybe_resume_accepting()
            events = self._sel.select(step)
            fd_error = None
            for key, _ in events:
                if key.data is None:
                    try:
                        self._accept()
                    except FdLimitError as exc:
                        fd_error = exc
                else:
                    self._ready.append(key.data)
            if fd_error is not None and not self._ready:
                raise fd_error  # once: accepting is paused now (Note [A full fd table])
            if not events and deadline is not None and time.monotonic() >= deadline:
                raise ShmshareTimeout(f"no batch arrived {f'on {self.path!r} ' if self.path else ''}"
                                      "before the timeout")
        try:
            return self._ready.popleft()
        except IndexError:  # close() from another thread emptied it meanwhile
            raise ValueError("this Receiver is closed") from None

    def _accept(self) -> None:
        assert self._listener is not None and self._sel is not None
        if len(self._peers) >= self._max_peers:
            # the newcomer waits in the backlog until a sender leaves (_forget resumes)
            self._sel.unregister(self._listener)
            self._accept_paused_until = float("inf")
            return
        try:
            check_fd_room(self._listener.max_fds)
            conn = self._listener.accept(timeout=0)
        except ShmshareTimeout:
            return
        except FdLimitError as exc:
            # Note [A full fd table]
            #     The peer stays in the listen backlog and the listener stays
            #     readable, so retrying at once would spin (the receiver once
            #     raised 429,095 errors in 3 s, serving no one). Accepting
            #     pauses instead for ACCEPT_PAUSE, as every listener's does
            #     (Note [Out of fds] in _pollserver.py); connected senders are
            #     served meanwhile, and a wait with nothing else to deliver
            #     raises FdLimitError once.
            self._sel.unregister(self._listener)
            self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE
            exc.add_note(f"shmshare: {self.path!r} accepts no new sender for {ACCEPT_PAUSE:g} s; "
                         "connected senders are still served")
            raise
        peer = Peer(conn, next(self._numbers))
        self._peers.append(peer)
        self._sel.register(conn._poll_fd(), selectors.EVENT_READ, peer)

    def _maybe_resume_accepting(self) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            assert self._sel is not None and self._listener is not None
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, None)

    def _drop(self, peer: Peer, exc: Exception) -> Exception:
        """Forget a sender whose batch could not be taken in; return the error to raise.

        Once a batch is lost the two ends no longer agree on segments and
        leases, so the connection goes: the sender is told why (if its socket
        has room) and takes back everything it lent, and a ``listen()``
        receiver goes on with the others.
        """
        if not isinstance(exc, (ProtocolError, FdLimitError, SegmentError, PeerRefused)):
            exc = ProtocolError(f"{type(exc).__name__}: {exc}")
        try:  # never wait: a sender that does not read must not stall us
            peer.conn.send({KIND: REFUSE, WHY: str(exc)[:_WHY_MAX]}, timeout=0)
        except (ShmshareError, OSError, ValueError):
            pass  # gone or full: it sees the connection end without the reason
        self._forget(peer)
        exc.sender = peer.number  # type: ignore[union-attr]  # as recv_from names it
        exc.add_note(f"shmshare: the connection to {peer.who} was dropped; it takes back what "
                     "it lent, and arrays already received stay valid")
        return exc

    def _forget(self, peer: Peer) -> None:
        if peer in self._peers:
            self._peers.remove(peer)
            if self._accept_paused_until == float("inf") and not self._closed:
                self._accept_paused_until = time.monotonic()  # room for a newcomer again
            self._bye_seen = peer.bye
            if self._sel is not None:
                self._sel.unregister(peer.conn._poll_fd())
            try:
                self._ready.remove(peer)
            except ValueError:
                pass
        peer.conn.close()
        for rec in peer.segments.values():
            rec.seg.close()  # each mapping goes when its last array does
            if self._fences is not None:
                self._fences.on_unmap(rec.pin)
        peer.segments.clear()

    def _decode(self, peer: Peer, header: dict[str, Any], fds: list[wire.Fd]) -> Any:
        if not fds and len(header) == 2 and type(tree := header.get(TREE)) is bytes \
                and (desc := _lane.one_array(tree)) is not None:  # one array (Note [Fast lane])
            if self._releases.thread is None:
                self._releases.start(self)
            return self._view(peer, *tensors.parse_desc(desc))
        if fds or NEW in header:
            try:
                map_new(self, peer, header.get(NEW, ()), fds)
            finally:
                for f in fds:
                    f.close()
        if GROW in header or DROP in header:
            grow_and_drop(self, peer, header)
        if self._releases.thread is None:
            self._releases.start(self)
        tree = header.get(TREE)
        if type(tree) is not bytes:
            raise ProtocolError(f"a batch must carry its packed tree as bytes, got "
                                f"{type(tree).__name__}")
        return tensors.decode(tree, lambda seg, block, off, lay: self._view(peer, seg, block, off, lay),
                              lambda lay, data: _lane.by_value(lay, data, self._writable))

    def _view(self, peer: Peer, seg_id: int, block: int, offset: int,
              lay: tensors.Layout) -> Any:
        dt = lay.dtype
        if dt.hasobject:  # bytes in shared memory would be taken for PyObject pointers
            raise ProtocolError(f"an array of dtype {dt} holds object references; refused")
        if seg_id == 0:
            # numpy makes a 0-byte string dtype (S0, U0) 1 byte wide: such an "empty" array of
            # 2**31 items would be 2 GiB of our memory
            if 0 not in lay.shape and (dt.itemsize or dt.kind in "SU"):
                raise ProtocolError(f"a descriptor without memory has shape {lay.shape} and dtype "
                                    f"{dt.str}, not empty")
            arr = np.empty(lay.shape, dt)  # nothing to share in an empty array
            if lay.torch_dtype and tensors.torch_imported():
                return tensors.as_torch(arr, lay.torch_dtype)
            arr.flags.writeable = self._writable  # as every received array
            return arr
        rec = peer.segments.get(seg_id) or segment_of(peer, seg_id)
        start = offset + lay.lo
        nbytes = lay.nbytes
        if not (start >= 0 and start + nbytes <= rec.size if not rec.expandable
                else rec.covers(start, start + nbytes)):
            raise ProtocolError(f"an array of {nbytes} bytes at offset {start} lies outside the "
                                f"mapped part of segment {seg_id} ({rec.size} bytes)")
        lease = _native.Lease(rec.root, rec.address + start, nbytes, not self._writable,
                              Release(self._releases, peer, block, nbytes) if self._fences is None
                              else FencedRelease(self._fences, peer, block, nbytes))
        if lay.dense:
            arr = np.ndarray(lay.shape, dt, lease)  # type: ignore[arg-type]  # positional: keywords cost
        else:
            arr = np.ndarray(lay.shape, dt, buffer=lease, offset=-lay.lo,  # type: ignore[arg-type]
                             strides=lay.strides)
        if lay.torch_dtype is None or not tensors.torch_imported():
            return arr  # Note [Tensors to a process without torch]
        # torch has no read-only tensors: from a read-only mapping, a private copy
        return tensors.as_torch(arr if self._writable else arr.copy(), lay.torch_dtype)

    # -- releases ----------------------------------------------------------------

    def _flush(self) -> bool:
        """Send the releases queued now (False: a sender's socket was full; they wait)."""
        return self._releases.flush(self._peers)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this Receiver is closed")

    def _after_fork_in_child(self) -> None:
        # Arrays inherited by a child never release the parent's leases (see
        # _Release); the child gets its own wake-up pipe and, on use, flusher.
        self._releases.wake.close()
        self._releases = ReleaseQueue()
        self._bye_seen = False
        if self._sel is not None:
            # The epoll instance is shared with the parent: an unregister here would remove
            # the parent's registrations too. The child's copy gets a selector of its own.
            old, self._sel = self._sel, selectors.DefaultSelector()
            old.close()  # closes only this process's fd of the shared instance
            if self._listener is not None:
                self._sel.register(self._listener, selectors.EVENT_READ, None)
            for p in self._peers:
                self._sel.register(p.conn._poll_fd(), selectors.EVENT_READ, p)


def _positive(value: int | None, name: str) -> int | None:
    if value is not None and (type(value) is not int or value <= 0):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


_NO_FDS: list[wire.Fd] = []  # a ring frame's: never appended to


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


_live: weakref.WeakSet[Receiver] = weakref.WeakSet()


def _after_fork() -> None:
    for rx in list(_live):
        if not rx._closed:  # a closed one has nothing to fix up: its selector, pipe and socket are gone
            rx._after_fork_in_child()


_fork.on_fork_in_child(5, _after_fork)


def _rebuild(conn: wire.Connection, writable: bool, trust_unsealed: bool, max_peer_bytes: int,
             max_peer_segments: int) -> Receiver:
    return Receiver([conn], writable=writable, trust_unsealed=trust_unsealed,
                    max_peer_bytes=max_peer_bytes, max_peer_segments=max_peer_segments)
