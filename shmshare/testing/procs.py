"""Bounded child processes for tests: every wait has a timeout, every child is killed by pid."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import Any

__all__ = ["Child", "start_child"]


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
        if self._proc.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
            self._proc.join(10)

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
