"""Bounded child processes for tests: every wait has a timeout, every child is killed by pid.

``Child``/``start_child`` for a target run by multiprocessing; ``kill``, ``wait_exit``,
``wait_gone`` and ``pid_alive`` for any process a test started (a pid of ``os.fork``, a
``multiprocessing`` Process, a ``subprocess.Popen``) or only knows the pid of (a
DataLoader's worker, a grandchild).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any

from .._procfs import pid_alive
from .waits import wait_until

__all__ = ["Child", "start_child", "kill", "wait_exit", "wait_gone", "pid_alive"]

_Proc = int | mp.process.BaseProcess | subprocess.Popen[Any]  # what kill and wait_exit take


class Child:
    """A started child process; ``stop()`` (or leaving the ``with``) kills it if still alive."""

    def __init__(self, proc: mp.process.BaseProcess) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        """The child's pid."""
        assert self._proc.pid is not None
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        """The exit code (negative signal number if killed), None while running."""
        return self._proc.exitcode

    def join(self, timeout: float) -> int:
        """Wait up to `timeout` s for the child; kill it and raise TimeoutError if it is still running."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self.kill()
            raise TimeoutError(f"child pid {self.pid} did not exit within {timeout} s; killed it")
        return self._proc.exitcode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the child by pid and reap it (bounded)."""
        kill(self._proc, sig=sig)

    def stop(self) -> None:
        """Kill the child if it is alive and release the Process object."""
        self.kill()
        if self._proc.exitcode is not None:
            self._proc.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_child(target: Callable[..., Any], *args: Any, method: str = "fork") -> Child:
    """Start `target(*args)` in a child process made with the `method` start method."""
    # Every concrete context has Process; typeshed's BaseContext, which get_context(str) returns, does not.
    proc = mp.get_context(method).Process(target=target, args=args, daemon=True)  # type: ignore[attr-defined]
    proc.start()
    return Child(proc)


def kill(*procs: _Proc | None, sig: int = signal.SIGKILL, timeout: float = 10.0, reap: bool = True) -> None:
    """Send `sig` to each process by pid and reap it, waiting at most `timeout` s for them all.

    Each of `procs` is a pid, a ``multiprocessing`` Process (joined, so that it learns its
    exit code) or a ``subprocess.Popen`` (waited for); None and processes that have already
    ended are passed over. A pid that is a child of this process is reaped with
    ``waitpid``, unless `reap` is false: pass ``reap=False`` for a child that something
    else reaps (multiprocessing, a DataLoader), whose exit code a ``waitpid`` here would
    steal. Any other pid is waited for until it has exited (a zombie has). A process still
    there after `timeout` is left as it is: this is cleanup, and raises nothing.
    """
    deadline = time.monotonic() + timeout
    for proc in procs:
        if proc is None:
            continue
        if isinstance(proc, int):
            _check_pid(proc)
            if not reap and not pid_alive(proc):
                continue  # ended: its owner may have reaped it, and the pid may be another's now
            _signal(proc, sig)
            _reap_pid(proc, deadline, reap)
        elif isinstance(proc, subprocess.Popen):
            if proc.poll() is None:
                _signal(proc.pid, sig)
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        elif proc.pid is not None and proc.exitcode is None:
            _signal(proc.pid, sig)
            proc.join(max(0.0, deadline - time.monotonic()))


def wait_exit(proc: _Proc, timeout: float = 30.0) -> int:
    """Wait up to `timeout` s for a process to exit and return its exit code (negative: the
    signal that killed it); kill it and raise AssertionError if it is still running.

    `proc` is a pid of this process's child (reaped here), a ``multiprocessing`` Process
    (joined) or a ``subprocess.Popen`` (waited for).
    """
    code: int | None = None
    if isinstance(proc, int):
        _check_pid(proc)
        deadline = time.monotonic() + timeout
        while (done := os.waitpid(proc, os.WNOHANG))[0] == 0 and time.monotonic() <= deadline:
            time.sleep(0.005)  # ChildProcessError above: not our child, or reaped already
        code = os.waitstatus_to_exitcode(done[1]) if done[0] else None
        pid = proc
    elif isinstance(proc, subprocess.Popen):
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        pid = proc.pid
    else:
        proc.join(timeout)
        code = proc.exitcode
        pid = proc.pid if proc.pid is not None else -1
    if code is None:
        kill(proc)
        raise AssertionError(f"pid {pid} did not exit within {timeout:g} s (killed it)")
    return code


def wait_gone(pids: Iterable[int], what: str, timeout: float = 30.0) -> None:
    """Wait up to `timeout` s for every pid to exit; kill those still running and raise
    AssertionError naming them and `what`.

    The pids need not be this process's children, and are not reaped here: a zombie has
    exited, and its parent (multiprocessing, a DataLoader, init) reaps it.
    """
    if isinstance(pids, int):
        raise TypeError(f"wait_gone takes an iterable of pids, got the int {pids}; pass [{pids}]")
    pids = list(pids)
    for p in pids:
        _check_pid(p)

    def running() -> list[int]:
        return [p for p in pids if pid_alive(p)]

    try:
        wait_until(lambda: not running(), lambda: f"{what} (pids {running()} still running: killed them)", timeout)
    except AssertionError:
        kill(*running(), reap=False)
        raise


def _check_pid(pid: int) -> None:
    """A pid is a positive int: 0 and -1 mean a whole process group or every process to kill()
    and waitpid(), and a fork's 0 in its child is easy to pass by mistake."""
    if type(pid) is not int or pid <= 0:
        raise ValueError(f"a pid must be a positive int, got {pid!r} (0 is the caller's process "
                         "group, -1 every process it may signal; in a forked child os.fork() "
                         "returned 0)")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # reaped already (a zombie still takes signals)


def _reap_pid(pid: int, deadline: float, reap: bool) -> None:
    """Wait until `pid` has ended or `deadline` has passed; reap it with waitpid if it is our
    child and `reap`."""
    while time.monotonic() <= deadline:
        if reap:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                reap = False  # not our child, or reaped already: watch it instead
        if not reap and not pid_alive(pid):
            return
        time.sleep(0.005)
