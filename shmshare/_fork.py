"""The one place where a forked child puts right what it inherited from its parent.

Note [At fork]
    A forked child holds copies of every fd and mapping of its parent, and
    of every Python object, but only the thread that forked. What it must
    not do with them is the parent's business: release the parent's leases,
    hand out the parent's pool blocks, send the parent's goodbye, wait on a
    lock a vanished thread held, or use the parent's CUDA context. Each
    layer registers one handler here, and the handlers run in layer order
    (the lowest first: the wire's locks are fresh before a sender's handler
    builds its new pool), whatever order the modules happened to be imported
    in. A handler runs in the child only, right after ``fork()``, with no
    other thread alive; it must not raise.

    A lock that another thread may hold while it sets up something a child
    needs too (the multiprocessing owner's, while a Queue's feeder thread
    makes the pool on its first put) is held across the fork instead:
    ``fork()`` waits until that thread lets go, so the child never starts
    with a lock held by a thread it does not have (``hold_across_fork``).
    Such locks are taken in layer order, highest first, and given back in
    both processes right after.

    A pool block an array of the parent's views at the fork is mapped by the
    child too, and must not be handed out again while the child lives: each
    lender marks such blocks in its parent handler (Note [Blocks a child
    inherits] in ``_plane/forks.py``). Other threads run meanwhile; one that
    let go of such a block between the fork and its mark would free it
    unmarked. So from the first "before" hook to the end of the parent's
    handlers :func:`forking` is true, and lenders free no local view's block
    then (it stays queued, and marked, for the next look).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["on_fork_in_child", "on_fork_in_parent", "hold_across_fork", "forking"]

_handlers: list[tuple[int, int, Callable[[], None]]] = []  # (layer, order registered, handler)
_parent_handlers: list[Callable[[], None]] = []
# (layer, order registered, a function returning the locks to take now, in that order)
_holders: list[tuple[int, int, Callable[[], list[Any]]]] = []
_taken: list[Any] = []  # what the forking thread took, to give back after
_forking = 0  # forks under way (threads may fork at once): from the first "before" hook to the parent's end
_forking_lock = threading.Lock()  # (+= of two threads' hooks is not atomic)


def forking() -> bool:
    """Whether this process is forking now (Note [At fork]): blocks of local views stay held."""
    return _forking > 0


def _count(step: int) -> None:
    global _forking
    with _forking_lock:
        _forking += step


def hold_across_fork(layer: int, locks: Callable[[], list[Any]]) -> None:
    """Before each fork take the locks `locks()` returns (highest layer first), and give them
    back after it in the parent and in the child (Note [At fork])."""
    _holders.append((layer, len(_holders), locks))
    _holders.sort(key=lambda h: (-h[0], h[1]))


def on_fork_in_child(layer: int, handler: Callable[[], None]) -> None:
    """Run `handler` in every forked child, after those of lower `layer` (tests/test_layers.py)."""
    _handlers.append((layer, len(_handlers), handler))
    _handlers.sort(key=lambda h: (h[0], h[1]))


def on_fork_in_parent(handler: Callable[[], None]) -> None:
    """Run `handler` in the parent after each fork (to note what a child may now hold too)."""
    _parent_handlers.append(handler)


def _before() -> None:
    _count(1)
    for _, _, locks in _holders:
        for lock in locks():
            lock.acquire()
            _taken.append(lock)


def _give_back() -> None:
    while _taken:
        _taken.pop().release()  # the forking thread took them: it is this thread, here and there


def _run() -> None:
    global _forking, _forking_lock
    _forking, _forking_lock = 0, threading.Lock()  # the child's own (another thread may have held it)
    _give_back()
    for _, _, handler in _handlers:
        try:
            handler()
        except BaseException as exc:  # noqa: BLE001 -- one layer's bug must not skip the others
            _say(f"shmshare: a fork handler failed in child pid {os.getpid()}: {exc!r}\n")


def _say(text: str) -> None:
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass  # no stderr: nothing else can be told


def _run_in_parent() -> None:
    try:
        _give_back()
        for handler in _parent_handlers:
            handler()
    finally:
        _count(-1)


os.register_at_fork(before=_before, after_in_child=_run, after_in_parent=_run_in_parent)
