"""What a pool tells the stats socket: its kind and its bytes (Note [Reporters] in ``_registry.py``).

Both reporters read the statistics without the pool's lock, as plain ints:
the stats thread must answer even while a thread holds the lock for long
(a retry chain, a sender waiting for room), and a figure read in the middle
of one malloc is off by that one block at most.
"""

from __future__ import annotations

from typing import Any

from ._stats import ALL

__all__ = ["KINDS", "kind_of", "report_allocator", "report_host_allocator"]

# provider name -> pool kind, as `shmshare stat` groups them
KINDS = {"shm": "shm", "cuda device": "device", "cuda host": "pinned",
         "simulated device": "simulated", "host fallback": "host"}


def kind_of(provider: Any) -> str:
    """The pool kind of a provider: shm, device, pinned, simulated, host, or its own name."""
    name = str(getattr(provider, "name", type(provider).__name__))
    return KINDS.get(name, name)


def report_allocator(alloc: Any) -> dict[str, Any]:
    """A CachingAllocator's report: reserved and allocated bytes now and at peak, segments."""
    s = alloc.stats
    provider = alloc.provider
    device = getattr(provider, "device", None)
    return {
        "id": id(alloc),
        "kind": kind_of(provider),
        "provider": alloc.name,
        "device": device if isinstance(device, int) else None,
        "reserved_bytes": s.reserved_bytes[ALL].current,
        "peak_reserved_bytes": s.reserved_bytes[ALL].peak,
        "allocated_bytes": s.allocated_bytes[ALL].current,
        "peak_allocated_bytes": s.allocated_bytes[ALL].peak,
        "segments": s.segment[ALL].current,
        "blocks": s.allocation[ALL].current,
        "num_ooms": s.num_ooms,
        "expandable": bool(alloc.config.expandable_segments),
    }


def report_host_allocator(alloc: Any) -> dict[str, Any]:
    """A CachingHostAllocator's report (pinned memory over CUDA), in the same keys."""
    s = alloc.stats
    provider = alloc.provider
    return {
        "id": id(alloc),
        "kind": kind_of(provider),
        "provider": str(getattr(provider, "name", type(provider).__name__)),
        "device": None,
        "reserved_bytes": s.reserved_bytes.current,
        "peak_reserved_bytes": s.reserved_bytes.peak,
        "allocated_bytes": s.allocated_bytes.current,
        "peak_allocated_bytes": s.allocated_bytes.peak,
        "segments": s.segment.current,
        "blocks": s.allocated.current,
        "num_ooms": 0,
        "expandable": False,
    }
