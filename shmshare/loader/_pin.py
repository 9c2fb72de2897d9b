"""``pin_memory=True``: batches page-locked where they lie, or pinned by a copy as torch does.

With CUDA usable through shmshare.cuda (cuda-python), the main process
registers each pool segment it maps with the driver once
(``cuMemHostRegister``): a batch is page-locked in the worker's own pages,
with no second copy, and ``.to("cuda", non_blocking=True)`` reads it by DMA.
Its block goes back to the worker only after an event recorded on the
current stream when the batch was dropped has completed (Note [Fenced
releases] in ``channel/_fences.py``), so a copy still in flight is never
overwritten by a later batch.

Without cuda-python but with a torch that has CUDA, batches are pinned as
torch's loader pins them: a copy into torch's pinned pool. Without an
accelerator, torch's warning, and batches as they are.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["Pinner", "choose"]


class Pinner:
    """The receiver's `pin` (channel ``Pinning``): registrations and fences in one context."""

    def __init__(self, device: int, current_stream: Callable[[], Any]) -> None:
        from .. import cuda

        self._cuda = cuda
        self.context = cuda.Context.primary(device)
        self.events = cuda.EventPool(self.context)
        self.current_stream = current_stream
        self.registered = 0  # segments page-locked so far

    def on_map(self, address: int, size: int, root: Any, readonly: bool) -> Any:
        reg = self._cuda.Registration.of_mapping(root, address, size, readonly, self.context)
        self.registered += 1
        return reg

    def on_unmap(self, token: Any) -> None:
        token.unregister()  # waits for every active context's work first (Note [Unregister waits])

    def fence(self) -> Any:
        return self.events.get().record(self.current_stream())

    def close(self) -> None:
        self.events.close()


def choose(loader: Any, stacklevel: int) -> tuple[str, Pinner | None]:
    """Return how to pin this loader's batches: ("none" | "copy" | "register", the Pinner)."""
    if loader.pin_memory and loader.pin_memory_device:
        warnings.warn("pin_memory_device is deprecated, the current accelerator will be used as the "
                      f"device,ignore pin_memory_device='{loader.pin_memory_device}'.",
                      stacklevel=stacklevel)
    if loader._device is not None and loader.num_workers > 0 and _cuda_usable():
        return "register", Pinner(loader._device, lambda: 0)  # copies from the pool's own pages
    if not loader.pin_memory:
        return "none", None
    torch = sys.modules.get("torch") if loader._use_torch else None
    if torch is not None:
        if not torch.accelerator.is_available():
            _no_accelerator(stacklevel)
            return "none", None
        acc = torch.accelerator.current_accelerator()
        if acc is None or acc.type != "cuda" or loader.num_workers == 0 or not _cuda_usable():
            return "copy", None
        return "register", Pinner(torch.cuda.current_device(),
                                  lambda: torch.cuda.current_stream().cuda_stream)
    if not _cuda_usable():
        _no_accelerator(stacklevel)
        return "none", None
    if loader.num_workers == 0:
        return "none", None  # numpy batches made here: nothing shared to page-lock
    return "register", Pinner(0, lambda: 0)  # the legacy default stream


def _cuda_usable() -> bool:
    from .. import cuda

    return cuda.available()


def _no_accelerator(stacklevel: int) -> None:
    warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then device "
                  "pinned memory won't be used.", stacklevel=stacklevel + 1)


def pin_by_copy(data: Any) -> Any:
    """torch's own pinning: a copy of every tensor into torch's pinned pool."""
    from torch.utils.data._utils.pin_memory import pin_memory

    return pin_memory(data)  # type: ignore[no-untyped-call]
