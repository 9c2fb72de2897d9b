"""The unpickling side: one connection per owner, segments mapped once, releases batched.

Note [Unpickling a handle]
    1. The link to the handle's owner: made on first use (connect to its fd
       server, fetch and map its lease table), reused after. A link whose
       owner hung up is dead, and so is its handle: :class:`OwnerGone`.
    2. The segment: mapped once per owner and segment (its fd fetched over
       the link, checked as a channel receiver checks one: a memfd sealed
       against shrinking, with every page backed), kept until the owner
       says the pool gave it back or the link dies.
    3. The claim: the handle's signature checked (``_table.sign``), our byte
       of the claim map set, then one compare-and-swap in the table (Note
       [Claims without a round trip], Note [The owner's record of claims]);
       after it, the owner may exit and the data stays valid. The segment
       comes first: a claim made before the mapping could let an exiting
       owner go before we had its fd.
    4. The view: a ``_native.Lease`` over the bytes, whose callback clears
       the mark and queues the release when the last view dies; the
       flusher thread (the plane's, Note [One release path]) sends the
       releases to each owner in batches within its MAX_AGE.
    A forked child starts with no links and never sends a release for an
    array it inherited: those leases are its parent's.
"""

from __future__ import annotations

import collections
import errno
import hmac
import os
import select
import threading
import time
from typing import Any

import numpy as np

from .. import _fork, _native, tensors, wire
from .._errors import FdLimitError, PeerDied, ShmshareError, ShmshareTimeout
from .._plane import Borrowed, Lender, default_caps
from .._plane.flusher import Waker, start_flusher
from .._plane.trust import check_fd, locally
from ..segment import Flags, Segment
from . import _layouts
from ._common import (
    DROP,
    ERROR,
    KIND,
    LEND,
    MAX_RELEASES,
    RELEASE,
    SEGMENT,
    TABLE,
    HandleError,
    OwnerGone,
    alive,
)
from ._table import CLAIMED, PENDING, SLOTS, Signer, describe, word

__all__ = ["client", "rebuild_array", "close_client"]

_SEND_WAIT = 0.05  # s a release frame waits for room before it is left for the next round
_REQUEST_WAIT = 30.0  # s an fd request waits for the owner (its GIL may be busy)
_CONNECT_WAIT = 10.0
_MAX_SLOTS = 4 * SLOTS  # a table (and claim map) an owner may make us map
_caps = default_caps("drop received arrays sooner: each keeps its segment mapped here")


class _Link:
    """This process's connection to one owner, and what it mapped of it."""

    __slots__ = ("pid", "token", "conn", "lock", "table_buf", "marks", "secret", "sign", "slots",
                 "segments", "dead", "readable", "claimed_low")

    def __init__(self, pid: int, token: int, path: str) -> None:
        self.pid, self.token = pid, token
        self.lock = threading.Lock()
        self.dead = False
        self.segments = Borrowed(Lender(f"the owner of the handles (pid {pid})"), _caps)  # our mappings
        try:
            self.conn = wire.connect(path, timeout=_CONNECT_WAIT, role="mp-peer")
        except (OSError, ShmshareTimeout) as exc:
            gone = exc.errno in (errno.ENOENT, errno.ECONNREFUSED) if isinstance(exc, OSError) else False
            if gone or not alive(pid):
                raise OwnerGone(f"the array's owner, pid {pid}, has exited (or was killed) and no "
                                "longer serves its handles: an array must be unpickled while its "
                                "owner lives, or within its exit linger (SHMSHARE_MP_LINGER)") from exc
            raise
        try:
            header, fds = self._request({KIND: TABLE})
            try:
                if header.get(KIND) == ERROR:
                    raise _owner_error(pid, header, "our claim map")
                if header.get(KIND) != TABLE or len(fds) != 2 or header.get("pid") != pid:
                    raise ShmshareError(f"pid {pid}'s fd server sent {header!r} for the lease table")
                n, secret = header.get("n"), header.get("m")
                if type(n) is not int or not 0 < n <= _MAX_SLOTS:
                    raise ShmshareError(f"pid {pid}'s fd server sent a table of {n!r} slots")
                if type(secret) is not bytes or len(secret) != 16:
                    raise ShmshareError(f"pid {pid}'s fd server sent no key for its handles")
                check_fd(fds[0].fileno(), n * 8, trust_unsealed=False, writable=True)
                check_fd(fds[1].fileno(), n, trust_unsealed=False, writable=True)
                table = locally(Segment.from_fd, fds[0], n * 8, Flags.FROMFD)
                claims = locally(Segment.from_fd, fds[1], n, Flags.FROMFD)
            finally:
                for f in fds:
                    f.close()
            self.table_buf = table.buffer
            self.marks = claims.buffer  # ours alone: a byte per slot we hold (Note [The owner's record of claims])
            self.secret = secret
            self.sign = Signer(secret)  # what the owner signed its handles with
            self.slots = n
            me = header.get("you")  # our pid as the owner sees it (another pid namespace: not ours)
            self.claimed_low = word(0, CLAIMED, me if type(me) is int and me > 0 else os.getpid())
            table.close()  # the buffers keep the mappings; no fd kept
            claims.close()
            poller = select.poll()  # anything to read (a drop, the end) shows here, cheaply
            poller.register(self.conn.fileno(), select.POLLIN | select.POLLHUP)
            self.readable = poller.poll
        except BaseException:
            self.conn.close()
            raise

    def _request(self, header: dict[str, Any]) -> tuple[dict[Any, Any], list[wire.Fd]]:
        """Send a request and wait for its answer (a drop notice on the way is taken in)."""
        try:
            self.conn.send(header, timeout=_REQUEST_WAIT)
            deadline = time.monotonic() + _REQUEST_WAIT
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ShmshareTimeout(f"pid {self.pid}'s fd server did not answer within "
                                          f"{_REQUEST_WAIT} s")
                got, fds = self.conn.recv(timeout=left)
                if got.get(KIND) == DROP:
                    self._drop(got)
                    continue
                return got, fds
        except PeerDied as exc:
            self.dead = True
            if alive(self.pid):
                raise ShmshareError(f"pid {self.pid}'s fd server closed our connection while it "
                                    "lives (it dropped us, or is shutting down): the handle may "
                                    "still be good; the next unpickle connects again") from exc
            raise self.gone() from exc
        except ShmshareTimeout:
            self.dead = True  # a late answer would be taken for the next request's
            raise

    def gone(self) -> OwnerGone:
        return OwnerGone(f"the array's owner, pid {self.pid}, has exited (or was killed): its "
                         "handles not yet unpickled are void; arrays already received stay valid")

    def _drop(self, header: dict[Any, Any]) -> None:
        self.segments.drop(header.get("i"))  # views keep their pages

    def check(self) -> None:
        """Take in what the owner sent meanwhile; raise OwnerGone if it hung up."""
        if self.dead:
            raise self.gone()
        try:
            while self.conn.poll(0):
                got = self.conn.recv_nowait()
                if got is None:
                    break
                header, fds = got
                for f in fds:
                    f.close()
                if header.get(KIND) == DROP:
                    self._drop(header)
        except PeerDied as exc:
            self.dead = True
            raise self.gone() from exc

    def segment(self, seg_id: int, size: int, external: bool) -> _native.Lease:
        root = self.segments.get(seg_id)
        if root is not None:
            return root
        header, fds = self._request({KIND: SEGMENT, "i": seg_id})
        try:
            if header.get(KIND) == ERROR:
                if header.get("c") is not None:
                    raise _owner_error(self.pid, header, f"segment {seg_id}")
                raise HandleError(f"pid {self.pid} says: {header.get('w')}")
            if header.get(KIND) != SEGMENT or header.get("i") != seg_id or len(fds) != 1 \
                    or header.get("n") != size:
                raise ShmshareError(f"pid {self.pid}'s fd server answered {header!r} for "
                                    f"segment {seg_id} of {size} bytes")
            # torch's own shm (share_memory_()) is neither sealed nor always backed: trusted as
            # torch trusts it -- the peer that pickled it could run any code in us anyway
            # (its pool's segments count against the caps; torch's storages are the user's own)
            return self.segments.map(seg_id, fds.pop(), size, writable=True, trust_unsealed=external,
                                     backed=0 if external else None, charged=not external)
        finally:
            for f in fds:
                f.close()

    def lend_again(self, slot: int, gen: int) -> tuple[int, int]:
        """A new lease on the block of our lease (slot, gen), for a handle we pickle on."""
        with self.lock:
            if self.dead or self.readable(0):
                self.check()
            header, fds = self._request({KIND: LEND, "s": slot, "g": gen})
        for f in fds:
            f.close()
        got = header.get("s"), header.get("g")
        if header.get(KIND) != LEND or type(got[0]) is not int or type(got[1]) is not int \
                or not 0 <= got[0] < self.slots:
            raise HandleError(f"pid {self.pid} did not lend lease {slot}.{gen} on: {header.get('w', header)!r}")
        return got  # type: ignore[return-value]

    def close(self) -> None:
        self.segments.clear()
        self.conn.close()

    def forget_in_child(self) -> None:
        """In a forked child: let go of the parent's connection and mappings (views keep theirs)."""
        self.close()
        self.table_buf.release()
        self.table_buf = memoryview(b"")
        self.marks = memoryview(bytearray(0))  # the parent's: our inherited views never clear them


class _Released:
    """on_release of a received array: unmark its slot and queue its release (no lock: any
    bytecode, any thread)."""

    __slots__ = ("client", "key", "slot", "gen", "pid", "marks")

    def __init__(self, client: Client, key: tuple[int, int], slot: int, gen: int,
                 marks: memoryview) -> None:
        self.client, self.key, self.slot, self.gen, self.pid = client, key, slot, gen, _pid
        self.marks = marks

    def __call__(self) -> None:
        if self.pid != _pid:
            return  # inherited by a forked child: the lease is its parent's
        self.marks[self.slot] = 0  # first: the owner may take the block back from now on
        c = self.client
        c.released.append((self.key, self.slot, self.gen))
        c.waker.poke()


class Client:
    """This process's links to owners, and the flusher that sends their releases.

    Releases are kept per owner, not per connection: the owner takes a release
    from any connection of the process that claimed it, so a link that died
    while its owner lives (the owner dropped a peer that did not read) is made
    again, and what it had not sent goes on the new one. A release that does
    not fit on the socket now waits for the next round; only an owner that is
    gone makes its releases moot.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.links: dict[tuple[int, int], _Link] = {}
        self.paths: dict[tuple[int, int], str] = {}
        self.claims: collections.Counter[tuple[int, int]] = collections.Counter()  # under lock
        self.lock = threading.Lock()
        self.released: collections.deque[tuple[tuple[int, int], int, int]] = collections.deque()
        self.pending: dict[tuple[int, int], list[int]] = {}  # the flusher's: not sent yet
        self._making: dict[tuple[int, int], threading.Lock] = {}  # one link being made per owner
        self._swept = 0.0  # when the flusher last let go of dead owners' links
        self.flush_lock = threading.Lock()
        self.waker = Waker()  # the flusher's wake-up (Note [One release path])
        self.closed = False
        self.lingering = False  # close() left claims out: the flusher closes once they are back
        self.rebuilding = 0  # unpickles under way (under lock): none may find this client closed
        self._flusher = start_flusher(self, self.waker, "shmshare-mp-releases")

    def link(self, pid: int, token: int, path: str) -> _Link:
        """The live link to an owner, made (again) if need be -- never under ``self.lock``:
        connecting to an owner that does not answer must not stall the others' arrays."""
        key = (pid, token)
        got = self.links.get(key)
        if got is not None and not got.dead:
            return got
        with self.lock:
            making = self._making.get(key)
            if making is None:
                making = self._making[key] = threading.Lock()
        with making:
            got = self.links.get(key)
            if got is None or got.dead:
                if got is None:
                    self._forget_the_dead()  # a new owner: a moment to let go of gone ones
                try:
                    new = _Link(pid, token, path)  # OwnerGone if the owner is
                except OwnerGone:
                    self._forget(key)
                    raise
                with self.lock:
                    old = self.links.get(key)
                    self.links[key] = got = new
                    self.paths[key] = path
                if old is not None:
                    old.close()  # views of its segments keep their own mappings
        return got

    def _forget(self, key: tuple[int, int]) -> None:
        """An owner that is gone, with none of our claims out: let go of everything of it."""
        with self.lock:
            if self.claims[key] > 0 or key in self.pending:
                return
            link = self.links.pop(key, None)
            self.paths.pop(key, None)
            self.claims.pop(key, None)
            self._making.pop(key, None)
        if link is not None:
            link.close()

    def _forget_the_dead(self) -> None:
        """Let go of the links of owners that hung up, once no claim of ours is out on them."""
        for key, link in list(self.links.items()):
            if self.claims[key] > 0 or key in self.pending:
                continue
            # under its lock: rebuild() polls the same poll object (one caller at a time)
            if not link.dead and link.lock.acquire(blocking=False):
                try:
                    if link.readable(0):
                        link.check()
                except OwnerGone:
                    pass  # marked dead
                finally:
                    link.lock.release()
            if link.dead:
                self._forget(key)

    def rebuild(self, *args: Any) -> np.ndarray | None:
        """An array of a handle; None if this client closed meanwhile (a shutdown() on another
        thread): then a new one rebuilds it. A client never closes while one is under way."""
        with self.lock:
            if self.closed:
                return None
            self.rebuilding += 1
        try:
            return self._rebuild(*args)
        finally:
            with self.lock:
                self.rebuilding -= 1

    def _rebuild(self, pid: int, token: int, path: str, seg_id: int, size: int, start: int,
                 span: int, lo: int, strides: tuple[int, ...], slot: int, gen: int,
                 dtype: np.dtype, shape: tuple[int, ...], external: bool, mac: bytes) -> np.ndarray:
        if not (start >= 0 and span > 0 and start + span <= size and lo <= 0 and slot >= 0):
            raise HandleError(f"a malformed handle: {span} bytes at offset {start} of a "
                              f"{size}-byte segment of pid {pid}, slot {slot}")
        # the view's own extent, in Python ints: numpy's bounds check can overflow (2**63)
        got = _layouts.extent(dtype.itemsize, shape, strides)
        if got is None:
            raise HandleError(f"a malformed handle from pid {pid}: shape {shape}, strides {strides}")
        got_lo, got_span = got
        if got_lo != lo or not 0 < got_span <= span:
            raise HandleError(f"a malformed handle from pid {pid}: shape {shape} and strides "
                              f"{strides} span {got_span} bytes from {got_lo}, not within its "
                              f"{span} bytes from {lo}")
        key = (pid, token)
        link = self.links.get(key)
        if link is None or link.dead:
            link = self.link(pid, token, path)
        expected = link.sign(seg_id, size, start, span, lo, slot, gen, external)
        if not expected or not hmac.compare_digest(expected, mac):
            raise HandleError(f"a handle of pid {pid} (lease {slot}.{gen}) that its owner did not "
                              f"make: {span} bytes at offset {start} of segment {seg_id} do not "
                              "match its signature (altered on the way, or forged)")
        with link.lock:
            if link.dead or link.readable(0):
                link.check()
            root = link.segments.get(seg_id)
            if root is None:
                root = link.segment(seg_id, size, external)
            if start + span > root.nbytes:  # what we mapped decides, not the handle's word
                raise HandleError(f"a malformed handle: {span} bytes at offset {start} of pid "
                                  f"{pid}'s segment {seg_id}, which is {root.nbytes} bytes")
            if slot >= link.slots:
                raise HandleError(f"a malformed handle: slot {slot} of pid {pid}'s lease table")
            marks = link.marks
            # before the claim: from the swap on, the owner must see we hold it. Set already: we
            # hold this slot (this is a second unpickle of a handle): leave the byte to the view
            # that owns it, whose death clears it
            mark = not marks[slot]
            if mark:
                marks[slot] = 1
            pending = (gen << 32) | _PENDING_LOW
            found = _cas64(link.table_buf, slot, pending, (gen << 32) | link.claimed_low)
            if found != pending:
                if mark:
                    marks[slot] = 0  # a release the owner saw meanwhile is looked at again
                raise _not_claimed(pid, slot, gen, found, link.claimed_low)
            with self.lock:
                self.claims[key] += 1
        # numpy checks that shape and strides stay inside the lease (ValueError otherwise)
        try:
            return np.ndarray(shape, dtype,
                              _native.Lease(root, root.address + start, span, False,  # type: ignore[arg-type]
                                            _Released(self, key, slot, gen, marks)),
                              -lo, strides)
        except (ValueError, TypeError) as exc:
            raise HandleError(f"a malformed handle from pid {pid}: {exc}") from exc

    # -- releases ----------------------------------------------------------------

    def flush(self) -> bool:
        """Send the queued releases that fit now; True if none is left waiting."""
        with self.flush_lock:
            pending = self.pending
            released = self.released
            while released:
                key, slot, gen = released.popleft()
                pending.setdefault(key, []).extend((slot, gen))
            for key in list(pending):
                pairs = pending[key]
                sent = self._send_releases(key, pairs)
                with self.lock:
                    self.claims[key] -= sent // 2
                del pairs[:sent]
                if not pairs:
                    del pending[key]
            return not pending

    def _send_releases(self, key: tuple[int, int], pairs: list[int]) -> int:
        """Send what fits of `pairs`; return how many items went (or are moot: owner gone)."""
        link = self.links.get(key)
        done = 0
        try:
            if link is None or link.dead:
                path = self.paths.get(key)
                if path is None:
                    return len(pairs)
                link = self.link(key[0], key[1], path)
            while done < len(pairs):
                chunk = pairs[done:done + 2 * MAX_RELEASES]
                link.conn.send({KIND: RELEASE, "l": chunk}, timeout=_SEND_WAIT)
                done += len(chunk)
            return done
        except ShmshareTimeout:
            return done if link is not None and not link.dead else 0  # full: the next round
        except OwnerGone:
            return len(pairs)  # its pool went with it (forgotten once nothing is pending)
        except (PeerDied, OSError, ValueError):
            if link is not None:
                link.dead = True
            if not alive(key[0]):
                return len(pairs)
            return 0  # it dropped us but lives: a new link next round

    # -- the flusher's host (Note [One release path]) ------------------------------------------

    def _flusher_flush(self) -> bool:
        if time.monotonic() - self._swept >= 1.0:  # a busy consumer of many owners too
            self._swept = time.monotonic()
            self._forget_the_dead()
        return self.flush()  # an owner that does not read (stopped, busy): False

    def _flusher_pending(self) -> bool:
        return bool(self.released or self.pending)

    def _flusher_idle(self) -> None:
        self._forget_the_dead()  # a second without releases

    def _flusher_done(self) -> bool:
        if self.closed:
            return True
        if self.lingering and self._close_idle():  # closed once the last claim was given back
            _lingering.discard(self)
            return True
        return False

    def close(self) -> None:
        """Send what is queued and close the links with no claim out. With claims out (arrays
        still alive), the flusher sends their releases as they come and then closes the rest:
        its links, its pipe and itself (``close_client()`` has let go of this client by then)."""
        self.flush()
        if self._close_idle():
            self.waker.wake.poke()
            self._flusher.join(5.0)
            self.waker.wake.close()
        else:
            _lingering.add(self)  # first: the flusher takes it out once it has closed itself
            self.lingering = True
            self.waker.wake.poke()  # the flusher looks again

    def _close_idle(self) -> bool:
        """Close the links with no claim out (or owner); True if none is left: closed."""
        with self.lock:
            if self.rebuilding:
                return False  # its link is in use, its claim not counted yet
            for key, link in list(self.links.items()):
                if self.claims[key] <= 0 or not alive(key[0]):
                    del self.links[key]
                    link.close()
            if self.links or self.pending or self.released:
                return False
            self.closed = True
            return True


def _owner_error(pid: int, header: dict[Any, Any], what: str) -> ShmshareError:
    """An owner's own trouble giving us `what` (out of fds or memory): the handle stays good."""
    code, why = header.get("c"), str(header.get("w"))[:500]
    if code in (errno.EMFILE, errno.ENFILE):
        return FdLimitError(code, f"{why} (its fd table is full: the handle is still good while "
                            "it lives; raise its ulimit -n)")
    return ShmshareError(f"pid {pid} could not give us {what}: {why} (its own trouble: the handle "
                         "is still good while it lives; try again once it has memory and fds)")


def _not_claimed(pid: int, slot: int, gen: int, found: int, mine: int) -> HandleError:
    g, state, claimer = describe(found)
    if g == gen and state == CLAIMED:
        who = "this process" if claimer == describe(mine)[2] else f"pid {claimer}"
        return HandleError(f"this handle (an array of pid {pid}, lease {slot}.{gen}) was already "
                           f"unpickled by {who}: a handle is good for one unpickle; pickle the "
                           "array again (put it on the queue again) for each receiver")
    return HandleError(f"this handle (an array of pid {pid}, lease {slot}.{gen}) is stale: its "
                       "array was already unpickled and released, or pid {pid} gave it back")


_client: Client | None = None
_lingering: set[Client] = set()  # closed with claims out, until the last is given back
_client_lock = threading.Lock()
_pid = os.getpid()
_PENDING_LOW = word(0, PENDING)  # the low half of a PENDING word
_cas64 = _native.cas64


def client() -> Client:
    global _client
    got = _client
    if got is not None and not got.closed:
        return got
    with _client_lock:
        if _client is None or _client.closed:
            _client = Client()
        return _client


def close_client() -> None:
    global _client
    with _client_lock:
        got, _client = _client, None
        if got is not None:
            got.close()  # with claims out, it lingers in _lingering (a forked child forgets it)


def rebuild_array(pid: int, token: int, path: str, seg_id: int, size: int, start: int, span: int,
                  lo: int, strides: tuple[int, ...], slot: int, gen: int, dtype: str,
                  shape: tuple[int, ...], external: bool = False, mac: bytes = b"") -> np.ndarray:
    """Unpickle a handle (Note [Unpickling a handle])."""
    dt = _dtypes.get(dtype)
    if dt is None:
        dt = tensors.decode_dtype(dtype)
        if dt.hasobject:
            raise HandleError(f"a handle of dtype {dt} (object references) is refused")
        if len(_dtypes) < 1024:
            _dtypes[dtype] = dt
    c = _client
    args = (pid, token, path, seg_id, size, start, span, lo, strides, slot, gen, dt, shape, external, mac)
    while True:
        got = (c if c is not None and not c.closed else client()).rebuild(*args)
        if got is not None:
            return got
        c = None  # closed by a shutdown() on another thread since we took it: a new client


_dtypes: dict[str, np.dtype] = {}
def _after_fork_in_child() -> None:
    global _client, _client_lock, _pid
    _pid = os.getpid()
    _client_lock = threading.Lock()
    got, _client = _client, None
    for c in [got, *_lingering] if got is not None else list(_lingering):
        c.closed = True  # its flusher thread is not here; nothing of it is sent from here
        for link in c.links.values():
            link.forget_in_child()  # our copies only: the parent's connection stays open
        c.links.clear()
        c.released.clear()
        c.pending.clear()
        c.waker.wake.close()  # the parent's flusher's pipe (its lock is new in a child: wake.py)
    _lingering.clear()


_fork.on_fork_in_child(6, _after_fork_in_child)
