"""Statistics of the pinned-host pool, named as PyTorch's ``host_memory_stats()``.

Note [Host pool statistics]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The keys are those PyTorch documents for ``torch.cuda.host_memory_stats()``
(releases 2.3 to 2.8, whose ``HostStats`` struct this follows):

- ``allocated.{current,peak,allocated,freed}``: blocks handed to callers and
  not yet reusable (a freed block waiting for events still counts, as in
  PyTorch: it leaves the count when it goes back to its free list). The C++
  struct calls this stat ``allocation``; the documentation, and so shmshare,
  ``allocated``.
- ``allocated_bytes.*``: the (power-of-two) bytes of those blocks.
- ``segment.*``: blocks the pool owns, in use or cached.
- ``reserved_bytes.*``: their bytes.
- ``num_host_alloc`` / ``num_host_free``: calls that got memory from the
  provider or gave it back (``cuMemHostAlloc`` / ``cuMemHostRegister``, and
  their inverses), the reserve segment included, as PyTorch's
  documentation defines them.
- ``host_alloc_time.{total,max,min,count,avg}`` and ``host_free_time.*``:
  microseconds spent in those calls.

PyTorch 2.9 renamed the stats (``allocations``, ``active_requests``...);
shmshare keeps the names of the issue and of the releases above.
"""

from __future__ import annotations

from ._stats import Stat

__all__ = ["DurationStat", "HostStats"]


class DurationStat:
    """Sum durations in microseconds: total, max, min, count, and their average."""

    __slots__ = ("total", "max", "min", "count")

    def __init__(self) -> None:
        self.total = 0  # microseconds summed
        self.max = 0  # longest single duration
        self.min = 0  # shortest single duration (0 before the first)
        self.count = 0  # durations counted

    def increase(self, micros: int) -> None:
        """Count one duration of ``micros`` microseconds."""
        self.total += micros
        self.count += 1
        self.max = max(self.max, micros)
        if self.count == 1 or micros < self.min:
            self.min = micros

    def reset_accumulated(self) -> None:
        """Forget every duration counted."""
        self.total = self.max = self.min = self.count = 0

    def as_dict(self) -> dict[str, int]:
        """Return the five fields by name (``avg`` rounded down)."""
        avg = self.total // self.count if self.count else 0
        return {"total": self.total, "max": self.max, "min": self.min, "count": self.count, "avg": avg}


class HostStats:
    """Hold every statistic of one pinned-host pool (see Note [Host pool statistics])."""

    __slots__ = ("allocated", "allocated_bytes", "segment", "reserved_bytes", "num_host_alloc",
                 "num_host_free", "host_alloc_time", "host_free_time")

    def __init__(self) -> None:
        self.allocated = Stat()  # blocks in callers' hands or waiting for events
        self.allocated_bytes = Stat()
        self.segment = Stat()  # blocks the pool owns
        self.reserved_bytes = Stat()
        self.num_host_alloc = 0  # provider.allocate calls
        self.num_host_free = 0  # provider.free calls
        self.host_alloc_time = DurationStat()  # microseconds in provider.allocate
        self.host_free_time = DurationStat()  # microseconds in provider.free

    def flat(self) -> dict[str, int]:
        """Return the statistics flattened and sorted like ``torch.cuda.host_memory_stats()``."""
        out: dict[str, int] = {"num_host_alloc": self.num_host_alloc, "num_host_free": self.num_host_free}
        for name in ("allocated", "allocated_bytes", "segment", "reserved_bytes"):
            for field, value in getattr(self, name).as_dict().items():
                out[f"{name}.{field}"] = value
        for name in ("host_alloc_time", "host_free_time"):
            for field, value in getattr(self, name).as_dict().items():
                out[f"{name}.{field}"] = value
        return dict(sorted(out.items()))

    def reset_peak(self) -> None:
        """Set every peak to its current value."""
        for stat in self._stats():
            stat.peak = stat.current

    def reset_accumulated(self) -> None:
        """Zero the allocated/freed totals, the call counters and the timings."""
        for stat in self._stats():
            stat.allocated = stat.freed = 0
        self.num_host_alloc = self.num_host_free = 0
        self.host_alloc_time.reset_accumulated()
        self.host_free_time.reset_accumulated()

    def _stats(self) -> tuple[Stat, ...]:
        return (self.allocated, self.allocated_bytes, self.segment, self.reserved_bytes)
