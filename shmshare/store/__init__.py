"""The named-tensor store: a daemon that holds objects by name, and its client ``Store``.

``shmshare serve`` runs the daemon (one per user and host, on a per-user
socket); ``Store()`` connects to it. ``put(name, value)`` stores an array,
a CPU tensor or a nested batch of them, sealed; ``create`` + ``seal`` fills
one in place; ``get(name)`` returns it as read-only zero-copy views. Objects
outlive their producer; an object's memory is free again once the name is
deleted and the last view of it is gone (kept warm in the daemon's pool for
later puts). See ``docs/store.md``.

Files: ``_protocol.py`` (frames, errors, the socket path), ``_packing.py``
(a value as one object's bytes, and views back), ``_objects.py`` (the
daemon's table: references, limit, eviction), ``_daemon.py`` (the daemon's
loop and requests), ``_making.py`` (its put, create and seal), ``_client.py``
(``Store``), ``_flusher.py`` (what a client sends and reads while idle),
``_inherited.py`` (what a forked child does with the Stores and views it inherits),
``_launch.py`` (``shmshare serve`` and ``Daemon``), ``_find.py`` (the daemons
``stat`` finds), ``_putting.py`` (a client's puts and creates: warm, immutable or
staged), ``_spill.py`` (spill files), ``_index.py`` and ``_fastget.py`` (gets without
a round trip), ``_refusals.py`` (refusals for want of memory).
"""

from __future__ import annotations

from ._client import ObjectInfo, Store
from ._daemon import serve
from ._launch import Daemon
from ._protocol import (
    BadRequest,
    ObjectExists,
    ObjectNotFound,
    StoreBusy,
    StoreError,
    StoreFull,
    StoreGone,
    default_path,
)

__all__ = ["Store", "ObjectInfo", "Daemon", "serve", "default_path", "StoreError", "StoreFull",
           "StoreGone", "ObjectExists", "ObjectNotFound", "BadRequest", "StoreBusy"]
