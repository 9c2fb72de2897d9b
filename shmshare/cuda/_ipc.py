"""Device memory sent to another process as fds over a shmshare wire connection.

Note [Device memory over fds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Sharing device memory needs a handle the other process can import. The
legacy ``cudaIpcGetMemHandle`` does not work for virtual-memory allocations,
and PyTorch's expandable-segment IPC exports each allocation as a POSIX fd
and has the receiver *take* it from the sender's fd table with
``pidfd_open`` + ``pidfd_getfd``. That needs ptrace permission over the
sender (``PTRACE_MODE_ATTACH_REALCREDS``: denied under Yama
``ptrace_scope`` >= 2 and in many containers without ``CAP_SYS_PTRACE``), and
the sender must still be alive when the receiver asks.

shmshare already has a socket to the peer, so each chunk's fd
(``cuMemExportToShareableHandle``, one per chunk, Note [Device chunks])
travels in ``SCM_RIGHTS``, as shm segment fds do. No ptrace permission is
involved, and the fd in flight keeps the physical memory alive: the sender
may exit right after sending. The receiver reserves an address range,
imports each fd (``cuMemImportFromShareableHandle``), closes it, maps the
chunks in order and sets access. The imported handles keep the memory
alive after the sender is gone, until the receiver unmaps.

Note [Device memory in batches]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A block of N chunks is N fds. Exporting them all before sending, and
importing only once all had arrived, held N fds at once on each side: a
2 GiB block is 1,024 fds, the default ``ulimit -n``. So both sides work in
batches of at most ``batch`` (= ``wire.MAX_FDS``) fds, one batch per
message: the sender exports a batch, sends it and closes its copies before
exporting the next; the receiver reserves the whole address range at the
header, then imports, closes and maps each batch as it arrives. Neither
side holds more than one batch of chunk fds at any moment.

Protocol version 2 (version 1 had no ``batch`` and no abort)::

    header        {kind: "shmshare.cuda.memory", version: 2, device, device_uuid,
                   chunk_size, nchunks, batch, offset, nbytes, meta}
                  + fds of chunks [0, min(batch, nchunks))
    continuation  {kind: "shmshare.cuda.memory.fds", index: i}
                  + fds of chunks [i, i + min(batch, nchunks - i)), i = batch, 2*batch...
    abort         {kind: "shmshare.cuda.memory.abort", index: i, error: str}, no fds:
                  the sender failed after sending chunks [0, i) and sends no more

The receiver accepts exactly that sequence: anything else (another kind,
a wrong index, too many or too few fds, a header whose sizes do not add
up or exceed the device) is a :class:`ProtocolError`, and whatever it had
imported and mapped is released. A sender that dies mid-way is
:class:`PeerDied` and one that stops talking a timeout, both naming how
many chunks had arrived; after any of these errors the connection is out
of step and should be closed.

Fds in flight (sent, not yet received) sit in the socket, in neither
process's table, but Linux charges each to the sending user's
``RLIMIT_NOFILE`` and fails a send past it with ETOOMANYREFS, which
``wire`` raises as :class:`FdLimitError`. Batching does not bound them: a
receiver that lags by more than the sender's ``ulimit -n`` chunks makes the
send fail (clearly, at once). Receive while the sender sends.

The sender must not reuse the block until the receiver says it is done;
that ordering is the channel's lease protocol, not this module's.

Note [Ordered before it leaves]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Kernels and copies that write the block may still be running when
``send_device_memory`` is called, and the receiver's streams know nothing
of the sender's. So the sender waits on the host for the stream named with
``stream=`` (``cuStreamSynchronize``), or for its whole context when none
is named (``cuCtxSynchronize``: every stream, blocking or not), *before the
header goes out*. Whatever the receiver does with the memory then comes
after those writes, on any stream, with nothing to wait for on its side.

An interprocess event (``CU_EVENT_INTERPROCESS``, ``cuIpcGetEventHandle``
in the header, the receiver's ``cuStreamWaitEvent``) would avoid the host
wait, as torch's CUDA IPC does. But the sender must keep that event alive
until the receiver has waited on it (the driver leaves using an imported
event after its owner destroyed it undefined), and this protocol has no
acknowledgement to say when that is; the channel's lease protocol will.

Note [Imported memory is unmapped deferred]
    The imported range is unmapped when the last holder (the
    :class:`ImportedDeviceMemory`, its arrays, their DLPack consumers) is
    gone, which happens in a finalizer or a DLPack deleter. ``cuMemUnmap``
    does not wait for kernels still reading the memory, and a finalizer
    must not wait (Note [Deferred releases]). So the unmap is a deferred
    release fenced on the device's legacy default stream (which covers its
    blocking streams), on each DLPack consumer's stream, and on the streams
    named with :meth:`ImportedDeviceMemory.record_stream`: a consumer that
    uses the memory on a non-blocking stream it did not pass to
    ``__dlpack__`` names it there, as with torch's ``record_stream``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import PeerDied, ProtocolError, ShmshareTimeout
from ..wire import MAX_FDS, Connection, Fd
from ._array import DeviceArray
from ._context import Context, Stream, stream_handle
from ._deferred import drain, release_later
from ._device import CudaDeviceProvider
from ._driver import call
from ._vmm import VirtualRange, posix_fd_handle_type

__all__ = ["ImportedDeviceMemory", "recv_device_memory", "send_device_memory"]

KIND = "shmshare.cuda.memory"
KIND_MORE = "shmshare.cuda.memory.fds"
KIND_ABORT = "shmshare.cuda.memory.abort"
VERSION = 2  # Note [Device memory in batches]
_ABORT_TIMEOUT = 1.0  # s: the abort is a courtesy to the receiver, never a reason to wait long


def send_device_memory(conn: Connection, provider: CudaDeviceProvider, address: Any, nbytes: int | None = None,
                       *, stream: Any = None, meta: dict[str, Any] | None = None,
                       timeout: float | None = None) -> None:
    """Send ``[address, address + nbytes)`` of ``provider``'s device memory to the peer of ``conn``.

    The send is ordered after the work that wrote the memory: it waits for
    ``stream``, or for the provider's whole context when None, before
    anything goes out (Note [Ordered before it leaves]). The chunks' fds go
    in batches of at most ``wire.MAX_FDS``, each exported just before it is
    sent and closed right after (Note [Device memory in batches]).

    Parameters
    ----------
    address : int or Block
        A block of an allocator over ``provider`` made with ``ipc=True``, or an address in one.
    nbytes : int, optional
        The block's size when None.
    stream : stream object or int handle, optional
        The stream whose work wrote the memory (a stream of the provider's
        device); the whole context is waited for when None.
    meta : dict, optional
        msgpack-able values delivered with the memory (dtype, shape...).
    timeout : float, optional
        Seconds each message may wait for room in the socket.
    """
    if nbytes is None:
        nbytes = getattr(address, "size", None)
    address = int(getattr(address, "address", address))
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    found = provider.range_of(address)
    if found is None or found[1] + nbytes > found[0].size:
        raise ValueError(f"[0x{address:x}, +{nbytes}) is not inside one virtual-memory segment of {provider!r} "
                         "(cuMemAlloc memory cannot be sent by fd: create the provider with ipc=True)")
    vrange, offset = found
    chunk = vrange.chunk_size
    first = offset - offset % chunk
    count = -(-(offset + nbytes - first) // chunk)
    missing = [o for o in range(first, first + count * chunk, chunk) if o not in vrange.chunks]
    if missing:  # checked before the header goes: the receiver then waits for nothing that cannot come
        raise ValueError(f"send of [0x{address:x}, +{nbytes}): the chunk at offset {missing[0]:#x} is not mapped")
    drain()
    _wait_for_writers(provider, stream)  # Note [Ordered before it leaves]
    header = {"kind": KIND, "version": VERSION, "device": provider.device,
              "device_uuid": provider.context.uuid(), "chunk_size": chunk, "nchunks": count,
              "batch": MAX_FDS, "offset": offset - first, "nbytes": nbytes, "meta": meta or {}}
    sent = 0
    while sent < count:
        n = min(MAX_FDS, count - sent)
        try:
            _, raw = vrange.export(first + sent * chunk, n * chunk)
        except BaseException as exc:
            if sent:
                _abort(conn, sent, count, exc)
            raise
        owned = [Fd(fd) for fd in raw]
        try:
            conn.send(header if sent == 0 else {"kind": KIND_MORE, "index": sent}, owned, timeout)
        except BaseException as exc:
            # a continuation that cannot go (fds in flight past RLIMIT_NOFILE, a full socket,
            # an interrupt): tell a receiver holding chunks [0, sent) to stop waiting
            if sent and not isinstance(exc, PeerDied):
                _abort(conn, sent, count, exc)
            raise
        finally:
            for fd in owned:  # the peer has its own copies now (or nothing, if the send failed)
                fd.close()
        sent += n


def _wait_for_writers(provider: CudaDeviceProvider, stream: Any) -> None:
    """Wait on the host for ``stream``'s work, or the provider's whole context's when None."""
    if stream is None:
        provider.context.synchronize()
        return
    owner = Context.of_stream(stream, provider.context)
    if owner.handle != provider.context.handle:
        raise ValueError(f"stream {stream!r} belongs to device {owner.device}; the memory is on device "
                         f"{provider.device}: pass the stream that wrote it")
    with owner.active():
        call("cuStreamSynchronize", stream_handle(stream))


def recv_device_memory(conn: Connection, *, timeout: float | None = None,
                       context: Context | None = None) -> ImportedDeviceMemory:
    """Receive device memory sent with :func:`send_device_memory`, imported and mapped here.

    Each batch of chunk fds is imported, closed and mapped as it arrives
    (Note [Device memory in batches]); ``timeout`` bounds the wait for each message.

    Raises
    ------
    ProtocolError
        For a message that is not device memory, a header that does not add
        up, a sequence of batches that is not the one announced, or a sender
        that gave up part way.
    PeerDied, ShmshareTimeout
        When the sender closes the connection, or stops sending, part way.
    """
    drain()
    header, fds = conn.recv(timeout)
    vrange: VirtualRange | None = None
    try:
        count, batch = _check_header(header, len(fds))
        context = context or _context_for(header["device_uuid"], header["device"])
        chunk = header["chunk_size"]
        if chunk * count > context.total_memory():
            raise ProtocolError(f"device memory header announces {count} chunks of {chunk} bytes, more than "
                                f"device {context.device}'s {context.total_memory()} bytes")
        vrange = VirtualRange(context, chunk * count, chunk, shareable=False)
        received = 0
        while True:
            _import_batch(vrange, received, fds)
            received += len(fds)
            if received == count:
                break
            fds = _next_batch(conn, timeout, received, count, batch)
        memory = ImportedDeviceMemory(vrange, header)
    except BaseException as exc:
        if vrange is not None:
            try:
                vrange.close()  # every chunk mapped so far, then the range; nothing used them: no synchronize
            except Exception as cleanup:  # noqa: BLE001 - noted on the first error, which says what went wrong
                exc.add_note(f"releasing the partly imported range failed too ({cleanup!r}); it is retried "
                             "as a deferred release")
                release_later(f"close of a partly imported {vrange!r}", vrange.close, [])
        raise
    finally:
        for fd in fds:
            fd.close()
    return memory


class ImportedDeviceMemory:
    """Device memory imported from another process, mapped in this one.

    Made by :func:`recv_device_memory`. ``close()`` drops this object's
    hold; the memory is unmapped (after synchronizing the context) when the
    last :class:`DeviceArray` made by :meth:`array`, and every DLPack
    consumer of one, are gone too.

    Attributes
    ----------
    address : int
        Device address of the first byte sent.
    nbytes : int
    device : int
        Local ordinal of the device it lives on.
    meta : dict
        What the sender attached.
    """

    def __init__(self, vrange: VirtualRange, header: dict[str, Any]) -> None:
        self._mapping: _Mapping | None = _Mapping(vrange)  # owns the range from here on
        self.address = vrange.address + header["offset"]
        self.nbytes = header["nbytes"]
        self.device = vrange.context.device
        self.meta = header["meta"]

    def record_stream(self, stream: Any) -> None:
        """Name a stream (of this memory's device) that uses the memory, as torch's ``record_stream``.

        The unmap after the last holder is gone waits for its work (Note
        [Imported memory is unmapped deferred]); the legacy default stream
        and DLPack consumers' streams need not be named.
        """
        if self._mapping is None:
            raise ValueError("record_stream() on closed ImportedDeviceMemory")
        self._mapping.record_stream(stream)

    def array(self, shape: Any = None, dtype: Any = np.uint8, *, stream: Any = None) -> DeviceArray:
        """Return a :class:`DeviceArray` over the memory (all of it as bytes by default)."""
        if self._mapping is None:
            raise ValueError("array() on closed ImportedDeviceMemory")
        dt = np.dtype(dtype)
        shape = (self.nbytes // dt.itemsize,) if shape is None else shape
        if stream is not None:
            self._mapping.record_stream(stream)  # the unmap waits for the stream it is produced on
        arr = DeviceArray(self.address, shape, dt, device=self.device, owner=self._mapping, stream=stream)
        if arr.nbytes > self.nbytes:
            raise ValueError(f"an array of {arr.nbytes} bytes does not fit in {self.nbytes} imported bytes")
        return arr

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._mapping is None

    def close(self) -> None:
        """Drop this object's hold on the mapping. Idempotent."""
        self._mapping = None

    def __enter__(self) -> ImportedDeviceMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ImportedDeviceMemory {self.nbytes} bytes at 0x{self.address:x} on device {self.device}>"


class _Mapping:
    """Own the imported range; unmap it, deferred, when the last holder goes (Note [Imported memory is
    unmapped deferred])."""

    def __init__(self, vrange: VirtualRange) -> None:
        self.vrange: VirtualRange | None = vrange
        self.streams: list[tuple[Context, Any]] = [(vrange.context, 0)]  # fences of the unmap

    def record_stream(self, stream: Any) -> None:
        """Add a stream whose work the unmap waits for (DLPack consumers land here too)."""
        vrange = self.vrange
        if vrange is None:
            return
        owner, handle = Context.of_stream(stream, vrange.context), stream_handle(stream)
        if not any(c is owner and stream_handle(s) == handle for c, s in self.streams):
            self.streams.append((owner, stream))
            if isinstance(stream, Stream):
                stream.name_for_release()

    def __del__(self) -> None:
        vrange, self.vrange = self.vrange, None
        if vrange is None:
            return
        try:
            release_later(f"unmap of imported {vrange!r}", vrange.close, self.streams)
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the driver tears everything down anyway
            pass


def _check_header(header: Any, nfds: int) -> tuple[int, int]:
    """Return (nchunks, batch) of a version-2 header carrying ``nfds`` fds, or raise ProtocolError."""
    if not isinstance(header, dict) or header.get("kind") != KIND:
        raise ProtocolError(f"expected a {KIND!r} message, got {header!r:.200}")
    if header.get("version") != VERSION:
        raise ProtocolError(f"device memory message version {header.get('version')!r}, expected {VERSION} "
                            "(install the same shmshare version on both sides)")
    fields = {"device": int, "chunk_size": int, "nchunks": int, "batch": int, "offset": int, "nbytes": int,
              "device_uuid": bytes, "meta": dict}
    for name, kind in fields.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool):
            raise ProtocolError(f"device memory header field {name!r} is {header.get(name)!r}, not {kind.__name__}")
    chunk, count, offset, nbytes = header["chunk_size"], header["nchunks"], header["offset"], header["nbytes"]
    if chunk <= 0 or count <= 0 or nbytes <= 0 or not 0 <= offset < chunk or -(-(offset + nbytes) // chunk) != count:
        raise ProtocolError(f"device memory header does not add up: {count} chunks of {chunk} bytes, "
                            f"{nbytes} bytes at offset {offset}")
    batch = header["batch"]
    if not 1 <= batch <= MAX_FDS:
        raise ProtocolError(f"device memory header asks for batches of {batch} fds; this end takes 1 to {MAX_FDS}")
    if nfds != min(count, batch):
        raise ProtocolError(f"device memory header announces {count} chunks in batches of {batch} "
                            f"but carries {nfds} fds")
    return count, batch


def _next_batch(conn: Connection, timeout: float | None, index: int, count: int, batch: int) -> list[Fd]:
    """Receive the continuation that carries chunks from ``index`` on; return its fds, or raise."""
    try:
        message, fds = conn.recv(timeout)
    except (PeerDied, ShmshareTimeout) as exc:
        raise type(exc)(f"{exc}, after {index} of {count} chunks of device memory had arrived") from exc
    want = min(batch, count - index)
    if isinstance(message, dict) and message.get("kind") == KIND_ABORT and not fds:
        raise ProtocolError(f"the sender gave up after {index} of {count} chunks of device memory: "
                            f"{message.get('error')!r:.300}")
    if (not isinstance(message, dict) or message.get("kind") != KIND_MORE or type(message.get("index")) is not int
            or message["index"] != index or len(fds) != want):
        for fd in fds:
            fd.close()
        raise ProtocolError(f"expected {KIND_MORE!r} with index {index} and {want} fds (chunks {index} to "
                            f"{index + want - 1} of {count}), got {message!r:.200} with {len(fds)} fds")
    return fds


def _import_batch(vrange: VirtualRange, index: int, fds: list[Fd]) -> None:
    """Import chunks ``index``... from ``fds``, close the fds, and map the chunks in ``vrange``; all or nothing."""
    handles: list[Any] = []
    try:
        kind = posix_fd_handle_type()
        with vrange.context.active():
            for fd in fds:  # the driver takes what it needs from each fd: ours are closed below
                handles.append(call("cuMemImportFromShareableHandle", fd.fileno(), kind))
    except BaseException:
        _release_quietly(vrange.context, handles)
        raise
    finally:
        for fd in fds:
            fd.close()
    vrange.map_imported(index * vrange.chunk_size, handles)  # owns every handle from here, mapped or not


def _release_quietly(context: Context, handles: list[Any]) -> None:
    """Release imported handles on an error path; one the driver refuses is retried deferred."""
    for handle in handles:
        try:
            with context.active():
                call("cuMemRelease", handle)
        except Exception:  # noqa: BLE001 - the error on its way out says what went wrong; this one is retried
            release_later(f"release of an imported chunk handle {handle!r}", _releaser(context, handle), [])


def _releaser(context: Context, handle: Any) -> Any:
    def release() -> None:
        with context.active():
            call("cuMemRelease", handle)
    return release


def _abort(conn: Connection, index: int, count: int, exc: BaseException) -> None:
    """Tell a receiver that has chunks [0, index) that no more will come, so it fails rather than waits."""
    try:
        conn.send({"kind": KIND_ABORT, "index": index,
                   "error": f"{type(exc).__name__}: {exc}"[:1000]}, (), _ABORT_TIMEOUT)
    except Exception:  # noqa: BLE001, S110 - the connection is broken too: the receiver sees that instead
        pass


def _context_for(uuid: bytes, ordinal: int) -> Context:
    """Return the primary context of the device with ``uuid`` (ordinals differ across processes)."""
    count = call("cuDeviceGetCount")
    for index in range(count):
        if bytes(call("cuDeviceGetUuid", call("cuDeviceGet", index)).bytes) == uuid:
            return Context.primary(index)
    raise ProtocolError(f"the sender's device (ordinal {ordinal} there, UUID {uuid.hex()}) is not visible "
                        f"in this process (check CUDA_VISIBLE_DEVICES)")
