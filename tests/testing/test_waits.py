"""wait_until: polls until its condition holds, and otherwise fails naming what it awaited."""

from __future__ import annotations

import pytest

from shmshare.testing import wait_until


def test_returns_once_the_condition_holds_calling_between_before_each_new_poll() -> None:
    calls: list[str] = []
    polls = iter([False, False, True])

    def condition() -> bool:
        calls.append("poll")
        return next(polls)

    wait_until(condition, "the third poll", between=lambda: calls.append("between"), interval=0)
    assert calls == ["poll", "between", "poll", "between", "poll"]


def test_fails_naming_what_was_awaited() -> None:
    with pytest.raises(AssertionError, match=r"^not within 0.05 s: every lease back$"):
        wait_until(lambda: False, "every lease back", 0.05)


def test_a_callable_what_describes_the_state_when_the_wait_fails() -> None:
    state = {"fds": 3}

    def what() -> str:
        return f"fds back to 2 (now {state['fds']})"

    state["fds"] = 4  # the text is made at failure, not when the wait began
    with pytest.raises(AssertionError, match=r"fds back to 2 \(now 4\)"):
        wait_until(lambda: False, what, 0.05)

