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
   the mapping alone keeps the pages), ``UNLINK`` removes the name at once.

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
"""

from __future__ import annotations

import enum
import errno
import fcntl
import os
import secrets
import stat
from typing import Any

import numpy as np

from . import _native
from ._errors import SegmentError
from ._lifetime import Closeable

__all__ = ["Flags", "Segment", "DEFAULT_FLAGS", "shm_free_bytes"]

_HUGE_HINT_BYTES = 2 << 20  # madvise(MADV_HUGEPAGE) from this size on
_NAME_ATTEMPTS = 16  # fresh random names tried before O_EXCL collisions are an error
_SHM_DIR = "/dev/shm"


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
        First mapped byte.
    """

    fd: int | None
    size: int
    name: str | None
    flags: Flags
    backend: str
    address: int

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
        nbytes = _check_nbytes(nbytes)
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
            nbytes = _check_nbytes(nbytes)
        oflag = os.O_RDONLY if flags & Flags.READONLY else os.O_RDWR
        if not flags & Flags.NOCREATE and nbytes is None and flags & Flags.SHAREDMEM:
            raise ValueError("opening shared memory without Flags.NOCREATE may create it: pass "
                             "nbytes, or add Flags.NOCREATE to open an existing object")
        if not flags & Flags.NOCREATE:
            oflag |= os.O_CREAT | (os.O_EXCL if flags & Flags.EXCLUSIVE else 0)
        if flags & Flags.SHAREDMEM:
            shm_name = _shm_name(os.fspath(name))
            fd = _shm_open(shm_name, oflag)
            return cls._finish(fd, nbytes, flags, "posix", shm_name, may_resize=True)
        path = os.fspath(name)
        try:
            fd = os.open(path, oflag | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SegmentError(exc.errno, f"open({path!r}) failed: {exc.strerror}") from exc
        return cls._finish(fd, nbytes, flags, "file", path, may_resize=True)

    @classmethod
    def from_fd(cls, fd: Any, nbytes: int | None = None,
                flags: Flags = Flags.FROMFD | Flags.KEEPFD) -> Segment:
        """Map a fd received from another process (it is dup'ed; the caller keeps its own).

        `fd` is an int or anything with ``fileno()``. `nbytes` None maps the
        whole object; a larger `nbytes` than the object is refused (touching
        past its end would raise SIGBUS).
        """
        flags = Flags(int(flags) | _FROMFD)
        if nbytes is not None:
            nbytes = _check_nbytes(nbytes)
        raw = fd.fileno() if hasattr(fd, "fileno") else fd
        if not isinstance(raw, int) or raw < 0:
            raise ValueError(f"fd must be a non-negative int or have fileno(), got {fd!r}")
        try:
            own = os.dup(raw)
        except OSError as exc:
            raise SegmentError(exc.errno, f"dup({raw}) failed: {exc.strerror}") from exc
        backend, name = _describe_fd(own, raw)
        return cls._finish(own, nbytes, flags, backend, name, may_resize=False)

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
        return np.ndarray(shp, dtype=dt, buffer=root, offset=offset)  # type: ignore[call-overload]

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
        _unlink(self.backend, self.name)

    def close(self) -> None:
        """Close the fd and drop the name now; unmap when the last view dies. Idempotent."""
        fd, self.fd = getattr(self, "fd", None), None  # forget first: no double close
        root, self._root = getattr(self, "_root", None), None
        owns_name, self._owns_name = getattr(self, "_owns_name", False), False
        try:
            if owns_name and getattr(self, "_pid", None) == os.getpid():
                # a forked child dropping its copy must not remove its parent's name
                _unlink(self.backend, self.name)
        finally:
            if fd is not None:
                os.close(fd)
            del root  # unmaps now unless a view still holds the mapping


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
        try:
            fd = os.memfd_create(memfd_name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise SegmentError(exc.errno, f"memfd_create failed: {exc.strerror}; "
                               "use backend='posix' on kernels without memfd") from exc
        return cls._finish(fd, nbytes, flags, "memfd", memfd_name, may_resize=True,
                           seal=_memfd_seals(flags, growable))

    @classmethod
    def _create_posix(cls, nbytes: int, flags: Flags, name: str | None) -> Segment:
        oflag = os.O_RDWR | os.O_CREAT | (os.O_EXCL if flags & Flags.EXCLUSIVE else 0)
        for _ in range(_NAME_ATTEMPTS):
            shm_name = _shm_name(name) if name else f"/shmshare_{os.getpid()}_{secrets.token_hex(6)}"
            try:
                fd = _shm_open(shm_name, oflag)
            except SegmentError as exc:
                if exc.errno == errno.EEXIST and name is None:
                    continue  # someone holds this random name: draw another
                raise
            return cls._finish(fd, nbytes, flags, "posix", shm_name, may_resize=True, created=True)
        raise SegmentError(errno.EEXIST, f"shm_open: {_NAME_ATTEMPTS} random names under "
                           f"{_SHM_DIR} were all taken; clean up stale /dev/shm/shmshare_* entries")

    @classmethod
    def _finish(cls, fd: int, nbytes: int | None, flags: Flags, backend: str, name: str | None,
                *, may_resize: bool, created: bool = False, seal: int = 0) -> Segment:
        """Run resize -> map -> finalize over an owned `fd`; close it (and unlink) on failure."""
        self = object.__new__(cls)
        self.fd, self._root, self._owns_name, self._pid = fd, None, created, os.getpid()
        self.size, self.name, self.flags, self.backend, self.address = 0, name, flags, backend, 0
        try:
            self._resize_and_map(nbytes, may_resize, seal)
        except BaseException:
            self.close()  # closes the fd, unmaps, unlinks a name we created
            raise
        return self

    def _resize_and_map(self, nbytes: int | None, may_resize: bool, seal: int) -> None:
        fd, f = self.fd, int(self.flags)
        assert fd is not None
        writable = not f & _READONLY
        current = os.fstat(fd).st_size
        size = current if nbytes is None else nbytes
        if size <= 0:
            raise SegmentError(errno.EINVAL, f"{self._what()} is empty; pass nbytes to create it")
        if current < size:
            if not (may_resize and writable and not f & _NOCREATE):
                raise SegmentError(errno.EINVAL, f"{self._what()} is {current} bytes, "
                                   f"{size} were asked: mapping past its end would SIGBUS on touch")
            os.ftruncate(fd, size)
            if f & (_SHAREDMEM | _SHARED):
                self._reserve_pages(size)
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
                pass
        if f & _UNLINK:
            self._owns_name = False
            _unlink(self.backend, self.name)
        if not f & _KEEPFD:
            self.fd = None
            os.close(fd)

    def _reserve_pages(self, size: int) -> None:
        """posix_fallocate the pages now, so running out is an error here, not SIGBUS later."""
        assert self.fd is not None
        while True:
            try:
                os.posix_fallocate(self.fd, 0, size)
                return
            except InterruptedError:
                continue
            except OSError as exc:
                raise SegmentError(exc.errno, f"cannot reserve {size} bytes for a {self.backend} "
                                   f"segment: posix_fallocate: {exc.strerror}. "
                                   f"{_space_hint(self.backend)}") from exc

    def _live_root(self) -> _native.Lease:
        if self._root is None:
            raise ValueError(f"segment {self.name!r} is closed")
        return self._root

    def _what(self) -> str:
        return f"{self.backend} object {self.name!r}"


def shm_free_bytes(path: str = _SHM_DIR) -> tuple[int, int]:
    """Return (free, total) bytes of the tmpfs at `path` (``/dev/shm``)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _memfd_seals(flags: Flags, growable: bool) -> int:
    seal = fcntl.F_SEAL_SHRINK | (0 if growable else fcntl.F_SEAL_GROW)
    return seal | (fcntl.F_SEAL_SEAL if flags & Flags.SEAL else 0)


def _check_nbytes(nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    return int(nbytes)


def _shm_name(name: str) -> str:
    name = name if name.startswith("/") else "/" + name
    if "/" in name[1:] or len(name) > 255:
        raise ValueError(f"a POSIX shm name is '/' plus up to 254 characters without '/', got {name!r}")
    return name


def _shm_open(name: str, oflag: int) -> int:
    try:
        return os.open(_SHM_DIR + name, oflag | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        hint = ""
        if exc.errno == errno.ENOENT:
            hint = " (no such shm object: it was never created or was already unlinked)"
        elif exc.errno == errno.EEXIST:
            hint = " (it exists and Flags.EXCLUSIVE was given)"
        raise SegmentError(exc.errno, f"shm_open({name!r}) failed: {exc.strerror}{hint}") from exc


def _unlink(backend: str, name: str | None) -> None:
    if not name or backend == "memfd":
        return  # a memfd has no name in any file system
    try:
        os.unlink(_SHM_DIR + name if backend == "posix" else name)
    except FileNotFoundError:
        pass  # someone else unlinked it: the goal is met


def _describe_fd(fd: int, given: int) -> tuple[str, str | None]:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SegmentError(errno.EINVAL, f"fd {given} is not a regular file or shared memory "
                           f"object (mode {stat.filemode(st.st_mode)}); only those can be mapped")
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "file", None
    if target.startswith("/memfd:"):
        return "memfd", target[len("/memfd:"):].removesuffix(" (deleted)")
    if target.startswith(_SHM_DIR + "/"):
        return "posix", target[len(_SHM_DIR):].removesuffix(" (deleted)")
    return "file", target.removesuffix(" (deleted)")


def _space_hint(backend: str) -> str:
    if backend == "posix":
        free, total = shm_free_bytes()
        return (f"{_SHM_DIR} has {free} of {total} bytes free; enlarge it (docker run "
                "--shm-size=...) or use backend='memfd', which it does not cap")
    try:
        import psutil
        avail = psutil.virtual_memory().available
        return (f"the host has {avail} bytes available; a memory cgroup limit may be lower "
                "(check /sys/fs/cgroup/memory.max); free memory or lower the pool size")
    except Exception:  # psutil missing or /proc unreadable: still raise the real error
        return "free memory or lower the pool size"
