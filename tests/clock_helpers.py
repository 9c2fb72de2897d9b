"""A clock for tests that count a wait instead of timing it (the project's rule: never assert a time)."""

from __future__ import annotations

import select
import types
from typing import Any


class PollClock:
    """A monotonic clock that moves only while the code under test waits: a poll returns at once
    with what is ready, and when nothing is, the clock jumps by the whole wait asked (as does a
    sleep). Patch ``time`` (``monotonic``, ``sleep``) and ``select`` of the modules that wait with
    this object and ``select()``; the wait is then ``now - START``, counted, not timed."""

    START = 1000.0

    def __init__(self) -> None:
        self.now = self.START
        self.polls = 0

    @property
    def waited(self) -> float:
        """Seconds the code under test waited on this clock."""
        return self.now - self.START

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def select(self) -> types.SimpleNamespace:
        """A stand-in for the select module whose polls run on this clock."""
        return types.SimpleNamespace(poll=self.poll, **{k: getattr(select, k) for k in dir(select)
                                                        if k.startswith("POLL")})

    def poll(self) -> Any:
        real = select.poll()
        clock = self

        class Poller:
            register, unregister, modify = real.register, real.unregister, real.modify

            def poll(self, ms: float | None = None) -> list[tuple[int, int]]:
                clock.polls += 1
                ready = real.poll(0)
                if not ready:
                    assert ms is not None, "a wait without a timeout"
                    clock.now += ms / 1000
                return ready

        return Poller()
