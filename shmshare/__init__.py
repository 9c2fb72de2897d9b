"""shmshare: zero-copy tensors between processes through shared memory.

Layers, imported one way only (a module never imports one above it):

    _native (C)  ->  segment  ->  wire  ->  memory  ->  tensors  ->  channel
                 ->  loader, store, multiprocessing  ->  cli

``shmshare.testing`` may import anything; nothing imports it.
"""

from __future__ import annotations

from ._errors import (
    FdLimitError,
    PeerDied,
    PeerRefused,
    PoolExhausted,
    ProtocolError,
    SegmentError,
    ShmshareError,
    ShmshareTimeout,
)
from ._statsd import serve_stats, stats_socket, stop_stats
from .channel import Receiver, Sender, channel, connect, listen
from .loader import DataLoader
from .segment import Flags, Segment
from .store import Store

__version__ = "0.1.0"

__all__ = [
    "channel",
    "listen",
    "connect",
    "Sender",
    "Receiver",
    "DataLoader",
    "Store",
    "serve_stats",
    "stop_stats",
    "stats_socket",
    "Flags",
    "Segment",
    "ShmshareError",
    "SegmentError",
    "ProtocolError",
    "PeerDied",
    "PeerRefused",
    "FdLimitError",
    "PoolExhausted",
    "ShmshareTimeout",
]
