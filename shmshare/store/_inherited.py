"""What a forked child inherits of the store: the parent's ``Store`` objects, and its views.

Note [Views across fork]
    A forked child inherits every view its parent holds. Like every other
    object it inherits, a view should keep the bytes it had at fork,
    whatever the parent does next. A view of an object of 1 MiB or more maps
    that object's own memfd, which is sealed against writes and never
    reused, so the child's mapping keeps its pages. A view of a small object
    maps a block of the daemon's pool. The daemon reuses that block for
    another object once the object has no name and no reference. The
    references are the parent's: the daemon knows nothing of the child, and
    the child's views hold none. So once the parent let go of its own, the
    child's bytes would change under it.

    So at fork, in the child, the pages of every live view of a pool
    block -- a get's, or the array of a warm ``create`` -- are replaced in
    place (``MAP_FIXED``, same addresses) by a private copy of their bytes.
    The copy is a memfd of the child's, written with ``pwrite`` from the
    mapping, sealed ``F_SEAL_WRITE`` and mapped ``PROT_READ`` (a create's
    array: unsealed and writable, its writes the child's own). The views
    are the same objects over the same addresses; only their bytes are now
    the child's own. The Stores' cached mappings go first (the Store
    itself is the parent's, unusable here); what no view holds of them is
    left as it is, since nothing reads it.

    The copy is made when the child runs, which may be after the parent
    went on: so the parent gives back none of its references until each
    child forked while a view held a pool block has said its copies are
    made (a pipe made before the fork: a byte, or the child's end closing
    when it exits), waiting for that at most COPY_WAIT when it has releases
    to send (``copies_made()``).

    Cost: a copy of the pages the live views cover (whole pages: a
    neighbour's bytes on a shared page come along), at every fork, charged
    to the child's memory cgroup (checked first: Note [Shared memory and
    the memory cgroup] in ``_packing``). A view of a large warm object is
    as large as the object: an object that forked children should share
    for free is put with ``immutable=True`` (its own memfd, sealed, never
    reused: nothing to copy).
    Taking references for the child instead would need a round trip to
    the daemon inside fork, racing the parent's releases, and the daemon
    watching the child's pid to know when they go: not done. If a copy
    cannot be made (no room in the cgroup, no fd), the child keeps the
    shared mapping and says so on stderr (not as a warning, which a filter
    could hide or turn into an exception inside the fork handlers): its
    views of that segment may then change once the parent lets go of its
    own. There is nothing louder to do: a view is plain memory, read
    without a call that could raise.
"""

from __future__ import annotations

import fcntl
import os
import select
import threading
import time
import weakref
from typing import TYPE_CHECKING

from .. import _fork, _native
from .._errors import ShmshareError
from ._packing import check_cgroup, new_memfd

if TYPE_CHECKING:
    from .._fd import Fd
    from .._plane import Borrowed
    from ._client import Store

__all__ = ["track_store", "forget_store", "track_view", "is_pool", "reused_by_daemon",
           "copies_made", "copy_in_place"]

COPY_WAIT = 5.0  # s: the longest a parent's releases wait for a forked child to copy its views

_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_stores: weakref.WeakSet[Store] = weakref.WeakSet()  # Stores of this process not shut down
_pool_roots: weakref.WeakSet[_native.Lease] = weakref.WeakSet()  # mappings of pool segments
_views: weakref.WeakSet[_native.Lease] = weakref.WeakSet()  # live views of pool blocks
_copying: list[int] = []  # read ends of children's "copied" pipes, in the parent
_copying_lock = threading.Lock()
_pipe: tuple[int, int] | None = None  # made before a fork while a view holds a pool mapping


def track_store(store: Store) -> None:
    """Have `store` put right in a forked child (``Store._after_fork``)."""
    _stores.add(store)


def forget_store(store: Store) -> None:
    _stores.discard(store)


def reused_by_daemon(fd: int) -> bool:
    """Whether the daemon may reuse the bytes behind `fd`: a pool segment, which has no write
    seal (an object's own memfd is sealed against writes: its bytes never change)."""
    return not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _WRITE_SEALS


def track_view(lease: _native.Lease) -> None:
    """Note a view of a pool block (a get's lease, a warm create's array), for a forked child
    to copy."""
    _views.add(lease)


def is_pool(root: _native.Lease) -> bool:
    """Whether `root` maps a pool segment (whose blocks the daemon reuses)."""
    return root in _pool_roots


def map_shared(segs: Borrowed, seg: int, fd: Fd, nbytes: int) -> _native.Lease:
    """Map segment `seg` of the daemon's, read-only and shared, and keep it in `segs` (a pool
    segment is charged to the caps, and noted for a forked child to copy)."""
    try:
        pool = reused_by_daemon(fd.fileno())
    except OSError:
        pool = False  # not shared memory at all: the check in map() says so
    root = segs.map(seg, fd, nbytes, writable=False, charged=pool)
    if pool:
        _pool_roots.add(root)
    return root


def copies_made(wait: float = COPY_WAIT) -> None:
    """Before the parent gives back references: wait (at most `wait` s in all) until every child
    forked while a view held a pool segment has made its copies (Note [Views across fork])."""
    if not _copying:
        return
    deadline = time.monotonic() + wait
    while True:
        with _copying_lock:  # not held while waiting: a fork's parent hook takes it too
            if not _copying:
                return
            r = _copying.pop(0)
        poller = select.poll()
        poller.register(r, select.POLLIN | select.POLLHUP)  # a byte, or EOF: the child is done
        poller.poll(max(0, int((deadline - time.monotonic()) * 1000)))
        os.close(r)  # done, or waited for long enough


def _before_fork() -> None:
    global _pipe
    fast = False
    for store in list(_stores):  # fast gets' views: counted once more until the children
        fast = store._fastgets.hold_for_fork() or fast  # copied theirs (the flusher)
    if (_views or fast) and _pipe is None:
        try:
            _pipe = os.pipe2(os.O_CLOEXEC)
        except OSError:  # no fd: the child's copy races the parent's releases, as it said
            _pipe = None


def _in_parent() -> None:
    global _pipe
    if _pipe is not None:
        r, w = _pipe
        _pipe = None
        os.close(w)
        with _copying_lock:
            _copying[:] = [fd for fd in _copying if not _done(fd)]  # a parent forking often keeps few
            _copying.append(r)
    for store in list(_stores):  # only now: the child's pipe is there for copies_made to wait on
        if store._fastgets.fork_pending:
            store._fastgets.forked()
            store._waker.poke()  # its flusher takes the holds back once the children copied


def _done(fd: int) -> bool:
    """Whether the child of this pipe said it copied (or exited); then the fd is closed."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    if not poller.poll(0):
        return False
    os.close(fd)
    return True


def _in_child() -> None:
    global _pipe, _copying_lock
    _copying_lock = threading.Lock()  # another thread of the parent may have held it at fork
    for r in _copying:  # the parent's waits, not ours
        os.close(r)
    _copying.clear()
    # first the copies, then the Stores' connections closed: were the parent gone already
    # (it exited after fork), our copy of its connection is all that keeps its references
    fast = [place for store in list(_stores) for place in store._fastgets.live_views()]
    for lo, hi, writable in _ranges([(v.address, v.nbytes, not v.readonly) for v in _views]
                                    + [(address, n, False) for address, n in fast]):
        copy_in_place(lo, hi - lo, writable)
    _views.clear()  # the copies are the child's own: a later fork need not copy them
    _pool_roots.clear()
    for store in list(_stores):
        store._fastgets.in_child()  # its counts: a private copy, before any view dies here
        store._after_fork()  # its cached mappings go: what is left is held by views
    _stores.clear()
    if _pipe is not None:
        r, w = _pipe
        _pipe = None
        os.close(r)
        try:
            os.write(w, b"c")
        except OSError:
            pass  # the parent closed its end: nobody waits
        os.close(w)


def _ranges(views: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """The pages `views` (address, bytes, writable) cover, as (start, end, writable) runs:
    overlapping or touching runs merged (writable if any view in it is)."""
    page = _native.PAGE_SIZE
    spans = sorted((a - a % page, -(-(a + n) // page) * page, w) for a, n, w in views if n)
    out: list[tuple[int, int, bool]] = []
    for lo, hi, writable in spans:
        if out and lo <= out[-1][1]:
            plo, phi, pw = out[-1]
            out[-1] = (plo, max(phi, hi), pw or writable)
        else:
            out.append((lo, hi, writable))
    return out


def copy_in_place(address: int, nbytes: int, writable: bool) -> None:
    """Replace the `nbytes` mapped at `address` by a private copy of their bytes: sealed and
    read-only, or (`writable`: a warm create's array) the child's own to write."""
    what = "a forked child's copy of the store's pool blocks its views map"
    try:
        check_cgroup(nbytes, what)  # pwrite allocates every page
        fd = new_memfd(nbytes, what)
        try:
            src = memoryview(_native.Lease(None, address, nbytes, readonly=True))
            done = 0
            while done < nbytes:
                done += os.pwrite(fd, src[done:], done)
            src.release()
            if not writable:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            _native.map_fd(address, nbytes, fd, 0, writable=writable)
        finally:
            os.close(fd)
    except (ShmshareError, OSError) as exc:  # a fork handler must not raise
        # said on stderr, not as a warning: a warnings filter could hide it, or (-W error) raise
        # it out of the fork handlers, and the layers after this one would not be put right
        _say(f"shmshare store: WARNING: forked child pid {os.getpid()} could not copy the "
             f"{nbytes} bytes of the store's pool its inherited views map ({exc}); those views "
             "share the daemon's pages, which it reuses for another object once the parent "
             "drops its own views: copy what the child needs before forking, or get it again "
             "in the child (Note [Views across fork])\n")


def _say(text: str) -> None:
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass  # no stderr: nothing else can be told


_fork.on_fork_in_child(6, _in_child)
_fork.on_fork_in_parent(_in_parent)
os.register_at_fork(before=_before_fork)
