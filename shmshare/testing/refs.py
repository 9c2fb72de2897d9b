"""Who holds one shared object: the fds and mappings of it in each process, and its link count.

What ``shmshare demo`` prints at every step, as a value a test can assert on::

    r = refs(seg, pids=[os.getpid(), child.pid])
    assert r[child.pid] == ([], [])  # the child let go of it
    assert r["nlink"] == 0  # and no name reaches it

Note [What refs can and cannot see]
    As in the demo (``shmshare/_demo.py``): fds are matched through
    ``/proc/<pid>/fd`` by the object's device and inode, mappings through
    ``/proc/<pid>/maps``. A fd in flight inside a socket (sent, not yet
    received) is in no fd table and is not counted. A process whose /proc
    we may not read (another user's, or ``hidepid``) shows nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from .._procfs import Mapping, holders, mappings

__all__ = ["refs", "Refs"]

# {pid: (fds, mappings), ..., "nlink": n}: one key per process asked about, and "nlink".
Refs = dict[int | str, tuple[list[int], list[Mapping]] | int]


def refs(obj: object, pids: Iterable[int] | None = None) -> Refs:
    """Return the fds and mappings that refer to `obj` in each of `pids`, and its link count.

    Parameters
    ----------
    obj
        A ``Segment`` (its fd, or its mapping if it keeps none), any object
        with ``fileno()``, a fd number of this process, or a path.
    pids
        The processes to look in; this process if None.

    Returns
    -------
    dict
        ``{pid: (fds, mappings), ..., "nlink": n}``: the fd numbers (sorted)
        and the ``Mapping`` lines of the object in each process, and the
        object's ``st_nlink`` (0 for a memfd or an unlinked shm object).
    """
    dev, ino, nlink = _identify(obj)
    out: Refs = {}
    for pid in [os.getpid()] if pids is None else pids:
        found, maps, _ = holders(pid, dev, ino)
        out[pid] = (found, maps)
    out["nlink"] = nlink
    return out


def _identify(obj: object) -> tuple[int, int, int]:
    """Return (st_dev, st_ino, st_nlink) of the object that `obj` names."""
    if isinstance(obj, (str, bytes, os.PathLike)):
        st = os.stat(obj)
        return st.st_dev, st.st_ino, st.st_nlink
    if getattr(obj, "closed", False) is True:  # a Segment, a file: its old fd or address may be another's now
        raise ValueError(f"refs() of a closed object: {obj!r}")
    fd = obj if isinstance(obj, int) else getattr(obj, "fd", None)
    if fd is None and not hasattr(obj, "address"):
        fd = obj.fileno() if hasattr(obj, "fileno") else None
    if isinstance(fd, int):
        st = os.fstat(fd)
        return st.st_dev, st.st_ino, st.st_nlink
    address = getattr(obj, "address", None)
    if isinstance(address, int) and address:
        return _mapped_at(address)
    raise TypeError(f"refs() takes a Segment, a fd, a path or an object with fileno(), not {obj!r}")


def _mapped_at(address: int) -> tuple[int, int, int]:
    """Return (st_dev, st_ino, st_nlink) of the object mapped at `address` in this process."""
    for m in mappings():
        if m.start <= address < m.end and m.inode:
            nlink = 0 if m.deleted else os.stat(m.path).st_nlink  # a memfd's path always says deleted
            major, minor = (int(x, 16) for x in m.dev.split(":"))
            return os.makedev(major, minor), m.inode, nlink
    raise ValueError(f"nothing is mapped at 0x{address:x} (a closed segment, or one not mapped yet)")
