"""Allocator statistics, kept and named as PyTorch's ``memory_stats()`` does.

Each statistic is a :class:`Stat` (current, peak, allocated, freed) kept
three times: for all pools, for small pools and for large pools. The flat
view (``"allocated_bytes.all.current"``...) is what ``memory_stats()``
returns, sorted by key like ``torch.cuda.memory_stats()``.
"""

from __future__ import annotations

__all__ = [
    "ALL",
    "LARGE_POOL",
    "SMALL_POOL",
    "STAT_NAMES",
    "TYPE_NAMES",
    "MemoryStats",
    "Stat",
    "adjust",
    "decrease",
    "increase",
]

ALL, SMALL_POOL, LARGE_POOL = 0, 1, 2
TYPE_NAMES = ("all", "small_pool", "large_pool")
STAT_NAMES = (
    "allocation",  # blocks handed to callers
    "segment",  # provider segments (expandable: reservations)
    "active",  # allocated blocks plus blocks waiting on events
    "inactive_split",  # free blocks of split, non-expandable segments
    "allocated_bytes",
    "reserved_bytes",  # bytes backed by the provider (expandable: mapped pages)
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",  # what callers asked for, before rounding
)
COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


class Stat:
    """Count one quantity: its current value, peak, and totals added and removed."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = 0  # value now
        self.peak = 0  # highest value since the last reset_peak
        self.allocated = 0  # total added since the last reset_accumulated
        self.freed = 0  # total removed since the last reset_accumulated

    def increase(self, amount: int) -> None:
        """Add ``amount`` and raise the peak if needed."""
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def decrease(self, amount: int) -> None:
        """Remove ``amount``."""
        self.current -= amount
        self.freed += amount

    def as_dict(self) -> dict[str, int]:
        """Return the four fields by name."""
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class MemoryStats:
    """Hold every statistic of one allocator."""

    __slots__ = STAT_NAMES + COUNTERS + ("oversize_allocations", "oversize_segments")

    def __init__(self) -> None:
        for name in STAT_NAMES:
            setattr(self, name, [Stat(), Stat(), Stat()])
        for name in COUNTERS:
            setattr(self, name, 0)
        self.oversize_allocations = Stat()  # allocated blocks >= max_split_size
        self.oversize_segments = Stat()  # classic segments >= max_split_size

    allocation: list[Stat]
    segment: list[Stat]
    active: list[Stat]
    inactive_split: list[Stat]
    allocated_bytes: list[Stat]
    reserved_bytes: list[Stat]
    active_bytes: list[Stat]
    inactive_split_bytes: list[Stat]
    requested_bytes: list[Stat]
    num_alloc_retries: int  # retries after releasing everything (PyTorch's "malloc retries")
    num_ooms: int  # OutOfMemoryError raised
    num_sync_all_streams: int  # synchronizations of every stream with pending events
    num_device_alloc: int  # provider allocate + map calls
    num_device_free: int  # provider free + unmap calls

    # The three calls below are malloc's and free's whole bookkeeping, with
    # the "all" and the per-pool Stat updated in one call: they run on every
    # malloc and free, where a loop of Stat method calls costs half as much again.

    def on_alloc(self, t: int, size: int, requested: int) -> None:
        """Count a block of ``size`` bytes handed out in pool type ``t``."""
        stats = self.allocation
        _up(stats[ALL], stats[t], 1)
        stats = self.allocated_bytes
        _up(stats[ALL], stats[t], size)
        stats = self.active
        _up(stats[ALL], stats[t], 1)
        stats = self.active_bytes
        _up(stats[ALL], stats[t], size)
        stats = self.requested_bytes
        _up(stats[ALL], stats[t], requested)

    def on_free_requested(self, t: int, size: int) -> None:
        """Count a block the caller freed (it may still wait for events)."""
        stats = self.allocation
        _down(stats[ALL], stats[t], 1)
        stats = self.allocated_bytes
        _down(stats[ALL], stats[t], size)

    def on_free_completed(self, t: int, size: int, requested: int) -> None:
        """Count a freed block that has no events left, back in its pool."""
        stats = self.active
        _down(stats[ALL], stats[t], 1)
        stats = self.active_bytes
        _down(stats[ALL], stats[t], size)
        stats = self.requested_bytes
        _down(stats[ALL], stats[t], requested)

    def stat_arrays(self) -> dict[str, list[Stat]]:
        """Return each per-pool statistic by name."""
        return {name: getattr(self, name) for name in STAT_NAMES}

    def flat(self, max_split_size: int) -> dict[str, int]:
        """Return the statistics flattened and sorted like ``torch.cuda.memory_stats()``."""
        out: dict[str, int] = {}
        for name, stats in self.stat_arrays().items():
            for type_name, stat in zip(TYPE_NAMES, stats):
                for field, value in stat.as_dict().items():
                    out[f"{name}.{type_name}.{field}"] = value
        for name in ("oversize_allocations", "oversize_segments"):
            for field, value in getattr(self, name).as_dict().items():
                out[f"{name}.{field}"] = value
        for name in COUNTERS:
            out[name] = getattr(self, name)
        out["max_split_size"] = max_split_size
        return dict(sorted(out.items()))

    def reset_peak(self) -> None:
        """Set every peak to its current value."""
        for stat in self._all_stats():
            stat.peak = stat.current

    def reset_accumulated(self) -> None:
        """Zero the allocated/freed totals and the event counters."""
        for stat in self._all_stats():
            stat.allocated = stat.freed = 0
        for name in COUNTERS:
            setattr(self, name, 0)

    def _all_stats(self) -> list[Stat]:
        stats = [s for arr in self.stat_arrays().values() for s in arr]
        return stats + [self.oversize_allocations, self.oversize_segments]


def increase(stats: list[Stat], types: tuple[int, ...], amount: int) -> None:
    """Increase ``stats[t]`` by ``amount`` for every pool type ``t`` in ``types``."""
    for t in types:
        stats[t].increase(amount)


def decrease(stats: list[Stat], types: tuple[int, ...], amount: int) -> None:
    """Decrease ``stats[t]`` by ``amount`` for every pool type ``t`` in ``types``."""
    for t in types:
        stats[t].decrease(amount)


def adjust(stats: list[Stat], types: tuple[int, ...], amount: int) -> None:
    """Increase or decrease by a signed ``amount`` (a Stat counts the two apart)."""
    if amount > 0:
        increase(stats, types, amount)
    elif amount < 0:
        decrease(stats, types, -amount)


def _up(a: Stat, b: Stat, amount: int) -> None:
    current = a.current = a.current + amount
    a.allocated += amount
    if current > a.peak:
        a.peak = current
    current = b.current = b.current + amount
    b.allocated += amount
    if current > b.peak:
        b.peak = current


def _down(a: Stat, b: Stat, amount: int) -> None:
    a.current -= amount
    a.freed += amount
    b.current -= amount
    b.freed += amount
