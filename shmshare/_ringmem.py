"""The rings' shared memory and settings (Note [Rings] in ``_ring.py``).

One sealed memfd per connection holds both directions' rings; the end that
offers makes it (:func:`make_memfd`), the other checks it as hostile before
mapping it (:func:`check_memfd`). ``SHMSHARE_RINGS`` turns the rings off and
``SHMSHARE_SPIN_US`` sets a reader's spin before it sleeps.
"""

from __future__ import annotations

import fcntl
import os
import stat

from . import _native
from ._errors import ProtocolError
from ._segcalls import sealed_memfd

__all__ = ["COUNT", "SLOT", "spin_ns", "enabled", "check_settings", "nbytes", "make_memfd", "check_memfd"]

COUNT = 256  # slots each way
SLOT = 512  # bytes per slot: a frame of up to SLOT - 4 bytes travels in the ring
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def spin_ns() -> int:
    """SHMSHARE_SPIN_US as nanoseconds (default 50 us); a clear error when it is not a number."""
    raw = os.environ.get("SHMSHARE_SPIN_US", "50")
    try:
        us = float(raw)
    except ValueError:
        raise ValueError(f"SHMSHARE_SPIN_US={raw!r} is not a number of microseconds; "
                         "set it to e.g. 50, or 0 to never spin") from None
    if not 0 <= us <= 1_000_000:
        raise ValueError(f"SHMSHARE_SPIN_US={raw!r} must be 0..1000000 microseconds")
    return int(us * 1000)


def enabled() -> bool:
    """Whether ends offer rings (``SHMSHARE_RINGS=0`` keeps every frame on the socket)."""
    raw = os.environ.get("SHMSHARE_RINGS", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"SHMSHARE_RINGS={raw!r} must be 1 (rings, the default) or 0 (the socket only)")
    return raw == "1"


def check_settings() -> None:
    """Check SHMSHARE_RINGS and SHMSHARE_SPIN_US now (a channel's construction), not at the
    first send of whichever process sends: ValueError saying what is wrong."""
    if enabled():
        spin_ns()


def nbytes() -> int:
    """Bytes of shared memory a connection's rings take (both directions, whole pages)."""
    return int(_native.Ring.nbytes(COUNT, SLOT))


def make_memfd() -> int:
    """A memfd of the rings' size, its pages allocated (no SIGBUS later), sealed; the fd."""
    return sealed_memfd("shmshare-rings", nbytes(), _SEALS)


def check_memfd(fd: int) -> None:
    """Check a peer's rings memfd before mapping it: ProtocolError naming what is wrong."""
    st = os.fstat(fd)
    size = nbytes()
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError("the peer's rings are not a regular file (a memfd)")
    if st.st_size != size:
        raise ProtocolError(f"the peer's rings are {st.st_size} bytes, not the {size} of "
                            f"{COUNT} slots of {SLOT} bytes each way")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError as exc:
        raise ProtocolError(f"the peer's rings cannot be sealed (not a memfd): {exc}") from None
    if seals & _SEALS != _SEALS:
        raise ProtocolError("the peer's rings are not sealed against shrinking, growing and "
                            "unsealing; they could vanish under this process (SIGBUS)")
    if seals & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE) or mode != os.O_RDWR:
        raise ProtocolError("the peer's rings cannot be written (sealed against writes, or an fd "
                            "not opened read-write): both ends write their indices there")
    if st.st_blocks * 512 < size:  # as segments are checked (Note [Trust no fd] in _plane/trust.py)
        raise ProtocolError(f"the peer's rings have holes: {st.st_blocks * 512} of their {size} "
                            "bytes have pages, and touching a hole could fail (SIGBUS)")
