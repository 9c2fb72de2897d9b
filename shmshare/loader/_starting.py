"""Starting workers one by one with the context, and what multiprocessing leaves in the main process."""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

from .. import wire
from ._worker import SpecHandoff, WorkerSpec, worker_main

__all__ = ["start_one", "pickle_hint", "close_sentinel", "drop_parent_pipe"]


def start_one(ctx: Any, end: wire.Connection, spec: WorkerSpec) -> Any:
    """Start one worker with the context; its end and its spec's memfd are closed once it has them."""
    handoff = SpecHandoff(spec)
    # spawn, forkserver: start() returns without waiting for the child to read its spec (Note [The
    # spec beside the start pipe] in _worker.py)
    w = ctx.Process(target=worker_main, args=(end, handoff), daemon=True)
    try:
        w.start()
    finally:
        end.close()  # the worker has its own copy now
        handoff.close()  # and of the spec's memfd
    drop_parent_pipe(w)
    return w


@contextlib.contextmanager
def pickle_hint() -> Iterator[None]:
    """torch's warning where a worker's arguments do not pickle (Python 3.14 starts with forkserver)."""
    try:
        yield
    except (TypeError, AttributeError, pickle.PicklingError):
        warnings.warn(
            "Got pickle error when attempting to start a worker Process. This might be "
            "because the worker Process arguments are not picklable. Python 3.14+ "
            "changed the multiprocessing start method in non-Mac POSIX platforms to "
            "'forkserver', which requires the worker Process arguments to be picklable. "
            "You can also try multiprocessing.set_start_method('fork').", stacklevel=6)
        raise


def close_sentinel(w: Any) -> None:
    """Close a reaped worker's sentinel fds now, not when the collector gets to its Process.

    Not ``Process.close()``: programs (torch's own tests) keep ``it._workers``
    and call ``join``/``is_alive``/``exitcode`` after the loader is gone, which
    a closed Process refuses; its exit code stays known.
    """
    popen = getattr(w, "_popen", None)
    if popen is not None and w.exitcode is not None and hasattr(popen, "close"):
        popen.close()


def drop_parent_pipe(w: Any) -> None:
    """Close the pipe end multiprocessing keeps only for the child's ``parent_process()``.

    Note [Two fds per worker]
        A fork or spawn ``Process`` holds two pipe fds in the parent: its
        sentinel (readable when the child exits) and the write end of a pipe
        whose read end the child keeps as ``parent_process().sentinel``, so
        that the child can see its parent die. Our workers watch their parent
        through their socket and ``getppid()``, never that sentinel, so the
        write end is closed at start: each worker costs the main process two
        fds (its socket and its sentinel) instead of three. The price: in a
        worker, ``multiprocessing.parent_process().is_alive()`` says False.
        A forkserver Process holds only its sentinel, and is left alone.
    """
    popen = getattr(w, "_popen", None)
    fin = getattr(popen, "finalizer", None)
    args = getattr(fin, "_args", None)
    if (type(args) is tuple and len(args) == 2 and args[0] == getattr(popen, "sentinel", None)
            and all(type(fd) is int for fd in args)):
        fin._args = (args[0],)  # type: ignore[union-attr]
        os.close(args[1])
