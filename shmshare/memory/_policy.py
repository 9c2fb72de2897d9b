"""Size policy of the caching allocator: rounding, pools, segment sizes.

These are PyTorch's constants and rules (``CUDACachingAllocator.cpp``),
written as pure functions so that they can be tested on their own.
"""

from __future__ import annotations

from ._config import AllocatorConfig

__all__ = [
    "MIN_BLOCK_SIZE",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "allocation_size",
    "format_size",
    "round_size",
]

MIN_BLOCK_SIZE = 512  # every block size is a multiple of this
SMALL_SIZE = 1 << 20  # requests up to 1 MiB go to the small pool
SMALL_BUFFER = 2 << 20  # small-pool segments (and small expandable pages) are 2 MiB
MIN_LARGE_ALLOC = 10 << 20  # requests of 1-10 MiB share one large segment
ROUND_LARGE = 2 << 20  # larger requests get a segment rounded to 2 MiB


def round_size(size: int, config: AllocatorConfig) -> int:
    """Return the block size for a request of ``size`` bytes.

    At least 512 B and a multiple of 512 B; with ``roundup_power2_divisions``
    in force for this size, rounded up to the next division of its
    power-of-two interval instead.
    """
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if config.roundup_power2_divisions:
        divisions = config.divisions(size)
        if divisions > 1 and size > MIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(size, divisions)
    return (size + MIN_BLOCK_SIZE - 1) & ~(MIN_BLOCK_SIZE - 1)


def allocation_size(size: int, config: AllocatorConfig) -> int:
    """Return the size of a new segment that will hold a block of ``size`` bytes.

    2 MiB for the small pool, one large segment (20 MiB by default) for
    requests under 10 MiB so that they share it, else the size rounded up
    to 2 MiB.
    """
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return config.large_segment_size
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


def format_size(size: int) -> str:
    """Format a byte count the way PyTorch's error messages do (``"20.00 MiB"``)."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """Round ``size`` up to one of ``divisions`` equal steps between two powers of two."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)  # floor // divisions; divisions is a power of 2
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step
