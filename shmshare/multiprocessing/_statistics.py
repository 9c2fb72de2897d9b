"""What this process's multiprocessing pool reports: ``shmshare.multiprocessing.statistics()``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OwnerStatistics"]


@dataclass(frozen=True)
class OwnerStatistics:
    """What this process's pool holds for handles it pickled (``statistics()``)."""

    pid: int
    handles_pickled: int  # handles made so far
    arrays_copied: int  # of which copied into the pool
    arrays_in_place: int  # of which sent from the pool as they were (empty(), share_memory_())
    by_value: int  # arrays pickled as bytes instead (no room in the pool or the table)
    handles_unclaimed: int  # pickled, not unpickled yet: each pins its block until claimed or exit
    handles_claimed: int  # unpickled by a live process, not released yet
    bytes_leased: int  # pool bytes those handles pin
    reclaimed: int  # handles given back because the process that claimed them went
    peers: int  # processes connected to the fd server now
    segments_sent: int  # segment fds the server handed out
    reserved_bytes: int  # shared memory the pool holds
    allocated_bytes: int  # of which in use (spare blocks included)
