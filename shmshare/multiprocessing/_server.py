"""The owner's fd server: one thread, one socket, connections kept open and reused.

Note [The fd server]
    torch's ``resource_sharer`` opens a connection per tensor to fetch its
    fd. Here a peer connects once per owner and keeps the connection: it
    asks for the lease table's fd once and for each segment's fd once, and
    sends its releases on it. The socket is 0600 in a 0700 directory of its
    own (``wire.Listener``), and every connection's peer uid is checked
    (``wire.Connection``). Frames are msgpack headers (``_common.py``):
    nothing a peer sends is unpickled. A peer that sends anything else, or
    more than a frame can hold, is dropped; its claims stay until its
    process exits (Note [The owner's record of claims]). Replies wait at
    most ``_REPLY_WAIT`` for room, so a peer that stops reading cannot
    stall the others. A process that exits with handles unclaimed hands
    this server's sockets to a keeper (Note [A keeper after exit]). The
    loop is a ``PollServer``'s (Note [One poll server] in ``_pollserver``),
    out of fds too (Note [Out of fds]).
"""

from __future__ import annotations

import os
import re
import stat
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import wire
from .._errors import PeerDied, ProtocolError, ShmshareError
from .._listen import refused
from .._pollserver import PollServer
from ._claims import ClaimMap
from ._common import DROP, ERROR, KIND, LEND, RELEASE, SEGMENT, TABLE

if TYPE_CHECKING:
    from ._owner import Owner

__all__ = ["Server", "sweep_stale"]

_FRAMES_A_ROUND = 16  # frames one peer gets answered before the others' turn (a flood of them)

_PREFIX = "shmshare-mp-"


_NAME = re.compile(r"shmshare-mp-[0-9]{1,10}-[0-9a-f]{1,16}\Z", re.ASCII)
_YOUNG = 60.0  # s: a directory this new may be an owner between its mkdir and its bind


def sweep_stale(base: str) -> int:
    """Remove the socket directories of owners that died without their exit (SIGKILL, a Pool's
    SIGTERM): ``shmshare-mp-<pid>-<token>`` of our uid whose socket nobody listens on.

    Liveness is the socket's, not the pid's: a pid means nothing to a process of another pid
    namespace sharing this directory. Never raises; returns how many it removed.
    """
    n = 0
    try:
        names = [e for e in os.listdir(base) if _NAME.match(e)]
    except OSError:
        return 0
    me, now = os.getuid(), time.time()
    for name in names:
        d = os.path.join(base, name)
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
                continue
            sock = os.path.join(d, "fd")
            if os.path.lexists(sock):
                if not refused(sock):
                    continue  # someone listens (or may: we cannot tell): not ours to remove
            elif now - st.st_mtime < _YOUNG:
                continue  # no socket yet: maybe an owner between its mkdir and its bind
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
            os.rmdir(d)
            n += 1
        except OSError:
            continue  # another process swept it first, or it is not ours to remove
    return n


_REPLY_WAIT = 1.0  # s a reply waits for room on a peer's socket before the peer is dropped


class _Peer:
    __slots__ = ("conn", "pid", "segments", "claims")

    def __init__(self, conn: wire.Connection) -> None:
        self.conn = conn
        self.pid = conn.peer_cred.pid
        self.segments: set[int] = set()  # ids whose fds it was sent
        # its process's claim map (Note [The owner's record of claims]), from its table request
        self.claims: ClaimMap | None = None


class Server:
    """Serve the lease table's and the pool segments' fds, and take releases in."""

    def __init__(self, owner: Owner, path: str) -> None:
        self._owner = owner
        self.path = path
        self._peers: dict[int, _Peer] = {}  # fd -> peer
        self._exits: dict[int, ClaimMap] = {}  # pidfd -> the map of the process it watches
        self._lock = threading.Lock()  # _peers, against dropped() from other threads
        self._poll = PollServer(wire.Listener(path, role="mp-owner"), self._accept, tick=self._tick)
        self._thread = threading.Thread(target=self._main, name="shmshare-mp-server", daemon=True)
        self._thread.start()

    def peers(self) -> int:
        with self._lock:
            return len(self._peers)

    def dropped(self, seg_id: int) -> None:
        """The pool gave a segment back: tell the peers that mapped it (without waiting)."""
        with self._lock:
            peers = [p for p in self._peers.values() if seg_id in p.segments]
        for p in peers:
            p.segments.discard(seg_id)
            try:
                p.conn.send({KIND: DROP, "i": seg_id}, timeout=0)
            except (ShmshareError, OSError, ValueError):
                pass  # full or gone: it keeps a mapping a little longer, nothing worse

    def close(self) -> None:
        """Stop the thread, close every connection and the socket (removing its directory)."""
        self._poll.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(10.0)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.conn.close()
        self._poll.close()

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies; the parent keeps serving."""
        for p in self._peers.values():
            p.conn.close()
        self._peers = {}
        self._poll.close()  # only the process that made it removes the socket file

    # -- the thread ------------------------------------------------------------

    def serve_here(self, done: Callable[[], bool], deadline: float) -> None:
        """In a keeper (Note [A keeper after exit]): serve from this thread, the only one, until
        ``done()`` or `deadline`; then the caller closes the owner."""
        self._poll.listener.adopt()  # this process removes the socket file now
        self._poll.run(done, deadline)

    def fds(self) -> set[int]:
        """Every fd the server uses (a keeper closes the rest)."""
        return self._poll.fds()

    def stop_thread(self) -> None:
        """Stop the thread and nothing else (a keeper is about to serve these sockets)."""
        if self._thread.is_alive():  # a stop ends one run: none left for the keeper's
            self._poll.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(10.0)

    def start_thread(self) -> None:
        """Serve from a thread again (no keeper could be made)."""
        self._thread = threading.Thread(target=self._main, name="shmshare-mp-server", daemon=True)
        self._thread.start()

    def remove_socket(self) -> None:
        """In a keeper that is done: remove the socket file and its directory (nothing else is
        closed: the process ends now)."""
        self._poll.listener.close()

    def disown(self) -> None:
        """A keeper serves the socket now: our copy's close (at exit) leaves its file there."""
        self._poll.listener.disown()

    def _main(self) -> None:
        self._poll.run()

    def _tick(self, now: float) -> None:
        self._owner.recheck()  # each round: releases that found their slot still marked

    def _accept(self, conn: wire.Connection) -> None:
        peer = _Peer(conn)
        fd = conn.fileno()
        with self._lock:
            self._peers[fd] = peer
        self._poll.add(fd, lambda: self._serve(fd, peer))

    def _claim_map(self, peer: _Peer) -> ClaimMap:
        """The claim map of the peer's process, made at its first table request."""
        claims, stale = self._owner.join(peer.pid)  # ShmshareError, OSError: said to the peer
        if stale is not None:  # that pid's process exited and the pid came back before we saw it
            self._exited(stale)
        if claims.pidfd is not None and claims.pidfd not in self._exits:
            self._exits[claims.pidfd] = claims
            self._poll.add(claims.pidfd, lambda: self._exited(claims), client=False)
        peer.claims = claims
        return claims

    def _exited(self, claims: ClaimMap) -> bool:
        """A process with a claim map is gone: take back what it held, and drop what is left of
        its connections (a child it forked may hold one: its claims would not be its own)."""
        if claims.pidfd is not None and self._exits.pop(claims.pidfd, None) is not None:
            self._poll.remove(claims.pidfd)
        self._owner.left(claims, exited=True)
        for fd, peer in list(self._peers.items()):
            if peer.claims is claims:
                self._drop(fd, peer)
        return False

    def _serve(self, fd: int, peer: _Peer) -> bool:
        try:
            for _ in range(_FRAMES_A_ROUND):  # then the others' turn: a flood starves no one
                got = peer.conn.recv_nowait()
                if got is None:
                    return False
                header, fds = got
                for f in fds:
                    f.close()  # a peer sends none
                self._answer(peer, header)
            return True  # more may wait: served again next round, after the others
        except PeerDied:
            pass  # it closed its end: it exited, was killed, or made a new connection
        except (ProtocolError, ShmshareError, OSError, ValueError, TypeError):
            pass  # broken, or not reading its answers: dropped below
        except Exception:  # noqa: BLE001, S110 -- a bug of ours drops that peer, never the server
            pass
        self._drop(fd, peer)
        return False

    def _drop(self, fd: int, peer: _Peer) -> None:
        self._poll.remove(fd)
        with self._lock:
            self._peers.pop(fd, None)
        peer.conn.close()
        # Its claims come back only once its process is gone (its pidfd says so), never because
        # a connection ended: a live process that reconnected, or that we dropped for a bad
        # frame or a full socket, still holds its arrays (Note [The owner's record of claims]).
        if peer.claims is not None:
            self._owner.left(peer.claims, exited=False)
            peer.claims = None

    def _answer(self, peer: _Peer, header: dict[Any, Any]) -> None:
        kind = header.get(KIND)
        if kind == RELEASE:
            pairs = header.get("l")
            if not isinstance(pairs, list):
                raise ProtocolError("a release frame without a list")
            self._owner.release(pairs)
        elif kind == SEGMENT:
            seg_id = header.get("i")
            try:
                got = self._owner.segment(seg_id) if isinstance(seg_id, int) else None
            except OSError as exc:  # our fd table is full (the dup): our trouble, not the peer's
                peer.conn.send({KIND: ERROR, "w": f"pid {self._owner.pid} could not send segment "
                                f"{seg_id}: {exc}", "c": exc.errno}, timeout=_REPLY_WAIT)
                return
            if got is None:
                peer.conn.send({KIND: ERROR, "w": f"no segment {seg_id!r} in pid {self._owner.pid}'s "
                                "pool (given back already: the handle is stale)"},
                               timeout=_REPLY_WAIT)
                return
            fd, size = got
            assert isinstance(seg_id, int)
            try:
                peer.segments.add(seg_id)
                peer.conn.send({KIND: SEGMENT, "i": seg_id, "n": size}, [fd], timeout=_REPLY_WAIT)
            finally:
                os.close(fd)
        elif kind == LEND:
            slot, gen = header.get("s"), header.get("g")
            got = None
            if peer.claims is not None and type(slot) is int and type(gen) is int:
                got = self._owner.lend_again(peer.claims, slot, gen)
            if got is None:
                peer.conn.send({KIND: ERROR, "w": f"pid {self._owner.pid} holds no lease {slot!r}.{gen!r} "
                                "of yours to lend on (released, or never yours)"}, timeout=_REPLY_WAIT)
            else:
                peer.conn.send({KIND: LEND, "s": got[0], "g": got[1]}, timeout=_REPLY_WAIT)
        elif kind == TABLE:
            table = self._owner.table
            try:
                claims = peer.claims if peer.claims is not None else self._claim_map(peer)
            except (ShmshareError, OSError) as exc:  # no memory or no fd for it: ours, not the peer's
                peer.conn.send({KIND: ERROR, "w": f"pid {self._owner.pid} could not make a claim map for "
                                f"pid {peer.pid}: {exc}", "c": getattr(exc, "errno", None)},
                               timeout=_REPLY_WAIT)
                return
            # "you": the pid we see it as (SO_PEERCRED), which its claims must carry: in another
            # pid namespace its own getpid() is another number; with the table, its own claim
            # map, and the key that signs our handles
            peer.conn.send({KIND: TABLE, "n": table.slots, "pid": self._owner.pid, "you": peer.pid,
                            "m": self._owner.secret}, [table.fd, claims.fd], timeout=_REPLY_WAIT)
        else:
            raise ProtocolError(f"unknown frame kind {kind!r}")
