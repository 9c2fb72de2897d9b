"""Memory history and snapshots in PyTorch's layout.

``memory_snapshot()`` returns what ``torch.cuda.memory._snapshot()`` does::

    {"segments": [segment, ...], "device_traces": [[entry, ...]],
     "allocator_settings": {...}}

A segment is one classic provider segment, or one contiguous *mapped* range
of an expandable segment (as PyTorch reports them), with its blocks in
address order. Trace entries record what the allocator did while history is
on: ``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``,
``segment_free``, ``segment_map``, ``segment_unmap`` and ``oom`` (which, as
in PyTorch, carries ``device_free`` instead of ``addr``). The pickle that
``dump_snapshot`` writes loads in ``torch.cuda._memory_viz`` (``stats``,
``trace``, ``trace_plot``, ``segment_plot``).
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from ._block import Block

__all__ = ["TraceRecorder", "build_segments", "capture_frames"]

_MAX_FRAMES = 48  # deep enough for real programs, bounded for the ring's memory
_HERE = os.path.dirname(os.path.abspath(__file__))


class TraceRecorder:
    """Keep the last ``max_entries`` trace entries of one allocator.

    Parameters
    ----------
    max_entries : int
        Size of the ring; older entries fall off.
    stacks : bool
        Record the Python stack with each entry and each allocated block.
    """

    __slots__ = ("entries", "stacks")

    def __init__(self, max_entries: int, stacks: bool) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be > 0, got {max_entries}")
        self.entries: deque[dict[str, Any]] = deque(maxlen=max_entries)
        self.stacks = stacks  # capture frames for entries and blocks

    def record(
        self,
        action: str,
        addr: int,
        size: int,
        stream: int,
        pool_id: tuple[int, int],
        frames: list[dict[str, Any]] | None = None,
    ) -> None:
        """Append one entry; ``frames`` defaults to the caller's stack when stacks are on."""
        if frames is None:
            frames = capture_frames() if self.stacks else []
        key = "device_free" if action == "oom" else "addr"
        self.entries.append(
            {
                "action": action,
                key: addr,
                "size": size,
                "stream": stream,
                "time_us": time.time_ns() // 1000,
                "frames": frames,
                "pool_id": pool_id,
                "compile_context": "N/A",
                "user_metadata": "",
            }
        )


def capture_frames() -> list[dict[str, Any]]:
    """Return the Python stack outside this package, innermost frame first."""
    frames: list[dict[str, Any]] = []
    f: Any = sys._getframe(1)
    while f is not None and len(frames) < _MAX_FRAMES:
        filename = f.f_code.co_filename
        if os.path.dirname(filename) != _HERE:
            frames.append({"filename": filename, "line": f.f_lineno, "name": f.f_code.co_name})
        f = f.f_back
    return frames


def build_segments(blocks: Iterable[Block]) -> list[dict[str, Any]]:
    """Describe the segments that ``blocks`` (every mapped block) belong to.

    A head is a mapped block with no mapped block just below it; its segment
    entry runs up the ``next`` links while they stay mapped.
    """
    heads = [b for b in blocks if b.mapped and (b.prev is None or not b.prev.mapped)]
    heads.sort(key=lambda b: b.address)
    return [_segment_dict(head) for head in heads]


def _segment_dict(head: Block) -> dict[str, Any]:
    owner = head.pool.owner
    segment: dict[str, Any] = {
        "device": 0,
        "address": head.address,
        "total_size": 0,
        "allocated_size": 0,
        "active_size": 0,
        "requested_size": 0,
        "stream": head.stream_id,
        "segment_type": "small" if head.pool.is_small else "large",
        "segment_pool_id": (0, 0) if owner is None else owner.id,
        "is_expandable": head.segment.expandable,
        "frames": [],
        "blocks": [],
    }
    block: Block | None = head
    while block is not None and block.mapped:
        segment["blocks"].append(_block_dict(block))
        segment["total_size"] += block.size
        if block.allocated:
            segment["allocated_size"] += block.size
        if _is_active(block):
            segment["active_size"] += block.size
            segment["requested_size"] += block.requested_size
        block = block.next
    return segment


def _block_dict(block: Block) -> dict[str, Any]:
    if block.allocated:
        state = "active_allocated"
    elif _is_active(block):
        state = "active_pending_free"
    else:
        state = "inactive"
    return {
        "address": block.address,
        "size": block.size,
        "requested_size": block.requested_size,
        "state": state,
        "frames": list(block.frames) if _is_active(block) else [],
    }


def _is_active(block: Block) -> bool:
    return block.allocated or block.event_count > 0 or bool(block.stream_uses)
