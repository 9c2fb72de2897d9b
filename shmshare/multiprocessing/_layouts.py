"""The checks of a handle's layout on the receiver, kept per layout.

A stream of arrays repeats a few layouts, so what a layout's check computes
(the bytes an array spans, the elements a tensor reaches) is kept per
(itemsize, shape, strides), at most ``_KEPT`` of each kind: a peer sending
ever new layouts makes the book start over, never grow. A malformed layout
is kept as malformed and refused every time; one sent with lists where
tuples belong is checked and not kept (a list is no key). Values that
compare equal (4096 and 4096.0) compute the same numbers, so what one peer
sent cannot change the answer for another's equal layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .. import tensors

__all__ = ["extent", "reach"]

_KEPT = 1024  # layouts of each kind kept at most
_T = TypeVar("_T")


def extent(itemsize: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int] | None:
    """``tensors.span`` of an array handle's layout: (lowest byte, bytes spanned) from element 0;
    None for a malformed one (shape and strides of other lengths, over 64 dimensions, a negative
    size)."""
    return _kept(_extents, _extent_of, (itemsize, shape, strides))


def reach(size: tuple[int, ...], stride: tuple[int, ...]) -> int | None:
    """Elements from a tensor handle's first element to its last (-1 when it has none); None for
    a negative stride (torch sends none)."""
    return _kept(_reaches, _reach_of, (size, stride))


def _kept(book: dict[Any, _T], compute: Callable[..., _T], key: tuple[Any, ...]) -> _T:
    try:
        return book[key]
    except KeyError:
        pass
    except TypeError:  # a list where a tuple belongs: checked all the same, not kept
        return compute(*key)
    got = book[key] = compute(*key)  # raises before it is kept
    if len(book) > _KEPT:
        book.clear()
    return got


def _extent_of(itemsize: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int] | None:
    if len(shape) != len(strides) or len(shape) > 64 or min(shape, default=1) < 0:
        return None
    return tensors.span(itemsize, shape, strides)


def _reach_of(size: tuple[int, ...], stride: tuple[int, ...]) -> int | None:
    if min(stride, default=0) < 0:
        return None
    return sum((n - 1) * d for n, d in zip(size, stride, strict=True)) if all(size) else -1


_extents: dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[int, int] | None] = {}
_reaches: dict[tuple[tuple[int, ...], tuple[int, ...]], int | None] = {}
