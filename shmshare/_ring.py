"""A connection's frames through shared memory: two rings beside the socket.

Note [Rings]
    A :class:`wire.Connection` whose end calls ``offer_ring()`` moves its
    frames off the socket: a sealed memfd holds two single-producer
    single-consumer rings (``native/ring.c``), one each way, of COUNT slots
    of SLOT bytes, and a frame of up to SLOT - 4 bytes is copied into a slot
    instead of going through ``sendmsg``/``recvmsg``. What must cross the
    socket still does: the handshake, fds, frames too large for a slot, and
    end of stream (the peer's death is still EOF on the socket).

    Setting up, with no round trip on anyone's path: the offering end sends
    OFFER (the memfd) on the socket; the other end checks it (a memfd-like
    regular file of exactly the size, sealed against shrinking, growing and
    further seals, writable, every page allocated), maps it, and answers
    ACCEPT on the socket, its last socket frame before its ring frames. The
    offerer starts reading its incoming ring when it reads ACCEPT, or when
    that ring holds a frame while the socket holds nothing (then all the
    peer sent before was read: a forked copy of ours may have taken the
    ACCEPT), and at its next send says SWITCH on the socket, its last socket
    frame before its own ring frames. So each direction changes from socket
    to ring at one point that both ends see in the same order, and nothing
    sent before it is read after what follows.

    After the switch every frame of the process that set the ring up goes
    through the ring, in order. A frame with fds, or too large for a slot,
    goes on the socket as CARRIED with a sequence number, and the ring gets
    a marker naming that number where the frame belongs; the reader takes
    the carried frame off the socket when it meets the marker (a carried
    frame read earlier waits in a small table, at most MAX_CARRIED). The
    ring is room-checked before the carried frame is sent, so a marker
    always finds its slot; carried frames come in order, at most MAX_CARRIED
    ahead of their markers (an honest writer is one ahead). Releases are
    sent in frames that fit a slot (``Connection.frame_room()``).

    Only the process that set the rings up uses them (Note [An end in
    another process] in ``_handover.py``): socket frames of any other
    process are delivered as they come, as before, and an end that hears
    the HELLO of a second process of its peer writes on the socket from
    then on, where any process of that end may read.

    Waiting: a reader that finds its ring empty spins for SPIN_NS (the
    ``SHMSHARE_SPIN_US`` setting, microseconds, default 50; after four
    spins in a row that found nothing, only one wait in 32 spins, until a
    spin pays again: on a busy machine a spin takes the writer's core), then *arms*
    (a flag in the ring: "wake me") and sleeps in poll() on the socket. A
    writer that finds the flag set takes it and sends a two-byte WAKE frame
    on the socket, never waiting (MSG_DONTWAIT: a full socket is readable
    already). The socket, not an eventfd or a futex: one poll then sees a
    frame, a wake-up and the peer's death, no fd is added per connection,
    and the peer cannot make the wake-up block (an eventfd's O_NONBLOCK is
    shared with the process that sent it and would be the peer's to clear).
    An idle end sleeps in poll() and costs nothing. A writer whose ring is
    full backs off in sleeps of ROOM_BACKOFF, doubling (kept across calls),
    until its timeout: a full ring means the reader is behind, so the wait
    is not for latency; it looks for the peer's hang-up (POLLHUP) each time.

    A reader of ``fileno()`` (a selector) is kept armed whenever its ring is
    empty after a read, so a frame pushed then always makes the socket
    readable; a WAKE is read off the socket only once the ring is empty. A
    selector may then fire once for a WAKE whose frames were already taken:
    ``recv_nowait()`` answers None, as for any spurious readiness.

    The memory is the peer's to write at any moment: ``native/ring.c``
    checks every index and length it reads (Note there), and here a marker
    for a number that is not the next, a carried frame out of order or past
    MAX_CARRIED, a memfd that is not ours to write, and a frame where none
    may be are ProtocolErrors. A peer that pushes a frame and hangs up
    between our two looks still has the frame delivered before PeerDied.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from . import _native
from ._errors import FdLimitError, PeerDied, ProtocolError, ShmshareTimeout
from ._handover import stand_in_hello
from ._handshake import State
from ._ringmem import COUNT, SLOT, check_memfd, check_settings, enabled, make_memfd, nbytes, spin_ns
from ._sockets import queued_bytes

if TYPE_CHECKING:
    from ._fd import Fd
    from .wire import Connection

__all__ = ["COUNT", "SLOT", "MAX_CARRIED", "spin_ns", "enabled", "check_settings", "nbytes", "make_memfd",
           "check_memfd", "RingLink", "BrokenRing"]

MAX_CARRIED = 4  # carried frames read ahead of their markers, at most (they hold fds); 1 is honest
CARRIED_EXTRA = 16  # bytes [CARRIED, [number, header]] takes beyond [MSG, header] (at most 10)
SPIN_MISSES, SPIN_PROBE = 4, 32  # see RingLink._spin_worth_it
ROOM_BACKOFF = (50e-6, 20e-3)  # s: a writer's first and longest sleep while its ring is full


class BrokenRing(ProtocolError):
    """The peer wrote an index or a length out of bounds into the rings: the connection is
    done for (a ProtocolError; its end is dropped, as for any frame it broke)."""


class RingLink:
    """One end's rings, where the switch from the socket stands, and its reading and writing
    (Note [Rings]). Part of its :class:`wire.Connection`, whose socket calls it uses."""

    def __init__(self, conn: Connection, ring: _native.Ring, *, offered: bool) -> None:
        self.conn = conn
        self.ring = ring  # the mapping; its fd is closed (no fd per connection for the rings)
        self.offered = offered  # this end made the rings (and reads the peer's ACCEPT)
        self.token = 0  # the OFFER's number, which its ACCEPT repeats (another process's is not ours)
        self.peer_pid = conn.peer_hello.get("pid") if conn.peer_hello else None  # whose rings
        self.fell_back = False  # another process of the peer spoke: ours go on the socket
        self.reading = False  # the peer's SWITCH (or ACCEPT) was read: its frames come by ring
        self.writing = False  # ours go by ring (after our ACCEPT or SWITCH went on the socket)
        self.accept_due = not offered  # the ACCEPT still to send
        self.switch_due = False  # the SWITCH to send before our first ring frame
        self.next_out = 0  # sequence number of our next carried frame
        self.next_in = 0  # of the peer's next marker
        self.carried: dict[int, tuple[Any, list[Fd]]] = {}  # read before their markers
        self.lost: set[int] = set()  # carried frames whose fds the kernel dropped (reported once)
        self.resolving: int | None = None  # the marker popped whose carried frame is still to read
        self.stash: collections.deque[tuple[Any, list[Fd]]] = collections.deque()  # delivered first
        self.armed_after_read = False  # a selector waits on the socket: arm whenever empty
        self.spin = spin_ns()
        self.pause = ROOM_BACKOFF[0]  # a writer's next sleep while its ring stays full
        self.misses = 0  # spins in a row that found nothing: past SPIN_MISSES, spin rarely
        self.waits = 0

    @classmethod
    def offer(cls, conn: Connection, timeout: float | None) -> RingLink:
        """Make the rings and send OFFER on the socket (the send lock held, the HELLO sent)."""
        fd = make_memfd()
        try:
            link = cls(conn, _native.Ring(fd, COUNT, SLOT, True), offered=True)
            link.token = int.from_bytes(os.urandom(8), "little") >> 1
            link.ring.arm()  # the peer's first ring frame wakes us (we read the socket till then)
            conn._rings = link  # before the peer can answer
            conn._send_frame(conn._packer.pack([KIND_OFFER, link.token]), [fd], timeout)
        except BaseException:
            conn._rings = None
            raise
        finally:
            os.close(fd)
        return link

    @classmethod
    def accept(cls, conn: Connection, token: Any, fds: list[Fd]) -> RingLink | None:
        """Take the peer's OFFER: check and map its rings, and answer ACCEPT if no send is in
        progress (else the next send does). None: declined (a selector reads this end)."""
        if len(fds) != 1:
            for f in fds:
                f.close()
            raise ProtocolError(f"a ring OFFER carried {len(fds)} fds, not 1")
        if type(token) is not int:
            fds[0].close()
            raise ProtocolError(f"a ring OFFER's number is a {type(token).__name__}, not an int")
        if conn._selected:
            fds[0].close()
            return None
        try:
            check_memfd(fds[0].fileno())
            ring = _native.Ring(fds[0].fileno(), COUNT, SLOT, False)
        except OSError as exc:
            raise ProtocolError(f"the peer's rings cannot be mapped: {exc}") from exc
        finally:
            fds[0].close()
        link = cls(conn, ring, offered=False)
        link.token = token
        if conn._armed_reader:
            link.armed_after_read = True
        conn._rings = link  # before ACCEPT: a send of another thread goes by ring from here on
        link.try_start_writing()
        return link

    def control(self, kind: int, body: Any, fds: list[Fd]) -> None:
        """A socket frame about the rings: ACCEPT, SWITCH, a carried frame early, a stale WAKE."""
        if kind in (KIND_CARRIED, KIND_WAKE) and self.offered and not self.reading:
            self.start_reading()  # sent after ACCEPT, which a forked copy of ours must have taken
        if kind == KIND_CARRIED and self.reading:
            self.take_carried(body, fds)
            return
        if kind == KIND_OFFER or (kind == KIND_WAKE and not fds):
            for f in fds:  # another offer (a forked or spawned copy's): declined
                f.close()
            return  # (a wake read before the ring was: nothing to do)
        if kind == KIND_ACCEPT and self.offered and (body != self.token or self.reading) and not fds:
            return  # another process's offer answered, or ours after its ring frames showed
        if not self.reading and not fds and kind == (KIND_ACCEPT if self.offered else KIND_SWITCH):
            self.start_reading()
            return
        for f in fds:
            f.close()
        raise ProtocolError(f"the peer sent a frame of kind {kind} where none may be (Note [Rings])")

    def start_reading(self) -> None:
        """The peer's frames come by ring from here on: after its ACCEPT (or SWITCH), or, for the
        end that offered, once its ring holds a frame and the socket nothing: then everything the
        peer sent before it (its HELLO and ACCEPT included) was read, if by a forked copy of ours
        (Note [An end in another process] in _handover.py)."""
        self.reading = True
        if self.armed_after_read:
            self.ring.arm()
        conn = self.conn
        if conn.peer_hello is None:  # a forked copy of ours read its HELLO: its credentials stand in
            conn.peer_hello = stand_in_hello(conn)
            conn.state = State.READY
        if self.offered and not self.fell_back:
            self.switch_due = True
            self.try_start_writing()

    def hello_from(self, pid: Any) -> None:
        """A HELLO: from another process than the one the rings were set up with (a fork's or a
        spawned child's copy of the peer's end), our frames go on the socket from here on, where
        any process of the peer may read them (Note [Rings])."""
        if self.peer_pid is None:
            self.peer_pid = pid
        elif pid != self.peer_pid:
            self.fell_back = True
            self.writing = self.accept_due = self.switch_due = False

    def try_start_writing(self) -> None:
        """Send ACCEPT or SWITCH now if no send is in progress (else the next send does), with our
        HELLO first if it has not gone: an end that never sends (a receiver of arrays sent by value,
        or of plain values, which release nothing) must not keep the peer's frames on the socket."""
        conn = self.conn
        if conn._send_lock.acquire(blocking=False):
            try:
                if not self.writing and not conn.closed and (self.accept_due or self.switch_due):
                    if not conn._hello_sent:
                        conn._say_hello(0)
                    self.start_writing(0)
            except (ShmshareTimeout, PeerDied):
                pass  # the next send tries again, or finds the peer gone
            finally:
                conn._send_lock.release()

    def keep_armed(self) -> None:
        """A selector waits on the socket: stay armed whenever the ring is empty."""
        self.armed_after_read = True
        self.ring.arm()

    # -- writing ------------------------------------------------------------------------------

    def send(self, header: Any, frame: bytes, fds: list[int], timeout: float | None) -> None:
        """Send one frame (under the connection's send lock): in a slot, or carried."""
        conn = self.conn
        if not self.writing:
            if not (self.accept_due or self.switch_due):  # offered, not accepted yet: the socket
                conn._send_frame(frame, fds, timeout)
                return
            self.start_writing(timeout)
        ring = self.ring
        if fds or len(frame) > SLOT - 4:
            self._wait_room(timeout)
            seq = self.next_out
            conn._send_frame(conn._packer.pack([KIND_CARRIED, [seq, header]]), fds, timeout)
            self.next_out += 1
            frame = conn._packer.pack([KIND_MARK, seq])
        while (r := ring.push(frame)) == 0:
            self._wait_room(timeout)
        if r == 3:
            self.wake()
        elif r < 0:
            raise BrokenRing("the peer broke the ring: its read index is not within the ring "
                                "of what this end wrote")

    def start_writing(self, timeout: float | None) -> None:
        """Send our last socket frame before our ring frames: ACCEPT, or SWITCH (send lock held)."""
        conn = self.conn
        conn._send_frame(conn._packer.pack([KIND_ACCEPT, self.token] if self.accept_due
                                           else [KIND_SWITCH, None]), [], timeout)
        self.accept_due = self.switch_due = False
        self.writing = True

    def push_nowait(self, frame: bytes) -> bool:
        """Push a frame if there is room now (a finalizer's goodbye); whether it went."""
        if not self.writing:
            return False
        r = self.ring.push(frame)
        if r == 3:
            self.wake()
        return r > 0

    def wake(self) -> None:
        """Tell a sleeping peer to look at its ring: a WAKE frame, never waiting."""
        try:
            self.conn._sock.sendmsg([_WAKE], [], _NOSIGNAL | _DONTWAIT)
        except OSError:  # full: it is readable already; gone: its next call says so
            pass

    def _wait_room(self, timeout: float | None) -> None:
        """Wait, backing off, until the outgoing ring has a free slot (Note [Rings])."""
        pending = self.ring.pending
        if 0 <= pending < COUNT:
            self.pause = ROOM_BACKOFF[0]
            return
        conn = self.conn
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = self.pause  # kept across calls: a caller that waits in slices backs off too
        hangup = select.poll()  # the peer's end closed, whatever it left queued for us
        hangup.register(conn._sock, select.POLLHUP | select.POLLRDHUP)
        while True:
            if pending < 0:
                raise BrokenRing("the peer broke the ring: its read index is not within the "
                                    "ring of what this end wrote")
            if pending < COUNT:
                return
            if conn.closed:
                raise ValueError("this Connection was closed while send() waited for room in "
                                 "its ring")
            if hangup.poll(0):
                raise PeerDied(f"the peer ({conn._peer_name()}) closed the connection with "
                               "its ring full")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ShmshareTimeout(f"send timed out after {timeout} s: the peer "
                                      f"({conn._peer_name()}) did not take from its full ring")
            time.sleep(pause if left is None else min(pause, left))
            pause = self.pause = min(2 * pause, ROOM_BACKOFF[1])
            pending = self.ring.pending

    # -- the fast lane (Note [Fast lane]) -------------------------------------------------------

    def send_now(self, make: Callable[..., bytes], *args: Any) -> bool:
        """Push the message frame ``make(*args)`` (``[MSG, header]`` packed, no fds), made only if
        our frames go by ring, if a slot is free now; False: nothing sent, ``send()`` it."""
        if not self.writing:
            return False
        frame = make(*args)
        if len(frame) > SLOT - 4:
            return False
        conn = self.conn
        if not conn._send_lock.acquire(blocking=False):
            return False
        try:
            if not self.writing or conn.state is State.CLOSED:
                return False
            r = self.ring.push(frame)
            if r == 0:
                return False  # full: the usual send waits for room
            if r == 3:
                self.wake()
            elif r < 0:
                raise BrokenRing("the peer broke the ring: its read index is not within the "
                                    "ring of what this end wrote")
            c = conn._counts
            c[0] += 1
            c[4] += len(frame)
            return True
        finally:
            conn._send_lock.release()

    def recv_now(self, raw: bytes = b"") -> Any:
        """The message at the head of the ring, if one is there now: its frame as bytes when it
        starts with `raw` (the caller parses it), else its header. None: nothing was taken,
        ``recv()`` the usual way (an empty ring, no HELLO read yet, a receive of another
        thread). A marker is resolved as ``recv()`` would, its frame kept for it."""
        conn = self.conn
        if not self.reading or self.stash or self.resolving is not None or conn.peer_hello is None:
            return None
        if not conn._recv_lock.acquire(False):
            return None
        try:
            if conn.state is State.CLOSED:
                return None
            buf = conn._buf
            ring = self.ring
            n = ring.pop_into(buf)
            if n < 0:
                return None  # empty, or broken: recv() pops again and says so
            if self.armed_after_read and not ring.readable():
                ring.arm()
            if raw and buf.startswith(raw):
                conn._counts[1] += 1
                return bytes(memoryview(buf)[:n])
            got = self._ring_frame(buf, n)
            if got is None:
                return None
            body, fds = got[1], got[2]
            if fds or type(body) is not dict:  # a carried frame, or a bad header: recv()'s
                self.stash.appendleft((body, fds))
                return None
            conn._counts[1] += 1
            return body
        finally:
            conn._recv_lock.release()

    # -- reading ------------------------------------------------------------------------------

    def pending(self) -> bool:
        """Whether a frame waits in the ring or the stash."""
        return bool(self.stash) or bool(self.ring.readable())

    def poll(self, timeout: float | None) -> bool:
        """The connection's poll(): receive the next message if one comes, and keep it for recv."""
        if self.pending():
            return True
        conn = self.conn
        if not conn._recv_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        try:
            got = conn._recv_locked(timeout)
            if got is None:
                return False
            self.stash.appendleft(got)  # under the lock: a recv() of another thread gets it first
            conn._counts[1] -= 1  # counted when recv() delivers it
            conn._counts[3] -= len(got[1])
            return True
        except PeerDied:
            return True  # recv() says so
        finally:
            conn._recv_lock.release()

    def next_frame(self, timeout: float | None) -> tuple[int, Any, list[Fd]] | None:
        """The next frame (under the receive lock): kind, body, fds; None after `timeout`.

        Ring frames come first; when the ring is empty, the socket's (what another process
        sent, a carried frame early, a HELLO) and its end. Spins, then arms and sleeps.
        """
        if self.stash:
            body, fds = self.stash.popleft()
            return KIND_MSG, body, fds
        if self.resolving is not None and (frame := self._resolve()) is not None:
            return frame
        conn = self.conn
        ring = self.ring
        buf = conn._buf
        deadline = None
        spun = False
        while True:
            n = ring.pop_into(buf)
            if n >= 0:
                if self.armed_after_read and not ring.readable():
                    ring.arm()
                if (frame := self._ring_frame(buf, n)) is not None:
                    return frame
                continue  # a marker whose carried frame's fds were lost (its error was raised)
            if n == -2:
                raise BrokenRing("the peer broke the ring: its write index or a slot's length "
                                    "is out of bounds")
            try:
                got = self._socket_frame()
            except PeerDied:
                if ring.readable():  # pushed, then gone, between our two looks
                    continue
                raise
            if got is not None:
                if got[0] != KIND_WAKE:
                    return got
                if timeout is not None:  # a flood of wake-ups must not outlast the timeout
                    if deadline is None:
                        deadline = time.monotonic() + timeout
                    elif time.monotonic() >= deadline and not ring.readable() and not (
                            self.armed_after_read and ring.arm()):
                        # (a WAKE taken may be for a frame pushed since our pop: the ring is
                        # looked at, and armed for a selector, before saying nothing came)
                        return None
                continue
            if timeout is not None and timeout <= 0:
                if self.armed_after_read and ring.arm():
                    continue
                return None
            if not spun:
                spun = True
                if self.spin and self._spin_worth_it():
                    if ring.spin(self.spin):
                        self.misses = 0
                        continue
                    self.misses += 1
            if ring.arm():
                continue
            if deadline is None and timeout is not None:
                deadline = time.monotonic() + timeout
            if not conn._poll_until(conn._pollin, deadline, "recv()"):
                return None

    def _spin_worth_it(self) -> bool:
        """Spin only while spinning pays: after SPIN_MISSES empty spins in a row (a slow or idle
        writer, a busy machine), only one wait in SPIN_PROBE spins, to see whether it pays again."""
        self.waits += 1
        return self.misses < SPIN_MISSES or self.waits % SPIN_PROBE == 0

    def _ring_frame(self, buf: bytearray, n: int) -> tuple[int, Any, list[Fd]] | None:
        try:
            msg = msgpack.unpackb(memoryview(buf)[:n], raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several types for bad input
            raise ProtocolError(f"a malformed frame of {n} bytes in the ring: {exc}") from exc
        if not (type(msg) is list and len(msg) == 2):
            raise ProtocolError(f"a ring frame must be [kind, body], got {msg!r:.80}")
        kind, body = msg
        if kind == KIND_MSG:
            return KIND_MSG, body, []
        if kind != KIND_MARK or type(body) is not int:
            raise ProtocolError(f"a ring frame of kind {kind!r}: only messages and markers "
                                "travel in the ring")
        if body != self.next_in:
            raise ProtocolError(f"the ring names carried frame {body} where {self.next_in} is next")
        self.resolving = body
        return self._resolve()

    def _resolve(self) -> tuple[int, Any, list[Fd]] | None:
        """The carried frame of the marker popped last, off the socket; None: its fds were lost,
        and the FdLimitError that said so was raised when it was read."""
        seq = self.resolving
        assert seq is not None
        # The peer sent the carried frame before it pushed the marker: it is among the bytes queued
        # on the socket now. Reading past them without it, the peer floods us (else a hang, and
        # messages kept for later without bound): its bytes are the bound, whatever the buffers.
        counts = self.conn._counts
        budget = counts[5] + queued_bytes(self.conn._sock)
        while seq not in self.carried and seq not in self.lost:
            if counts[5] > budget:
                raise ProtocolError(f"the peer sent more on the socket than was queued when its ring "
                                    f"named carried frame {seq}, without that frame")
            got = self._socket_frame()
            if got is None and self.conn._shared:  # a forked copy of ours took it (as it could
                self.lost.add(seq)  # any frame of this socket): passed over, as it would be lost
                break
            if got is None:
                raise ProtocolError(f"the ring names carried frame {seq}, which is not on the "
                                    "socket")
            if got[0] == KIND_WAKE:
                continue
            if got[0] == KIND_CARRIED:
                self.take_carried(got[1], got[2])
            elif got[0] == KIND_MSG:  # another process's, read on the way: delivered next
                self.stash.append((got[1], got[2]))
            else:
                self.conn._control(got[0], got[1], got[2])
        self.resolving = None
        self.next_in += 1
        if seq in self.lost:
            self.lost.discard(seq)
            return None
        kept = self.carried.pop(seq, None)
        if kept is None:  # close() of another thread emptied the table
            raise ValueError("this Connection was closed while recv() waited")
        return KIND_MSG, kept[0], kept[1]

    def _socket_frame(self) -> tuple[int, Any, list[Fd]] | None:
        """The next socket frame, if one is queued; a carried frame whose fds the kernel dropped
        (a full fd table) is noted, so that its marker is passed over, and the error raised."""
        try:
            return self.conn._recv_frame(0)
        except FdLimitError as exc:
            seq = getattr(exc, "carried", None)
            if seq is not None:
                if seq != self.next_in + len(self.carried) + len(self.lost) or (
                        len(self.carried) + len(self.lost) >= MAX_CARRIED):
                    raise ProtocolError(f"the peer's carried frame {seq} is out of order or "
                                        f"more than {MAX_CARRIED} ahead of the ring") from exc
                self.lost.add(seq)
            raise

    def take_carried(self, body: Any, fds: list[Fd]) -> None:
        """Keep a carried frame until its marker comes."""
        bad = None
        expected = self.next_in + len(self.carried) + len(self.lost)  # they come in order
        if not (type(body) is list and len(body) == 2 and type(body[0]) is int):
            bad = f"a carried frame must be [number, header], got {body!r:.80}"
        elif body[0] != expected:
            bad = f"the peer's carried frame {body[0]} came where {expected} was next"
        elif len(self.carried) + len(self.lost) >= MAX_CARRIED:
            bad = f"the peer sent more than {MAX_CARRIED} carried frames ahead of its ring"
        if bad is not None:
            for f in fds:
                f.close()
            raise ProtocolError(bad)
        self.carried[body[0]] = (body[1], fds)

    def close(self) -> None:
        """Unmap the rings (a call of another thread then raises ValueError) and close the fds
        of frames never delivered."""
        self.ring.close()
        for _, fds in self.carried.values():
            for f in fds:
                f.close()
        for _, fds in self.stash:
            for f in fds:
                f.close()
        self.carried.clear()
        self.stash.clear()


KIND_HELLO, KIND_MSG, KIND_OFFER, KIND_ACCEPT, KIND_SWITCH, KIND_CARRIED, KIND_WAKE, KIND_MARK = range(8)
SOCKET_KINDS = frozenset((KIND_HELLO, KIND_MSG, KIND_OFFER, KIND_ACCEPT, KIND_SWITCH, KIND_CARRIED,
                          KIND_WAKE))
_WAKE = msgpack.packb([KIND_WAKE, None])
_NOSIGNAL, _DONTWAIT = int(socket.MSG_NOSIGNAL), int(socket.MSG_DONTWAIT)
