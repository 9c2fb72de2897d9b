"""What a receiver checks before it maps a fd a peer sent, and what it lets one peer hold.

Note [Trust no fd]
    A mapping of a file that someone shrinks turns the next read past the
    new end into SIGBUS, which kills the receiver: Python cannot catch it.
    So a receiver maps only what cannot be shrunk under it:

    - a memfd sealed ``F_SEAL_SHRINK`` (what every shmshare sender sends by
      default), always;
    - an unsealed shared-memory file (a POSIX shm object under /dev/shm, a
      tmpfs file, a memfd without the seal) only when the receiver was made
      with ``trust_unsealed=True``: it trusts its senders not to truncate;
    - nothing else: a regular file on a disk file system can be truncated by
      anyone holding it, and pipes, sockets, devices, directories and
      anonymous inodes cannot be mapped as a peer's memory at all.

    ``F_GET_SEALS`` tells shared memory from the rest: it succeeds on shmem
    and hugetlbfs files only (on a POSIX shm object it returns
    ``F_SEAL_SEAL``: never sealable); hugetlbfs is refused too. The fd's
    access mode must allow the mapping asked for (and a writable receiver
    takes no fd sealed against writes), and the object must be as large as
    announced.

    A hole is the other way to hurt a reader without shrinking anything:
    reading a page that was never allocated allocates it, charged to the
    *reader's* memory cgroup (an OOM kill of the receiver) or, on a full
    tmpfs, SIGBUS. Senders reserve every page (``posix_fallocate``) before
    they send, so the pages to be mapped must all be there already
    (``st_blocks``). What remains: ``F_SEAL_SHRINK`` does not stop a sender
    from punching holes *after* the check (only ``F_SEAL_WRITE`` would,
    and a pool's pages must stay writable), so a hostile sender can still
    make a receiver allocate up to what it maps -- bounded by the caps below.

Note [Caps per peer]
    A peer's announcements cost the receiver address space (an expandable
    segment reserves its whole range at once) and mappings, of which a
    process may hold ``vm.max_map_count``; without a bound one same-uid peer
    could reserve terabytes or use up every mapping. Each peer is capped in
    both; past a cap the receiver refuses the batch with a ProtocolError
    naming the cap, tells the sender why, and drops that connection only.
    The defaults are generous and follow the host: four times its RAM
    (at least 64 GiB) of address space, and an eighth of max_map_count.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Any

from .._errors import FD_EXHAUSTED, FdLimitError, ProtocolError, SegmentError, ShmshareError
from .._listen import check_room

__all__ = ["check_fd", "describe_fd", "default_max_peer_bytes", "default_max_peer_segments",
           "locally", "check_fd_room"]

_FD_MARGIN = 8  # fds kept free beyond one message's worth before accepting another sender

_PAGE = os.sysconf("SC_PAGE_SIZE")
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1


def check_fd(fd: int, size: int, *, trust_unsealed: bool, writable: bool,
             backed: int | None = None) -> None:
    """Raise ProtocolError unless `fd` is shared memory we may map (Note [Trust no fd]).

    `size` is the bytes that will be mapped from offset 0; `writable`
    needs an ``O_RDWR`` fd that is not sealed against writes; `backed` (by
    default `size`) is how many bytes of it must have pages already.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError(f"the sender sent {describe_fd(fd, st)} as a segment; only shared "
                            "memory (a sealed memfd) can be mapped")
    try:
        seals: int | None = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = None  # not shmem or hugetlbfs: a file anyone holding it can truncate
    if seals is None:
        raise ProtocolError(f"the sender sent {describe_fd(fd, st)} as a segment; it can be "
                            "truncated under our mapping (SIGBUS), so only shared memory is mapped")
    if not seals & fcntl.F_SEAL_SHRINK and not trust_unsealed:
        raise ProtocolError(
            f"the sender sent {describe_fd(fd, st)}, which is not a memfd sealed F_SEAL_SHRINK: it "
            "could shrink it under our arrays (SIGBUS). A receiver maps unsealed shared memory (the "
            "POSIX backend) only when made with trust_unsealed=True")
    if st.st_blksize > _PAGE:
        raise ProtocolError(f"the sender sent {describe_fd(fd, st)}, a hugetlbfs file (blocks of "
                            f"{st.st_blksize} bytes); only ordinary shared memory is mapped")
    if writable and seals & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
        raise ProtocolError(f"the sender sent {describe_fd(fd, st)}, sealed against writes, to a "
                            "writable receiver: it cannot be mapped writable")
    mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    if mode == os.O_WRONLY or (writable and mode != os.O_RDWR):
        access = "read-write" if writable else "readable"
        raise ProtocolError(f"the sender sent a segment fd that is not {access} "
                            f"({describe_fd(fd, st)})")
    if st.st_size < size:
        raise ProtocolError(f"a segment fd of {st.st_size} bytes was announced as {size} bytes")
    need = size if backed is None else backed
    if st.st_blocks * 512 < need:
        raise ProtocolError(
            f"the sender sent {describe_fd(fd, st)} with holes: {st.st_blocks * 512} of the "
            f"{need} bytes to be mapped have pages. Reading a hole would allocate a page charged "
            "to this process (its memory cgroup could OOM-kill it; a full tmpfs is SIGBUS); "
            "senders reserve every page before they send (posix_fallocate)")


def describe_fd(fd: int, st: os.stat_result | None = None) -> str:
    """Say what `fd` is, in words: "a pipe", "a regular file on ext4 (/tmp/x)", ..."""
    st = os.fstat(fd) if st is None else st
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = "?"
    fmt = stat.S_IFMT(st.st_mode)
    kinds = {stat.S_IFIFO: "a pipe", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory",
             stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
             stat.S_IFLNK: "a symbolic link"}
    if fmt in kinds:
        return f"{kinds[fmt]} ({target})"
    if fmt == 0 or target.startswith("anon_inode:"):
        return f"an anonymous inode ({target})"
    if target.startswith("/memfd:"):
        return f"a memfd ({target})"
    return f"a regular file on {_fs_type(st.st_dev)} ({target})"


def default_max_peer_bytes() -> int:
    """Address space one peer may make us reserve: 4x the host's RAM, at least 64 GiB."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(64 << 30, 4 * ram)


def default_max_peer_segments() -> int:
    """Mappings one peer may make us hold: an eighth of vm.max_map_count."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return max(64, int(f.read()) // 8)
    except (OSError, ValueError):  # no procfs: the kernel's default of 65530
        return 65530 // 8


def _fs_type(dev: int) -> str:
    """Return the file system type of the mount with device number `dev` (mountinfo)."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if left.split()[2:3] == [want]:
                    return right.split()[0]
    except OSError:  # only a message loses its detail
        pass
    return f"the file system of device {want}"


# -- our own limits, told apart from the peer's doing ---------------------------


def locally(fn: Any, *args: Any, **kw: Any) -> Any:
    """Run a mapping call; a failure of ours (not the peer's) is a SegmentError saying so."""
    try:
        return fn(*args, **kw)
    except (ShmshareError, ValueError):
        raise
    except OSError as exc:
        if exc.errno in FD_EXHAUSTED:
            raise FdLimitError.exhausted("mapping a sender's segment", exc) from exc
        hint = {errno.ENOMEM: "out of address space or mappings: RLIMIT_AS (ulimit -v) or "
                              "vm.max_map_count",
                errno.EPERM: "mapping was denied here (a seccomp or LSM policy?)",
                errno.EACCES: "mapping was denied here"}.get(exc.errno or 0, "see errno")
        raise SegmentError(exc.errno, f"this process could not map a sender's segment "
                           f"({exc}): a local limit, not the sender's doing: {hint}") from exc


def check_fd_room(max_fds: int) -> None:
    """Raise FdLimitError unless accepting leaves room for a full message's fds.

    A connected sender's next batch may bring up to `max_fds` fds, which the
    kernel drops (MSG_CTRUNC, and that sender is lost) when the table is full;
    a newcomer must not take the last of that room (Note [A full fd table]):
    one message's worth and a margin, by every listener's rule (``_listen.check_room``).
    """
    check_room(max_fds + _FD_MARGIN, "the connected senders' segments need them")
