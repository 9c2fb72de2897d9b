"""Timeouts as every call of shmshare takes them: None (wait for good) or a number of seconds."""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["check_timeout"]


def check_timeout(value: Any, what: str, zero: bool = True) -> None:
    """Refuse a timeout that is not None or a number of seconds (>= 0 with `zero`, else > 0: NaN,
    negatives, strings and bools included), naming the call and the value."""
    if value is None or ((type(value) is float or type(value) is int) and (value >= 0 if zero else value > 0)):
        return  # the usual cases, kept short: send() and recv() check theirs per message
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and (
        float(value) >= 0 if zero else float(value) > 0)
    if not ok:
        raise ValueError(f"{what}(timeout=...) takes None or seconds {'>=' if zero else '>'} 0, "
                         f"got {value!r}")
