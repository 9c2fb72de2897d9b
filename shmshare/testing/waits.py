"""Bounded waits for tests: poll a condition until it holds, or fail naming what never came.

A test that waits for another process or thread (a release to come back, a
peer to be dropped, a child to leave) polls; it never sleeps a fixed time and
never asserts how long anything took. The bound only decides when a test that
would otherwise hang fails instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(condition: Callable[[], object], what: str | Callable[[], str], timeout: float = 30.0, *,
               interval: float = 0.01, between: Callable[[], object] | None = None) -> None:
    """Poll `condition()` until it is true; raise AssertionError naming `what` after `timeout` s.

    Parameters
    ----------
    condition
        Called at once, then every `interval` s; the wait ends when it returns a true value.
        The last call is made after the bound has passed, before the wait fails.
    what
        What is awaited, for the error ("every lease back"); or a function returning that
        text, called only when the wait fails (to describe the state at that moment).
    timeout
        The bound, in seconds.
    interval
        Seconds slept between polls.
    between
        Called after each poll that found `condition()` false, before sleeping: what makes
        progress or frees what is awaited (``gc.collect``, a ``poll_releases``).
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            text = what() if callable(what) else what
            raise AssertionError(f"not within {timeout:g} s: {text}")
        if between is not None:
            between()
        time.sleep(interval)
