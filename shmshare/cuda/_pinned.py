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
are per device. The mmap is private, so it is advised ``MADV_WIPEONFORK``
before it is pinned: otherwise a fork makes its pages copy-on-write, and
the first write after the fork moves this process's page away from the one
the DMA engine targets (``cuMemHostAlloc`` memory is the driver's to
protect). Wiping rather than ``MADV_DONTFORK`` leaves the child a mapping
of its own at the address, so the child's copy of the mmap object unmaps
its own zero pages, never a mapping the child later placed there.

Note [Pinned ranges outlive their owners]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each pinned range has one finalizer, which unpins before it unmaps: a
provider or pool dropped without ``close()`` must not let the mmap's own
finalizer unmap pages that are still registered (a stale DMA target, and
``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`` for the next mapping at that
address), nor leak ``cuMemHostAlloc`` memory. The finalizer does not wait
for the GPU: it queues a deferred release (Note [Deferred releases]) fenced
on the legacy stream of every active context and on the RECENT_STREAMS
streams the provider recorded events on most recently (new events, and the
last ones it recorded there, which stand in for a stream destroyed since).

Events belong to a context and can be recorded only on its streams, so the
provider keeps an event pool per context and picks it from the stream
(Note [Current context]).
"""

from __future__ import annotations

import errno
import mmap
import threading
import weakref
from collections.abc import Hashable
from typing import Any

from .. import _native
from ..memory._config import AllocatorConfig, get_config, parse_config
from ..memory._host import CachingHostAllocator
from ..memory._host_fallback import AnonymousMemory
from ..memory._policy import format_size
from ..memory._provider import ProviderOutOfMemory
from ._context import Context, Event, EventPool, stream_handle
from ._deferred import drain, release_later
from ._driver import call, driver

__all__ = ["CudaHostProvider", "host_allocator"]

MAX_PREFAULT_THREADS = 64  # _native.prefault's limit
RECENT_STREAMS = 64  # streams a range dropped unclosed is fenced on: the most recently recorded ones


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
        self.events = EventPool(self.context)  # this context's; others' in _pools
        self._pools: dict[int, EventPool] = {self.context.handle: self.events}  # context handle -> pool
        # (context handle, stream handle) -> (context, stream handle, the event recorded there last),
        # the RECENT_STREAMS most recently used: what a range dropped unclosed is fenced on
        self._recent: dict[tuple[int, int], tuple[Context, int, Event]] = {}
        self._live: dict[int, _Pinned] = {}  # address -> memory handed out
        self._lock = threading.Lock()

    # --- memory --------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> tuple[int, _Pinned]:
        """Return (address, handle) of ``nbytes`` of page-locked memory."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        drain()
        with self.context.active():
            pinned = self._allocate_registered(nbytes) if self.register else self._allocate_host(nbytes)
        pinned.watch(self.context, self._recent)
        with self._lock:
            self._live[pinned.address] = pinned
        return pinned.address, pinned

    def free(self, handle: object) -> None:
        """Unpin and give back memory from ``allocate``."""
        with self._lock:
            if not isinstance(handle, _Pinned) or self._live.get(handle.address) is not handle:
                raise ValueError(f"free of {handle!r}, which is not live memory of this provider")
            del self._live[handle.address]
        handle.close()

    # --- streams and events ----------------------------------------------------------------

    def record_event(self, stream: Hashable) -> Event:
        """Return a pooled event of ``stream``'s context recorded on it (any stream object or int handle).

        The default streams (0, 1, 2) are taken as this provider's context's.
        """
        context = Context.of_stream(stream, self.context)
        handle = stream_handle(stream)
        with self._lock:
            pool = self._pools.get(context.handle)
            if pool is None:
                pool = self._pools[context.handle] = EventPool(context)
        event = pool.get().record(handle)
        with self._lock:
            self._recent.pop((context.handle, handle), None)  # most recent last
            self._recent[(context.handle, handle)] = (context, handle, event)
            if len(self._recent) > RECENT_STREAMS:
                del self._recent[next(iter(self._recent))]
        return event

    def event_done(self, event: object) -> bool:
        """Return whether ``event`` completed (``cuEventQuery``), without blocking."""
        if not isinstance(event, Event):
            raise ValueError(f"event_done on {event!r}, which is not an event of this provider")
        return event.query()

    def close(self) -> None:
        """Free what is still live and destroy pooled events. Idempotent."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
            pools = list(self._pools.values())
        error: Exception | None = None
        for pinned in live:  # each one, even after a failure: a failed one is retried deferred
            try:
                pinned.close()
            except Exception as exc:  # noqa: BLE001 - raised below, once every range was tried
                error = error or exc
        for pool in pools:
            pool.close()
        if error is not None:
            raise error

    def __repr__(self) -> str:
        path = f"register on {self.register_threads} threads" if self.register else "cuMemHostAlloc"
        return f"<CudaHostProvider {path}, {len(self._live)} allocations>"

    # --- private ---------------------------------------------------------------------------------

    def _allocate_host(self, nbytes: int) -> _Pinned:
        flags = int(driver().CU_MEMHOSTALLOC_PORTABLE)
        return _Pinned(int(call("cuMemHostAlloc", nbytes, flags)), nbytes, None, self.context)

    def _allocate_registered(self, nbytes: int) -> _Pinned:
        memory = AnonymousMemory(nbytes)  # an mmap failure is already ProviderOutOfMemory
        try:
            self._prefault(memory)
            _keep_out_of_forks(memory)  # Note [Pinned register path]
            call("cuMemHostRegister", memory.address, memory.length, int(driver().CU_MEMHOSTREGISTER_PORTABLE))
        except BaseException:
            memory.close()
            raise
        return _Pinned(memory.address, nbytes, memory, self.context)

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
    """Own one page-locked range: ``cuMemHostAlloc``'d, or an mmap that ``cuMemHostRegister`` pinned.

    One finalizer per range unpins, then unmaps (Note [Pinned ranges outlive their owners]).
    """

    __slots__ = ("address", "size", "memory", "context", "_finalizer", "__weakref__")

    def __init__(self, address: int, size: int, memory: AnonymousMemory | None, context: Context) -> None:
        self.address = address  # first byte
        self.size = size  # bytes asked for
        self.memory = memory  # the registered mmap; None for cuMemHostAlloc memory
        self.context = context
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def watch(self, context: Context, recent: dict[tuple[int, int], tuple[Context, int, Event]]) -> None:
        """Arm the finalizer: when this object is collected unclosed, release the range deferred.

        ``recent`` is the provider's streams with their latest events (read when the finalizer runs).
        """
        self._finalizer = weakref.finalize(self, _release_dropped, self.address, self.size, self.memory,
                                           context, recent)

    def close(self) -> None:
        """Unpin and free now; the caller knows nothing uses it. Idempotent.

        When the driver refuses, the range stays pinned and mapped and the
        release is retried later (Note [Deferred releases]); the error is raised.
        """
        address, self.address = self.address, 0
        if not address:
            return
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        try:
            _unpin(address, self.memory, self.context)
        except BaseException:
            memory = self.memory
            release_later(_what(address, self.size, memory), lambda: _unpin(address, memory, self.context),
                          every_context=True)
            raise

    def __repr__(self) -> str:
        kind = "cuMemHostAlloc" if self.memory is None else "registered"
        return f"<pinned {kind} 0x{self.address:x}+{self.size}>"


MADV_WIPEONFORK = getattr(mmap, "MADV_WIPEONFORK", 18)  # linux/mman.h; Python names it on few builds


def _keep_out_of_forks(memory: AnonymousMemory) -> None:
    """Give a forked child zero pages here instead of the parent's, copy-on-write.

    ``MADV_WIPEONFORK`` (Linux 4.14): the child still has a mapping at the
    address, so its copy of the mmap object unmaps only its own pages.
    ``MADV_DONTFORK`` where the kernel lacks it.
    """
    try:
        _native.madvise(memory.address, memory.length, MADV_WIPEONFORK)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _native.madvise(memory.address, memory.length, mmap.MADV_DONTFORK)


def _unpin(address: int, memory: AnonymousMemory | None, context: Context) -> None:
    """Free ``cuMemHostAlloc`` memory, or unregister then unmap a registered mmap."""
    with context.active():
        if memory is None:
            call("cuMemFreeHost", address)
            return
        call("cuMemHostUnregister", address)  # if this fails the memory stays mapped, on purpose
    memory.close()


def _release_dropped(address: int, size: int, memory: AnonymousMemory | None, context: Context,
                     recent: dict[tuple[int, int], tuple[Context, int, Event]]) -> None:
    """The finalizer of a range dropped unclosed: a deferred release, fenced; no driver call here.

    It waits for the legacy stream of every active context, for new events
    on the streams the provider recorded on most recently (a copy from a
    block of the range may be queued there after its last free), and for
    the last event on each (which stands in for a stream gone since).
    """
    entries = list(recent.values())
    release_later(_what(address, size, memory), lambda: _unpin(address, memory, context),
                  [(c, h) for c, h, _ in entries], events=[e for _, _, e in entries], every_context=True,
                  in_forked_child=memory.close if memory is not None else None)


def _what(address: int, size: int, memory: AnonymousMemory | None) -> str:
    kind = "cuMemHostAlloc" if memory is None else "registered"
    return f"release of pinned {kind} memory 0x{address:x}+{size}"


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
