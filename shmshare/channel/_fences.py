"""Pinned receivers: segments page-locked once, and releases held until the device is done.

Note [Fenced releases]
    A receiver given a `pin` (``Receiver(pin=...)``: the loader's, with CUDA)
    page-locks each classic segment once when it maps it (``pin.on_map``), so
    that device copies read the sender's pages where they lie. A copy is
    asynchronous: when a program drops a batch, a copy from it may still be
    in flight on the device. So the release of such an array is *fenced*:
    the Lease callback (any thread, any bytecode) only queues it here; at
    the receiver's next ``recv`` (its own thread, a safe point) the releases
    queued since the last one get one fence, an event recorded on the
    current stream (``pin.fence()``), and go back to their sender only once
    that fence has completed. A block is therefore never handed out again
    while the device may still read it. ``close()`` waits for every fence; a
    receiver collected unclosed cannot wait, and says so in its warning.

    ``pin.on_unmap`` undoes ``on_map`` (it waits for the device first) when
    the sender drops the segment, the sender goes, or the receiver closes.
    Expandable segments are not page-locked: their batches are not pinned.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Protocol

from ._releases import Release, current_pid

if TYPE_CHECKING:
    from ._books import Peer
    from ._receiver import Receiver

__all__ = ["Pinning", "Fences", "FencedRelease"]


class Pinning(Protocol):
    """What a pinned receiver asks of its `pin` (the loader's: ``shmshare.loader._pin``)."""

    def on_map(self, address: int, size: int, root: Any, readonly: bool) -> Any: ...
    def on_unmap(self, token: Any) -> None: ...
    def fence(self) -> Any: ...  # an object with query() -> bool and synchronize()


class FencedRelease(Release):
    """on_release of an array of a pinned receiver: queued until a fence covers it."""

    __slots__ = ()

    def __call__(self) -> None:
        if self.pid != current_pid():
            return  # an array inherited by a forked child: the lease is its parent's
        self.q.unfenced.append((self.peer, self.lease, self.nbytes))  # q: the receiver's Fences


class Fences:
    """The releases of a pinned receiver, from the Lease callbacks to the release queue."""

    def __init__(self, pin: Pinning) -> None:
        self.pin = pin
        self.error: Exception | None = None  # the first driver failure, raised by close()
        self.unfenced: collections.deque[tuple[Peer, int, int]] = collections.deque()
        self.fenced: collections.deque[tuple[Any, list[tuple[Peer, int, int]]]] = collections.deque()

    def take(self, rx: Receiver, wait: bool = False) -> None:
        """Fence what was released since the last call; pass on what is fenced and done.

        With `wait`, wait for every fence (``close()``).
        """
        if self.unfenced:
            items = []
            while self.unfenced:
                items.append(self.unfenced.popleft())
            self.fenced.append((self.pin.fence(), items))
        while self.fenced:
            fence, items = self.fenced[0]
            if wait:
                fence.synchronize()
            elif not fence.query():
                return
            self.fenced.popleft()
            for peer, lease, nbytes in items:
                rx._releases.add(peer, lease, nbytes)

    def on_map(self, address: int, size: int, root: Any, readonly: bool) -> Any:
        return self.pin.on_map(address, size, root, readonly)

    def on_unmap(self, token: Any) -> None:
        """Undo on_map; a failure (the range then stays pinned, and mapped) waits for close()."""
        if token is not None:
            try:
                self.pin.on_unmap(token)
            except Exception as exc:  # noqa: BLE001 - the receiver must still close what it holds
                self.error = self.error or exc

    def wait_all(self, rx: Receiver) -> None:
        """close(): wait for every fence. If the device fails, the releases are void: the senders
        retire those blocks when the connection ends (never reuse them)."""
        try:
            self.take(rx, wait=True)
        except Exception as exc:  # noqa: BLE001 - raised by close() once everything is closed
            self.error = self.error or exc
            self.unfenced.clear()
            self.fenced.clear()
