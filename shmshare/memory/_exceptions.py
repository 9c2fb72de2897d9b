"""Errors of the caching allocator core.

Both derive from :class:`shmshare.ShmshareError`; ``OutOfMemoryError`` is also
a ``MemoryError`` and ``InvariantError`` an ``AssertionError``, so callers can
catch them with the builtin they would naturally reach for.
"""

from __future__ import annotations

from .._errors import ShmshareError

__all__ = ["OutOfMemoryError", "InvariantError"]


class OutOfMemoryError(ShmshareError, MemoryError):
    """Raise when a pool cannot serve a request after its whole retry chain.

    The message reads like PyTorch's ``CUDA out of memory``: what was asked,
    the provider's capacity and free bytes, what the allocator holds
    allocated and reserved-but-unallocated, and which setting would help.
    The numbers are also attributes, for code that reacts to the failure.

    Attributes
    ----------
    requested : int
        Bytes the caller asked for.
    size : int
        Bytes the allocator tried to get from the provider (the rounded
        request, or the segment size that would have held it).
    capacity, free : int or None
        What the provider reported, ``None`` where it does not know.
    allocated, reserved : int
        Bytes allocated to callers, and bytes reserved from the provider,
        over every pool of the allocator, at the time of the failure.
    """

    def __init__(
        self,
        message: str,
        *,
        requested: int = 0,
        size: int = 0,
        capacity: int | None = None,
        free: int | None = None,
        allocated: int = 0,
        reserved: int = 0,
    ) -> None:
        super().__init__(message)
        self.requested = requested
        self.size = size
        self.capacity = capacity
        self.free = free
        self.allocated = allocated
        self.reserved = reserved


class InvariantError(ShmshareError, AssertionError):
    """Report a broken pool invariant found by ``check_invariants()``.

    The message names the invariant (numbered as in docs/architecture.md), the segment
    and the block, with their addresses and sizes.
    """


# Tracebacks and reprs name the public module these are exported from, not this private one.
for _cls in (OutOfMemoryError, InvariantError):
    _cls.__module__ = "shmshare.memory"
del _cls
