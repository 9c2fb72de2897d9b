"""pattern(): the same values for the same id in every process, other values for another id."""

from __future__ import annotations

import numpy as np
import pytest

from shmshare.testing import pattern


def test_the_same_seed_gives_the_same_values_and_item_i_does_not_depend_on_n() -> None:
    assert np.array_equal(pattern(7, 1000), pattern(7, 1000))
    assert np.array_equal(pattern(7, 1000)[:10], pattern(7, 10))
    assert pattern(7, 0).shape == (0,)


@pytest.mark.parametrize("a, b", [(0, 1), (1, 2), (-1, 1), (5, 5 + 2**32), (3, 3 + 100_003)])
def test_other_seeds_differ_everywhere_and_no_run_is_another_shifted(a: int, b: int) -> None:
    x, y = pattern(a, 4096), pattern(b, 4096)
    assert np.count_nonzero(x == y) < 8  # equal values only by chance (about 2**-31 each)
    for shift in range(1, 64):
        assert not np.array_equal(x[shift:shift + 256], y[:256])
        assert not np.array_equal(x[shift:shift + 256], x[:256])


@pytest.mark.parametrize("dtype", [np.uint32, ">u4", "<i8", np.uint64, np.float64, np.uint8])
def test_values_are_in_0_to_2_to_the_31_in_the_dtype_asked(dtype: object) -> None:
    x = pattern(11, 4096, dtype)
    assert x.dtype == np.dtype(dtype)  # type: ignore[call-overload]
    wide = pattern(11, 4096, np.uint64)
    assert wide.max() < 2**31
    if np.dtype(dtype).itemsize >= 4:  # type: ignore[call-overload]
        assert np.array_equal(x.astype(np.uint64), wide)
    else:
        assert np.array_equal(x, (wide & 0xFF).astype(np.uint8))
    assert len(np.unique(pattern(11, 1 << 16))) > (1 << 16) - 8


def test_a_seed_must_be_an_integer() -> None:
    with pytest.raises(TypeError):
        pattern(1.5, 4)  # type: ignore[arg-type]
