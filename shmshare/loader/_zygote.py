"""Under spawn and forkserver: one process starts, takes the dataset once, and forks every worker.

Note [Workers forked from one process]
    A spawned (or forkserver) worker starts a Python, imports what the
    dataset's pickle names (torch: seconds of CPU) and unpickles its own copy
    of the dataset. N workers do that N times, and on a busy machine the
    first batch waits for all of them: torch's loader takes longer to its
    first batch with every worker added. The start method was chosen to keep
    the main process's threads, CUDA context and locks out of the workers, not
    for the N imports.

    So, by default (``worker_start="one"``), the loader starts *one* process
    with the context, the "zygote". It gets the specs of all workers in one
    pickle, where the dataset appears once, and imports and unpickles once.
    Then it forks the N workers. A fork of that clean process holds none of
    the main process's state, which is what spawn was for, and costs
    milliseconds. The time to the first batch stays flat in the number of
    workers, and the dataset's pages are shared by all of them until written.

    The workers are the zygote's children, not the main process's. The
    zygote tells the main process their pids, waits until it has opened a
    pidfd for each (before that it reaps none of them, so no pid can be
    reused meanwhile), then reaps them and writes each exit status back. The
    main process keeps a ``ForkedWorker`` per worker with what a
    ``multiprocessing.Process`` offers the loader: ``pid``, ``exitcode``,
    ``join``, ``is_alive``, ``terminate``, ``kill`` and ``sentinel`` (the
    pidfd, readable once the worker is gone). Signals go through the pidfd,
    so they never reach another process. The zygote ignores SIGINT (Ctrl-C
    stops the main process, whose shutdown stops the workers) and exits once
    its last worker has. A worker whose zygote dies exits as an orphan does
    (its parent changed), and one whose main process dies sees its socket end.

    ``worker_start="each"`` starts every worker with the context, as torch
    does. That is also what happens with one worker (a zygote would only add
    a fork) and where there are no pidfds (Linux before 5.3).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

from .. import wire

__all__ = ["ForkedWorker", "Zygote", "zygote_main", "can_fork_from_one", "start_zygote"]

_ACK = b"k"


def can_fork_from_one() -> bool:
    """Whether this kernel gives pidfds (what watching another process's children needs)."""
    try:
        fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return False
    os.close(fd)
    return hasattr(signal, "pidfd_send_signal")


_WAIT = 600.0  # s the zygote is given to import and unpickle before it forks (unless it dies first)


def start_zygote(ctx: Any, conns: list[wire.Connection], specs: list[Any]) -> Zygote:
    """Start the zygote with the context, handing it the workers' ends and specs; wait for its workers."""
    from ._worker import SpecHandoff

    main_end, its_end = socket.socketpair()
    handoff = SpecHandoff(specs)
    try:
        p = ctx.Process(target=zygote_main, args=(conns, handoff, _FdArg(its_end.fileno())), daemon=True,
                        name="shmshare-loader-zygote")
        p.start()
    except BaseException:
        main_end.close()
        raise
    finally:
        for c in conns:
            c.close()  # the zygote has its own copies now
        handoff.close()
        its_end.close()
    return Zygote(p, main_end.detach(), len(specs), _WAIT)  # (it cleans up after itself if it raises)


class _FdArg:
    """An fd in a Process's arguments: sent as an fd (DupFd) while multiprocessing starts it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Any:
        from multiprocessing import reduction

        return _fd_of, (reduction.DupFd(self.fd),)


def _fd_of(dup: Any) -> int:
    return int(dup.detach())


def zygote_main(conns: list[wire.Connection], handoff: Any, report: int) -> None:
    """The zygote: fork a worker per connection, tell the main process their pids, reap them."""
    from ._worker import SpecHandoff, worker_main

    specs = handoff.spec
    me = os.getpid()  # the workers' parent: one that finds another has lost it, and exits
    pids: list[int] = []
    try:
        for i, (conn, spec) in enumerate(zip(conns, specs, strict=True)):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(conns, i, report, me, lambda c=conn, s=spec: worker_main(c, SpecHandoff(s)))
            pids.append(pid)
            conn.close()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
        _write(report, (" ".join(map(str, pids)) + "\n").encode())
        _wait_ack(report)
        left = set(pids)
        while left:
            pid, status = os.waitpid(-1, 0)
            if pid in left:
                left.discard(pid)
                _write(report, f"{pid} {os.waitstatus_to_exitcode(status)}\n".encode(), ignore_gone=True)
    finally:
        for c in conns:
            c.close()
        os.close(report)


def _child(conns: list[wire.Connection], i: int, report: int, parent: int, run: Any) -> None:
    """In a forked worker: run it, exit as a multiprocessing child would (never return)."""
    code = 1
    try:
        from . import _worker

        _worker._phases.append(("fork", time.time()))
        _worker._parent = parent  # a zygote killed before the worker looks is seen all the same
        os.close(report)
        for j, c in enumerate(conns):
            if j != i:
                c.close()
        import multiprocessing.util

        util: Any = multiprocessing.util  # (its private names, as a forked Process's _bootstrap uses them)
        util._finalizer_registry.clear()  # the zygote's, not ours to run
        util._run_after_forkers()
        run()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as multiprocessing reports a child's
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _write(fd: int, data: bytes, ignore_gone: bool = False) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except BrokenPipeError:
        if not ignore_gone:
            raise


def _wait_ack(fd: int) -> None:
    """Block until the main process has opened its pidfds (or has gone)."""
    while True:
        try:
            os.read(fd, 1)
            return
        except InterruptedError:
            continue


class Zygote:
    """The main process's side: the zygote's Process, the socket it reports on, the workers' handles."""

    def __init__(self, process: Any, report: int, count: int, wait: float) -> None:
        self.process = process
        self._report = report
        self._buf = b""
        self.workers: list[ForkedWorker] = []
        try:
            line = self._line(time.monotonic() + wait)
            if line is None:
                raise RuntimeError(self._why_no_pids(wait))
            pids = [int(p) for p in line.split()]
            if len(pids) != count:
                raise RuntimeError(f"the DataLoader's worker zygote reported {len(pids)} workers, not {count}")
            try:
                for pid in pids:
                    self.workers.append(ForkedWorker(pid, self))
            finally:
                _write(report, _ACK, ignore_gone=True)  # now it may reap them
        except BaseException:
            for w in self.workers:
                w.kill()
            self.close()
            raise

    def _why_no_pids(self, wait: float) -> str:
        self.process.join(0.5)
        code = self.process.exitcode
        if code is None:
            return (f"the DataLoader's worker zygote (pid {self.process.pid}) did not fork its workers within "
                    f"{wait:.0f} s")
        return (f"the DataLoader's worker zygote (pid {self.process.pid}) exited with code {code} before it "
                "forked its workers (its error is printed above: unpickling the dataset, or an import, "
                "failed there)")

    def _line(self, deadline: float | None) -> str | None:
        """The next line the zygote wrote, waiting until `deadline` (None: only what is there)."""
        while b"\n" not in self._buf:
            left = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._report], [], [], left)
            if not ready:
                return None
            try:
                chunk = os.read(self._report, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def collect(self, wait: float = 0.0) -> None:
        """Take in the exit statuses the zygote has written (waiting up to `wait` for the first)."""
        deadline = time.monotonic() + wait
        while True:
            line = self._line(deadline if wait else None)
            if line is None:
                return
            pid, code = (int(x) for x in line.split())
            for w in self.workers:
                if w.pid == pid:
                    w.exitcode = code
            wait = 0.0

    def close(self) -> None:
        """After the workers: join the zygote, close the report socket and the pidfds."""
        p = self.process
        p.join(1.0)
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join()
        for w in self.workers:
            w.close()
        if self._report >= 0:
            fd, self._report = self._report, -1
            os.close(fd)


class ForkedWorker:
    """A worker forked by the zygote, seen from the main process as a ``multiprocessing.Process``."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        self.name = f"shmshare-loader-worker-{pid}"
        self.daemon = True
        self._zygote = zygote
        self._pidfd = os.pidfd_open(pid)  # (not reaped before the ack: this is that worker)

    @property
    def sentinel(self) -> int:
        return self._pidfd

    def _gone(self, timeout: float | None) -> bool:
        if self._pidfd < 0:
            return True
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(ready)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the worker has exited and its exit status is known (or `timeout` passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.exitcode is not None or not self._gone(timeout):
            return
        while self.exitcode is None:  # gone: the zygote writes its status as it reaps it
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return
            self._zygote.collect(min(left, 1.0))
            if deadline is None and self.exitcode is None and not self._zygote.process.is_alive():
                return  # no one left to say

    def is_alive(self) -> bool:
        return self.exitcode is None and not self._gone(0)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self._pidfd >= 0 and self.exitcode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # gone already

    def close(self) -> None:
        fd, self._pidfd = self._pidfd, -1
        if fd >= 0:
            os.close(fd)

    def __repr__(self) -> str:
        state = "alive" if self.exitcode is None else f"exitcode={self.exitcode}"
        return f"<ForkedWorker pid={self.pid} {state}>"
