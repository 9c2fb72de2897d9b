"""Contents derived from an id, to fill a block on one side and check it on the other.

A test that moves arrays between processes fills each with ``pattern(id, n)``
and compares what arrives with ``pattern(id, n)`` computed again: no copy of
the data travels beside it, and a block swapped for another, shifted, torn or
zeroed on the way does not compare equal.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["pattern"]

_M32 = (1 << 32) - 1
_M64 = (1 << 64) - 1


def pattern(seed: int, n: int, dtype: npt.DTypeLike = np.uint32) -> npt.NDArray[Any]:
    """Return `n` values of `dtype` derived from `seed` (a block's or a message's id).

    The same `seed` and `n` give the same values in every process. Each value is a hash
    of its position and the seed (not their sum, nor their xor), so another seed gives
    other values, and a run of one pattern equals a run of another, at another offset,
    only by chance (about 2**-31 per value).
    The values lie in ``[0, 2**31)``: exact in every integer dtype of 32 bits or more
    and in float64; narrower integer dtypes keep their low bits. Item ``i`` does not
    depend on `n`.
    """
    seed = operator.index(seed)
    if not 0 <= n < 1 << 32:
        raise ValueError(f"pattern(): n must be in [0, 2**32), not {n}")
    x = np.arange(n, dtype=np.uint32)
    _hash32(x)
    x += np.uint32(_mix64(seed) & _M32)  # wraps: a sum of two hashes, hashed again below
    _hash32(x)
    x &= np.uint32(0x7FFFFFFF)
    return x.astype(dtype, copy=False)


def _hash32(x: npt.NDArray[np.uint32]) -> None:
    """Hash each item of `x` in place: lowbias32 (Chris Wellons' integer hash), a bijection whose
    every input bit moves about half the output bits."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)


def _mix64(seed: int) -> int:
    """splitmix64's step over `seed` modulo 2**64 (negative seeds included; 0 is no fixed point)."""
    z = (seed + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)
