"""One poll server under every service that listens: the stats socket, the multiprocessing fd
server and the store daemon (in ``wire``'s layer, beside ``_listen.py``).

Note [One poll server]
    Each of the three serves its clients from one thread with one
    ``poll()``, so no client waits for another and no lock guards the
    service's tables. The loop is the same for all of them, so it lives
    here once, and each service holds a :class:`PollServer` (composition:
    the service keeps its clients' state and its answers; the server keeps
    the poll set, the listener, the stop pipe, the deadlines and the
    out-of-fds policy). A round of the loop:

    1. Call again, without waiting, the fds whose callback said so last
       round: a connection whose ring still holds frames, which a poll of
       its socket cannot see (Note [Rings] in ``_ring.py``; the store's).
    2. Ask the service's ``tick(now)`` when it wants the next round (its
       own timers: the stats notes, the store's waits and trim), and poll
       until then, the soonest added fd's deadline, the end of an accepting
       pause, or _LONGEST_WAIT (an ``until()`` is looked at that often).
    3. For each fd that is ready: the stop pipe is drained; the listener
       gives one connection (Note [Out of fds]), refused past `max_clients`
       (by the service's `refuse`: a close, or a reply saying why first)
       or handed to `accept`; any other fd's ``ready()`` runs.
    4. An fd added with a `wait` that is still there that many seconds
       after it was added is removed and given to its ``late()`` (a client
       that never asked).

    Callbacks never wait on one client: they read with ``recv_nowait()``
    and reply with a timeout of 0 (or the service's short one). What a
    callback raises ends ``run()``: each service catches its clients'
    troubles itself and decides what its own are worth. ``stop()`` works
    from any thread and from a signal handler: it sets a flag and writes a
    byte to a pipe the poll watches, and the loop returns before the next
    fd it would serve. A stop ends one ``run()``: the next one serves again.

Note [Out of fds]
    A listener whose backlog holds a connection that cannot be taken stays
    readable: polled level-triggered, a server whose fd table is full would
    spin at 100 % of a core until a fd frees up. And a newcomer that takes
    the last free fds leaves none for what the connected clients send: the
    kernel drops the fds of a message that finds no room (``MSG_CTRUNC``),
    and a store put loses its memfd.

    So the one policy of the three servers (and of a ``listen()`` receiver,
    which keeps a message's fds free instead: Note [A full fd table]; the
    rule is ``_listen.check_room``): a connection is accepted only
    while at least FD_ROOM fds stay free (an eighth of a table too small
    for that, and at least 2: a tiny table still takes clients). When fewer
    are free, or ``accept`` fails with EMFILE or ENFILE, the listener leaves
    the poll set for ACCEPT_PAUSE seconds while the connected clients are
    served; peers in the backlog stay queued and are taken after.

    FD_ROOM is 24: what the greediest of the three may open to serve one
    request of a client already connected (the store: a request's memfd,
    a read-only reopen of a segment, a staging memfd; the fd server: a
    segment's dup, a claim map and its pidfd), with room to spare: the
    store kept 24 free before, the fd server 8, the stats socket none.
    ACCEPT_PAUSE is 0.2 s: five looks a second at a full table (each a
    listing of ``/proc/self/fd``), and a peer in the backlog waits at most
    that long once fds are free again. The stats socket paused 1 s before.
"""

from __future__ import annotations

import math
import os
import select
import threading
import time
from collections.abc import Callable

from ._errors import FD_EXHAUSTED, ShmshareError, ShmshareTimeout, making_fds
from ._lifetime import Closeable
from ._listen import ACCEPT_PAUSE, Listener, check_room
from .wire import Connection

__all__ = ["PollServer", "FD_ROOM", "ACCEPT_PAUSE"]

FD_ROOM = 24  # fds kept free before another connection is accepted (Note [Out of fds])
_LONGEST_WAIT = 1.0  # s one poll waits at most: run()'s until() is looked at this often


class PollServer(Closeable):
    """Accept connections on a listener and call back for each fd that is readable, from the one
    thread that calls :meth:`run` (Note [One poll server]).

    Takes `listener` over: ``close()`` closes it. ``accept(conn)`` is handed each connection
    taken, which is its own from then on; it calls :meth:`add` to be told when the connection
    is readable. Past `max_clients` fds added as clients, a newcomer goes to ``refuse(conn)``
    instead (default: closed). ``tick(now)`` runs once a round and returns when it wants the
    next (None: whenever). ``on_pause(exc)`` is told each time accepting pauses.
    """

    def __init__(self, listener: Listener, accept: Callable[[Connection], None], *,
                 max_clients: int | None = None, refuse: Callable[[Connection], None] | None = None,
                 tick: Callable[[float], float | None] | None = None,
                 on_pause: Callable[[OSError], None] | None = None) -> None:
        self.listener = listener
        try:
            self._r, self._w = making_fds("pipe2", os.pipe2, os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            listener.close()  # ours from the call on
            raise
        self._wake_lock = threading.Lock()  # stop() never writes into a pipe closed meanwhile
        self._accept = accept
        self._max_clients = max_clients
        self._refuse = refuse
        self._tick = tick
        self._on_pause = on_pause
        self._listen_fd = listener.fileno()
        self._poller = select.poll()
        self._poller.register(self._listen_fd, select.POLLIN)
        self._poller.register(self._r, select.POLLIN)
        self._watched: dict[int, _Watch] = {}  # fd -> what to call when it is readable
        self._timed: dict[int, _Watch] = {}  # those of them with a deadline
        self._again: list[_Watch] = []  # called next round without waiting in poll
        self._clients = 0  # fds added as clients
        self._stopping = False
        self._resume_at = 0.0  # monotonic time to poll the listener again; 0: it is polled
        self.pauses = 0  # how often accepting paused (for tests and reports)

    @property
    def clients(self) -> int:
        """How many fds added as clients are served now."""
        return self._clients

    def add(self, fd: int, ready: Callable[[], bool], *, client: bool = True,
            wait: float | None = None, late: Callable[[], None] | None = None) -> None:
        """Call ``ready()`` whenever `fd` is readable, and once more next round without waiting
        while it returns True. With `wait`: if `fd` is still here `wait` s from now, remove it
        and call ``late()``. `client` False: it does not count against `max_clients`."""
        if fd in self._watched:
            raise ValueError(f"fd {fd} is served already")
        if (wait is None) != (late is None):
            raise ValueError("a wait needs its late() callback, and late() a wait")
        deadline = None if wait is None else time.monotonic() + wait
        watch = _Watch(fd, ready, client, deadline, late)
        self._poller.register(fd, select.POLLIN)
        self._watched[fd] = watch
        if deadline is not None:
            self._timed[fd] = watch
        self._clients += client

    def remove(self, fd: int) -> None:
        """Stop polling `fd` (before its owner closes it). Idempotent."""
        watch = self._watched.pop(fd, None)
        if watch is None:
            return
        self._timed.pop(fd, None)
        self._poller.unregister(fd)
        self._clients -= watch.client

    def fds(self) -> set[int]:
        """Every fd this server polls or owns (a keeper closes the rest)."""
        return {self._listen_fd, self._r, self._w, *self._watched}

    def run(self, until: Callable[[], bool] | None = None, deadline: float = math.inf) -> None:
        """Serve from this thread until :meth:`stop`, ``until()`` or the monotonic `deadline`."""
        try:
            while not self._stopping:
                if time.monotonic() >= deadline or (until is not None and until()):
                    return
                again, self._again = self._again, []
                for watch in again:
                    if self._watched.get(watch.fd) is watch:  # not removed (its fd reused) since
                        self._serve(watch)
                for fd, _ in self._poller.poll(0 if self._again else self._wait_ms(deadline)):
                    if self._stopping:
                        return
                    if fd == self._r:
                        self._drain()
                    elif fd == self._listen_fd:
                        self._take()
                    else:
                        readable = self._watched.get(fd)
                        if readable is not None:
                            self._serve(readable)
                self._expire(time.monotonic())
        finally:
            self._stopping = False  # one stop ends one run

    def stop(self) -> None:
        """End :meth:`run` (the one serving now, or the next to start) from any thread or a
        signal handler."""
        self._stopping = True
        if self._wake_lock.acquire(blocking=False):  # held by close(): nothing left to wake
            try:
                if self._w >= 0:
                    os.write(self._w, b"x")
            except OSError:
                pass  # full: the loop has bytes to read already
            finally:
                self._wake_lock.release()

    def close(self) -> None:
        """Close the listener (its socket file goes, in the process that made it) and the stop
        pipe, and forget the fds added (their owners close them). Idempotent."""
        with self._wake_lock:
            r, w, self._r, self._w = self._r, self._w, -1, -1  # forget first: never close twice
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
        self.listener.close()
        self._watched.clear()
        self._timed.clear()
        self._again.clear()
        self._clients = 0

    # -- the loop's steps --------------------------------------------------------

    def _wait_ms(self, deadline: float) -> int:
        now = time.monotonic()
        soonest = min(deadline, now + _LONGEST_WAIT)
        if self._tick is not None:
            due = self._tick(now)
            if due is not None:
                soonest = min(soonest, due)
        for watch in self._timed.values():
            if watch.deadline is not None:
                soonest = min(soonest, watch.deadline)
        if self._resume_at:
            soonest = min(soonest, self._resume_at)
        return max(0, min(int(_LONGEST_WAIT * 1000), int((soonest - now) * 1000) + 1))

    def _serve(self, watch: _Watch) -> None:
        if watch.ready():
            self._again.append(watch)

    def _drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def _take(self) -> None:
        conn = self._accept_one()
        if conn is None:
            return
        if self._max_clients is not None and self._clients >= self._max_clients:
            if self._refuse is None:
                conn.close()  # it sees the end at once, and may try again
            else:
                self._refuse(conn)
            return
        self._accept(conn)

    def _accept_one(self) -> Connection | None:
        """The next peer's Connection; None if there is none now, it was refused (another uid),
        or accepting paused (Note [Out of fds])."""
        try:
            check_room(FD_ROOM, "the connected clients' requests need them")
            return self.listener.accept(timeout=0)
        except ShmshareTimeout:
            return None  # it gave up, or another process took it
        except OSError as exc:  # FdLimitError too
            if exc.errno not in FD_EXHAUSTED:
                return None  # that peer's trouble (it hung up half-way): the next one may do
            self._poller.unregister(self._listen_fd)
            self._resume_at = time.monotonic() + ACCEPT_PAUSE
            self.pauses += 1
            if self._on_pause is not None:
                self._on_pause(exc)
            return None
        except ShmshareError:
            return None  # a peer of another uid: refused, it sees its socket close

    def _expire(self, now: float) -> None:
        for watch in [w for w in self._timed.values() if w.deadline is not None and w.deadline <= now]:
            if self._watched.get(watch.fd) is watch:  # not removed by an earlier late()
                self.remove(watch.fd)
                assert watch.late is not None
                watch.late()
        if self._resume_at and now >= self._resume_at:
            self._resume_at = 0.0
            self._poller.register(self._listen_fd, select.POLLIN)


class _Watch:
    __slots__ = ("fd", "ready", "client", "deadline", "late")

    def __init__(self, fd: int, ready: Callable[[], bool], client: bool, deadline: float | None,
                 late: Callable[[], None] | None) -> None:
        self.fd = fd
        self.ready = ready  # True: call again next round, without waiting in poll
        self.client = client  # counts against max_clients
        self.deadline = deadline  # monotonic time it goes to late(); None: never
        self.late = late
