"""User memory pools: ``MemPool`` and the ``use_mem_pool`` context.

A :class:`MemPool` is a name for a private set of block pools, as
``torch.cuda.MemPool`` is. Inside ``with use_mem_pool(pool):`` every
``malloc`` made on this thread, by any allocator, takes its blocks from
that allocator's private pools for ``pool`` (created on first use), and the
blocks go back there when freed. Memory cached in a live private pool is not
released by ``empty_cache()`` nor by the retry chain; a pool marked
``use_on_oom`` lends its cached blocks to default-pool requests that would
otherwise fail. Once the ``MemPool`` object is gone, its cached segments are
released like any other on the next ``empty_cache()`` or retry.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from ._block import BlockPool

__all__ = ["MemPool", "PrivatePool", "current_mem_pool", "use_mem_pool"]

_ids = itertools.count(1)
_tls = threading.local()
# use_mem_pool contexts open on any thread. While it is 0, nobody allocates
# from a MemPool, so current_mem_pool() (and malloc, which reads it directly)
# skips the thread-local lookup. Changed under _open_lock: "+= 1" on a global
# is not atomic. A thread always sees its own increment.
open_contexts = 0
_open_lock = threading.Lock()


class MemPool:
    """Name a private pool that allocations can be routed to.

    Parameters
    ----------
    use_on_oom : bool
        Let requests outside the pool borrow its cached blocks before the
        allocator releases cached memory (step 2 of the retry chain).
    """

    __slots__ = ("_id", "use_on_oom", "__weakref__")

    def __init__(self, use_on_oom: bool = False) -> None:
        self._id = (0, next(_ids))  # PyTorch's MempoolId_t: (0, n) for user pools
        self.use_on_oom = use_on_oom

    @property
    def id(self) -> tuple[int, int]:
        """Return the pool's id, as it appears in snapshots (``segment_pool_id``)."""
        return self._id

    def __repr__(self) -> str:
        return f"MemPool(id={self._id}, use_on_oom={self.use_on_oom})"


@contextmanager
def use_mem_pool(pool: MemPool) -> Iterator[MemPool]:
    """Route this thread's allocations to ``pool`` inside the ``with`` block.

    Contexts nest; the innermost pool wins.
    """
    if not isinstance(pool, MemPool):
        raise TypeError(f"use_mem_pool expects a MemPool, got {type(pool).__name__}")
    global open_contexts
    stack: list[MemPool] = _tls.__dict__.setdefault("stack", [])
    with _open_lock:
        stack.append(pool)
        open_contexts += 1
    try:
        yield pool
    finally:
        with _open_lock:
            open_contexts -= 1
            stack.pop()


def current_mem_pool() -> MemPool | None:
    """Return the pool this thread allocates from, or None for the default pools."""
    if not open_contexts:
        return None
    stack = _tls.__dict__.get("stack")
    return stack[-1] if stack else None


class PrivatePool:
    """Hold one allocator's block pools for one :class:`MemPool`."""

    __slots__ = ("id", "use_on_oom", "small", "large", "_ref")

    def __init__(self, pool: MemPool) -> None:
        self.id = pool.id  # the MemPool's id
        self.use_on_oom = pool.use_on_oom  # lend cached blocks on OOM
        self.small = BlockPool(True, self)  # requests <= 1 MiB
        self.large = BlockPool(False, self)  # larger requests
        self._ref = weakref.ref(pool)  # dead once the user drops the MemPool

    @property
    def alive(self) -> bool:
        """Return whether the user's ``MemPool`` object still exists."""
        return self._ref() is not None

    def pools(self) -> tuple[BlockPool, BlockPool]:
        """Return the small and the large block pool."""
        return self.small, self.large

    def __repr__(self) -> str:
        return f"PrivatePool(id={self.id})"
