"""Memory past a sender's pool, for a sender that must not wait (the DataLoader's workers).

Note [Past the pool]
    A sender's pool is bounded (``limit=``): once the receiver holds that
    much, ``send``/``empty`` wait for releases and raise ``PoolExhausted``
    after their timeout. That is right for a pipeline, where a receiver that
    holds everything has stopped reading. It is wrong for a loader: torch's
    keeps going however many batches the program keeps (``list(loader)``, a
    cached validation set, batches appended for later), and a wait there is
    a stall nobody asked for.

    So a sender made with ``on_overflow`` takes, when its pool is full of
    blocks the receiver holds (not when the host is out of memory), a block
    from a second caching allocator over the same kind of sealed memfds,
    with no limit. The receiver sees one more segment, announced as any
    other; nothing changes for it. Such a block is never kept as a spare:
    when the receiver releases it, it goes back and the allocator gives its
    free segments back at once. The receiver unmaps a freed segment when
    the next message tells it so (a receiver that receives nothing more
    keeps its mapping, and so the pages, until the sender closes). ``on_overflow`` is called the
    first time, so that the owner can say once that the pool was too small.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..memory import CachingAllocator, OutOfMemoryError, ShmProvider, ShmSegment

__all__ = ["Overflow"]

_CLASSIC = "expandable_segments:False"


class Overflow:
    """The allocator past a sender's pool (Note [Past the pool]); made on first use."""

    def __init__(self, backend: str, config: str | None, listener: Callable[..., None],
                 on_first: Callable[[int], None]) -> None:
        self._backend, self._config, self._listener = backend, config, listener
        self._on_first = on_first
        self.provider: ShmProvider | None = None
        self.alloc: CachingAllocator | None = None
        self.addrs: set[int] = set()  # addresses of the blocks handed out, not yet freed

    def malloc(self, nbytes: int, drain: Callable[[], None], pool: CachingAllocator) -> Any:
        """A block of `nbytes`: from `pool` if what came back already (`drain`) makes room,
        else past it (the host's errors as the allocator raises them)."""
        drain()
        try:
            return pool.malloc(nbytes)
        except OutOfMemoryError:
            pass
        if self.alloc is None:
            self.provider = ShmProvider(None, self._backend)
            self.provider.listeners.append(self._listener)
            # classic segments, whatever the settings: a freed one goes back whole, its pages
            # never punched under the receiver's mapping
            self.alloc = CachingAllocator(self.provider, _CLASSIC if not self._config else
                                          f"{self._config},{_CLASSIC}")
            self._on_first(nbytes)
        block = self.alloc.malloc(nbytes)
        self.addrs.add(block.address)
        return block

    def owns(self, address: int) -> bool:
        return address in self.addrs

    def free(self, block: Any) -> None:
        """Take a block back, and give the segments that hold nothing back to the host."""
        assert self.alloc is not None
        self.addrs.discard(block.address)
        self.alloc.free(block)
        self.alloc.empty_cache()

    def empty_cache(self) -> None:
        if self.alloc is not None:
            self.alloc.empty_cache()

    def after_fork_in_child(self, in_use: set[int]) -> list[ShmSegment]:
        """In a forked child: the parent's segments of ours (Note [Segments in a forked child])."""
        return [] if self.provider is None else self.provider.after_fork_in_child(in_use)
