"""The one exception tree of shmshare.

Every error raised on purpose by shmshare derives from :class:`ShmshareError`,
and also from the builtin that a caller would naturally catch (``OSError``,
``MemoryError``, ``ConnectionError`` ...), so ``except OSError`` keeps working.
Messages name what was asked, the limit that was hit and how to fix it.
"""

from __future__ import annotations

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


class PoolExhausted(ShmshareError, MemoryError):
    """A pool reached its byte limit and nothing was given back in time."""


class ShmshareTimeout(ShmshareError, TimeoutError):
    """A bounded wait (``timeout=``) ran out."""
