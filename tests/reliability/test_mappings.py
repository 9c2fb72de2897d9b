"""What the receiver maps, as /proc/<pid>/maps shows it, and how long the sender keeps its own.

A receiver maps the sender's pages ``r--s`` unless ``writable=True``
(``rw-s``); writing into a received read-only array is numpy's ValueError
and the sender's array stays as it was. A closed sender's ``empty()`` array
takes its fd and mapping with it when it dies.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import shmshare
from shmshare._procfs import fds, shm_mappings
from shmshare.testing import pattern

from .helpers import Kid, shmshare_maps

N = 1 << 18  # uint32: 1 MiB


def _hold_and_write(ctl, rx) -> None:
    got = rx.recv(timeout=30)
    try:
        got["x"][0] = 12345
        wrote = "wrote"
    except ValueError as exc:
        wrote = f"ValueError: {exc}"
    ctl.send({"ev": "holding", "wrote": wrote})
    ctl.recv(timeout=30)  # hold until the test has read our maps
    del got
    rx.close()


@pytest.mark.parametrize("backend", ["memfd", "posix"])
@pytest.mark.parametrize("writable", [False, True], ids=["read_only", "writable"])
def test_receiver_mapping_flags(backend: str, writable: bool) -> None:
    tx, rx = shmshare.channel(backend=backend, writable=writable)
    try:
        with Kid(_hold_and_write, rx) as kid:
            rx.close()
            arr = tx.empty(N, np.uint32)
            arr[:] = pattern(3, N)
            tx.send({"x": arr}, timeout=10)
            res = kid.expect("holding")
            maps = shmshare_maps(kid.pid)
            kid.tell(done=True)
            assert kid.join(30) == 0
            assert maps, "the receiver maps nothing of the sender's"
            perms = {m.perms for m in maps}
            want = "rw-s" if writable else "r--s"
            assert perms == {want}, f"receiver maps {perms}, wanted {want}: {maps}"
            if writable:
                assert res["wrote"] == "wrote"
            else:
                assert res["wrote"].startswith("ValueError"), res
                assert np.array_equal(arr, pattern(3, N)), "the sender's array changed"
            del arr
    finally:
        tx.close()
        rx.close()


def test_a_closed_senders_empty_array_takes_its_fd_and_mapping() -> None:
    tx, rx = shmshare.channel()
    keep = tx.empty(N, np.uint32)
    keep[:] = 1
    tx.close()
    rx.close()
    assert shm_mappings("self", "shmshare"), "the array's mapping should still be there"
    before_fds = [t for t in fds("self").values() if "shmshare" in t]
    assert before_fds, "the array's segment fd should still be there"
    del keep
    gc.collect()  # the array's own last reference; the Sender object lives on meanwhile
    assert not shm_mappings("self", "shmshare"), "mapping outlived the array"
    assert not [t for t in fds("self").values() if "shmshare" in t], "fd outlived the array"
    del tx
