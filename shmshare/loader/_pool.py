"""The worker's pool, where collate functions put their batches (None outside a worker)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["empty", "set_pool", "POOL_WAIT"]

# s a worker waits for blocks back when the host (its memory cgroup) has no more shared memory;
# a pool merely full of batches the program keeps does not wait (Note [Past the pool])
POOL_WAIT = 60.0

_sender: Any = None  # the worker's channel.Sender


def set_pool(sender: Any) -> None:
    global _sender
    _sender = sender


def empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """Return an uninitialized array (a tensor for a torch dtype) in the worker's pool.

    Outside a worker, an ordinary one: the main process has nothing to send.
    """
    if _sender is not None:
        return _sender.empty(shape, dtype, timeout=POOL_WAIT)
    if type(dtype).__module__ == "torch":
        import torch

        return torch.empty(shape, dtype=dtype)
    return np.empty(shape, dtype)
