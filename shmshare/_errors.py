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
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "FD_EXHAUSTED",
    "making_fds",
    "ShmshareError",
    "SegmentError",
    "ProtocolError",
    "PeerDied",
    "PeerRefused",
    "FdLimitError",
    "PoolExhausted",
    "ShmshareTimeout",
]


_T = TypeVar("_T")


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
        """Return the error for `syscall` failing with EMFILE/ENFILE (or any errno), with the fix.

        The one place that words fd exhaustion, for segments and the wire
        alike: the syscall, RLIMIT_NOFILE soft and hard, how many fds are
        open, and what to do (Note [Counting fds when none are left]).
        `extra` is appended as one more sentence (a caller's own cause, such
        as a peer's ``max_fds``); `cause` replaces the leading "<syscall>
        failed: <strerror>" where the caller knows better.
        """
        code = err if isinstance(err, int) else (err.errno or _errno.EMFILE)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        nopen = _open_fds()
        if nopen is not None:
            held = f"{nopen} fds are open"
        elif code == _errno.EMFILE:
            held = f"all {soft} of RLIMIT_NOFILE are in use"
        else:
            held = "the open fds could not be counted"
        raise_to = hard if soft < hard else None
        how = (f"`ulimit -n {raise_to}` or resource.setrlimit(RLIMIT_NOFILE, ({raise_to}, {raise_to}))"
               if raise_to is not None else
               "the hard limit is reached too: raise it as root (`ulimit -Hn`, systemd LimitNOFILE=, "
               "docker run --ulimit nofile=N:N)")
        what = cause or f"{syscall} failed: {os.strerror(code)}"
        text = (f"{what}. RLIMIT_NOFILE is {soft} (hard {hard}) and "
                f"{held}: raise it ({how}) or close fds (a received segment needs none once "
                "mapped; close pools and connections you no longer use)")
        if code == _errno.ENFILE:
            text += ("; ENFILE means the whole system's file table is full: raise fs.file-max "
                     "(sysctl) or find the process holding them")
        if extra:
            text += "; " + extra
        return cls(code, text)


class PoolExhausted(ShmshareError, MemoryError):
    """A pool reached its byte limit and nothing was given back in time."""


class ShmshareTimeout(ShmshareError, TimeoutError):
    """A bounded wait (``timeout=``) ran out."""


# Note [Counting fds when none are left]
#     Counting open fds needs a fd of its own (listing /proc/self/fd opens it),
#     and that is exactly what fails with EMFILE when the table is full. Then
#     the count is known without reading it: all RLIMIT_NOFILE of them are in
#     use. A message never says "-1 fds are open".


def _open_fds() -> int | None:
    """Return the number of fds this process has open, or None when they cannot be listed."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # EMFILE (no fd to list with), or no /proc: the caller words the unknown
        return None
    return max(0, len(names) - 1)  # the listing's own fd is among the names


FD_EXHAUSTED = (_errno.EMFILE, _errno.ENFILE)  # the fd table (ours, or the system's) is full


def making_fds(syscall: str, fn: Callable[..., _T], *args: Any) -> _T:
    """Call `fn`, which makes fds: a full fd table is FdLimitError, never a bare OSError."""
    try:
        return fn(*args)
    except OSError as exc:
        if exc.errno in FD_EXHAUSTED:
            raise FdLimitError.exhausted(syscall, exc) from exc
        raise


# Tracebacks and reprs name the public module these are exported from, not this private one.
for _cls in (ShmshareError, SegmentError, ProtocolError, PeerDied, PeerRefused, FdLimitError, PoolExhausted,
             ShmshareTimeout):
    _cls.__module__ = "shmshare"
del _cls
