"""Segments: PyTorch's MapAllocator, one object per mapping.

A :class:`Segment` goes through the four steps that MapAllocator walks
(``docs/architecture.md``, "The layers", Segment):

1. **open** -- get a fd: ``memfd_create`` (the default backend), ``shm_open``
   (``backend="posix"``), a file ``open`` (a path), or a fd handed in
   (``FROMFD``, dup'ed so the caller keeps its own);
2. **resize** -- ``fstat``; ``ftruncate`` only when creating and writable, then
   ``posix_fallocate`` so a full tmpfs or memory limit is an error *now*
   rather than a SIGBUS at first touch;
3. **map** -- ``mmap`` MAP_SHARED (or MAP_PRIVATE, copy-on-write, for a file
   without SHARED), PROT_READ for READONLY, plus a madvise hint;
4. **finalize** -- seal the memfd, ``KEEPFD`` keeps the fd (else it is closed:
   the mapping alone keeps the pages). ``UNLINK`` removes the name right
   after open, before resize (Note [Unlink at once]).

An *expandable* segment (:meth:`Segment.reserve`, or :meth:`Segment.from_fd`
with ``reserve=True`` on the receiving side) is one memfd behind a reserved
address range whose pieces are mapped and unmapped later with
:meth:`Segment.map_range` and :meth:`Segment.unmap_range`. Either way the
``Segment`` is the only owner of the fd and of the mapping.

Note [Mapping lifetime]
    The mapping is owned by a root :class:`shmshare._native.Lease`; every view
    (``buffer``, ``view()``, numpy arrays made from them) holds that lease.
    ``close()`` closes the fd and drops the name *now*, and the pages are
    unmapped when the last view dies -- never under a live array. So closing
    a segment can never turn a reader's array into a SIGSEGV.

Note [Seals]
    A memfd is created ``MFD_ALLOW_SEALING`` and sealed ``F_SEAL_SHRINK``
    (plus ``F_SEAL_GROW`` unless created growable) before its fd can leave
    the process, so no peer can truncate it under a reader's mapping (which
    would SIGBUS the reader). ``Flags.SEAL`` adds ``F_SEAL_SEAL``: the seal
    set is final. POSIX shm objects cannot be sealed; that is one reason
    memfd is the default.

Note [Unlink at once]
    With ``UNLINK`` a POSIX name is removed right after ``shm_open``
    succeeds, before ``ftruncate``, ``posix_fallocate`` and ``mmap``: the fd
    keeps the object alive, and a SIGKILL can leave ``/dev/shm/shmshare_*``
    behind only between two system calls, not across a slow fallocate of
    gigabytes. Names left anyway (a crash in that window, or segments made
    without UNLINK whose creator died) are removed by :func:`sweep`
    (``shmshare sweep``; Note [Stale shm names] in ``_shmdir``).

Note [Segments in a forked child]
    A forked child inherits every fd and mapping. It must not send or reuse
    the parent's segments, and closing an inherited fd is right (the child
    has its own copy of the fd table), but unmapping is not always: arrays
    the child inherited may still point into the pages. So
    ``_forget_after_fork`` closes the fd and gives up the name (only the
    creating pid unlinks) and keeps the mapping; the caller decides which
    mappings nothing of the child uses and closes those. This is the one
    place that knows what a forked child may do with a segment; the pool's
    provider (``ShmProvider.after_fork_in_child``) applies it to its records.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import os
import secrets
from typing import Any

import numpy as np

from . import _native
from . import _segcalls as _sc
from ._errors import FD_EXHAUSTED, SegmentError
from ._fd import Fd
from ._lifetime import Closeable
from ._shmdir import SHM_DIR as _SHM_DIR
from ._shmdir import shm_free_bytes, space_hint, sweep

__all__ = ["Flags", "Segment", "DEFAULT_FLAGS", "shm_free_bytes", "sweep"]

_HUGE_HINT_BYTES = 2 << 20  # madvise(MADV_HUGEPAGE) from this size on
_NAME_ATTEMPTS = 16  # fresh random names tried before O_EXCL collisions are an error


class Flags(enum.IntFlag):
    """MapAllocator flags, with PyTorch's values, plus three of shmshare's own."""

    SHARED = 1  # a file path, mapped MAP_SHARED
    SHAREDMEM = 2  # shared memory (memfd or shm_open), not a file
    EXCLUSIVE = 4  # O_EXCL: never open someone else's object by accident
    NOCREATE = 8  # open an existing object; never create
    KEEPFD = 16  # keep the fd after mapping (to send it to another process)
    FROMFD = 32  # map a fd handed in by the caller
    UNLINK = 64  # remove the name right after mapping
    READONLY = 1 << 8  # O_RDONLY and PROT_READ
    SEAL = 1 << 9  # memfd: also F_SEAL_SEAL, the seal set is final
    POPULATE = 1 << 10  # MAP_POPULATE: fault every page in at map time


DEFAULT_FLAGS = Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.KEEPFD | Flags.UNLINK
# Plain-int copies for the map path: IntFlag arithmetic costs ~1 us an operation.
_SHARED, _SHAREDMEM, _NOCREATE, _KEEPFD, _FROMFD, _UNLINK, _READONLY, _POPULATE = map(int, (
    Flags.SHARED, Flags.SHAREDMEM, Flags.NOCREATE, Flags.KEEPFD, Flags.FROMFD, Flags.UNLINK,
    Flags.READONLY, Flags.POPULATE))
_BACKENDS = ("memfd", "posix")


class Segment(Closeable):
    """A shared-memory (or file) mapping: the MapAllocator of one allocation.

    Build one with :meth:`create` (new shared memory), :meth:`open` (an
    existing POSIX shm name or a file path) or :meth:`from_fd` (a fd received
    from another process). ``close()`` is idempotent; a segment is also a
    context manager.

    Attributes
    ----------
    fd : int or None
        The fd kept with ``KEEPFD`` (owned by the segment), else None.
    size : int
        Mapped bytes.
    name : str or None
        The shm name, file path or memfd name; None when unknown.
    flags : Flags
        The flags the segment was made with.
    backend : str
        ``"memfd"``, ``"posix"`` or ``"file"``.
    address : int
        First mapped byte (first reserved byte, for an expandable segment).
    """

    fd: int | None
    size: int
    name: str | None
    flags: Flags
    backend: str
    address: int
    _root: _native.Lease | None  # owns the mapping (Note [Mapping lifetime])
    _owns_name: bool  # close() unlinks the name (created here, not yet unlinked)
    _pid: int  # the creating process: only it unlinks (a forked child's close() must not)
    _grows: bool | None  # None: mapped whole; True: reserve()d here; False: a peer's, reserved

    def __init__(self) -> None:
        raise TypeError("use Segment.create(), Segment.open() or Segment.from_fd()")

    # -- construction -------------------------------------------------------

    @classmethod
    def create(
        cls,
        nbytes: int,
        flags: Flags = DEFAULT_FLAGS,
        backend: str = "memfd",
        *,
        growable: bool = False,
        name: str | None = None,
    ) -> Segment:
        """Create new shared memory of `nbytes` and map it.

        Parameters
        ----------
        nbytes : int
            Size in bytes, > 0.
        flags : Flags
            Must include SHAREDMEM; NOCREATE and FROMFD belong to
            :meth:`open` and :meth:`from_fd`.
        backend : {"memfd", "posix"}
            ``memfd`` is nameless from birth and sealable; ``posix`` uses
            ``shm_open`` under ``/dev/shm`` with a name
            ``/shmshare_<pid>_<random>`` (retried on collision).
        growable : bool
            memfd only: leave ``F_SEAL_GROW`` off so the pool can grow it.
        name : str, optional
            posix only: use this name instead of a random one.
        """
        nbytes = _sc.check_nbytes(nbytes)
        flags = Flags(flags)
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if flags & (Flags.NOCREATE | Flags.FROMFD):
            raise ValueError("Segment.create() makes new memory; use Segment.open() for NOCREATE "
                             "and Segment.from_fd() for FROMFD")
        if not flags & Flags.SHAREDMEM:
            raise ValueError("Segment.create() needs Flags.SHAREDMEM; map a file with "
                             "Segment.open(path, nbytes, Flags.SHARED)")
        if flags & Flags.READONLY:
            raise ValueError("a read-only segment cannot be created (nothing could write it); "
                             "create it writable and open or receive it with Flags.READONLY")
        if backend == "memfd":
            if name is not None:
                raise ValueError("memfd segments have no name to choose; use backend='posix'")
            return cls._create_memfd(nbytes, flags, growable)
        if growable:
            raise ValueError("growable=True needs backend='memfd' (POSIX shm cannot be sealed)")
        return cls._create_posix(nbytes, flags, name)

    @classmethod
    def open(cls, name: str | os.PathLike[str], nbytes: int | None = None,
             flags: Flags = Flags.SHAREDMEM | Flags.NOCREATE) -> Segment:
        """Open a POSIX shm object by name (SHAREDMEM) or a file by path, and map it.

        With SHAREDMEM, `name` is a shm name (``/shmshare_1_ab``). Otherwise
        it is a path, mapped MAP_SHARED with ``Flags.SHARED`` and MAP_PRIVATE
        (copy-on-write) without. Without NOCREATE the object is created if
        missing (O_EXCL with EXCLUSIVE) and grown to `nbytes` when writable.
        `nbytes` None maps the whole object.
        """
        flags = Flags(flags)
        if flags & Flags.FROMFD:
            raise ValueError("Flags.FROMFD goes with Segment.from_fd(), not open()")
        if nbytes is not None:
            nbytes = _sc.check_nbytes(nbytes)
        oflag = os.O_RDONLY if flags & Flags.READONLY else os.O_RDWR
        if not flags & Flags.NOCREATE and nbytes is None and flags & Flags.SHAREDMEM:
            raise ValueError("opening shared memory without Flags.NOCREATE may create it: pass "
                             "nbytes, or add Flags.NOCREATE to open an existing object")
        if not flags & Flags.NOCREATE:
            oflag |= os.O_CREAT | (os.O_EXCL if flags & Flags.EXCLUSIVE else 0)
        if flags & Flags.SHAREDMEM:
            shm_name = _sc.shm_name(os.fspath(name))
            fd = _sc.shm_open(shm_name, oflag)
            return cls._finish(fd, nbytes, flags, "posix", shm_name, may_resize=True)
        path = os.fspath(name)
        try:
            fd = os.open(path, oflag | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in FD_EXHAUSTED:
                raise _sc.fd_error(f"open({path!r})", exc) from exc
            raise SegmentError(exc.errno, f"open({path!r}) failed: {exc.strerror}") from exc
        return cls._finish(fd, nbytes, flags, "file", path, may_resize=True)

    @classmethod
    def from_fd(cls, fd: Fd | int | Any, nbytes: int | None = None,
                flags: Flags = Flags.FROMFD | Flags.KEEPFD, *, reserve: bool = False) -> Segment:
        """Map a fd received from another process.

        Ownership depends on what `fd` is:

        - a :class:`shmshare.wire.Fd` (what ``Connection.recv`` returns) is
          *taken* (``fd.take()``): no dup, the segment owns the number from
          now on and the ``Fd`` is left empty. Without ``KEEPFD`` the fd is
          closed right after mapping, so a receiver holds no fd per classic
          segment; on any error it is closed too, never leaked.
        - an int, or another object with ``fileno()``, is dup'ed: the caller
          keeps its own and still has to close it.

        `nbytes` None maps the whole object; a larger `nbytes` than the
        object is refused (touching past its end would raise SIGBUS).

        With `reserve` the fd is a peer's expandable segment: `nbytes` of
        address space are reserved and nothing is mapped yet; map the pieces
        the peer announces with :meth:`map_range`. The fd is then kept
        (``KEEPFD`` is implied): later pieces are mapped from it.
        """
        if nbytes is not None:
            nbytes = _sc.check_nbytes(nbytes)
        if isinstance(fd, Fd):
            own = given = fd.take()  # ValueError if it was taken or closed already
        else:
            given = fd.fileno() if hasattr(fd, "fileno") else fd
            if isinstance(given, bool) or not isinstance(given, int) or given < 0:
                raise ValueError(f"fd must be a non-negative int or have fileno(), got {fd!r}")
            try:
                own = os.dup(given)
            except OSError as exc:
                raise _sc.fd_error(f"dup({given})", exc) from exc
        try:
            st = os.fstat(own)
            backend, name = _sc.describe_fd(own, st, given)
        except BaseException:
            os.close(own)
            raise
        if reserve:
            if nbytes is None:
                os.close(own)
                raise ValueError("from_fd(reserve=True) needs nbytes: the size of the range to "
                                 "reserve")
            return cls._reserved(own, nbytes, Flags(int(flags) | _FROMFD | _KEEPFD), backend, name,
                                 grows=False)
        return cls._finish(own, nbytes, Flags(int(flags) | _FROMFD), backend, name,
                           may_resize=False, current=st.st_size)

    @classmethod
    def reserve(cls, nbytes: int, flags: Flags = DEFAULT_FLAGS) -> Segment:
        """Reserve `nbytes` of address space over a fresh, empty memfd: an expandable segment.

        The memfd is 0 bytes and sealed ``F_SEAL_SHRINK`` only (it may grow,
        never shrink under a reader; Note [Seals]); nothing is mapped and no
        page is reserved until :meth:`map_range`. The fd is kept (it is what
        peers receive); `flags` must include SHAREDMEM and KEEPFD.
        """
        nbytes = _sc.check_nbytes(nbytes)
        flags = Flags(flags)
        if not flags & Flags.SHAREDMEM or not flags & Flags.KEEPFD:
            raise ValueError("Segment.reserve() needs Flags.SHAREDMEM and Flags.KEEPFD: later "
                             "ranges are mapped from the kept fd")
        if flags & (Flags.NOCREATE | Flags.FROMFD | Flags.READONLY):
            raise ValueError("Segment.reserve() makes new, writable memory; receive a peer's "
                             "with Segment.from_fd(fd, nbytes, reserve=True)")
        name = f"shmshare_{os.getpid()}_{secrets.token_hex(4)}"
        fd = _sc.memfd_create(name)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK |
                        (fcntl.F_SEAL_SEAL if flags & Flags.SEAL else 0))
        except BaseException:
            os.close(fd)
            raise
        return cls._reserved(fd, nbytes, flags, "memfd", name, grows=True)

    # -- expandable segments ------------------------------------------------

    @property
    def expandable(self) -> bool:
        """Whether this segment is a reserved range mapped piece by piece (:meth:`reserve`)."""
        return self._grows is not None

    def map_range(self, offset: int, nbytes: int) -> None:
        """Map ``[offset, offset + nbytes)`` of the fd at ``address + offset``.

        On a segment from :meth:`reserve`: grow the memfd if needed, check
        the memory cgroup (Note [Checking memory before reserving] in ``_segcalls``),
        ``posix_fallocate`` the pages, then map them; all or nothing (pages
        fallocate got are punched out again on failure). A full memory is a
        :class:`SegmentError` with ``errno`` ENOSPC/ENOMEM. On a receiver's
        segment (``from_fd(..., reserve=True)``) the peer has grown the fd:
        it must already cover the range, and is mapped read-only with
        ``READONLY``. `offset` and `nbytes` are page multiples.
        """
        fd = self._range_fd("map_range", offset, nbytes)
        end = offset + nbytes
        if not self._grows:
            size = os.fstat(fd).st_size
            if size < end:
                raise SegmentError(errno.EINVAL, f"{self._what()} is {size} bytes; mapping "
                                   f"[{offset}, {end}) past its end would SIGBUS on touch")
            _native.map_fd(self.address + offset, nbytes, fd, offset,
                           writable=not int(self.flags) & _READONLY)
            return
        try:
            if os.fstat(fd).st_size < end:
                _sc.ftruncate(fd, end, self._what())
            self._reserve_pages(offset, nbytes)
            _native.map_fd(self.address + offset, nbytes, fd, offset)
        except BaseException:
            try:  # all or nothing: give back whatever fallocate got
                _native.punch_hole(fd, offset, nbytes)
            except OSError:
                pass  # nothing was allocated there (or the fd is unusable): the error below matters
            raise

    def unmap_range(self, offset: int, nbytes: int, punch: bool = False) -> None:
        """Unmap ``[offset, offset + nbytes)``; the addresses stay reserved.

        With `punch` the pages are also punched out of the memfd, so their
        memory goes back to the host -- only when no peer may still read them
        (a peer's mapping of a punched range reads zeros).
        """
        fd = self._range_fd("unmap_range", offset, nbytes)
        _native.unmap(self.address + offset, nbytes)
        if punch:
            _native.punch_hole(fd, offset, nbytes)

    # -- views --------------------------------------------------------------

    @property
    def buffer(self) -> memoryview:
        """Return a memoryview of the whole mapping (keeps the pages mapped while it lives)."""
        return memoryview(self._live_root())

    def view(self, dtype: Any, shape: Any, offset: int = 0) -> np.ndarray:
        """Return a numpy array of `dtype` and `shape` over the mapping, starting at `offset`.

        The array keeps the pages mapped, even after ``close()``.
        """
        root = self._live_root()
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        need = dt.itemsize * int(np.prod(shp, dtype=np.int64))
        if offset < 0 or offset + need > self.size:
            raise ValueError(f"view of {need} bytes at offset {offset} does not fit in a "
                             f"{self.size}-byte segment")
        return np.ndarray(shp, dtype=dt, buffer=root, offset=offset)  # type: ignore[arg-type]  # numpy types Buffer from 3.12

    @property
    def lease(self) -> _native.Lease:
        """Return the root Lease over the whole mapping.

        Views made from it (or Leases owning it) keep the pages mapped after
        ``close()``; the mapping goes when the last of them does.
        """
        return self._live_root()

    @property
    def seals(self) -> int:
        """Return the memfd's F_GET_SEALS bits (0 for other backends)."""
        if self.backend != "memfd" or self.fd is None:
            return 0
        return fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._root is None

    def fileno(self) -> int:
        """Return the kept fd (``KEEPFD``), for sending; the segment still owns it."""
        if self.fd is None:
            raise ValueError("this segment keeps no fd; create it with Flags.KEEPFD to share it")
        return self.fd

    # -- lifetime -----------------------------------------------------------

    def unlink(self) -> None:
        """Remove the segment's name now (what ``UNLINK`` does at map time). Idempotent.

        The pages live on while any fd or mapping of them does, in any
        process; no process can open them by name any more.
        """
        self._owns_name = False
        _sc.unlink(self.backend, self.name)

    def close(self) -> None:
        """Close the fd and drop the name now; unmap when the last view dies. Idempotent."""
        fd, self.fd = getattr(self, "fd", None), None  # forget first: no double close
        root, self._root = getattr(self, "_root", None), None
        owns_name, self._owns_name = getattr(self, "_owns_name", False), False
        try:
            if owns_name and getattr(self, "_pid", None) == os.getpid():
                # a forked child dropping its copy must not remove its parent's name
                _sc.unlink(self.backend, self.name)
        finally:
            if fd is not None:
                os.close(fd)
            del root  # unmaps now unless a view still holds the mapping

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited fd and give up the name; keep the mapping.

        Note [Segments in a forked child]. ``close()`` afterwards unmaps
        (once no view holds the mapping) and touches no fd or name.
        """
        fd, self.fd = self.fd, None  # forget first: close() must not close the number again
        self._owns_name = False
        if fd is not None:
            os.close(fd)

    def __reduce__(self) -> Any:
        raise TypeError("a Segment cannot be pickled; send segment.fd over a shmshare.wire "
                        "Connection and map it with Segment.from_fd()")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"address=0x{self.address:x}"
        return (f"<Segment {self.backend} {self.name!r} size={self.size} fd={self.fd} "
                f"flags={self.flags!r} {state}>")

    # -- internals ----------------------------------------------------------

    @classmethod
    def _create_memfd(cls, nbytes: int, flags: Flags, growable: bool) -> Segment:
        memfd_name = f"shmshare_{os.getpid()}_{secrets.token_hex(4)}"
        fd = _sc.memfd_create(memfd_name)
        return cls._finish(fd, nbytes, flags, "memfd", memfd_name, may_resize=True,
                           seal=_sc.memfd_seals(bool(flags & Flags.SEAL), growable), current=0)

    @classmethod
    def _create_posix(cls, nbytes: int, flags: Flags, name: str | None) -> Segment:
        oflag = os.O_RDWR | os.O_CREAT | (os.O_EXCL if flags & Flags.EXCLUSIVE else 0)
        for _ in range(_NAME_ATTEMPTS):
            shm_name = _sc.shm_name(name) if name else f"/shmshare_{os.getpid()}_{secrets.token_hex(6)}"
            try:
                fd = _sc.shm_open(shm_name, oflag)
            except SegmentError as exc:
                if exc.errno == errno.EEXIST and name is None:
                    continue  # someone holds this random name: draw another
                raise
            return cls._finish(fd, nbytes, flags, "posix", shm_name, may_resize=True, created=True)
        raise SegmentError(errno.EEXIST, f"shm_open: {_NAME_ATTEMPTS} random names under "
                           f"{_SHM_DIR} were all taken; remove stale ones with `shmshare sweep`")

    @classmethod
    def _blank(cls, fd: int, flags: Flags, backend: str, name: str | None,
               created: bool) -> Segment:
        self = object.__new__(cls)
        self.fd, self._root, self._owns_name, self._pid = fd, None, created, os.getpid()
        self.size, self.name, self.flags, self.backend, self.address = 0, name, flags, backend, 0
        self._grows = None
        return self

    @classmethod
    def _finish(cls, fd: int, nbytes: int | None, flags: Flags, backend: str, name: str | None,
                *, may_resize: bool, created: bool = False, seal: int = 0,
                current: int = -1) -> Segment:
        """Run unlink -> resize -> map -> finalize over an owned `fd`; close it (and unlink) on failure.

        `current` is the object's size when the caller already knows it (-1: fstat here).
        """
        self = cls._blank(fd, flags, backend, name, created)
        try:
            if int(flags) & _UNLINK and backend != "memfd":
                self._owns_name = False  # Note [Unlink at once]: before the slow steps
                _sc.unlink(backend, name)
            self._resize_and_map(nbytes, may_resize, seal, current)
        except BaseException:
            self.close()  # closes the fd, unmaps, unlinks a name we created
            raise
        return self

    @classmethod
    def _reserved(cls, fd: int, nbytes: int, flags: Flags, backend: str, name: str | None,
                  *, grows: bool) -> Segment:
        """Reserve `nbytes` of address space for the owned `fd`; map nothing yet."""
        self = cls._blank(fd, flags, backend, name, False)
        self._grows = grows
        try:
            address = _native.reserve(nbytes)
            # the root Lease owns the whole range: munmap of it drops mapped pieces and reservation
            self._root = _native.Lease(None, address, nbytes, readonly=bool(int(flags) & _READONLY),
                                       unmap=True)
        except BaseException:
            self.close()
            raise
        self.address, self.size = address, nbytes
        return self

    def _resize_and_map(self, nbytes: int | None, may_resize: bool, seal: int, current: int) -> None:
        fd, f = self.fd, int(self.flags)
        assert fd is not None
        writable = not f & _READONLY
        if current < 0:
            current = os.fstat(fd).st_size
        size = current if nbytes is None else nbytes
        if size <= 0:
            raise SegmentError(errno.EINVAL, f"{self._what()} is empty; pass nbytes to create it")
        if current < size:
            if not (may_resize and writable and not f & _NOCREATE):
                raise SegmentError(errno.EINVAL, f"{self._what()} is {current} bytes, "
                                   f"{size} were asked: mapping past its end would SIGBUS on touch")
            _sc.ftruncate(fd, size, self._what())
            if f & (_SHAREDMEM | _SHARED):
                self._reserve_pages(0, size)
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seal)
        shared = bool(f & (_SHAREDMEM | _SHARED)) or self.backend in _BACKENDS
        address = _native.mmap(size, fd, 0, writable=writable, shared=shared,
                               populate=bool(f & _POPULATE))
        self._root = _native.Lease(None, address, size, readonly=not writable, unmap=True)
        self.address, self.size = address, size
        if shared and size >= _HUGE_HINT_BYTES and self.backend != "file":
            try:  # a hint: ignored where shmem THP is off
                _native.madvise(address, size - size % _native.PAGE_SIZE, _native.MADV_HUGEPAGE)
            except OSError:
                pass  # EINVAL where shmem THP is compiled out: the mapping works without it
        if not f & _KEEPFD:
            self.fd = None
            os.close(fd)

    def _reserve_pages(self, offset: int, nbytes: int) -> None:
        """posix_fallocate the pages now, so running out is an error here, not SIGBUS later.

        Shared memory is checked against the memory cgroup first (Note
        [Checking memory before reserving] in ``_segcalls``); a file on disk is not charged
        to it as shared memory is, so it is not.
        """
        assert self.fd is not None
        if self.backend != "file":
            _sc.check_cgroup(nbytes, self.backend)
            _sc.check_host(nbytes, self.backend)
        try:
            os.posix_fallocate(self.fd, offset, nbytes)  # EINTR is retried by Python (PEP 475)
        except OSError as exc:
            raise SegmentError(exc.errno, f"cannot reserve {nbytes} bytes for a {self.backend} "
                               f"segment: posix_fallocate: {exc.strerror}. "
                               f"{space_hint(self.backend, nbytes, exc.errno or 0)}") from exc

    def _range_fd(self, what: str, offset: int, nbytes: int) -> int:
        """Check a range call on an expandable segment; return its fd."""
        if self._grows is None:
            raise ValueError(f"{what}() is for expandable segments (Segment.reserve(), or "
                             "from_fd(..., reserve=True)); this one is mapped whole")
        if self.fd is None or self._root is None:
            raise ValueError(f"segment {self.name!r} is closed")
        page = _native.PAGE_SIZE
        if offset < 0 or nbytes <= 0 or offset % page or nbytes % page or offset + nbytes > self.size:
            raise ValueError(f"{what}: [{offset}, +{nbytes}) must be whole pages inside the "
                             f"{self.size}-byte reservation")
        return self.fd

    def _live_root(self) -> _native.Lease:
        if self._root is None:
            raise ValueError(f"segment {self.name!r} is closed")
        return self._root

    def _what(self) -> str:
        return f"{self.backend} object {self.name!r}"
