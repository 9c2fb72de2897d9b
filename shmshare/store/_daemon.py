"""The store daemon: one thread, one poll loop, every client's requests in turn.

Note [One thread]
    Every request is a few dictionary operations, a check of a fd, and at
    most one copy of less than ``LARGE`` bytes (a small object's bytes read
    from the client's staging memfd into a pool block): large objects'
    bytes never pass through the daemon, which only holds their memfds.
    So one thread serves every client (a ``PollServer``: Note [One poll
    server]), and no lock guards the table. A
    reply never waits for room on a client's socket: a client reads each
    reply before it sends its next request, so a full socket means one that
    does not read, and it is dropped (its references go with it) rather
    than waited for by everyone else.

Note [The write seal]
    A put's memfd arrives sealed ``F_SEAL_WRITE`` already: its writer used
    ``pwrite`` and never mapped it (Note [Writing a large object]). A
    created object's memfd is mapped writable by its creator, and the
    kernel refuses ``F_SEAL_WRITE`` while such a mapping exists (EBUSY). So
    ``seal`` applies ``F_SEAL_FUTURE_WRITE`` -- no new writable mapping, no
    ``write()``, no ``mprotect`` to writable -- and the full seal follows
    once the creator tells that its mapping is gone (``unmapped``), or its
    connection ends, or at the next get. Until then only the creator's own
    mapping can still change the bytes. Getters map ``PROT_READ``; a
    mapping's ``mprotect(PROT_WRITE)`` fails, as does a writable ``mmap``.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import os
import signal
import time
from typing import Any

from .. import wire
from .._errors import FdLimitError, PeerDied, ProtocolError, ShmshareError, ShmshareTimeout
from .._fd import Fd
from .._plane.trust import check_fd
from .._pollserver import ACCEPT_PAUSE, PollServer
from . import _making as making
from ._index import HELD_POLL, WORDS, map_counts
from ._making import Bad, name_of
from ._objects import Obj, Table
from ._protocol import (
    ABORTED,
    BAD,
    BUSY,
    LARGE,
    NOT_FOUND,
    NOT_SEALED,
    TIMEOUT,
    StoreError,
    StoreFull,
    check_dir,
    default_path,
    remove_stale,
)
from ._spill import Spiller

__all__ = ["Server", "serve", "MAX_CLIENTS"]

log = logging.getLogger("shmshare.store")

_REPLY_WAIT = 0.0  # s a reply waits for room on a client's socket (Note [One thread])
_MAX_WAITS = 256  # waits one connection may have pending
_MAX_PUSHED = 16  # drop frames sent to a client unasked between two of its requests
_DROPS_PER_REPLY = 4096  # segment ids a reply carries at most (a frame is 128 KiB)
MAX_CLIENTS = 4096  # clients connected at once, by default (a get's wait is one more)
_LIST_PAGE = 256  # entries per list reply, at most ...
_LIST_BYTES = 64 * 1024  # ... and about this many bytes of them


class _Client:
    __slots__ = ("id", "conn", "fd", "pid", "segments", "refs", "staging", "creating", "drops", "future",
                 "waits", "pushed", "pending", "wsegs")

    def __init__(self, cid: int, conn: wire.Connection) -> None:
        self.id = cid
        self.conn = conn
        self.fd = conn._poll_fd()  # rings allowed: the loop asks pending() (Note [Rings] in _ring)
        self.pid = conn.peer_cred.pid
        self.segments: set[int] = set()  # segments whose fd it was sent (it may map them)
        self.refs: dict[int, int] = {}  # oid -> its gets not given back
        self.staging: tuple[int, int] | None = None  # its staging memfd (ours), and size
        self.creating: set[int] = set()  # oids it created and has not sealed
        self.drops: list[int] = []  # segments gone that it may still map: told in the next reply
        self.future: set[int] = set()  # oids it sealed while mapping them writable
        self.waits = 0  # its waits pending
        self.pushed = 0  # drop frames sent to it unasked since its last request
        self.pending: dict[int, Obj] = {}  # oid -> a warm put's block it is filling
        self.wsegs: set[int] = set()  # pool segments whose read-write fd it was sent


class Server:
    """The store: a listening socket, the table, and the clients (Note [One thread])."""

    def __init__(self, path: str | None = None, limit: int | None = None,
                 evict: bool = False, max_clients: int = MAX_CLIENTS,
                 spill: str | None = None) -> None:
        if limit is not None and limit <= 0:
            raise ValueError(f"--limit must be a positive number of bytes, got {limit}")
        check_spill_args(limit, evict, spill)
        if max_clients < 1:
            raise ValueError(f"max_clients must be at least 1, got {max_clients}")
        self.max_clients = max_clients
        chosen = path is None and not os.environ.get("SHMSHARE_STORE")  # else the user's choice
        self.path = os.fspath(path) if path is not None else default_path()
        if chosen:
            check_dir(self.path)
        remove_stale(self.path)
        self.table = Table(limit, evict, self._dropped,
                           None if spill is None else Spiller(spill))
        making.recover_spilled(self)  # a killed daemon's spilled objects (Note [Spilling])
        self._clients: dict[int, _Client] = {}  # socket fd -> client
        self._waits: dict[str, list[tuple[_Client, float]]] = {}  # name -> (client, deadline)
        self._deadlines: list[tuple[float, str]] = []  # a heap of the waits' (deadline, name)
        self._poll = PollServer(wire.Listener(self.path, role="store", backlog=256), self._accept,
                                max_clients=max_clients, refuse=self._refuse, tick=self._timers,
                                on_pause=_said_out_of_fds)
        self._started = time.time()
        self._held_at = 0.0  # when to look next at objects fast gets' views hold
        self.counts = {"put": 0, "get": 0, "create": 0, "delete": 0, "clients": 0, "refused": 0}

    def stop(self) -> None:
        """Ask the loop to end (from a signal handler or another thread)."""
        self._poll.stop()

    def run(self) -> None:
        """Serve until :meth:`stop`; then close every client and free every object."""
        try:
            self._poll.run()
        finally:
            self.close()

    def close(self) -> None:
        for client in list(self._clients.values()):
            self._drop(client, hung_up=False)
        self.table.close()
        self._poll.close()

    # -- connections ---------------------------------------------------------------

    def _timers(self, now: float) -> float | None:
        """Each round: answer the waits that ran out and trim an idle pool; when to look next."""
        self._expire_waits()
        heap = self._deadlines
        while heap and heap[0][1] not in self._waits:
            heapq.heappop(heap)  # woken or dropped since
        trim = self.table.trim_if_idle(now)
        held = None
        if self.table.fast_held:  # looked at every HELD_POLL s, not every round
            if now >= self._held_at:
                self._held_at = now + HELD_POLL
                self.table.recheck_held()
            held = self._held_at if self.table.fast_held else None
        return min([t for t in (heap[0][0] if heap else None, trim, held) if t is not None],
                   default=None)

    def _accept(self, conn: wire.Connection) -> None:
        self.counts["clients"] += 1
        client = _Client(self.counts["clients"], conn)
        self._clients[client.fd] = client
        self._poll.add(client.fd, lambda: self._serve(client))
        log.debug("client %d (pid %s) connected", client.id, client.pid)

    def _refuse(self, conn: wire.Connection) -> None:
        """Tell a newcomer past the cap that we are full, then close: a bare close would read
        as a dead daemon, whose advice (start another) loses every object held here."""
        log.warning("%d clients connected: refusing pid %s", self.max_clients, conn.peer_cred.pid)
        self.counts["refused"] += 1
        text = (f"the store daemon (pid {os.getpid()}) at {self.path!r} is serving its maximum "
                f"of {self.max_clients} clients, and its objects are intact: close idle Store "
                "objects (each holds a connection, and a get(timeout=...) one more while it "
                "waits) and make a new Store, or start the daemon with a higher "
                "SHMSHARE_STORE_MAX_CLIENTS")
        try:
            conn.send({"k": "err", "e": BUSY, "w": text}, timeout=0)
        except (ShmshareError, OSError, ValueError):
            pass  # it left already, or its socket is full: it reads the close alone
        conn.close()

    def _serve(self, client: _Client) -> bool:
        # One frame per readiness: poll is level-triggered, so a client with more queued is
        # served again on the next round, after the others (and no recvmsg is spent on EAGAIN);
        # True: its ring holds more, which a poll would not see (served again without waiting)
        try:
            got = client.conn.recv_nowait()
            if got is None:
                return False
            header, fds = got
            try:
                self._answer(client, header, fds)
            finally:
                for f in fds:
                    f.close()
            return client.conn.pending()
        except PeerDied:
            self._drop(client, hung_up=True)
        except FdLimitError as exc:
            # its request's fds did not fit in our table (MSG_CTRUNC): the request is lost, so
            # answer it with the reason and keep the client (dropping it would take back every
            # reference it holds, under its views)
            log.warning("out of fds receiving from client %d (pid %s): %s", client.id,
                        client.pid, exc)
            lost = getattr(exc, "header", None)
            try:
                if isinstance(lost, dict):
                    self._carried(client, lost)  # its releases and forgets still count
                self._reply(client, {"k": "err", "e": "daemon", "w": f"the store daemon (pid "
                                     f"{os.getpid()}) is out of file descriptors: {exc}"})
            except (ShmshareError, OSError, ValueError):
                self._drop(client, hung_up=False)
        except (ProtocolError, ShmshareError, OSError, ValueError, TypeError) as exc:
            log.info("client %d (pid %s) dropped: %s", client.id, client.pid, exc)
            self._drop(client, hung_up=False)
        except Exception:  # a bug of ours: that client goes, the store keeps serving
            log.exception("client %d (pid %s) dropped after an error in the daemon", client.id,
                          client.pid)
            self._drop(client, hung_up=False)
        return False

    def _drop(self, client: _Client, hung_up: bool) -> None:
        """The client is gone: its references go, its unsealed objects are aborted."""
        if self._clients.get(client.fd) is client:
            del self._clients[client.fd]
            self._poll.remove(client.fd)
        client.conn.close()
        table = self.table
        for oid, n in client.refs.items():
            obj = table.objects.get(oid)
            if obj is not None:
                table.unref(obj, client.id, n)
        client.refs.clear()
        if table.index.counts.pop(client.id, None) is not None:  # its fast gets' views go too
            table.recheck_held()
        for obj in client.pending.values():
            table.free_pending(obj)
        client.pending.clear()
        for oid in client.creating:
            obj = table.objects.get(oid)
            if obj is not None and not obj.sealed:
                log.info("object %r aborted: its creator (pid %s) left before seal",
                         obj.name, client.pid)
                table.unname(obj)
                self._wake_waiters(obj.name, abort=f"object {obj.name!r} was aborted: its "
                                   f"creator (pid {client.pid}) went before sealing it")
        client.creating.clear()
        for oid in client.future:
            obj = table.objects.get(oid)
            if obj is not None:
                table.write_seal(obj)  # its writable mapping went with it
        client.future.clear()
        if client.waits:
            for name in list(self._waits):
                ws = [w for w in self._waits[name] if w[0] is not client]
                if ws:
                    self._waits[name] = ws
                else:
                    del self._waits[name]
            client.waits = 0
        if client.staging is not None:
            os.close(client.staging[0])
            client.staging = None
        log.debug("client %d (pid %s) gone%s", client.id, client.pid,
                  "" if hung_up else " (dropped)")

    def _dropped(self, seg_id: int) -> None:
        """A segment left the store: tell the clients that may map it, so they unmap it.

        At most _MAX_PUSHED frames go unasked to a client between two of its requests; the
        rest ride on its next reply ("d"). Our own frames must never fill its socket: a reply
        that finds no room costs the client its connection, and every reference with it.
        """
        for client in self._clients.values():
            if seg_id in client.segments or seg_id in client.wsegs:
                client.segments.discard(seg_id)
                client.wsegs.discard(seg_id)
                if client.pushed >= _MAX_PUSHED:
                    client.drops.append(seg_id)
                    continue
                try:
                    client.conn.send({"k": "drop", "i": seg_id}, timeout=0)
                    client.pushed += 1
                except (ShmshareError, OSError, ValueError):
                    client.drops.append(seg_id)  # its socket is full: told in the next reply

    def _reply(self, client: _Client, header: dict[str, Any], fds: list[int] | None = None) -> None:
        if client.drops:
            header["d"] = client.drops[:_DROPS_PER_REPLY]
            del client.drops[:_DROPS_PER_REPLY]
        client.conn.send(header, fds or (), timeout=_REPLY_WAIT)

    # -- requests ------------------------------------------------------------------

    def _answer(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        kind = h.get("k")
        one_way = kind in ("rel", "unmapped")
        self._carried(client, h)
        try:
            handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise ProtocolError(f"unknown request {kind!r}")
            handler(self, client, h, fds)
        except Bad as exc:
            if not one_way:
                code, text = exc.args
                self._reply(client, {"k": "err", "e": code, "w": text})
        except StoreFull as exc:
            self._reply(client, {"k": "err", "e": "full", "w": str(exc)})
        except (PeerDied, ProtocolError, ShmshareTimeout):
            raise
        except (OSError, MemoryError) as exc:  # ours (memfds, fds, memory): told, not dropped
            log.warning("request %r of client %d failed in the daemon: %s", kind, client.id, exc)
            if not one_way:
                self._reply(client, {"k": "err", "e": "daemon", "w": f"the store daemon (pid "
                                     f"{os.getpid()}) could not do it: {exc}"})

    def _carried(self, client: _Client, h: dict[Any, Any]) -> None:
        """What any request carries besides itself (Note [A client's mappings])."""
        client.pushed = 0  # it reads again: room for a few unsolicited frames
        if "rl" in h:  # releases
            self._release(client, {"o": h["rl"]}, [])
        forget = h.get("fg")  # segments it was sent but could not map: send them again
        if isinstance(forget, list):
            client.segments.difference_update(x for x in forget if type(x) is int)
        forget = h.get("wfg")  # ... their read-write fds, sent for warm puts and creates
        if isinstance(forget, list):
            client.wsegs.difference_update(x for x in forget if type(x) is int)

    def _unmapped(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        oid = h.get("o")
        pending = client.pending.pop(oid, None) if type(oid) is int else None
        if pending is not None:  # a warm put given up between room and put: its block goes
            self.table.free_pending(pending)
            return
        obj = self.table.objects.get(oid)  # type: ignore[arg-type]
        if obj is None:
            client.future.discard(h.get("o"))
        elif obj.creator == client.id and obj.sealed:
            self.table.write_seal(obj)
            if obj.write_seal == "full":
                client.future.discard(obj.oid)

    def _get(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        name = name_of(h)
        obj = self.table.names.get(name)
        if obj is None:
            raise Bad(NOT_FOUND, f"no object {name!r} in the store")
        if not obj.sealed:
            raise Bad(NOT_SEALED, f"object {name!r} is not sealed yet (its creator is filling "
                       "it): pass get(..., timeout=SECONDS) to wait for it")
        table = self.table
        if obj.spilled is not None:
            try:
                table.restore(obj)  # StoreFull when no room can be made: it stays spilled
            except StoreFull:
                raise
            except (OSError, StoreError) as exc:  # the daemon's trouble: told, not dropped
                raise Bad("daemon", f"the store daemon (pid {os.getpid()}) could not read "
                          f"spilled object {name!r} back: {exc}") from exc
        if obj.write_seal == "future":
            table.write_seal(obj)
        reply = {"k": "obj", "o": obj.oid, "i": obj.seg_id, "off": obj.offset, "s": obj.size,
                 "m": obj.meta}
        send: list[int] = []
        if obj.size == 0:
            pass
        elif obj.fd >= 0 and obj.torch:
            reply["p"] = True  # mapped copy-on-write for its tensors, once per get
            send.append(obj.fd)
            reply["n"] = obj.size
        elif obj.held is not None and obj.torch and obj.size >= LARGE:
            reply["p"] = True  # its pages of the pool segment, copy-on-write, once per get
            send.append(table.ro_fd(obj.held.seg))
            reply["n"] = obj.held.seg.size
        elif obj.seg_id not in client.segments:
            if obj.held is not None:
                seg = obj.held.seg
                send.append(table.ro_fd(seg))
                reply["n"] = seg.size
            else:
                send.append(obj.fd)
                reply["n"] = obj.size
            client.segments.add(obj.seg_id)
        if obj.slot >= 0 and "p" not in reply:
            reply["x"], reply["g"] = obj.slot, obj.gen  # its next get may skip us
        # the reference only now: a reply that could not be made (no fd for ro_fd) takes none
        table.ref(obj, client.id)
        client.refs[obj.oid] = client.refs.get(obj.oid, 0) + 1
        table.touch(obj)
        self.counts["get"] += 1
        self._reply(client, reply, send)

    def _release(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        oids = h.get("o")
        if not isinstance(oids, list):
            raise ProtocolError("a rel frame without a list of object ids")
        table = self.table
        for oid in oids:
            n = client.refs.get(oid, 0) if type(oid) is int else 0
            if not n:
                continue  # not its to give back
            if n == 1:
                del client.refs[oid]
            else:
                client.refs[oid] = n - 1
            obj = table.objects.get(oid)
            if obj is not None:
                table.unref(obj, client.id)

    def _delete(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        name = name_of(h)
        obj = self.table.names.get(name)
        if obj is None:
            raise Bad(NOT_FOUND, f"no object {name!r} in the store")
        for c in self._clients.values():
            c.creating.discard(obj.oid)
        self.table.unname(obj)
        self.counts["delete"] += 1
        self._reply(client, {"k": "ok"})

    def _info(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        name = name_of(h)
        obj = self.table.names.get(name)
        if obj is None:
            raise Bad(NOT_FOUND, f"no object {name!r} in the store")
        self._reply(client, {"k": "info", "l": self.table.entry(obj, time.time())})

    def _list(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        after = h.get("a")
        names = self.table.sorted_names()
        start = bisect.bisect_right(names, after) if isinstance(after, str) else 0
        names = names[start:start + _LIST_PAGE + 1]
        now = time.time()
        page: list[list[Any]] = []
        budget = _LIST_BYTES  # a reply is one frame: at most wire.MAX_FRAME bytes
        for n in names[:_LIST_PAGE]:
            budget -= len(n.encode()) + 96
            if budget < 0 and page:
                break
            page.append(self.table.entry(self.table.names[n], now))
        self._reply(client, {"k": "list", "l": page, "more": len(names) > len(page)})

    def _stats(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        st = self.table.stats()
        st.update(self.counts, pid=os.getpid(), path=self.path, connected=len(self._clients),
                  uptime=round(time.time() - self._started, 3))
        self._reply(client, {"k": "stats", "s": st})

    def _stage(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        size = h.get("s")
        if len(fds) != 1 or type(size) is not int or not 0 < size <= LARGE:
            raise Bad(BAD, f"a staging memfd is one fd of 1..{LARGE} bytes")
        try:
            check_fd(fds[0].fileno(), size, trust_unsealed=False, writable=False, backed=0)
        except ProtocolError as exc:
            raise Bad(BAD, str(exc)) from exc
        if client.staging is not None:
            os.close(client.staging[0])
        client.staging = (fds[0].take(), size)
        self._reply(client, {"k": "ok"})

    def _fast(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        """A client's counts of fast gets (Note [Gets without a round trip]); the index back."""
        index = self.table.index
        if len(fds) != 1 or client.id in index.counts:
            raise Bad(BAD, "a fast request carries one fd, once per connection")
        try:
            index.counts[client.id] = map_counts(fds[0])
        except ProtocolError as exc:
            raise Bad(BAD, str(exc)) from exc
        self._reply(client, {"k": "fast", "n": WORDS}, [index.ro_fd])

    def _wait(self, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
        name = name_of(h)
        seconds = h.get("t")
        if not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise Bad(BAD, f"a wait needs t >= 0 seconds, got {seconds!r}")
        obj = self.table.names.get(name)
        if obj is not None and obj.sealed:
            self._reply(client, {"k": "ok"})
            return
        if client.waits >= _MAX_WAITS:
            raise Bad(BAD, f"{_MAX_WAITS} waits are pending on this connection already")
        deadline = time.monotonic() + min(float(seconds), 1e9)
        self._waits.setdefault(name, []).append((client, deadline))
        heapq.heappush(self._deadlines, (deadline, name))
        client.waits += 1

    # -- helpers -------------------------------------------------------------------

    def _wake_waiters(self, name: str, abort: str | None = None) -> None:
        ws = self._waits.pop(name, None)
        if not ws:
            return
        for client, _ in ws:
            client.waits = max(0, client.waits - 1)
            if client.conn.closed:
                continue
            try:
                if abort is None:
                    self._reply(client, {"k": "ok"})
                else:
                    self._reply(client, {"k": "err", "e": ABORTED, "w": abort})
            except (ShmshareError, OSError, ValueError):
                self._drop(client, hung_up=False)

    def _expire_waits(self) -> None:
        heap, now = self._deadlines, time.monotonic()
        if not heap or heap[0][0] > now:
            return
        due = set()
        while heap and heap[0][0] <= now:
            due.add(heapq.heappop(heap)[1])
        late: list[tuple[str, _Client]] = []
        for name in due:
            ws = self._waits.get(name)
            if not ws:
                continue
            keep = [w for w in ws if w[1] > now]
            late += [(name, c) for c, d in ws if d <= now]
            if keep:
                self._waits[name] = keep
            else:
                del self._waits[name]
        # replies only once the table of waits is consistent: dropping a client that does not
        # read may abort its objects and wake (and remove) other names' waiters
        for name, client in late:
            client.waits = max(0, client.waits - 1)
            if client.conn.closed:
                continue
            try:
                self._reply(client, {"k": "err", "e": TIMEOUT,
                                     "w": f"no sealed object {name!r} came in time"})
            except (ShmshareError, OSError, ValueError):
                self._drop(client, hung_up=False)


_HANDLERS: dict[str, Any] = {
    "put": making.put, "create": making.create, "seal": making.seal, "get": Server._get,
    "rel": Server._release, "unmapped": Server._unmapped, "del": Server._delete,
    "info": Server._info, "list": Server._list, "stats": Server._stats, "stage": Server._stage,
    "wait": Server._wait, "room": making.room, "fast": Server._fast,
}


def serve(path: str | None = None, limit: int | None = None, evict: bool = False,
          ready: Any = None, max_clients: int = MAX_CLIENTS, spill: str | None = None) -> int:
    """Run the store until SIGINT or SIGTERM; `ready(daemon)` is called once it listens."""
    daemon = Server(path, limit, evict, max_clients, spill)
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def stop(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        daemon.stop()

    for s in old:
        signal.signal(s, stop)
    try:
        if ready is not None:
            ready(daemon)
        daemon.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def _said_out_of_fds(exc: BaseException) -> None:
    log.warning("out of fds, not accepting clients for %.1f s: %s", ACCEPT_PAUSE, exc)


def check_spill_args(limit: int | None, evict: bool, spill: str | None) -> None:
    """Refuse --spill without --limit (nothing would ever spill) or with --evict (spilling is
    how room is made instead of evicting)."""
    if spill is None:
        return
    if not spill:
        raise ValueError("--spill takes a directory, and got an empty path (an unset variable?): "
                         "name the directory to spill to")
    if limit is None:
        raise ValueError("--spill spills past --limit, and no --limit was given: add one "
                         "(e.g. --limit 4G), or leave --spill out")
    if evict:
        raise ValueError("--spill keeps what --evict would delete: pass one of them, not both")
