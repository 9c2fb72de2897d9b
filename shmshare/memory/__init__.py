"""The caching allocators: one provider-agnostic core over several providers.

:class:`CachingAllocator` is PyTorch's CUDA caching allocator (blocks, best
fit, split and merge, stream events, the retry chain, expandable segments,
statistics, snapshots) written once over a small provider interface
(:class:`Provider`, Note [Providers] in ``_provider.py``).
:class:`SimulatedDevice` is a provider with no hardware behind it, used to
test every policy on CPU. The design notes are in ``docs/allocator.md``.

The core imports nothing from shmshare but ``shmshare._errors``; providers
that need segments or the native layer live beside it and import those.
"""

from __future__ import annotations

from .. import _statsd  # noqa: F401 -- arms SHMSHARE_STATS: the first pool starts the stats socket
from ._allocator import CachingAllocator
from ._block import Block
from ._config import (
    ENV_VAR,
    AllocatorConfig,
    configure,
    get_config,
    parse_config,
)
from ._core import MemoryEvent
from ._exceptions import InvariantError, OutOfMemoryError
from ._host import CachingHostAllocator
from ._host_fallback import AnonymousMemory, HostFallbackProvider
from ._mempool import MemPool, current_mem_pool, use_mem_pool
from ._policy import format_size, round_size
from ._provider import ExpandableProvider, Provider, ProviderOutOfMemory
from ._shm import ShmProvider, ShmSegment
from ._simulated import SimulatedDevice, SimulatedDeviceError, SimulatedStream

__all__ = [
    "CachingAllocator",
    "CachingHostAllocator",
    "HostFallbackProvider",
    "AnonymousMemory",
    "Block",
    "MemoryEvent",
    "MemPool",
    "use_mem_pool",
    "current_mem_pool",
    "AllocatorConfig",
    "configure",
    "get_config",
    "parse_config",
    "ENV_VAR",
    "round_size",
    "format_size",
    "Provider",
    "ExpandableProvider",
    "ProviderOutOfMemory",
    "OutOfMemoryError",
    "InvariantError",
    "ShmProvider",
    "ShmSegment",
    "SimulatedDevice",
    "SimulatedStream",
    "SimulatedDeviceError",
]
