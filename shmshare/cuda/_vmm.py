"""Device address ranges backed chunk by chunk with the driver's virtual-memory API.

Note [Device chunks]
~~~~~~~~~~~~~~~~~~~~
``cuMemUnmap`` can only unmap whole mappings: a range mapped from one
``cuMemCreate`` allocation cannot be given back in part. The allocator core
maps and unmaps page-aligned ranges in its own page size (2 MiB for small
pools, ``large_segment_size`` for large ones), and a provider cannot tell
which page size a reservation uses. So a :class:`VirtualRange` backs every
mapped range with one physical allocation per *chunk* of the allocation
granularity (2 MiB on current GPUs): any range the core unmaps is a whole
number of chunks. The cost is one ``cuMemCreate``/``cuMemMap`` pair per
chunk (10 for a 20 MiB page); access is set once per mapped range.

A chunk made shareable (``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``) can be
exported as a fd (``cuMemExportToShareableHandle``) and imported in another
process; see Note [Device memory over fds] in ``_ipc.py``.
"""

from __future__ import annotations

from typing import Any

from ._context import Context
from ._driver import call, driver

__all__ = ["VirtualRange", "allocation_granularity", "posix_fd_handle_type"]



def allocation_granularity(context: Context, shareable: bool, small_page: int = 2 << 20) -> int:
    """Return the chunk size for ``cuMemCreate`` on the context's device.

    The driver's RECOMMENDED granularity (the size it maps best) when it
    divides ``small_page`` (the allocator core's page for small pools), else
    the MINIMUM one, which the driver requires every size to be a multiple of.
    """
    drv = driver()
    flags = drv.CUmemAllocationGranularity_flags
    prop = _allocation_prop(context.device, shareable)
    recommended = int(call("cuMemGetAllocationGranularity", prop, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
    minimum = int(call("cuMemGetAllocationGranularity", prop, flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    if recommended > 0 and recommended % minimum == 0 and small_page % recommended == 0:
        return recommended
    return minimum


class VirtualRange:
    """Own a reserved device address range and the chunks mapped into it (Note [Device chunks]).

    Parameters
    ----------
    context : Context
        The device's primary context.
    nbytes : int
        Bytes of address space; a positive multiple of ``chunk_size``.
    chunk_size : int
        Bytes per physical allocation: the allocation granularity.
    shareable : bool
        Make chunks exportable as POSIX fds.
    """

    def __init__(self, context: Context, nbytes: int, chunk_size: int, *, shareable: bool) -> None:
        if chunk_size <= 0 or nbytes <= 0 or nbytes % chunk_size:
            raise ValueError(f"a virtual range of {nbytes} bytes is not a positive multiple of the "
                             f"{chunk_size}-byte chunk size")
        self.context = context
        self.size = nbytes  # bytes of address space
        self.chunk_size = chunk_size
        self.shareable = shareable
        self.chunks: dict[int, Any] = {}  # offset -> CUmemGenericAllocationHandle mapped there
        self.unreleased: list[Any] = []  # handles unmapped whose cuMemRelease failed: retried at close()
        with context.active():
            self.address = int(call("cuMemAddressReserve", nbytes, chunk_size, 0, 0))  # first byte
        self._released = False

    # --- mapping --------------------------------------------------------------------------

    def map(self, offset: int, nbytes: int) -> None:
        """Back ``[offset, offset + nbytes)`` with new chunks; all or nothing."""
        self._check_range(offset, nbytes, "map")
        if any(o in self.chunks for o in range(offset, offset + nbytes, self.chunk_size)):
            raise ValueError(f"map of [{offset:#x}, +{nbytes:#x}) overlaps chunks already mapped")
        prop = _allocation_prop(self.context.device, self.shareable)
        done: list[int] = []
        with self.context.active():
            try:
                for chunk in range(offset, offset + nbytes, self.chunk_size):
                    handle = call("cuMemCreate", self.chunk_size, prop, 0)
                    try:
                        call("cuMemMap", self.address + chunk, self.chunk_size, 0, handle, 0)
                    except BaseException:
                        call("cuMemRelease", handle)
                        raise
                    self.chunks[chunk] = handle
                    done.append(chunk)
                self._set_access(offset, nbytes)
            except BaseException as exc:
                self._undo(done, exc)  # all or nothing: the core relies on it after an OOM
                raise

    def map_imported(self, offset: int, handles: list[Any]) -> None:
        """Map chunks imported from another process at ``offset``, in order; all or nothing.

        Takes ownership of every handle: on failure each is released, mapped or not.
        """
        nbytes = len(handles) * self.chunk_size
        done: list[int] = []
        try:
            self._check_range(offset, nbytes, "map_imported")
            with self.context.active():
                for i, handle in enumerate(handles):
                    chunk = offset + i * self.chunk_size
                    call("cuMemMap", self.address + chunk, self.chunk_size, 0, handle, 0)
                    self.chunks[chunk] = handle
                    done.append(chunk)
                self._set_access(offset, nbytes)
        except BaseException as exc:
            with self.context.active():
                self._undo(done, exc)
                for handle in handles[len(done):]:
                    try:
                        call("cuMemRelease", handle)
                    except Exception as cleanup:  # noqa: BLE001 - kept for close(), noted on the first error
                        self.unreleased.append(handle)
                        exc.add_note(f"releasing an imported chunk failed too: {cleanup}")
            raise

    def unmap(self, offset: int, nbytes: int) -> None:
        """Unmap and release the chunks of ``[offset, offset + nbytes)``.

        The caller waited for the work that used them: ``cuMemUnmap`` does
        not (seed notes, "cudaFree的同步").
        """
        self._check_range(offset, nbytes, "unmap")
        missing = [o for o in range(offset, offset + nbytes, self.chunk_size) if o not in self.chunks]
        if missing:
            raise ValueError(f"unmap of [{offset:#x}, +{nbytes:#x}): chunk at {missing[0]:#x} is not mapped")
        with self.context.active():
            for chunk in range(offset, offset + nbytes, self.chunk_size):
                self._unmap_chunk(chunk)

    def release(self) -> None:
        """Give the address range back; every chunk must be unmapped. Idempotent."""
        if self._released:
            return
        if self.chunks:
            raise ValueError(f"release of a virtual range with {len(self.chunks)} chunks still mapped")
        with self.context.active():
            self._release_unreleased()
            call("cuMemAddressFree", self.address, self.size)
        self._released = True

    def close(self) -> None:
        """Unmap every chunk and release the range (the caller synchronized). Idempotent.

        A chunk whose unmap fails stays in ``chunks`` (still mapped: the
        range is not freed under it) and the first error is raised after
        every other chunk was tried; calling ``close()`` again retries.
        """
        if self._released:
            return
        error: BaseException | None = None
        with self.context.active():
            for chunk in sorted(self.chunks):
                try:
                    self._unmap_chunk(chunk)
                except Exception as exc:  # noqa: BLE001 - raised below, once every chunk was tried
                    error = error or exc
        if error is not None:
            raise error
        self.release()

    # --- export ---------------------------------------------------------------------------------

    def export(self, offset: int, nbytes: int) -> tuple[int, list[int]]:
        """Return (offset of the first chunk, a new fd per chunk) covering ``[offset, offset + nbytes)``.

        The fds belong to the caller, who must close them.
        """
        if not self.shareable:
            raise ValueError("this range's chunks were not made shareable (use ipc=True)")
        if nbytes <= 0 or offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"export of [{offset:#x}, +{nbytes:#x}) lies outside a {self.size}-byte range")
        first = offset - offset % self.chunk_size
        stop = -(-(offset + nbytes) // self.chunk_size) * self.chunk_size
        kind = posix_fd_handle_type()
        fds: list[int] = []
        try:
            with self.context.active():
                for chunk in range(first, stop, self.chunk_size):
                    handle = self.chunks.get(chunk)
                    if handle is None:
                        raise ValueError(f"export: the chunk at offset {chunk:#x} is not mapped")
                    fds.append(int(call("cuMemExportToShareableHandle", handle, kind, 0)))
        except BaseException:
            _close_fds(fds)
            raise
        return first, fds

    def __repr__(self) -> str:
        mapped = len(self.chunks) * self.chunk_size
        return f"<VirtualRange 0x{self.address:x}+{self.size}, {mapped} bytes mapped>"

    # --- private ---------------------------------------------------------------------------------

    def _check_range(self, offset: int, nbytes: int, what: str) -> None:
        if self._released:
            raise ValueError(f"{what} on a released virtual range")
        step = self.chunk_size
        if offset < 0 or nbytes <= 0 or offset % step or nbytes % step or offset + nbytes > self.size:
            raise ValueError(f"{what} of [{offset:#x}, +{nbytes:#x}) is not whole {step}-byte chunks "
                             f"inside a {self.size}-byte range")

    def _set_access(self, offset: int, nbytes: int) -> None:
        call("cuMemSetAccess", self.address + offset, nbytes, [_access_desc(self.context.device)], 1)

    def _unmap_chunk(self, chunk: int) -> None:
        """Unmap and release one chunk (the context is current).

        It leaves the books only once ``cuMemUnmap`` succeeded: a failed
        unmap keeps it in ``chunks``, still mapped, for a retry. A failed
        release after a good unmap keeps the handle in ``unreleased``.
        """
        handle = self.chunks[chunk]
        call("cuMemUnmap", self.address + chunk, self.chunk_size)
        del self.chunks[chunk]
        try:
            call("cuMemRelease", handle)
        except BaseException:
            self.unreleased.append(handle)
            raise

    def _undo(self, done: list[int], exc: BaseException) -> None:
        """Unmap the chunks of a failed map (the context is current); note failures on ``exc``."""
        for chunk in done:
            try:
                self._unmap_chunk(chunk)
            except Exception as cleanup:  # noqa: BLE001 - the first error says what went wrong
                exc.add_note(f"undoing the map of the chunk at {chunk:#x} failed too: {cleanup}")

    def _release_unreleased(self) -> None:
        while self.unreleased:
            call("cuMemRelease", self.unreleased[-1])
            self.unreleased.pop()


def posix_fd_handle_type() -> Any:
    """Return ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` (cuda-python wants the enum, not 1)."""
    return driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _allocation_prop(device: int, shareable: bool) -> Any:
    drv = driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if shareable:
        prop.requestedHandleTypes = posix_fd_handle_type()
    return prop


def _access_desc(device: int) -> Any:
    drv = driver()
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def _close_fds(fds: list[int]) -> None:
    import os

    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
