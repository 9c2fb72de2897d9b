# Types for the C extension built from native/shmshare_native.c and native/lease.c.
#
# Functions parsed with PyArg_ParseTuple take their arguments by position only
# (hence the `/`); those parsed with PyArg_ParseTupleAndKeywords take them by
# position or by the keyword names in their kwlist. "p" arguments accept any
# object and use its truth value; they are typed `bool` because that is what a
# caller means. Addresses are plain ints ("K": unsigned long long).
# `python -m mypy.stubtest shmshare._native` checks this file against the build.

from collections.abc import Callable
from typing import Any, Final, final

import numpy as np
from typing_extensions import Buffer

PAGE_SIZE: Final[int]
"""sysconf(_SC_PAGESIZE), read at import."""
MADV_NORMAL: Final[int]
MADV_SEQUENTIAL: Final[int]
MADV_WILLNEED: Final[int]
MADV_DONTNEED: Final[int]
MADV_REMOVE: Final[int]
MADV_HUGEPAGE: Final[int]
MADV_POPULATE_READ: Final[int]
MADV_POPULATE_WRITE: Final[int]

def reserve(nbytes: int, /) -> int:
    """Reserve address space (PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE); the address."""

def map_fd(address: int, nbytes: int, fd: int, offset: int = 0, writable: bool = True) -> None:
    """Map `fd` with MAP_SHARED|MAP_FIXED into a reserved, page-aligned range."""

def mmap(
    nbytes: int,
    fd: int,
    offset: int = 0,
    writable: bool = True,
    shared: bool = True,
    populate: bool = False,
) -> int:
    """Map `fd` where the kernel chooses (MAP_SHARED, or MAP_PRIVATE copy-on-write); the address."""

def unmap(address: int, nbytes: int, release: bool = False) -> None:
    """Turn a range back into a PROT_NONE reservation, or munmap it when `release`."""

def punch_hole(fd: int, offset: int, nbytes: int, /) -> None:
    """fallocate(PUNCH_HOLE|KEEP_SIZE): give the pages back, keep the size."""

def madvise(address: int, nbytes: int, advice: int, /) -> None:
    """madvise(2) on a page-aligned range; `advice` is one of the MADV_* constants."""

def prefault(address: int, nbytes: int, threads: int = 1, writable: bool = False) -> None:
    """Fault every page in on 1..64 `threads` with the GIL released."""

# Before 3.12 numpy's stubs do not make an ndarray a Buffer (nor take one as ndarray(buffer=)).
def shape_bytes(shape: object, itemsize: int, /) -> tuple[tuple[int, ...], int] | None:
    """(shape, nbytes) of an empty(shape) of `itemsize`-byte items when the shape is an exact int
    or a tuple of at most 64 exact ints >= 0 whose bytes fit a Py_ssize_t; None for anything else."""

def extent(obj: Buffer | np.ndarray[Any, Any], /) -> tuple[int, int, int]:
    """(address, lo, span): where element 0 of a strided buffer lies, and the bytes its elements
    cover, [address + lo, address + lo + span); an empty buffer gives lo = span = 0."""

def hash_bytes(data: Buffer, /) -> int:
    """A 64-bit hash of the bytes (signed), the same in every process: shared mappings' keys."""

def hash_spans(data: Buffer | np.ndarray[Any, Any], offsets: Buffer | np.ndarray[Any, Any],
               out: Buffer | np.ndarray[Any, Any], /) -> None:
    """out[i] = hash_bytes(data[offsets[i]:offsets[i+1]]) for int64 offsets (n + 1) and out (n)."""

def find_key(key: Buffer, hashes: Buffer | np.ndarray[Any, Any], order: Buffer | np.ndarray[Any, Any],
             offsets: Buffer | np.ndarray[Any, Any], data: Buffer | np.ndarray[Any, Any], /) -> int:
    """The index of the key equal to `key` in a packed mapping (sorted int64 `hashes`, `order[j]`
    the key of hashes[j], key i = data[offsets[i]:offsets[i+1]]), or -1."""

def add64(address: int, delta: int, /) -> int:
    """Atomically add `delta` to the 8-byte word at `address`; the new value (seq_cst)."""

def load64(address: int, /) -> int:
    """The 8-byte word at `address`, loaded seq_cst."""

def store64(address: int, value: int, /) -> None:
    """Store `value` in the 8-byte word at `address`, seq_cst."""

# No Py_TPFLAGS_BASETYPE: the type cannot be subclassed.
@final
class Unref:
    """Calling it subtracts 1 from the 8-byte word at `address` (seq_cst), unless made before
    a fork and called in the child; it keeps `keep1` and `keep2` alive, out of the garbage
    collector's reach."""

    def __new__(cls, address: int, keep1: object, keep2: object, /) -> Unref: ...
    def __call__(self, *args: object, **kwargs: object) -> None: ...

def cas64(buffer: Buffer, index: int, expected: int, desired: int, /) -> int:
    """Atomically set the `index`-th 8-byte word of a writable, 8-byte aligned buffer to
    `desired` if it holds `expected`; return the value found (swapped iff it equals `expected`)."""

# No Py_TPFLAGS_BASETYPE: the type cannot be subclassed.
@final
class Lease:
    """Export [address, address+nbytes) through the buffer protocol while keeping `owner` alive.

    When the lease and every buffer exported from it are gone, exactly once: the range is
    munmap'ed if `unmap`, `fd` is closed if >= 0 (the lease owns it), and `on_release()` is
    called.
    """

    def __init__(
        self,
        owner: object,
        address: int,
        nbytes: int,
        readonly: bool = False,
        on_release: Callable[[], object] | None = None,
        unmap: bool = False,
        fd: int = -1,
    ) -> None: ...
    @property
    def address(self) -> int:
        """First byte exported."""
    @property
    def nbytes(self) -> int:
        """Number of bytes exported."""
    @property
    def readonly(self) -> bool:
        """Whether exports are read-only."""
    @property
    def exports(self) -> int:
        """Number of live buffer exports."""
    @property
    def owner(self) -> object:
        """The object this lease keeps alive (None once released by the collector)."""
    # The buffer protocol (bf_getbuffer / bf_releasebuffer), spelled as PEP 688 spells it so
    # that a Lease is a `collections.abc.Buffer` to the type checker.
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class Ring:
    """One end of a connection's two single-producer single-consumer rings in shared memory
    (native/ring.c; Note [Rings] in shmshare/_ring.py). Maps `fd` itself and unmaps it when the
    object dies; `first` picks which direction this end writes."""

    def __init__(self, fd: int, count: int, slot: int, first: bool) -> None: ...
    def push(self, frame: Buffer, /) -> int:
        """1 pushed, 3 pushed and the reader must be woken, 0 full, -2 the peer broke the ring."""
    def pop_into(self, buffer: Buffer, /) -> int:
        """-1 empty, -2 the peer broke the ring, else the frame's length (copied to the start)."""
    def readable(self) -> bool:
        """Whether a frame waits."""
    def arm(self) -> bool:
        """Say this end is about to sleep; whether a frame waits after all."""
    def close(self) -> None:
        """Unmap (now, or when a spin() running without the GIL returns); later calls raise."""
    def spin(self, ns: int, /) -> bool:
        """Look for a frame for up to `ns` nanoseconds, the GIL released; whether one came."""
    @staticmethod
    def nbytes(count: int, slot: int, /) -> int:
        """Bytes of shared memory both directions take (whole pages)."""
    @property
    def count(self) -> int: ...
    @property
    def slot(self) -> int: ...
    @property
    def pending(self) -> int:
        """Frames pushed that the peer has not taken; -1 when it broke the ring."""
