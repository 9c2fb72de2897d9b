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
    from the range, and the range may be unmapped right after. Any stream
    of any context may be copying from it (the registration is portable),
    so :meth:`Registration.unregister` first synchronizes every primary
    context that is active in this process, not just the one it was
    registered in. It is rare (once per segment lifetime), so the wait
    costs little. When the Segment object is collected instead, the
    unregister is a deferred release (Note [Deferred releases]): fenced by
    events on the legacy stream of each active context and on the streams
    named with :meth:`Registration.record_stream`, never a wait in the
    finalizer.

A segment opened read-only is registered ``CU_MEMHOSTREGISTER_READ_ONLY``,
which the driver needs for pages mapped without write permission and which
a device supports only when ``CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED``
says so; without it registering a read-only segment is refused, naming that.

Registered shm pages get no ``MADV_WIPEONFORK``/``MADV_DONTFORK`` (the
pinned pool's private anonymous pages do, Note [Pinned register path]): a
shared mapping is not copied on write, so a fork cannot move its pages away
from the DMA, and the advice would only take the data (or the mapping) away
from a forked child that inherited the Segment object.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .. import _native
from ..segment import Flags, Segment
from ._context import Context, Stream, active_primaries, stream_handle
from ._deferred import drain, release_later
from ._driver import CudaError, call, driver

__all__ = ["Registration", "register_segment", "registered", "unregister_segment"]

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
        if address % _native.PAGE_SIZE:
            raise ValueError(f"cannot register 0x{address:x}: the driver pins whole pages, and it is not "
                             f"page aligned ({_native.PAGE_SIZE} bytes)")
        self.context = context
        self.address = address
        self.size = -(-size // _native.PAGE_SIZE) * _native.PAGE_SIZE
        self.readonly = readonly
        self._streams: list[tuple[Context, Any]] = []  # named with record_stream: (context, stream)
        drv = driver()
        flags = int(drv.CU_MEMHOSTREGISTER_PORTABLE)
        if readonly:
            if not context.attribute("CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED"):
                raise CudaError(f"device {context.device} cannot page-lock read-only memory "
                                "(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0), and this mapping "
                                "is read-only: open the segment writable to register it, or copy from it "
                                "without registering (the driver stages pageable copies)")
            flags |= int(drv.CU_MEMHOSTREGISTER_READ_ONLY)
        drain()
        self._hold: Any = _native.Lease(root, address, size, readonly=readonly)
        try:
            with context.active():
                call("cuMemHostRegister", self.address, self.size, flags)
        except BaseException:
            self._hold = None
            raise

    @property
    def registered(self) -> bool:
        """Whether the range is still page-locked."""
        return self._hold is not None

    def record_stream(self, stream: Any, context: Context | None = None) -> None:
        """Name a non-blocking stream that copies from the range, as torch's ``record_stream`` does.

        A release deferred from a finalizer waits for the work on it as well
        as for each active context's legacy stream (Note [Unregister waits]);
        an explicit :meth:`unregister` waits for everything anyway. A
        :class:`Stream` named here is kept alive until then.
        """
        owner = context or Context.of_stream(stream, self.context)
        handle = stream_handle(stream)
        if not any(c is owner and stream_handle(s) == handle for c, s in self._streams):
            self._streams.append((owner, stream))
            if isinstance(stream, Stream):
                stream.name_for_release()

    def unregister(self) -> None:
        """Wait for every active context's work, unpin the range and let the mapping go. Idempotent.

        If the wait or the unpin fails, the range stays registered and
        mapped (never unmap pinned pages) and the unregister is retried as
        a deferred release (Note [Deferred releases]).
        """
        hold, self._hold = self._hold, None
        if hold is None:
            return
        try:
            for context in _contexts(self.context):
                context.synchronize()  # Note [Unregister waits]
            with self.context.active():
                call("cuMemHostUnregister", self.address)
        except BaseException:
            self._defer(hold)
            raise
        del hold  # unpinned: the mapping may go from here on

    def _release_later(self) -> None:
        """Unregister from a finalizer: fenced by events, never a wait here (Note [Deferred releases])."""
        hold, self._hold = self._hold, None
        if hold is not None:
            self._defer(hold)

    def _defer(self, hold: Any) -> None:
        """Queue the unregister (no driver call here: this may be a finalizer)."""
        address, context = self.address, self.context

        def unpin() -> None:
            nonlocal hold
            with context.active():
                call("cuMemHostUnregister", address)
            hold = None  # unpinned: the mapping may go

        def forget() -> None:  # a forked child: nothing is pinned here, only the view is the child's
            nonlocal hold
            hold = None

        release_later(f"unregister of 0x{address:x}+{self.size}", unpin, [(context, 0), *self._streams],
                      every_context=True, in_forked_child=forget)

    def __repr__(self) -> str:
        state = "registered" if self.registered else "unregistered"
        return f"<Registration 0x{self.address:x}+{self.size} {state}>"


def _contexts(own: Context) -> list[Context]:
    """Every active primary context, with ``own`` first (it is active: we retained it)."""
    return [own, *(c for c in active_primaries() if c.handle != own.handle)]


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
    """Unregister when the segment object is collected, as a deferred release; never waits here."""
    try:
        registration._release_later()
    except Exception:  # noqa: BLE001, S110 - a finalizer has no caller; at exit the driver is gone first
        pass
