"""Timeouts as every call of shmshare takes them: None (wait for good) or a number of seconds."""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["check_timeout"]


def check_timeout(value: Any, what: str, zero: bool = True) -> None:
    """Refuse a timeout that is not None or a number of seconds (>= 0 with `zero`, else > 0: NaN,
    negatives, strings, bools and ints past a float included), naming the call and the value."""
    if value is None:
        return
    if isinstance(value, float):  # float, np.float64: the usual cases, kept short (send() and
        if value >= 0 if zero else value > 0:  # recv() check theirs per message)
            return
    elif type(value) is int and (0 if zero else 1) <= value <= _EXACT:
        return
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except (OverflowError, ValueError, TypeError):
            seconds = -1.0  # past a float (10**400): no clock adds it
        if seconds >= 0 if zero else seconds > 0:
            return
    raise ValueError(f"{what}(timeout=...) takes None or seconds {'>=' if zero else '>'} 0, "
                     f"got {value!r:.100}")


_EXACT = 1 << 53  # ints up to here are exact floats: a clock adds them
