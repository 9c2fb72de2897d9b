"""Fixtures of the shmshare.multiprocessing tests.

Importing the module registers its reducers on multiprocessing's
ForkingPickler, for the whole process: what a user asks for, and what
would change every later test of this suite that pickles an array or a
tensor for multiprocessing (torch's DataLoader, the channel's tests). So
the reducers (and the import hook of Note [Reducers against import
order]) are in place only during the tests here, and each test ends with
this process's pool server and links shut down, with no linger, before
the leak checker looks: what a test left unclaimed is its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest

_PRISTINE = dict(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
_META_PATH = list(sys.meta_path)

import shmshare.multiprocessing as smp  # noqa: E402  (after the snapshot: it registers)


def _restore(before: dict[Any, Any]) -> None:
    """Put back what ours replaced, and only that: multiprocessing and torch register reducers of
    their own on first import (multiprocessing.connection's, torch's tensors'), which must stay."""
    from shmshare.multiprocessing import _reduce

    reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    for key, fn in list(reducers.items()):
        if fn in (_reduce.reduce_ndarray, _reduce.reduce_tensor, _reduce.reduce_storage):
            if key in before:
                reducers[key] = before[key]
            else:
                del reducers[key]
    sys.meta_path[:] = [f for f in sys.meta_path if f in _META_PATH]


_restore(_PRISTINE)


@pytest.fixture(scope="package", autouse=True)
def mp_reducers() -> Iterator[None]:
    """Ours while the tests of this directory run (module-scoped children fork under them too)."""
    from shmshare.multiprocessing import _reduce

    before = dict(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
    _reduce.install()
    try:
        yield
    finally:
        _restore(before)


@pytest.fixture(autouse=True)
def mp_shutdown() -> Iterator[None]:
    from shmshare.multiprocessing import _reduce

    _reduce.install()  # again: a test may have put torch's back
    try:
        yield
    finally:
        smp.shutdown()
