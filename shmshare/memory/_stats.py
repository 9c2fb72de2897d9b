"""Allocator statistics, kept and named as PyTorch's ``memory_stats()`` does.

Each statistic has three columns: all pools, small pools, large pools, each
with four fields (current, peak, allocated, freed). A pool column is a
:class:`PoolStat`, the "all" column a :class:`SumStat` over the two; single
statistics (``oversize_*``) are a :class:`Stat`. The flat view
(``"allocated_bytes.all.current"``...) is what ``memory_stats()`` returns,
sorted by key like ``torch.cuda.memory_stats()``.

Note [Statistics on the hot path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A malloc+free pair changes seven statistics (allocation, allocated_bytes,
active, active_bytes, requested_bytes and, when a block is split or merged,
inactive_split and inactive_split_bytes) up and down again. Kept the plain
way, for both the pool column and "all", that is 28 ``Stat`` updates of
two or three fields each: about 2 us of a pair that should take a few.
Three things make it cheap:

- Every change to a statistic goes to exactly one pool (a block lives in
  one), so "all" is the sum of the two pool columns. Only its peak, a
  maximum over time, has to be kept: it is raised after each increase, and
  decreases do not touch "all" at all (:class:`SumStat`).
- In a pool column, ``current == base + allocated - freed`` always holds
  (``base`` being the value at the last ``reset_accumulated``), so ``freed``
  is computed when read and a decrease is one subtraction
  (:class:`PoolStat`).
- The hot updates are written out in straight lines over Stats bound once
  per pool (``HotStats``), with no helper call per Stat: a Python call
  costs as much as the update it would make.

The values are the same as PyTorch's bookkeeping gives; ``check_invariants()``
compares every one of them with a walk of the blocks.
"""

from __future__ import annotations

from typing import Final, cast

__all__ = [
    "ALL",
    "LARGE_POOL",
    "SMALL_POOL",
    "STAT_NAMES",
    "TYPE_NAMES",
    "HotStats",
    "MemoryStats",
    "PoolStat",
    "Stat",
    "SumStat",
    "decrease",
    "increase",
]

ALL: Final = 0  # the columns of a statistic (Final: mypy then knows what column[ALL] is)
SMALL_POOL: Final = 1
LARGE_POOL: Final = 2
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
_HOT_NAMES = ("allocation", "allocated_bytes", "active", "active_bytes", "requested_bytes", "inactive_split",
              "inactive_split_bytes")  # the order of HotStats


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


class PoolStat:
    """The small- or large-pool column of a statistic: a Stat whose ``freed`` is derived.

    See Note [Statistics on the hot path]: ``freed`` is
    ``base + allocated - current``, so decreasing touches ``current`` only.
    """

    __slots__ = ("current", "peak", "allocated", "base")

    def __init__(self) -> None:
        self.current = 0  # value now
        self.peak = 0  # highest value since the last reset_peak
        self.allocated = 0  # total added since the last reset_accumulated
        self.base = 0  # current at the last reset_accumulated

    @property
    def freed(self) -> int:
        """Return the total removed since the last reset_accumulated."""
        return self.base + self.allocated - self.current

    def increase(self, amount: int) -> None:
        """Add ``amount`` and raise the peak if needed."""
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def decrease(self, amount: int) -> None:
        """Remove ``amount``."""
        self.current -= amount

    def reset_accumulated(self) -> None:
        """Zero ``allocated`` and ``freed``."""
        self.allocated = 0
        self.base = self.current

    def as_dict(self) -> dict[str, int]:
        """Return the four fields by name."""
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class SumStat:
    """The "all" column of a statistic: the sum of its two pool columns, with a peak of its own.

    ``current``, ``allocated`` and ``freed`` are computed when read (see Note
    [Statistics on the hot path]); ``peak`` is kept, raised by whoever
    increases a pool column. Assigning ``current`` (as tests that corrupt the
    statistics do) keeps the difference from the sum as an offset, so the
    value reads back as written; the hot path's peak updates leave the
    offset out (three loads per statistic), so after such a write only
    ``check_invariants()`` is meaningful, and it reports the write.
    """

    __slots__ = ("small", "large", "peak", "offset")

    def __init__(self, small: PoolStat, large: PoolStat) -> None:
        self.small = small  # the small-pool column
        self.large = large  # the large-pool column
        self.peak = 0  # highest sum since the last reset_peak
        self.offset = 0  # 0 unless current was assigned directly

    @property
    def current(self) -> int:
        """Return the value now, over both pools."""
        return self.small.current + self.large.current + self.offset

    @current.setter
    def current(self, value: int) -> None:
        self.offset = value - self.small.current - self.large.current

    @property
    def allocated(self) -> int:
        """Return the total added since the last reset_accumulated, over both pools."""
        return self.small.allocated + self.large.allocated

    @property
    def freed(self) -> int:
        """Return the total removed since the last reset_accumulated, over both pools."""
        return self.small.freed + self.large.freed

    def raise_peak(self) -> None:
        """Raise the peak to the current value if it is higher (after an increase)."""
        current = self.current
        if current > self.peak:
            self.peak = current

    def as_dict(self) -> dict[str, int]:
        """Return the four fields by name."""
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


Column = tuple[SumStat, PoolStat, PoolStat]  # indexed by ALL, SMALL_POOL, LARGE_POOL
HotColumn = tuple[PoolStat, PoolStat, SumStat]  # this pool's column, the other pool's, "all"


class MemoryStats:
    """Hold every statistic of one allocator."""

    __slots__ = STAT_NAMES + COUNTERS + ("oversize_allocations", "oversize_segments", "hot")

    def __init__(self) -> None:
        for name in STAT_NAMES:
            small, large = PoolStat(), PoolStat()
            setattr(self, name, (SumStat(small, large), small, large))
        for name in COUNTERS:
            setattr(self, name, 0)
        self.oversize_allocations = Stat()  # allocated blocks >= max_split_size
        self.oversize_segments = Stat()  # classic segments >= max_split_size
        # hot[t]: what malloc and free update for pool type t
        self.hot: dict[int, HotStats] = {SMALL_POOL: HotStats(self, SMALL_POOL), LARGE_POOL: HotStats(self, LARGE_POOL)}

    allocation: Column
    segment: Column
    active: Column
    inactive_split: Column
    allocated_bytes: Column
    reserved_bytes: Column
    active_bytes: Column
    inactive_split_bytes: Column
    requested_bytes: Column
    num_alloc_retries: int  # retries after releasing everything (PyTorch's "malloc retries")
    num_ooms: int  # OutOfMemoryError raised
    num_sync_all_streams: int  # synchronizations of every stream with pending events
    num_device_alloc: int  # provider allocate + map calls
    num_device_free: int  # provider free + unmap calls

    def stat_arrays(self) -> dict[str, Column]:
        """Return each per-pool statistic by name."""
        return {name: getattr(self, name) for name in STAT_NAMES}

    def flat(self, max_split_size: int) -> dict[str, int]:
        """Return the statistics flattened and sorted like ``torch.cuda.memory_stats()``."""
        out: dict[str, int] = {}
        for name, stats in self.stat_arrays().items():
            columns: tuple[SumStat | PoolStat, ...] = stats
            for type_name, stat in zip(TYPE_NAMES, columns, strict=True):
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
        for column in self.stat_arrays().values():
            for one in column:
                one.peak = one.current
        for stat in (self.oversize_allocations, self.oversize_segments):
            stat.peak = stat.current

    def reset_accumulated(self) -> None:
        """Zero the allocated/freed totals and the event counters ("all" follows its pools)."""
        for column in self.stat_arrays().values():
            column[SMALL_POOL].reset_accumulated()
            column[LARGE_POOL].reset_accumulated()
        for stat in (self.oversize_allocations, self.oversize_segments):
            stat.allocated = stat.freed = 0
        for name in COUNTERS:
            setattr(self, name, 0)


class HotStats:
    """The statistics that malloc and free change, for one pool type, bound once.

    Each ``_HOT_NAMES`` statistic is held as (this pool's column, the other
    pool's column, the SumStat), so that an increase raises both peaks with
    locals only. The methods are straight lines on purpose (and ``if``, not
    ``max()``: a call costs more than the compare); see Note [Statistics on
    the hot path].
    """

    __slots__ = _HOT_NAMES

    allocation: HotColumn
    allocated_bytes: HotColumn
    active: HotColumn
    active_bytes: HotColumn
    requested_bytes: HotColumn
    inactive_split: HotColumn
    inactive_split_bytes: HotColumn

    def __init__(self, stats: MemoryStats, t: int) -> None:
        other = LARGE_POOL if t == SMALL_POOL else SMALL_POOL
        for name in _HOT_NAMES:
            column = getattr(stats, name)
            setattr(self, name, (column[t], column[other], column[ALL]))

    def on_alloc(self, size: int, requested: int) -> None:
        """Count a block of ``size`` bytes handed out (``requested`` asked for)."""
        (n, n_o, n_all), (b, b_o, b_all) = self.allocation, self.allocated_bytes
        (an, an_o, an_all), (ab, ab_o, ab_all) = self.active, self.active_bytes
        rq, rq_o, rq_all = self.requested_bytes
        x = n.current = n.current + 1
        n.allocated += 1
        if x > n.peak:
            n.peak = x
        x += n_o.current
        if x > n_all.peak:
            n_all.peak = x
        x = b.current = b.current + size
        b.allocated += size
        if x > b.peak:
            b.peak = x
        x += b_o.current
        if x > b_all.peak:
            b_all.peak = x
        x = an.current = an.current + 1
        an.allocated += 1
        if x > an.peak:
            an.peak = x
        x += an_o.current
        if x > an_all.peak:
            an_all.peak = x
        x = ab.current = ab.current + size
        ab.allocated += size
        if x > ab.peak:
            ab.peak = x
        x += ab_o.current
        if x > ab_all.peak:
            ab_all.peak = x
        x = rq.current = rq.current + requested
        rq.allocated += requested
        if x > rq.peak:
            rq.peak = x
        x += rq_o.current
        if x > rq_all.peak:
            rq_all.peak = x

    def on_free_requested(self, size: int) -> None:
        """Count a block the caller freed (it may still wait for events)."""
        self.allocation[0].current -= 1
        self.allocated_bytes[0].current -= size

    def on_free_completed(self, size: int, requested: int) -> None:
        """Count a freed block that has no events left, back in its pool."""
        self.active[0].current -= 1
        self.active_bytes[0].current -= size
        self.requested_bytes[0].current -= requested

    def on_split(self, blocks: int, nbytes: int) -> None:
        """Change inactive_split by ``blocks`` and inactive_split_bytes by ``nbytes`` (signed)."""
        n, n_o, n_all = self.inactive_split
        b, b_o, b_all = self.inactive_split_bytes
        if blocks > 0:
            x = n.current = n.current + blocks
            n.allocated += blocks
            if x > n.peak:
                n.peak = x
            x += n_o.current
            if x > n_all.peak:
                n_all.peak = x
        elif blocks < 0:
            n.current += blocks
        if nbytes > 0:
            x = b.current = b.current + nbytes
            b.allocated += nbytes
            if x > b.peak:
                b.peak = x
            x += b_o.current
            if x > b_all.peak:
                b_all.peak = x
        elif nbytes < 0:
            b.current += nbytes


def increase(stats: Column, t: int, amount: int) -> None:
    """Increase the pool-type ``t`` column of a statistic by ``amount`` ("all" follows)."""
    cast(PoolStat, stats[t]).increase(amount)
    stats[ALL].raise_peak()


def decrease(stats: Column, t: int, amount: int) -> None:
    """Decrease the pool-type ``t`` column of a statistic by ``amount`` ("all" follows)."""
    cast(PoolStat, stats[t]).decrease(amount)

