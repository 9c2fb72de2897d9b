"""Page-lock a shared-memory segment once, so device copies run straight from it.

Note [Registered segments]
~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's DataLoader copies each batch from shared memory into a separate
pinned buffer before the host-to-device copy. A consumer that registers the
received segment's mapping with ``cuMemHostRegister`` skips that copy: the
DMA engine reads the shm pages directly. Registering costs about as much as
pinning fresh memory, so it is done once per mapping and cached here (a
segment's blocks are reused for many batches).

A registration holds a view (:class:`shmshare._native.Lease`) of the
segment's mapping, so the mapping cannot go while it is registered: the
unregister always comes before the ``munmap``. It ends with
:func:`unregister_segment`, :meth:`Registration.unregister`, or when the
:class:`~shmshare.Segment` object is collected; the mapping then goes when
its last other view does.

Note [Unregister waits]
    ``cuMemHostUnregister`` does not promise to wait for copies in flight
    from the range, and the range may be unmapped right after. So
    :meth:`Registration.unregister` synchronizes the context first. It is
    rare (once per segment lifetime), so the wait costs little.

A segment opened read-only is registered ``CU_MEMHOSTREGISTER_READ_ONLY``,
which the driver needs for pages mapped without write permission.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .. import _native
from ..segment import Flags, Segment
from ._context import Context
from ._driver import call

__all__ = ["Registration", "register_segment", "registered", "unregister_segment"]

PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE
READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY

_registrations: weakref.WeakKeyDictionary[Segment, Registration] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class Registration:
    """Own one ``cuMemHostRegister`` of a segment's mapping (Note [Registered segments]).

    Attributes
    ----------
    address : int
        First registered byte: the segment's address.
    size : int
        Registered bytes: the mapping's whole pages.
    """

    def __init__(self, segment: Segment, context: Context) -> None:
        root = segment.lease  # raises ValueError when the segment is closed
        self._register(root, segment.address, segment.size, bool(segment.flags & Flags.READONLY),
                       context)

    @classmethod
    def of_mapping(cls, root: Any, address: int, size: int, readonly: bool,
                   context: Context) -> Registration:
        """Page-lock ``[address, address+size)`` of a mapping that `root` (a Lease) keeps.

        For a mapping whose Segment is already closed (a channel receiver's):
        the registration holds a view of `root`, so the mapping stays until
        :meth:`unregister`. Not cached: the caller owns it.
        """
        self = cls.__new__(cls)
        self._register(root, address, size, readonly, context)
        return self

    def _register(self, root: Any, address: int, size: int, readonly: bool, context: Context) -> None:
        self.context = context
        self.address = address
        self.size = -(-size // _native.PAGE_SIZE) * _native.PAGE_SIZE
        self.readonly = readonly
        self._hold: Any = _native.Lease(root, address, size, readonly=readonly)
        context.make_current()
        try:
            call("cuMemHostRegister", self.address, self.size, PORTABLE | (READ_ONLY if self.readonly else 0))
        except BaseException:
            self._hold = None
            raise

    @property
    def registered(self) -> bool:
        """Whether the range is still page-locked."""
        return self._hold is not None

    def unregister(self) -> None:
        """Wait for the context's work, unpin the range and let the mapping go. Idempotent."""
        hold, self._hold = self._hold, None
        if hold is None:
            return
        try:
            self.context.synchronize()  # Note [Unregister waits]
        finally:  # unpin even when the wait failed (a sticky error): never unmap pinned pages
            try:
                call("cuMemHostUnregister", self.address)
            except BaseException:
                _leaked_holds.append(hold)  # still pinned: keeping the mapping beats unmapping it
                raise
        del hold  # unpinned: the mapping may go from here on

    def __repr__(self) -> str:
        state = "registered" if self.registered else "unregistered"
        return f"<Registration 0x{self.address:x}+{self.size} {state}>"


_leaked_holds: list[object] = []  # mappings whose unregister failed: kept mapped on purpose


def register_segment(segment: Segment, context: Context | None = None) -> Registration:
    """Page-lock ``segment``'s mapping once and return its registration (cached per segment).

    Parameters
    ----------
    segment : Segment
        An open segment, created here or received from another process.
    context : Context, optional
        Device 0's primary context when None. The registration is portable:
        every context sees the range as pinned.
    """
    if not isinstance(segment, Segment):
        raise TypeError(f"register_segment needs a shmshare Segment, got {type(segment).__name__}")
    with _lock:
        current = _registrations.get(segment)
        if current is not None and current.registered:
            return current
        registration = Registration(segment, context or Context.primary(0))
        _registrations[segment] = registration
        weakref.finalize(segment, _unregister_quietly, registration)
        return registration


def unregister_segment(segment: Segment) -> bool:
    """Undo :func:`register_segment`; return whether the segment was registered."""
    with _lock:
        registration = _registrations.pop(segment, None)
    if registration is None or not registration.registered:
        return False
    registration.unregister()
    return True


def registered(segment: Segment) -> Registration | None:
    """Return the live registration of ``segment``, or None."""
    with _lock:
        registration = _registrations.get(segment)
    return registration if registration is not None and registration.registered else None


def _unregister_quietly(registration: Registration) -> None:
    """Unregister when the segment object is collected; a dead driver (at exit) is not an error."""
    try:
        registration.unregister()
    except Exception:  # noqa: BLE001, S110 - a finalizer has no caller; at exit the driver is gone first
        pass
