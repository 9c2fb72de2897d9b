"""What the hostile store tests share: raw peers, crafted memfds and meta, stopped and fd-starved daemons."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from shmshare import wire
from shmshare._segcalls import sealed_memfd
from shmshare.store import Daemon, StoreError
from shmshare.store._packing import SEALS, one_array_meta

MiB = 1 << 20
_READY = "shmshare store listening on "
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_SEEK_HOLE = getattr(os, "SEEK_HOLE", 4)




def _memfd(size: int, seals: int = SEALS, fill: bool = True, name: str = "hostile") -> int:
    """A memfd of `size` bytes (every page allocated when `fill`) with `seals` added."""
    return sealed_memfd(name, size, seals, fill)


def _meta(n: int) -> bytes:
    """The meta of an object that is one uint8 array of `n` items at offset 0."""
    return one_array_meta((n,), np.dtype(np.uint8), None, n > 0)


@contextlib.contextmanager
def _raw(path: str) -> Iterator[wire.Connection]:
    conn = wire.connect(path, timeout=5)
    try:
        yield conn
    finally:
        conn.close()


def _ask(conn: wire.Connection, header: dict[str, Any], fds: Any = ()) -> dict[Any, Any]:
    """Send one request and return its reply (any fds it brings are closed)."""
    conn.send(header, fds, timeout=5)
    h, got = conn.recv(timeout=5)
    for f in got:
        f.close()
    return h


def _daemon_fd(pid: int, memfd_name: str) -> int:
    """A fresh read-only fd of the memfd called `memfd_name` that daemon `pid` holds."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:{memfd_name}"):
            return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    raise AssertionError(f"daemon pid {pid} holds no memfd {memfd_name!r}")


def _first_hole(fd: int) -> int:
    return os.lseek(fd, 0, _SEEK_HOLE)


def _nfds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def _fresh_daemon(sockdir: str, tag: str, **kw: Any) -> Iterator[Daemon]:
    """A daemon that a test may crash: killed (by pid) at the end whatever state it is in."""
    d = Daemon.start(os.path.join(sockdir, f"{tag}-{os.getpid()}.sock"), **kw)
    try:
        yield d
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGCONT)
        d.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(d.path)


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The daemon SIGSTOPped for the block, SIGCONTed after whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _start_with_nofile(path: str, nofile: int) -> Daemon:
    """A daemon whose RLIMIT_NOFILE is `nofile` (soft and hard)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen([sys.executable, "-m", "shmshare", "serve", "--socket", path],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True, preexec_fn=limit)
    assert proc.stdout is not None
    try:
        if not select.select([proc.stdout], [], [], 10)[0]:
            raise AssertionError("the fd-limited daemon did not start within 10 s")
        line = proc.stdout.readline()
        assert line.startswith(_READY), line
    except BaseException:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        raise
    return Daemon(proc, path)


@contextlib.contextmanager
def _no_free_fds() -> Any:
    """This process's fd table full for the block (RLIMIT_NOFILE at the highest fd, the holes
    below filled); every fd and the limit restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(f) for f in os.listdir("/proc/self/fd")) + 1
    fill: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
    try:
        while True:
            try:
                fill.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                break
        yield
    finally:
        for f in fill:
            os.close(f)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def fill_with_memfd_puts(store: Any, most: int = 200) -> int:
    """Put 1 MiB objects (a memfd, so a fd in the daemon, each) until the daemon refuses one
    (its fd table full) or `most` are in; return how many went in."""
    n = 0
    while n < most:
        try:
            store.put(f"big{n}", np.zeros(MiB, np.uint8), immutable=True)
        except StoreError:
            break
        n += 1
    return n
