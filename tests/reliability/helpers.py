"""Shared pieces of the reliability suite: bounded children, host counters (patterns and bounded
waits: shmshare.testing's pattern and wait_until).

Every child here is forked by :func:`shmshare.testing.start_child`, talks to
the test over a ``wire.pipe`` control connection (msgpack dicts, never
pickles), ends with ``os._exit`` so no pytest machinery runs in it, and is
killed by pid in the test's ``finally``. A test asserts on the child's exit
status: a negative one is a signal (SIGBUS, SIGSEGV, an OOM kill), reported
with the seed and case that were running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]

import shmshare
from shmshare import wire
from shmshare._procfs import meminfo_kb, shm_mappings, shm_names
from shmshare.testing import Child, start_child

MiB = 1 << 20
CHILD_DEADLINE = 90.0  # s: no child outlives this, whatever the test does


def shmem_bytes() -> int:
    """Return the host's Shmem (every tmpfs, shm and memfd page) in bytes."""
    return meminfo_kb("Shmem") * 1024


def wait_shmem_below(limit: int, timeout: float = 10.0) -> int:
    """Wait until host Shmem is at most `limit`; return the lowest value seen.

    Other processes on the host move Shmem too, so the lowest value over the
    wait is what a test compares, never one sample.
    """
    deadline = time.monotonic() + timeout
    low = shmem_bytes()
    while low > limit and time.monotonic() < deadline:
        time.sleep(0.05)
        low = min(low, shmem_bytes())
    return low


def fd_count(pid: int | str = "self") -> int:
    """Return how many fds process `pid` has open (0 once it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def shm_left() -> set[str]:
    """Return the ``/dev/shm/shmshare_*`` names on the host."""
    return shm_names("shmshare_")


def shmshare_maps(pid: int | str) -> list[Any]:
    """Return the shared-memory mappings of `pid` that shmshare made for data (memfd or /dev/shm);
    not a connection's rings (``shmshare-rings``: control memory, read-write on both sides)."""
    return [m for m in shm_mappings(pid) if "shmshare" in m.path and "shmshare-rings" not in m.path]


def exit_status(code: int | None) -> str:
    """Describe an exit code the way a failure message should (``signal SIGBUS``)."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit status {code}"


def set_nofile(n: int) -> None:
    """Lower this process's RLIMIT_NOFILE soft limit to `n` (call it in a child)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def _child_main(body: Callable[..., None], conn: wire.Connection, other: wire.Connection,
                args: tuple[Any, ...]) -> None:
    other.close()
    code = 0
    try:
        body(conn, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails on it
        code = 3
        with contextlib.suppress(Exception):
            conn.send({"ev": "crash", "type": type(exc).__name__, "msg": str(exc),
                       "tb": traceback.format_exc()[-3000:]}, timeout=5)
    finally:
        with contextlib.suppress(Exception):
            conn.close()
        os._exit(code)


class Kid:
    """A forked child running ``body(ctl, *args)``, with its end of a control connection."""

    def __init__(self, body: Callable[..., None], *args: Any) -> None:
        self.ctl, child_end = wire.pipe()
        try:
            self.child: Child = start_child(_child_main, body, child_end, self.ctl, args)
        finally:
            child_end.close()
        self.pid = self.child.pid  # kept: the Process object is closed by stop()

    def event(self, timeout: float = 20.0) -> dict[str, Any]:
        """Return the child's next report; a crash report or a dead child fails the test."""
        try:
            msg, fds = self.ctl.recv(timeout=timeout)
        except shmshare.ShmshareTimeout:
            raise AssertionError(f"child pid {self.pid} reported nothing within {timeout:.0f} s "
                                 f"({exit_status(self.child.exitcode)})") from None
        except shmshare.PeerDied:
            self.child.join(10)
            raise AssertionError(f"child pid {self.pid} went away: "
                                 f"{exit_status(self.child.exitcode)}") from None
        for f in fds:
            f.close()
        if msg.get("ev") == "crash":
            raise AssertionError(f"child pid {self.pid} raised {msg['type']}: {msg['msg']}\n"
                                 f"{msg['tb']}")
        return msg

    def expect(self, ev: str, timeout: float = 20.0) -> dict[str, Any]:
        msg = self.event(timeout)
        assert msg.get("ev") == ev, f"expected a {ev!r} report from pid {self.pid}, got {msg}"
        return msg

    def tell(self, **msg: Any) -> None:
        self.ctl.send(msg, timeout=10)

    def join(self, timeout: float = 30.0) -> int:
        return self.child.join(timeout)

    def kill(self) -> None:
        self.child.kill()

    def stop(self) -> None:
        self.child.stop()
        self.ctl.close()

    def __enter__(self) -> Kid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def walk_arrays(obj: Any) -> Iterator[np.ndarray]:
    """Yield every numpy array in a received batch."""
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from walk_arrays(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from walk_arrays(v)


def touch_all(obj: Any) -> int:
    """Read every byte each array in `obj` spans (a shrunk file under it would be a SIGBUS).

    The span, not the elements: a zero-stride array of 2**34 elements over 8 bytes is legal
    and costs 8 bytes to read.
    """
    total = 0
    for arr in walk_arrays(obj):
        if arr.size and arr.dtype.itemsize:
            low, high = byte_bounds(arr)
            if not 0 < high - low < 1 << 30:
                raise ValueError(f"an array spans [{low:#x}, {high:#x}): shape {arr.shape} "
                                 f"strides {arr.strides} dtype {arr.dtype}")
            raw = ctypes.string_at(low, high - low)
            total += int(np.frombuffer(raw, np.uint8).sum(dtype=np.uint64))
    return total


def error_report(exc: BaseException) -> dict[str, Any]:
    """What a child reports about an exception: its type, bases and whole message."""
    notes = "; ".join(getattr(exc, "__notes__", ()))
    return {"ev": "error", "type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__], "msg": f"{exc} {notes}".strip()}


def remove_private_dir(path: str | None) -> None:
    """Remove the directory a crashed child's ``listen()`` left (``/tmp/shmshare-*``)."""
    if path and os.path.basename(os.path.dirname(path)).startswith("shmshare-"):
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
