"""``Store``: a client of the store daemon.

Note [A client's mappings]
    A get maps the object's segment once per client -- an arena segment of
    the daemon's pool, or the object's own memfd -- ``PROT_READ``, and keeps
    the mapping until the daemon says the segment is gone (a ``drop``
    frame): the next get of an object there needs no fd and no mmap. Each
    get is one lease over the object's bytes; when the last view of it
    dies, the lease's callback queues the object's id, and the ids go back
    with the client's next request, or from a flusher thread within a few
    milliseconds when the client is idle. Objects holding torch tensors are
    different, because torch has no read-only tensors and a write through
    a ``PROT_READ`` mapping would be SIGSEGV: a memfd object is mapped
    copy-on-write (``MAP_PRIVATE``) for each such get, so its tensors are
    writable and a write stays private to this process; a small object's
    tensors are private copies.

Note [Replies owed]
    One connection carries requests and replies in order. A request whose reply did not
    come in ``timeout`` still gets one later; the client counts it as owed and reads it
    before the next reply, rather than reconnect: a new connection would end the old one,
    and the daemon would take back every reference this client holds, under its views.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Generic, Self, SupportsIndex, TypeVar, overload

import numpy as np

from .. import _empty_args, _native, tensors
from .._errors import FdLimitError, PeerDied, ProtocolError, ShmshareTimeout
from .._fd import Fd
from .._plane import Borrowed, Lender, default_caps
from .._plane.borrow import populate as populate_pages
from .._plane.flusher import Waker, start_flusher
from .._timeouts import check_timeout
from .._typevars import V
from . import _inherited as inherited
from . import _putting as putting
from ._fastget import MISS, FastGets
from ._flusher import Flushing, Queued, late, late_lost
from ._packing import Plan, build, one_array_meta
from ._protocol import (
    BUSY,
    LARGE,
    ObjectInfo,
    ObjectNotFound,
    StoreBusy,
    StoreError,
    StoreGone,
    check_name,
    connect,
    raise_for,
    refusal,
    socket_path,
)

__all__ = ["Store", "ObjectInfo"]


if TYPE_CHECKING:
    import numpy.typing as npt
    import torch
_ScalarT = TypeVar("_ScalarT", bound=np.generic)
_Shape = SupportsIndex | tuple[SupportsIndex, ...] | builtins.list[SupportsIndex]  # what create takes

_MIN_ANSWER = 0.05  # s a get(timeout=...) leaves the daemon to answer, however little is left
_WAIT_MARGIN = 0.5  # s past a wait's own end that its answer may take
_CAPS = default_caps("delete objects, or drop what you got sooner")  # its pool's segments


class Store(Generic[V]):
    """A connection to the store daemon (``shmshare serve``).

    Parameters
    ----------
    path : str, optional
        The daemon's socket; by default ``$SHMSHARE_STORE``, else
        ``$XDG_RUNTIME_DIR/shmshare/store.sock``, else
        ``/tmp/shmshare-<uid>/store.sock``.
    timeout : float or None
        Seconds to wait for the daemon to connect and to answer each
        request (None: forever).

    ``Store[V]`` is a store of `V`s for the type checker, as ``shelve.Shelf[V]``
    is: the program says what it puts (``store: Store[dict[str, np.ndarray]] =
    Store()``), ``put`` takes and ``get`` returns that, nothing checks it at
    run time, and an unparameterized ``Store`` holds ``Any``. Say
    ``np.ndarray`` for a tensor that may reach a process without torch.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None,
                 timeout: float | None = 10.0) -> None:
        check_timeout(timeout, "Store", zero=False)  # 0: no request could be answered
        self.path = socket_path(path)
        self.timeout = timeout
        self._closed = False
        self._conn = connect(self.path, timeout, "store-client")
        with contextlib.suppress(ShmshareTimeout, OSError):  # a full socket or fd table: no rings
            self._conn.offer_ring(timeout=0)  # requests and replies in shared memory (Note [Rings])
        self.daemon_pid = self._conn.peer_cred.pid
        self._lock = threading.Lock()  # one request at a time on the connection
        self._owed = 0  # replies of timed-out requests still to come (Note [Replies owed])
        lender = Lender(f"the store daemon (pid {self.daemon_pid})")
        self._segs = Borrowed(lender, _CAPS)  # its segments, read-only (gets)
        self._wsegs = Borrowed(lender, _CAPS)  # its pool segments, read-write (warm puts)
        self._wforget: builtins.list[int] = []  # read-write fds sent to us that we did not map
        self._released: collections.deque[int] = collections.deque()
        self._unmapped: collections.deque[int] = collections.deque()
        self._drops: collections.deque[int] = collections.deque()  # segments the daemon dropped
        self._forget: builtins.list[int] = []  # segments sent to us that we did not map
        self._waker = Waker()  # the flusher's wake-up (Note [One release path])
        self._out = 0  # gets whose views are still alive
        self._putting = 0  # warm puts between room and put (Note [Warm memory])
        self._staging: tuple[int, int] | None = None  # (fd, address) of our staging memfd
        self._creating: dict[str, tuple[int, Any]] = {}  # name -> (oid, buffer or None)
        self._gone: str | None = None  # why the connection is unusable
        self._gone_as: type[StoreError] = StoreGone  # ... and what that raises
        # the thread holds the Store only weakly: a Store dropped unclosed (and with no view
        # left, since views hold it) is collected, and the thread then ends
        self._fastgets = FastGets()
        self._flushing = Flushing(self)
        self._flusher = start_flusher(self._flushing, self._waker, "shmshare-store-flusher")
        inherited.track_store(self)

    # -- the API -------------------------------------------------------------------

    def put(self, name: str, value: V, *, replace: bool = False, immutable: bool = False) -> None:
        """Store `value` (an array, a CPU tensor, or a nested dict/list/tuple of them and plain
        values) under `name`, sealed; ObjectExists if the name is taken (unless `replace`).
        `immutable`: in a memfd of its own that the kernel seals against writes, rather than
        the store's warm pool (Note [Warm memory] in ``_putting.py``)."""
        check_name(name)
        _check_flag(immutable, "put", "immutable")
        _check_flag(replace, "put", "replace")
        putting.put(self, name, Plan(value), replace, immutable)

    @overload
    def create(self, name: str, shape: _Shape, dtype: type[_ScalarT] | np.dtype[_ScalarT], *,
               immutable: bool = False) -> npt.NDArray[_ScalarT]: ...
    @overload
    def create(self, name: str, shape: _Shape, dtype: npt.DTypeLike | None, *,
               immutable: bool = False) -> npt.NDArray[Any]: ...
    @overload  # last: where torch is not installed, torch.dtype is Any and would match anything
    def create(self, name: str, shape: _Shape, dtype: torch.dtype, *,
               immutable: bool = False) -> torch.Tensor: ...

    def create(self, name: str, shape: Any, dtype: Any, *, immutable: bool = False) -> Any:
        """Make object `name` of one uninitialized array to fill in place; :meth:`seal` it to
        publish it. A torch dtype gives a torch tensor. `immutable` as for :meth:`put`."""
        check_name(name)
        _check_flag(immutable, "create", "immutable")
        np_dtype, torch_dtype = _empty_args.alloc_dtypes(dtype)
        shape, size = _empty_args.alloc_shape(shape, np_dtype.itemsize)  # as numpy's empty()
        tname = None if torch_dtype is None else str(torch_dtype).removeprefix("torch.")
        header = {"k": "create", "n": name, "m": one_array_meta(shape, np_dtype, tname, size > 0),
                  "s": size, "t": tname is not None}
        arr = putting.create(self, name, header, shape, np_dtype, immutable)
        return arr if tname is None else tensors.as_torch(arr, tname)

    def seal(self, name: str) -> None:
        """Publish an object made by :meth:`create`: from now on it can be got, never changed."""
        check_name(name)
        got = self._creating.get(name)
        if got is None:
            raise KeyError(f"{name!r} was not created through this Store (or is sealed already)")
        buf = got[1]
        try:
            self._seal(name, buf)
        except KeyError:  # deleted or replaced meanwhile: nothing of ours is left to seal
            del self._creating[name]
            raise
        del self._creating[name]

    def _seal(self, name: str, buf: Any) -> None:
        if isinstance(buf, weakref.ref):
            self._call({"k": "seal", "n": name})
            arr = buf()
            if arr is not None:
                arr.flags.writeable = False  # views made before seal stay writable, until gone
        else:
            plan = Plan(buf)
            with self._lock:
                putting.stage(self, plan)
                self._call_locked({"k": "seal", "n": name, "st": plan.size}, [])
            buf.flags.writeable = False

    def get(self, name: str, timeout: float | None = None, *, populate: bool = False) -> V:
        """The value stored under `name`, as read-only zero-copy views.

        With `timeout` None it does not wait (KeyError if no sealed object of that name is
        there); else it waits that many seconds for one to be put or sealed (ShmshareTimeout after).
        `populate`: fill this process's page tables for the whole object first, so reading it
        faults no more (Note [Populate on request] in ``_plane/borrow.py``: not faster here)."""
        if type(name) is str and timeout is None and populate is False:
            got: V = self._fastgets.get(self, name, False)  # Note [Gets without a round trip]
            if got is not MISS:  # (a name got before: valid)
                return got
        check_name(name)
        _check_flag(populate, "get", "populate")
        check_timeout(timeout, "get", zero=True)  # NaN and negatives too
        got = self._fastgets.get(self, name, populate)
        if got is not MISS:
            return got
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        while True:
            try:
                # the daemon gets at least _MIN_ANSWER to answer, even with timeout=0
                left = None if deadline is None else max(_MIN_ANSWER, deadline - time.monotonic())
                got = self._get_now(name, left, populate)  # what was put, by the Store's word (V)
                return got
            except ObjectNotFound:
                if deadline is None:
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ShmshareTimeout(f"no sealed object {name!r} in the store after "
                                          f"{timeout} s") from None
                self._wait(name, left)

    def delete(self, name: str) -> None:
        """Take `name` out of the store (KeyError if absent); views got of it stay valid."""
        check_name(name)
        self._call({"k": "del", "n": name})
        self._creating.pop(name, None)

    def info(self, name: str) -> ObjectInfo:
        """What the store holds under `name` (KeyError if nothing)."""
        check_name(name)
        h, _ = self._call({"k": "info", "n": name})
        return ObjectInfo._of(h["l"])

    def list(self) -> builtins.list[ObjectInfo]:
        """Every object in the store, by name."""
        out: builtins.list[ObjectInfo] = []
        after: str | None = None
        while True:
            h, _ = self._call({"k": "list", "a": after})
            out.extend(ObjectInfo._of(e) for e in h["l"])
            if not h.get("more") or not h["l"]:
                return out
            after = out[-1].name

    def stats(self) -> dict[str, Any]:
        """The daemon's own figures: bytes held, objects, clients, requests served."""
        h, _ = self._call({"k": "stats"})
        return dict(h["s"])

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            return self.info(name).sealed
        except KeyError:
            return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop using the store. Views got from it stay valid: the connection stays open, on
        its own, until the last of them is gone (else the daemon could reuse their memory)."""
        if self._closed:
            return
        self._closed = True
        self._segs.clear()  # views keep their own mappings
        self._wsegs.clear()
        self._waker.wake.poke()
        if threading.current_thread() is not self._flusher:
            self._flusher.join(1.0 if self._idle() else 0)

    def _idle(self) -> bool:
        """No view of a get is alive (their releases may still be queued) and no warm put is
        writing its room (the daemon would give it to another put), or no daemon."""
        return (self._out - len(self._released) <= 0 and not self._putting
                and not self._fastgets.out()) or self._gone is not None

    def __del__(self) -> None:
        # collected unclosed, so no view is left (each holds the Store): end the connection
        # (its own finalizer would too) and let the flusher see the Store gone
        try:
            if not self._closed:
                self._closed = True
                self._conn.close()
                self._drop_staging()  # its fd and mapping are ours, not the flusher's
                self._waker.wake.poke()
        except Exception:  # noqa: BLE001, S110 - a half-built Store, or interpreter shutdown
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (f"<Store {self.path!r} daemon pid {self.daemon_pid}"
                f"{' closed' if self._closed else ''}>")

    # -- requests ------------------------------------------------------------------

    def _call(self, header: dict[str, Any], fds: builtins.list[int] | None = None
              ) -> tuple[dict[Any, Any], builtins.list[Fd]]:
        with self._lock:
            return self._call_locked(header, fds or [])

    def _call_locked(self, header: dict[str, Any], fds: builtins.list[int],
                     timeout: float | None = None) -> tuple[dict[Any, Any], builtins.list[Fd]]:
        if self._gone is not None:
            raise self._gone_as(self._gone)
        if self._closed:
            raise StoreError(f"this Store ({self.path!r}) is closed: make a new one")
        wait = self.timeout if timeout is None else (
            timeout if self.timeout is None else min(timeout, self.timeout))
        try:
            while self._owed:  # first the replies of requests given up on (Note [Replies owed])
                try:
                    h, got = self._conn.recv(timeout=wait)
                except FdLimitError as exc:  # read, its fd lost: undone from its header
                    self._late_lost(exc)
                    continue
                if h.get("k") == "drop":
                    self._dropped(h.get("i"))
                    for f in got:
                        f.close()
                    continue
                self._owed -= 1
                self._late(h, got)
        except PeerDied as exc:
            raise self._died(exc) from exc
        except ShmshareTimeout as exc:
            raise ShmshareTimeout(f"the store daemon (pid {self.daemon_pid}) at {self.path!r} has "
                                  f"not answered {self._owed} earlier requests") from exc
        if self._released:
            header["rl"] = self._take_released()
        if self._forget:
            header["fg"], self._forget = self._forget, []
        if self._wforget:
            header["wfg"], self._wforget = self._wforget, []
        sent = False
        try:
            self._conn.send(header, fds, timeout=wait)
            sent = True
            while True:
                h, got = self._conn.recv(timeout=wait)
                if h.get("k") == "drop":
                    self._dropped(h.get("i"))
                    for f in got:
                        f.close()
                    continue
                break
        except PeerDied as exc:
            raise self._died(exc) from exc
        except FdLimitError as exc:  # the reply came, its fd did not fit our table: undo it
            lost: Any = getattr(exc, "header", None)
            if sent and isinstance(lost, dict):
                self._late(lost, [])
            elif sent:
                self._owed += 1  # unreadable: count it as to come (nothing else is safe)
            raise
        except ShmshareTimeout as exc:
            if sent:
                self._owed += 1
            raise ShmshareTimeout(f"the store daemon (pid {self.daemon_pid}) at {self.path!r} did "
                                  f"not answer a {header.get('k')} within {wait} s") from exc
        except BaseException:  # KeyboardInterrupt, ...: its reply is still to come
            if sent:
                self._owed += 1
            raise
        finally:
            if not sent:
                self._unsent(header)
        drops = h.get("d")
        if isinstance(drops, list):
            for seg in drops:
                self._dropped(seg)
        if h.get("k") == "err":
            for f in got:
                f.close()
            self._check_busy(h)
            raise_for(str(h.get("e")), str(h.get("w")))
        return h, got

    def _late_lost(self, exc: FdLimitError) -> None:
        late_lost(self, exc)

    def _late(self, h: dict[Any, Any], got: builtins.list[Fd]) -> None:
        late(self, h, got)

    def _died(self, exc: Exception) -> StoreError:
        """The connection ended: StoreBusy if the daemon said it was full first, else StoreGone."""
        if self._gone_as is not StoreBusy:
            busy = refusal(self._conn)  # a send that met the close has not read it yet
            if busy is not None:
                self._gone, self._gone_as = busy, StoreBusy
            else:
                self._gone = (f"the store daemon (pid {self.daemon_pid}) at {self.path!r} is gone "
                              f"({exc}): the objects it held are lost (views got already stay "
                              "valid); start `shmshare serve` again and make a new Store")
        assert self._gone is not None
        return self._gone_as(self._gone)

    def _check_busy(self, h: dict[Any, Any]) -> None:
        """A refusal at the client cap: the daemon closes this connection, so every later
        request says the same (not that the daemon is gone)."""
        if h.get("e") == BUSY and h.get("k") == "err":
            self._gone, self._gone_as = str(h.get("w")), StoreBusy

    def _unsent(self, header: dict[str, Any]) -> None:
        """A request that never left: what it carried goes back to wait for the next one."""
        rl = header.pop("rl", None)
        if rl:
            self._released.extendleft(reversed(rl))
            self._out += len(rl)
        fg = header.pop("fg", None)
        if fg:
            self._forget[:0] = fg
        fg = header.pop("wfg", None)
        if fg:
            self._wforget[:0] = fg
        if header.get("k") == "put" and type(header.get("o")) is int:
            self._abandon(header["o"])  # the room it filled goes back

    def _abandon(self, oid: int) -> None:
        """Give back a warm put's room that will not be filled (an ``unmapped`` frame)."""
        self._unmapped.append(oid)
        self._waker.poke()

    def _take_released(self) -> builtins.list[int]:
        inherited.copies_made()  # a child forked with views copies them before we give references back
        q, out = self._released, []
        while q:
            out.append(q.popleft())
        self._out -= len(out)
        return out

    def _dropped(self, seg: Any) -> None:
        # The mapping goes on the flusher's thread: the munmap of a large object frees its
        # pages (a tenth of a second per GiB), which a get must not wait for
        if type(seg) is int:
            self._drops.append(seg)
            self._waker.poke()

    def _get_now(self, name: str, timeout: float | None = None, populate: bool = False) -> Any:
        root: _native.Lease | None = None
        with self._lock:
            h, fds = self._call_locked({"k": "get", "n": name}, [], timeout)
            self._out += 1
            oid, seg, off, size, meta = h["o"], h["i"], h["off"], h["s"], h["m"]
            private = h.get("p") is True
            done = Queued(self, self._released, oid)
            try:
                if size and not private:
                    # under the lock: another thread's get of the same segment must find it
                    # mapped (the daemon sent its fd once, to whichever reply came first)
                    root = self._segs.get(seg)
                    if root is None:
                        sent = bool(fds)
                        try:
                            root = self._map(fds, h.get("n"), seg)  # kept in _segs
                        except BaseException:
                            if sent:
                                self._forget.append(seg)  # sent, not mapped: ask for it again
                            raise
            except BaseException:
                for f in fds:
                    f.close()
                done()  # nothing of it lives on: give the reference back with the next request
                raise
            if not self._fastgets.tried:  # the daemon answers: fast gets from the next one on
                self._fastgets.set_up(self, timeout)
        try:
            if size == 0:
                return build(meta, 0, 0, None, True, done, True)
            pool = False
            if private:  # a tensor's copy-on-write mapping: of a pool segment, a forked child
                pool = bool(fds) and inherited.reused_by_daemon(fds[0].fileno())  # copies it (its
                root = self._map(fds, h.get("n"), None)  # untouched pages are the daemon's)
            assert root is not None
            if not 0 <= off <= off + size <= root.nbytes:
                raise ProtocolError(f"the store placed {size} bytes at offset {off} of a "
                                    f"{root.nbytes}-byte segment")
            if populate:
                populate_pages(root, off, size)
            if not private:
                self._fastgets.remember(name, h, root)
            return build(meta, root.address + off, size, root, not private, done, not private,
                         inherited.track_view if pool or inherited.is_pool(root) else None)
        except BaseException:
            done()
            raise
        finally:
            for f in fds:
                f.close()

    def _map(self, fds: builtins.list[Fd], nbytes: Any, seg: Any) -> _native.Lease:
        """Map the fd of a reply: segment `seg` shared and kept, or (None) a private copy."""
        if len(fds) != 1 or type(nbytes) is not int or nbytes <= 0:
            raise ProtocolError("the store sent an object without its segment's fd")
        if seg is None:
            return self._segs.map_private(fds[0], nbytes)
        if type(seg) is not int:
            raise ProtocolError(f"the store named segment {seg!r}")
        return inherited.map_shared(self._segs, seg, fds.pop(), nbytes)

    def _wait(self, name: str, seconds: float) -> None:
        """Wait on a connection of its own until `name` is sealed (Note [Replies owed])."""
        conn = connect(self.path, min(seconds + _MIN_ANSWER, self.timeout or seconds + _MIN_ANSWER),
                       "store-waiter", gone=StoreGone)
        try:
            conn.send({"k": "wait", "n": name, "t": seconds}, timeout=seconds + _MIN_ANSWER)
            h, got = conn.recv(timeout=seconds + _WAIT_MARGIN)  # the daemon answers at `seconds`
            for f in got:
                f.close()
        except PeerDied as exc:
            busy = refusal(conn)  # this connection refused at the cap: ours is still served
            if busy is not None:
                raise StoreBusy(busy) from exc
            raise self._died(exc) from exc
        finally:
            conn.close()
        if h.get("k") == "err" and h.get("e") != "timeout":
            raise_for(str(h.get("e")), str(h.get("w")))

    # -- the flusher -----------------------------------------------------------------

    def _shutdown(self) -> bool:
        """Close for good, unless a view came alive meanwhile (a get that was in flight when
        close() was called: decided under the lock, which every get holds until it counts its
        view); True once closed."""
        with self._lock:
            if not self._idle():
                return False
            self._conn.close()
            self._drop_staging()
            self._segs.clear()
            self._wsegs.clear()
            self._fastgets.drop()
        inherited.forget_store(self)
        return True

    def _after_fork(self) -> None:
        """In a forked child (Note [Views across fork]): the parent's connection is the
        parent's -- a child that used it would interleave its frames with the parent's -- so
        this Store is unusable here, and its cached mappings go (views keep theirs)."""
        self._gone = "this Store was made before fork(): make a new Store in the child"
        self._gone_as = StoreGone
        self._closed = True
        self._conn.close()
        self._segs.clear()
        self._wsegs.clear()
        self._released.clear()
        self._lock = threading.Lock()

    def _drop_staging(self) -> None:
        if self._staging is not None:
            fd, address = self._staging
            self._staging = None
            _native.unmap(address, LARGE, release=True)
            os.close(fd)



def _check_flag(value: object, call: str, name: str) -> None:
    if type(value) is not bool:
        raise TypeError(f"{call}({name}=...) takes True or False, got {value!r}")
