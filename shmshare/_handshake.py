"""The handshake of a shmshare connection: who the peer is, and whether it speaks our protocol.

Note [Handshake]
    The connection's state is explicit (:class:`State`). Each end sends a
    HELLO frame (protocol version, pid, role) before its first message; the
    first frame an end receives must be a HELLO with the same major version.
    A HELLO may come again later: an end handed to another process (a
    multiprocessing child) introduces itself anew, so ``peer_hello`` always
    names the process that is talking now. The handshake costs no round
    trip: it rides in front of the first message.
    The peer's kernel credentials (SO_PEERCRED) are read when the
    connection is made, and a peer of another uid is refused unless allowed.
"""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass
from typing import Any

from ._errors import PeerRefused, ProtocolError
from ._sockets import peer_cred

__all__ = ["PROTOCOL_VERSION", "State", "PeerCred", "hello", "check_hello", "check_uid", "read_peer_cred"]

PROTOCOL_VERSION = 4  # 2: a channel batch travels as packed bytes, tuples as marked lists; 3: rings; 4: inline arrays


class State(enum.Enum):
    """Where a connection's handshake stands."""

    NEW = "new"  # nothing sent or received yet
    HELLO_SENT = "hello_sent"  # we introduced ourselves, the peer has not
    READY = "ready"  # the peer's HELLO arrived (ours may be unsent: it goes with our first send)
    CLOSED = "closed"


@dataclass(frozen=True)
class PeerCred:
    """SO_PEERCRED of the peer: the process that created its end, and its ids."""

    pid: int
    uid: int
    gid: int


def hello(role: str) -> dict[str, Any]:
    """The body of our HELLO frame."""
    return {"version": PROTOCOL_VERSION, "pid": os.getpid(), "role": role}


def check_hello(body: Any, nfds: int) -> dict[str, Any]:
    """The peer's HELLO body, checked: ProtocolError if malformed, PeerRefused if of another version."""
    if nfds:
        raise ProtocolError("a HELLO frame carried fds")
    if not isinstance(body, dict) or not isinstance(body.get("version"), int):
        raise ProtocolError(f"a malformed HELLO: {body!r:.120}")
    if body["version"] != PROTOCOL_VERSION:
        raise PeerRefused(f"the peer (pid {body.get('pid')}) speaks shmshare protocol version "
                          f"{body['version']}, this process version {PROTOCOL_VERSION}; "
                          "install the same shmshare version on both sides")
    return body


def check_uid(cred: PeerCred, allowed: frozenset[int]) -> None:
    """Refuse a peer of another uid unless it is allowed."""
    me = os.getuid()
    if cred.uid != me and cred.uid not in allowed:
        raise PeerRefused(f"peer pid {cred.pid} runs as uid {cred.uid} and this process as uid {me}; "
                          f"pass allow_uids=[{cred.uid}] to accept it")


def read_peer_cred(sock: socket.socket) -> PeerCred:
    """SO_PEERCRED of a connected AF_UNIX socket."""
    return PeerCred(*peer_cred(sock))
