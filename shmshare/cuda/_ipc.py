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
may exit right after sending. The receiver imports each fd
(``cuMemImportFromShareableHandle``), closes it, reserves an address range,
maps the chunks in order and sets access. The imported handles keep the
memory alive after the sender is gone, until the receiver unmaps.

The message is one header (up to 64 fds), then continuation messages for
more fds. The sender must not reuse the block until the receiver says it is
done; that ordering is the channel's lease protocol, not this module's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import ProtocolError
from ..wire import MAX_FDS, Connection, Fd
from ._array import DeviceArray
from ._context import Context
from ._device import CudaDeviceProvider
from ._driver import call
from ._vmm import VirtualRange, posix_fd_handle_type

__all__ = ["ImportedDeviceMemory", "recv_device_memory", "send_device_memory"]

KIND = "shmshare.cuda.memory"
KIND_MORE = "shmshare.cuda.memory.fds"
VERSION = 1


def send_device_memory(conn: Connection, provider: CudaDeviceProvider, address: Any, nbytes: int | None = None,
                       *, meta: dict[str, Any] | None = None, timeout: float | None = None) -> None:
    """Send ``[address, address + nbytes)`` of ``provider``'s device memory to the peer of ``conn``.

    Parameters
    ----------
    address : int or Block
        A block of an allocator over ``provider`` made with ``ipc=True``, or an address in one.
    nbytes : int, optional
        The block's size when None.
    meta : dict, optional
        msgpack-able values delivered with the memory (dtype, shape...).
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
    first, fds = vrange.export(offset, nbytes)
    owned = [Fd(fd) for fd in fds]
    try:
        header = {"kind": KIND, "version": VERSION, "device": provider.device,
                  "device_uuid": provider.context.uuid(), "chunk_size": vrange.chunk_size,
                  "nchunks": len(fds), "offset": offset - first, "nbytes": nbytes, "meta": meta or {}}
        for index in range(0, len(owned), MAX_FDS):
            message = header if index == 0 else {"kind": KIND_MORE, "index": index}
            conn.send(message, owned[index:index + MAX_FDS], timeout)
    finally:
        for fd in owned:
            fd.close()


def recv_device_memory(conn: Connection, *, timeout: float | None = None,
                       context: Context | None = None) -> ImportedDeviceMemory:
    """Receive device memory sent with :func:`send_device_memory`, imported and mapped here.

    Raises
    ------
    ProtocolError
        For a message that is not device memory, or whose fds do not match its header.
    """
    header, fds = conn.recv(timeout)
    try:
        nchunks = _check_header(header, len(fds))
        while len(fds) < nchunks:
            more, extra = conn.recv(timeout)
            fds += extra
            if not isinstance(more, dict) or more.get("kind") != KIND_MORE or len(fds) > nchunks:
                raise ProtocolError(f"expected {nchunks} chunk fds of device memory, got {len(fds)} and {more!r}")
        context = context or _context_for(header["device_uuid"], header["device"])
        return ImportedDeviceMemory(context, header, fds)
    finally:
        for fd in fds:
            fd.close()


class ImportedDeviceMemory:
    """Device memory imported from another process, mapped in this one.

    ``close()`` drops this object's hold; the memory is unmapped (after
    synchronizing the context) when the last :class:`DeviceArray` made by
    :meth:`array`, and every DLPack consumer of one, are gone too.

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

    def __init__(self, context: Context, header: dict[str, Any], fds: list[Fd]) -> None:
        chunk, count = header["chunk_size"], header["nchunks"]
        context.make_current()
        vrange = VirtualRange(context, chunk * count, chunk, shareable=False)
        handles: list[Any] = []
        try:
            kind = posix_fd_handle_type()
            for fd in fds:  # the driver dups what it needs: our fds are closed by the caller
                handles.append(call("cuMemImportFromShareableHandle", fd.fileno(), kind))
        except BaseException:
            for handle in handles:
                call("cuMemRelease", handle)
            vrange.release()
            raise
        try:
            vrange.map_imported(0, handles)  # owns every handle from here, mapped or not
        except BaseException:
            vrange.release()
            raise
        self._mapping: _Mapping | None = _Mapping(vrange)
        self.address = vrange.address + header["offset"]
        self.nbytes = header["nbytes"]
        self.device = context.device
        self.meta = header["meta"]

    def array(self, shape: Any = None, dtype: Any = np.uint8, *, stream: Any = None) -> DeviceArray:
        """Return a :class:`DeviceArray` over the memory (all of it as bytes by default)."""
        if self._mapping is None:
            raise ValueError("array() on closed ImportedDeviceMemory")
        dt = np.dtype(dtype)
        shape = (self.nbytes // dt.itemsize,) if shape is None else shape
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
    """Own the imported range; unmap it (after the context's work) when the last holder goes."""

    def __init__(self, vrange: VirtualRange) -> None:
        self.vrange: VirtualRange | None = vrange

    def __del__(self) -> None:
        vrange, self.vrange = self.vrange, None
        if vrange is None:
            return
        try:
            vrange.context.synchronize()  # kernels may still read it: cuMemUnmap does not wait
            vrange.close()
        except Exception:  # interpreter shutdown: the driver tears everything down anyway
            pass


def _check_header(header: Any, nfds: int) -> int:
    if not isinstance(header, dict) or header.get("kind") != KIND:
        raise ProtocolError(f"expected a {KIND!r} message, got {header!r}")
    if header.get("version") != VERSION:
        raise ProtocolError(f"device memory message version {header.get('version')!r}, expected {VERSION}")
    fields = {"device": int, "chunk_size": int, "nchunks": int, "offset": int, "nbytes": int,
              "device_uuid": bytes, "meta": dict}
    for name, kind in fields.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool):
            raise ProtocolError(f"device memory header field {name!r} is {header.get(name)!r}, not {kind.__name__}")
    chunk, count, offset, nbytes = header["chunk_size"], header["nchunks"], header["offset"], header["nbytes"]
    if chunk <= 0 or count <= 0 or offset < 0 or nbytes <= 0 or offset + nbytes > chunk * count:
        raise ProtocolError(f"device memory header does not add up: {count} chunks of {chunk} bytes, "
                            f"{nbytes} bytes at offset {offset}")
    if nfds != min(count, MAX_FDS):
        raise ProtocolError(f"device memory header announces {count} chunks but carries {nfds} fds")
    return count


def _context_for(uuid: bytes, ordinal: int) -> Context:
    """Return the primary context of the device with ``uuid`` (ordinals differ across processes)."""
    count = call("cuDeviceGetCount")
    for index in range(count):
        if bytes(call("cuDeviceGetUuid", call("cuDeviceGet", index)).bytes) == uuid:
            return Context.primary(index)
    raise ProtocolError(f"the sender's device (ordinal {ordinal} there, UUID {uuid.hex()}) is not visible "
                        f"in this process (check CUDA_VISIBLE_DEVICES)")
