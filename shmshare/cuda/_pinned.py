"""Page-locked host memory from the driver, for the pinned-host caching pool.

Note [Pinned register path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``cuMemHostAlloc`` maps and pins the pages inside the driver under a global
lock, one page after another, so a large pinned buffer blocks every other
thread's driver calls for as long as that takes. PyTorch's
``pinned_use_cuda_host_register`` path splits the work: allocate ordinary
page-aligned memory, fault its pages in on several threads at once
(``pinned_num_register_threads``; here ``_native.prefault``, with the GIL
released), then ``cuMemHostRegister`` the range, which only has to pin
pages that already exist. shmshare takes the memory from an anonymous
``mmap`` (page aligned, so nothing is wasted on alignment) and registers it
``CU_MEMHOSTREGISTER_PORTABLE``, as it does ``cuMemHostAlloc`` memory
(``CU_MEMHOSTALLOC_PORTABLE``): pinned for every context, not just the one
current at allocation, since pinned memory is process-wide while contexts
are per device.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Hashable
from typing import Any

from .. import _native
from ..memory._config import AllocatorConfig, get_config, parse_config
from ..memory._host import CachingHostAllocator
from ..memory._host_fallback import AnonymousMemory
from ..memory._policy import format_size
from ..memory._provider import ProviderOutOfMemory
from ._context import Context, Event, EventPool, stream_handle
from ._driver import call

__all__ = ["CudaHostProvider", "host_allocator"]

PORTABLE = 1  # CU_MEMHOSTALLOC_PORTABLE == CU_MEMHOSTREGISTER_PORTABLE == 1
MAX_PREFAULT_THREADS = 64  # _native.prefault's limit


class CudaHostProvider:
    """Give the pinned-host pool page-locked memory and CUDA events.

    Parameters
    ----------
    context : Context, optional
        Where events are made and calls run; device 0's primary context when None.
    config : str, AllocatorConfig or None
        Settings; ``pinned_use_cuda_host_register`` and
        ``pinned_num_register_threads`` pick the path (Note [Pinned register path]).
    register : bool, optional
        Overrides ``pinned_use_cuda_host_register``.
    register_threads : int, optional
        Overrides ``pinned_num_register_threads`` (1 to 64).
    """

    name = "cuda host"

    def __init__(self, context: Context | None = None, config: str | AllocatorConfig | None = None, *,
                 register: bool | None = None, register_threads: int | None = None) -> None:
        config = _resolve(config)
        self.register = config.pinned_use_cuda_host_register if register is None else bool(register)
        threads = config.pinned_num_register_threads if register_threads is None else register_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_PREFAULT_THREADS:
            raise ValueError(f"register_threads must be an int from 1 to {MAX_PREFAULT_THREADS}, got {threads!r}")
        self.register_threads = threads
        self.context = context or Context.primary(0)
        self.events = EventPool(self.context)
        self._live: dict[int, _Pinned] = {}  # address -> memory handed out
        self._lock = threading.Lock()

    # --- memory --------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> tuple[int, _Pinned]:
        """Return (address, handle) of ``nbytes`` of page-locked memory."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        self.context.make_current()
        pinned = self._allocate_registered(nbytes) if self.register else self._allocate_host(nbytes)
        with self._lock:
            self._live[pinned.address] = pinned
        return pinned.address, pinned

    def free(self, handle: object) -> None:
        """Unpin and give back memory from ``allocate``."""
        with self._lock:
            if not isinstance(handle, _Pinned) or self._live.get(handle.address) is not handle:
                raise ValueError(f"free of {handle!r}, which is not live memory of this provider")
            del self._live[handle.address]
        self.context.make_current()
        handle.close()

    # --- streams and events ----------------------------------------------------------------

    def record_event(self, stream: Hashable) -> Event:
        """Return a pooled event recorded on ``stream`` (any stream object or int handle)."""
        return self.events.get().record(stream_handle(stream))

    def event_done(self, event: object) -> bool:
        """Return whether ``event`` completed (``cuEventQuery``), without blocking."""
        if not isinstance(event, Event):
            raise ValueError(f"event_done on {event!r}, which is not an event of this provider")
        return event.query()

    def close(self) -> None:
        """Free what is still live and destroy pooled events. Idempotent."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
        if live:
            self.context.make_current()
        for pinned in live:
            pinned.close()
        self.events.close()

    def __repr__(self) -> str:
        path = f"register on {self.register_threads} threads" if self.register else "cuMemHostAlloc"
        return f"<CudaHostProvider {path}, {len(self._live)} allocations>"

    # --- private ---------------------------------------------------------------------------------

    def _allocate_host(self, nbytes: int) -> _Pinned:
        return _Pinned(int(call("cuMemHostAlloc", nbytes, PORTABLE)), nbytes, None)

    def _allocate_registered(self, nbytes: int) -> _Pinned:
        memory = AnonymousMemory(nbytes)  # an mmap failure is already ProviderOutOfMemory
        try:
            self._prefault(memory)
            call("cuMemHostRegister", memory.address, memory.length, PORTABLE)
        except BaseException:
            memory.close()
            raise
        return _Pinned(memory.address, nbytes, memory)

    def _prefault(self, memory: AnonymousMemory) -> None:
        """Fault the pages in first, on several threads: the driver then only pins them.

        ``MADV_POPULATE_WRITE`` fails with ENOMEM when the pages cannot be
        had (its other ENOMEM, a hole in the range, cannot happen: the
        mapping is ours and whole). That is the pool's out-of-memory, as a
        failed mmap or ``CUDA_ERROR_OUT_OF_MEMORY`` is: the pool empties its
        cache and retries rather than failing at once. (Kernels before 5.14
        touch the pages instead; there the OOM killer answers, not an errno.)
        """
        try:
            _native.prefault(memory.address, memory.length, self.register_threads, True)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            raise ProviderOutOfMemory(f"host: faulting in {format_size(memory.length)} to register "
                                      f"(prefault on {self.register_threads} threads) failed: "
                                      f"{exc.strerror or exc}") from exc


class _Pinned:
    """Own one page-locked range: ``cuMemHostAlloc``'d, or an mmap that ``cuMemHostRegister`` pinned."""

    __slots__ = ("address", "size", "memory")

    def __init__(self, address: int, size: int, memory: AnonymousMemory | None) -> None:
        self.address = address  # first byte
        self.size = size  # bytes asked for
        self.memory = memory  # the registered mmap; None for cuMemHostAlloc memory

    def close(self) -> None:
        """Unpin and free (the caller made the context current). Idempotent."""
        address, self.address = self.address, 0
        if not address:
            return
        if self.memory is None:
            call("cuMemFreeHost", address)
            return
        call("cuMemHostUnregister", address)  # if this fails the memory stays mapped, on purpose
        self.memory.close()

    def __repr__(self) -> str:
        kind = "cuMemHostAlloc" if self.memory is None else "registered"
        return f"<pinned {kind} 0x{self.address:x}+{self.size}>"


_default_pool: CachingHostAllocator | None = None
_default_lock = threading.Lock()


def host_allocator(config: str | AllocatorConfig | None = None) -> CachingHostAllocator:
    """Return the process-wide pinned-host pool over device 0's context (made on first use).

    ``config`` applies only to the call that creates it; later calls return
    the same pool, as ``at::getHostAllocator(at::kCUDA)`` does.
    """
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            config = _resolve(config)
            _default_pool = CachingHostAllocator(CudaHostProvider(config=config), config)
        return _default_pool


def _resolve(config: Any) -> AllocatorConfig:
    if isinstance(config, str):
        return parse_config(config, get_config(), source="CudaHostProvider(config=...)")
    if config is None:
        return get_config()
    if not isinstance(config, AllocatorConfig):
        raise TypeError(f"config must be a str, an AllocatorConfig or None, got {type(config).__name__}")
    return config
