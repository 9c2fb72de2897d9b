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
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["on_fork_in_child", "on_fork_in_parent"]

_handlers: list[tuple[int, int, Callable[[], None]]] = []  # (layer, order registered, handler)
_parent_handlers: list[Callable[[], None]] = []


def on_fork_in_child(layer: int, handler: Callable[[], None]) -> None:
    """Run `handler` in every forked child, after those of lower `layer` (tests/test_layers.py)."""
    _handlers.append((layer, len(_handlers), handler))
    _handlers.sort(key=lambda h: (h[0], h[1]))


def on_fork_in_parent(handler: Callable[[], None]) -> None:
    """Run `handler` in the parent after each fork (to note what a child may now hold too)."""
    _parent_handlers.append(handler)


def _run() -> None:
    for _, _, handler in _handlers:
        handler()


def _run_in_parent() -> None:
    for handler in _parent_handlers:
        handler()


os.register_at_fork(after_in_child=_run, after_in_parent=_run_in_parent)
