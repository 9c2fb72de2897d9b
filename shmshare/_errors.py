"""The one exception tree of shmshare.

Every error raised on purpose by shmshare derives from :class:`ShmshareError`,
and also from the builtin that a caller would naturally catch (``OSError``,
``MemoryError``, ``ConnectionError`` ...), so ``except OSError`` keeps working.
Messages name what was asked, the limit that was hit and how to fix it.
"""

from __future__ import annotations

import errno as _errno
import os
import resource

__all__ = [
    "ShmshareError",
    "SegmentError",
    "ProtocolError",
    "PeerDied",
    "PeerRefused",
    "FdLimitError",
    "PoolExhausted",
    "ShmshareTimeout",
]


class ShmshareError(Exception):
    """Base class of every error shmshare raises on purpose."""


class SegmentError(ShmshareError, OSError):
    """Creating, sizing, mapping or opening a shared-memory segment failed.

    ``errno`` is set when a system call failed.
    """


class ProtocolError(ShmshareError):
    """A frame on a shmshare connection was malformed, too large, or unexpected."""


class PeerDied(ShmshareError, ConnectionError):
    """The process at the other end of a connection closed it or died."""


class PeerRefused(ShmshareError, PermissionError):
    """A peer was refused (another uid, or an incompatible protocol version)."""


class FdLimitError(ShmshareError, OSError):
    """File descriptors could not be received or created: RLIMIT_NOFILE was hit."""

    @classmethod
    def exhausted(cls, syscall: str, err: OSError | int, extra: str = "", *,
                  cause: str = "") -> FdLimitError:
        """Return the error for `syscall` failing with EMFILE/ENFILE (`err`), saying what to do.

        `cause` replaces the leading "<syscall> failed: <strerror>"; `extra`
        is said after the limit and the fix.

        The count of open fds is read from ``/proc/self/fd``, which itself
        needs a fd: when the table is full the message says so instead of
        giving a count it could not read.
        """
        code = err if isinstance(err, int) else (err.errno or _errno.EMFILE)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if code == _errno.ENFILE:
            used = "the whole system's file table is full (ENFILE: fs.file-max)"
        else:
            try:
                used = f"{len(os.listdir('/proc/self/fd')) - 1} fds are open"
            except OSError:  # EMFILE itself: every slot is taken
                used = f"all {soft} fds allowed are in use"
        what = cause or f"{syscall} failed: {os.strerror(code)}"
        text = (f"{what}. RLIMIT_NOFILE is {soft} (hard {hard}) "
                f"and {used}: raise it (ulimit -n, resource.setrlimit) or close fds")
        return cls(code, text + (f"; {extra}" if extra else ""))


class PoolExhausted(ShmshareError, MemoryError):
    """A pool reached its byte limit and nothing was given back in time."""


class ShmshareTimeout(ShmshareError, TimeoutError):
    """A bounded wait (``timeout=``) ran out."""
