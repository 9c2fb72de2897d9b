"""The daemon's refusals for want of memory -- its cgroup's or the host's (``HostFull``) -- and
the words the store's StoreFull messages share."""

from __future__ import annotations

import os
from typing import Any

from .._errors import SegmentError
from ..memory._policy import format_size
from ._packing import cgroup_refusal
from ._protocol import StoreFull

__all__ = ["HostFull", "daemon_refusal", "host_cause", "amount", "objects"]


class HostFull(StoreFull):
    """The daemon's own memory -- its memory cgroup, or the host -- cannot take an object's
    pages (Note [Shared memory and the memory cgroup] in ``_packing``). Evicting is not tried
    for it: room under --limit is not what is missing."""


def daemon_refusal(nbytes: int, what: str) -> HostFull | None:
    """The error for `nbytes` of shared memory the daemon's memory cgroup cannot take, if so."""
    who = f"the store daemon (pid {os.getpid()})"
    refused = cgroup_refusal(nbytes, what, who, (
        "Delete objects, or raise that cgroup's limit (docker run --memory; memory.max, or "
        "memory.limit_in_bytes on cgroup v1); a "
        "`shmshare serve --limit` below it makes the store refuse (or, with --evict, evict) "
        "before the cgroup is reached"))
    return None if refused is None else HostFull(refused)


def host_cause(exc: BaseException) -> SegmentError | None:
    """The segment layer's refusal behind a pool's OutOfMemoryError (no memory on the host, or
    in the cgroup), if that is what it was rather than the provider's limit (our --limit)."""
    seen: BaseException | None = exc
    for _ in range(8):  # OutOfMemoryError <- ProviderOutOfMemory <- SegmentError
        if seen is None:
            return None
        if isinstance(seen, SegmentError):
            return seen
        seen = seen.__cause__
    return None


def amount(n: int) -> str:
    """`n` bytes as a person reads them, exact where rounding would hide it: "4.00 MiB (4194304
    bytes)", "1000 bytes"."""
    short = format_size(n)
    return short if short.endswith(" bytes") else f"{short} ({n} bytes)"


def objects(objs: list[Any], kind: str) -> str:
    """How many `objs` and their bytes: "2 objects (5.00 MiB)", "no deleted objects"."""
    if not objs:
        return f"no {kind}objects"
    return (f"{len(objs)} {kind}object{'s' if len(objs) != 1 else ''} "
            f"({format_size(sum(o.size for o in objs))})")
