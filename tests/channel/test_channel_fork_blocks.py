"""A sender that forks while arrays from empty() are alive: the child maps those blocks through
its copy of the parent's mapping, so the parent must not hand them out again while the child lives
(Note [Blocks a child inherits], _plane/forks.py); and a dtype of 0 bytes an item is widened as
numpy's own empty() widens it, never sent as a batch the receiver must refuse.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from shmshare import channel
from shmshare.testing import kill, pattern, wait_exit

N = 1 << 14
WAIT = 30.0


def test_a_block_a_forked_child_still_maps_is_not_reused_until_the_child_is_gone():
    tx, rx = channel(limit=64 << 20)
    r, w = os.pipe()
    pid = 0
    try:
        warm = tx.empty(N, np.uint32)
        tx.send(warm, timeout=WAIT)
        del warm
        rx.recv(timeout=WAIT)
        a = tx.empty(N, np.uint32)
        a[:] = pattern(1, N)
        inherited = a.__array_interface__["data"][0]
        pid = os.fork()
        if pid == 0:  # the child: wait, then write into the array it inherited (its own, to it)
            try:
                os.read(r, 1)
                a[:] = 0xDEAD
            finally:
                os._exit(0)
        del a
        gc.collect()
        b = tx.empty(N, np.uint32)
        assert b.__array_interface__["data"][0] != inherited  # retired while the child lives
        b[:] = pattern(2, N)
        tx.send(b, timeout=WAIT)
        got = rx.recv(timeout=WAIT)
        os.write(w, b"x")
        assert wait_exit(pid, WAIT) == 0
        pid = 0
        assert np.array_equal(got, pattern(2, N))  # the child's write went to its own block
        del got, b
    finally:
        if pid:
            kill(pid)
        os.close(r)
        os.close(w)
        tx.close()
        rx.close()


@pytest.mark.parametrize("dtype", ["S0", "U0", ">U0"])
def test_a_zero_byte_string_dtype_is_widened_as_numpy_widens_it(dtype):
    tx, rx = channel()
    with tx, rx:
        a = tx.empty(4, dtype)
        assert a.dtype == np.empty(4, dtype).dtype or a.dtype.itemsize == np.dtype(dtype.replace("0", "1")).itemsize
        a[:] = "x"
        tx.send(a, timeout=WAIT)
        got = rx.recv(timeout=WAIT)
        assert list(got) == list(a)
        tx.send(np.arange(3), timeout=WAIT)  # the channel is still up
        assert list(rx.recv(timeout=WAIT)) == [0, 1, 2]
