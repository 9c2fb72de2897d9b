"""Zero-copy tensor channels between processes.

``tx, rx = shmshare.channel()`` for a parent and its children (either end
can be handed to a multiprocessing child, fork or spawn);
``shmshare.listen(path)`` for a receiver that many unrelated senders
``shmshare.connect(path)`` to. A pool segment's fd crosses the socket once
per receiver; after that an array is a few dozen bytes of msgpack, and its
memory comes back to the sender's pool when the receiver drops it.

Note [Hot path]
    A small message costs Python bytecode, not bytes: at 4 KB the producer
    and the consumer each spend ~40-60 us of CPU per message on the shared
    2-core machine this is developed on (``scripts/bench_peers.py``,
    2026-12-05), the two syscalls no longer among it since frames go through
    the rings (Note [Rings] in ``_ring.py``). What keeps it from more:
    - the batch is walked by msgpack's C packer and unpacker, with Python
      called only for the exts (``tensors.Encoder``, ``tensors.decode``);
    - an array's address and extent come from one buffer request in C
      (``_native.extent``), not ``__array_interface__`` (a dict per call);
    - a block whose leases are back is kept as a spare for the next request
      of its size, skipping the allocator (Note [Spare blocks], ``_blocks.py``);
    - ``wire`` computes deadlines only when it has to wait, and the header's
      optional parts are looked at only when present.
    Measure changes here with ``scripts/bench_channel.py``; each of these was
    a visible share of a 4 KB message.
"""

from __future__ import annotations

import os
from typing import Any

from .. import _ring, wire
from .._plane.pool import check_limit
from .._timeouts import check_timeout
from ._receiver import Receiver
from ._sender import DEFAULT_LIMIT, Sender, SenderStatistics

__all__ = ["channel", "listen", "connect", "Sender", "Receiver", "SenderStatistics",
           "DEFAULT_LIMIT"]


def channel(*, limit: int = DEFAULT_LIMIT, config: str | None = None, backend: str = "memfd",
            writable: bool = False, max_peer_bytes: int | None = None,
            max_peer_segments: int | None = None) -> tuple[Sender, Receiver]:
    """Return a connected (Sender, Receiver) pair.

    Parameters
    ----------
    limit : int
        Bytes of shared memory the sender's pool may hold (back-pressure past it):
        at least 2 MiB, its smallest segment (an array over 1 MiB takes 20 MiB).
    config : str, optional
        Allocator settings for the sender's pool, ``SHMSHARE_ALLOC_CONF`` syntax.
    backend : {"memfd", "posix"}
        Shared memory behind the pool.
    writable : bool
        Map the sender's pages writable in the receiver (else ``PROT_READ``;
        torch tensors then arrive as private copies, see :class:`Receiver`).
    max_peer_bytes, max_peer_segments : int, optional
        The receiver's caps on what the sender may make it hold.

    With ``backend="posix"`` the receiver maps the sender's unsealed POSIX
    shm (``trust_unsealed``): both ends are made here, by one caller.
    """
    check_limit(limit)
    _ring.check_settings()
    a, b = wire.pipe()
    a._role, b._role = "sender", "receiver"
    try:
        tx = Sender(a, limit=limit, config=config, backend=backend)
    except BaseException:
        a.close()
        b.close()
        raise
    try:
        rx = Receiver([b], writable=writable, trust_unsealed=backend == "posix",
                      max_peer_bytes=max_peer_bytes, max_peer_segments=max_peer_segments)
    except BaseException:
        tx.close()
        b.close()
        raise
    return tx, rx


def listen(path: str | os.PathLike[str] | None = None, *, writable: bool = False,
           trust_unsealed: bool = False, max_peer_bytes: int | None = None,
           max_peer_segments: int | None = None, max_peers: int | None = None,
           **listener_kw: Any) -> Receiver:
    """Return a Receiver that accepts senders on a Unix socket at `path` (fan-in).

    With `path` None the socket is made in a fresh private directory; the
    receiver's ``path`` says where. `trust_unsealed` accepts senders of
    ``backend="posix"``: this receiver trusts them not to truncate their
    shared memory (Note [Trust no fd] in ``_plane/trust.py``).
    """
    _ring.check_settings()
    listener = wire.Listener(path, role="receiver", **listener_kw)
    try:
        return Receiver(listener=listener, writable=writable, trust_unsealed=trust_unsealed,
                        max_peer_bytes=max_peer_bytes, max_peer_segments=max_peer_segments,
                        max_peers=max_peers)
    except BaseException:
        listener.close()  # the socket file and the directories made for it go too
        raise


def connect(path: str | os.PathLike[str], *, timeout: float | None = None,
            limit: int = DEFAULT_LIMIT, config: str | None = None, backend: str = "memfd",
            **conn_kw: Any) -> Sender:
    """Return a Sender connected to the receiver listening at `path`."""
    check_limit(limit)
    _ring.check_settings()
    check_timeout(timeout, "connect")
    conn = wire.connect(path, timeout=timeout, role="sender", **conn_kw)
    return Sender(conn, limit=limit, config=config, backend=backend)
