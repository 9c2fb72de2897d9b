"""What the owner's fd server and its peers say to each other, and the errors of handles.

Frames (msgpack headers on a ``wire.Connection``; nothing is pickled):

- peer -> owner ``{"k": "t"}``: the lease table, please; owner -> peer
  ``{"k": "t", "n": slots, "pid": owner pid, "you": the peer's pid as the
  owner sees it, "m": the key of the handles' signatures}`` with two fds:
  the table's and the peer's own claim map's (``_claims.py``).
- peer -> owner ``{"k": "s", "i": segment id}``; owner -> peer ``{"k": "s",
  "i": id, "n": size}`` with the segment's fd, or ``{"k": "e", "w": why}``.
- peer -> owner ``{"k": "r", "l": [slot, gen, slot, gen, ...]}``: releases,
  never answered; a slot is given back only if no live process's claim map
  marks it.
- owner -> peer ``{"k": "d", "i": id}``: a segment the pool gave back (drop
  the mapping once no view uses it). Sent without waiting; may be lost.
- peer -> owner ``{"k": "l", "s": slot, "g": gen}``: lend the block of a
  lease this peer holds once more, for a handle it pickles on (a tensor it
  received and sends to another process); owner -> peer ``{"k": "l", "s":
  new slot, "g": its gen}``, or ``{"k": "e", "w": why}`` (Note [Lending on]
  in ``_storages.py``).
"""

from __future__ import annotations

import os

from .._errors import PeerDied, ShmshareError
from .._procfs import pid_alive as alive  # the one test of a pid, for _client, _books and _storages

__all__ = ["KIND", "TABLE", "SEGMENT", "ERROR", "RELEASE", "DROP", "LEND", "OwnerGone", "HandleError",
           "alive", "env_number"]

KIND = "k"
TABLE, SEGMENT, ERROR, RELEASE, DROP, LEND = "t", "s", "e", "r", "d", "l"
MAX_RELEASES = 4096  # (slot, gen) pairs in one release frame


class OwnerGone(PeerDied):
    """A handle's owning process exited or was killed before the handle was unpickled."""


class HandleError(ShmshareError):
    """A handle that cannot be unpickled here: already unpickled once, stale, or malformed."""


def env_number(name: str, default: float, what: str) -> float:
    """A number >= 0 from the environment variable `name` (`what` it counts, for the error)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of {what}, got {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0 {what}, got {raw!r}")
    return value


# Tracebacks and reprs name the public module these are exported from, not this private one.
for _cls in (OwnerGone, HandleError):
    _cls.__module__ = "shmshare.multiprocessing"
del _cls
