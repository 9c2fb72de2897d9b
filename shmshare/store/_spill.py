"""Spilling: sealed, unreferenced objects go to files in ``--spill DIR`` past ``--limit``.

Note [Spilling]
    With ``shmshare serve --limit N --spill DIR``, room for a put is made
    as ``--evict`` makes it -- sealed objects no client references, least
    recently used first -- but the object is not lost: its bytes go to a
    file in DIR and it keeps its name (``info().kind == "spilled"``). A get
    of it brings it back: the daemon makes room (spilling others if need
    be), reads the file into a memfd of its own, seals it against writes
    and removes the file. As Ray's object spilling, on one thread: the
    daemon serves nobody else while it writes or reads a file.

    A spill file is written whole under a temporary name and renamed to
    ``<oid>-<random>.spill`` only when complete, so a daemon killed mid-spill leaves
    a ``.tmp`` file and the object was still in memory (gone with the
    daemon, as every object in memory is). A daemon started on a DIR with
    spill files takes their objects back, spilled, under their names (a
    name in two files: the newer wins, the older is reported and removed);
    the ``.tmp`` files of a killed one are removed. A stop
    (SIGTERM) frees every object, spilled ones with their files. Files are
    not fsync'd: they outlive the daemon, not the host.

    Each file is ``MAGIC``, an 8-byte little-endian header length, a
    msgpack header (name, size, meta, torch, created), then the object's
    bytes at the next page boundary. A file that does not parse is
    reported and left alone. A full DIR (ENOSPC, EDQUOT) refuses the put
    that needed room with ``StoreFull`` naming it; the object that did not
    fit in the file stays in memory, whole.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Any

import msgpack

from .._errors import SegmentError
from ._protocol import StoreError, StoreFull

__all__ = ["Spiller", "SpillFile", "check_spill_dir", "write_from_memory", "write_from_fd"]

log = logging.getLogger("shmshare.store")

MAGIC = b"SHMSPILL\x01\x00\x00\x00"
_PAGE = os.sysconf("SC_PAGE_SIZE")
_CHUNK = 16 << 20  # bytes per write or read of a spill file
_MAX_HEADER = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_tmp_ids = itertools.count(1)


@dataclass
class SpillFile:
    """A spilled object as its file says it."""

    path: str
    name: str
    size: int
    meta: bytes
    torch: bool
    created: float
    data_at: int  # where its bytes start in the file


def check_spill_dir(path: str) -> str:
    """The absolute spill directory, made 0700 if missing; StoreError unless it is a directory
    of ours that others cannot write (someone could plant files the store would serve)."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise StoreError(f"--spill {path!r}: cannot make or read it ({exc}); name a directory "
                         "the daemon can write") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"--spill {path!r} is not a directory (a symlink or a file): name a "
                         "directory of the daemon's own")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise StoreError(f"--spill {path!r} belongs to uid {st.st_uid} with mode "
                         f"{stat.S_IMODE(st.st_mode):04o}: the store serves what is in it, so it "
                         "must be the daemon user's and not writable by others (chmod 700)")
    return path


class Spiller:
    """The daemon's spill directory: writing, reading back and removing spill files."""

    def __init__(self, directory: str) -> None:
        self.dir = check_spill_dir(directory)
        self._lock_fd = -1
        self.lock()
        self.bytes = 0  # object bytes in spill files now
        self.spilled = 0  # spills ever
        self.restored = 0  # objects read back ever

    def write(self, oid: int, name: str, size: int, meta: bytes, torch: bool, created: float,
              source: Any) -> tuple[str, int]:
        """Write an object to a new ``<oid>-<random>.spill`` (`source(fd, offset)`: writes its
        `size` bytes to fd at offset); its path, and where its bytes start. StoreFull when the
        directory is full (nothing left behind)."""
        header = msgpack.packb({"n": name, "s": size, "m": meta, "t": torch, "c": created},
                               use_bin_type=True)
        data_at = -(-(len(MAGIC) + 8 + len(header)) // _PAGE) * _PAGE
        tmp = os.path.join(self.dir, f".{oid}-{os.getpid()}-{next(_tmp_ids)}.tmp")
        final = os.path.join(self.dir, f"{oid}-{secrets.token_hex(6)}.spill")  # never a
        # recovered file's name: the oids of a daemon before this one began at 1 too
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                head = MAGIC + len(header).to_bytes(8, "little") + header
                _write_all(fd, head, 0)
                source(fd, data_at)
                os.rename(tmp, final)
            finally:
                os.close(fd)
        except OSError as exc:
            _unlink(tmp)
            if exc.errno in _FULL_ERRNOS:
                raise StoreFull(f"the spill directory {self.dir!r} is full ({exc.strerror}): "
                                f"object {name!r} ({size} bytes) could not be spilled to make "
                                "room, and stays in memory. Free room there, restart the store "
                                "with a --spill directory on a larger file system, or a larger "
                                "--limit") from exc
            raise
        self.bytes += size
        self.spilled += 1
        return final, data_at

    def read_into(self, path: str, name: str, size: int, fd: int) -> None:
        """Copy the bytes of object `name` (`size` bytes) from its spill file into `fd` (a
        memfd) from offset 0: StoreError unless the file is still that object's own."""
        try:
            src = _open(path)
        except OSError as exc:
            raise StoreError(f"the spill file {path!r} of object {name!r} cannot be read "
                             f"({exc.strerror}): it was removed or changed outside the store, "
                             "and the object is lost") from exc
        try:
            f = _parse_header(src, path)
            if (f.name, f.size) != (name, size):
                raise StoreError(f"the spill file {path!r} holds {f.name!r} ({f.size} bytes), "
                                 f"not object {name!r} ({size} bytes): it was replaced outside "
                                 "the store")
            data_at = f.data_at
            done = 0
            while done < size:
                n = os.sendfile(fd, src, data_at + done, min(_CHUNK, size - done))
                if n <= 0:
                    raise StoreError(f"the spill file {path!r} ended early")
                done += n
        finally:
            os.close(src)
        self.restored += 1

    def remove(self, path: str, size: int) -> None:
        """The object is back in memory, or gone: its file goes (one that cannot be removed is
        logged: a daemon started on the directory would take it back)."""
        self.bytes -= size
        try:
            _unlink(path)
        except OSError as exc:
            log.error("cannot remove spill file %s (%s): a daemon started on %s would take "
                      "its object back; remove it by hand", path, exc, self.dir)

    def lock(self) -> None:
        """Hold the directory for this daemon (a second one on it would take its files)."""
        fd = os.open(os.path.join(self.dir, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"--spill {self.dir!r} is in use by another store daemon (its "
                             "lock is held): give each daemon a directory of its own") from exc
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            os.close(fd)  # the lock goes with it

    def recover(self) -> list[SpillFile]:
        """The objects a killed daemon left in the directory (oldest first); a killed spill's
        ``.tmp`` files are removed, and a file that does not parse is reported and kept."""
        found: list[SpillFile] = []
        for entry in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, entry)
            if entry.endswith(".tmp") and entry.startswith("."):
                log.warning("removing %s: a spill cut short when its daemon was killed", path)
                _unlink(path)
                continue
            if not entry.endswith(".spill"):
                continue
            try:
                found.append(_read_header(path))
            except (OSError, ValueError, StoreError) as exc:
                log.error("spill file %s is not one the store can read back (%s): left as it "
                          "is", path, exc)
        found.sort(key=lambda f: f.created)
        self.bytes = sum(f.size for f in found)
        return found


def _open(path: str) -> int:
    """Open a spill file to read: never through a symlink, never blocking (a FIFO), and only a
    regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def _read_header(path: str) -> SpillFile:
    fd = _open(path)
    try:
        return _parse_header(fd, path)
    finally:
        os.close(fd)


def _parse_header(fd: int, path: str) -> SpillFile:
    st = os.fstat(fd)
    try:
        head = os.pread(fd, len(MAGIC) + 8, 0)
        if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
            raise StoreError("no spill file's magic")
        n = int.from_bytes(head[len(MAGIC):], "little")
        if not 0 < n <= _MAX_HEADER:
            raise StoreError(f"a header of {n} bytes")
        raw = os.pread(fd, n, len(MAGIC) + 8)
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        name, size, meta, torch, created = h["n"], h["s"], h["m"], h["t"], h["c"]
        if not (isinstance(name, str) and type(size) is int and size >= 0
                and isinstance(meta, bytes) and isinstance(torch, bool)
                and isinstance(created, (int, float))):
            raise StoreError("a malformed header")
        data_at = -(-(len(MAGIC) + 8 + n) // _PAGE) * _PAGE
        if st.st_size < data_at + size:
            raise StoreError(f"{st.st_size} bytes, short of its object's {size}")
        return SpillFile(path, name, size, meta, torch, float(created), data_at)
    except (KeyError, TypeError, ValueError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise StoreError(f"{path!r}: a malformed header ({exc!r})") from exc


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + _CHUNK], offset + done)


def write_from_memory(view: memoryview) -> Any:
    """A `source` for :meth:`Spiller.write`: bytes the daemon maps (a pool block)."""
    def source(fd: int, offset: int) -> None:
        _write_all(fd, view, offset)
    return source


def write_from_fd(src: int, size: int) -> Any:
    """A `source` for :meth:`Spiller.write`: an object's memfd (never mapped: sendfile)."""
    def source(fd: int, offset: int) -> None:
        os.lseek(fd, offset, os.SEEK_SET)
        done = 0
        while done < size:
            n = os.sendfile(fd, src, done, min(_CHUNK, size - done))
            if n <= 0:
                raise SegmentError(errno.EIO, "an object's memfd ended early")
            done += n
    return source


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
