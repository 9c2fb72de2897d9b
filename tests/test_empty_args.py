"""Shapes as an ``empty()`` takes them (shmshare/_empty_args.py): as numpy's ``empty`` does, the usual
ones through ``_native.shape_bytes`` in C, the rest in Python, with the same answers."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from shmshare import _native
from shmshare._empty_args import alloc_shape

SHAPES = [5, 0, (), [], (2, 3), (0, 2), [2, 3], range(3), np.int64(4), np.uint8(3), np.array(3), np.array([2, 3]),
          np.array([2, 3], np.int8), (np.int64(2), 3), [np.int8(2)], tuple([1] * 64),
          # refused by both
          -3, (-1, 2), True, (True, 2), [True], np.array([True]), (np.bool_(True),), 2.0, (2.0,), [2.5, 1],
          "3", ("3",), None, (None,), {2: 0}, {2, 3}, (x for x in [2]), np.array([[2]]), tuple([1] * 65),
          (0, 2**63), (2**63,), 2**64, (2**40, 2**40, 0), (0, 2**40, 2**40)]


def _numpy(shape: object) -> object:
    try:
        return np.empty(shape, np.uint8).shape  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        return type(exc)


def _ours(shape: object) -> object:
    try:
        return alloc_shape(shape, 1)[0]
    except (TypeError, ValueError) as exc:
        return type(exc)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: repr(s)[:30])
def test_a_shape_is_taken_or_refused_as_numpys_empty_does(shape: object) -> None:
    assert _ours(shape) == _numpy(shape)


def test_bytes_are_not_a_shape_here_though_numpy_takes_them_as_ints() -> None:
    # numpy 2.4 takes b"ab" as the sequence of ints (97, 98); a shape in bytes is a mistake here
    with pytest.raises(TypeError, match="a shape is an int or a sequence of ints"):
        alloc_shape(b"ab", 1)


@pytest.mark.parametrize(("shape", "itemsize", "got"), [
    ((2, 3), 4, ((2, 3), 24)), (5, 8, ((5,), 40)), ((), 8, ((), 8)), ((0, 2**60), 4, ((0, 2**60), 0)),
    ((0, 2**62), 4, None), ((2**40, 2**40, 0), 1, None),
    ((True,), 1, None), ((np.int64(2),), 1, None), ([2], 1, None), ((-1,), 1, None), ((2**63,), 1, None),
    ((2**62, 4), 1, None), ((2**32, 2**32), 1, None), (tuple([1] * 65), 1, None), ((2,), -1, None),
])
def test_the_c_path_takes_only_the_usual_shapes_and_never_an_overflow(shape: object, itemsize: int,
                                                                       got: object) -> None:
    assert _native.shape_bytes(shape, itemsize) == got


def test_more_bytes_than_an_address_space_say_the_shape_is_wrong() -> None:
    with pytest.raises(ValueError, match="more than this process can address: the shape is wrong"):
        alloc_shape((2**62, 4), 1)
    assert alloc_shape((sys.maxsize,), 1) == ((sys.maxsize,), sys.maxsize)
