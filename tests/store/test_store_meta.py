"""What the daemon checks in an object's meta before it keeps it: a torch dtype that does not
describe the numpy dtype under it is refused at put, since every getter would fail on it."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from shmshare import tensors
from shmshare.store import Daemon, Store, StoreError
from shmshare.store._packing import SEALS

from .hostile_helpers import MiB, _ask, _memfd, _raw


def _torch_meta(dtype: str, shape: tuple[int, ...], torch_dtype: str) -> bytes:
    """The meta of one C-order array at offset 0 whose descriptor says `torch_dtype`."""
    itemsize = np.dtype(dtype).itemsize
    strides = tensors.c_strides(itemsize, shape)
    ext = tensors.pack_desc(1, 0, 0, dtype.encode(), shape, strides, torch_dtype.encode())
    return tensors.encode(ext, lambda o: None)


@pytest.mark.parametrize("dtype,shape,torch_dtype", [
    ("|u1", (MiB,), "float32"),  # another item size: a get's view(float32) changes the shape
    ("|u1", (MiB // 4, 4), "int64"),
    ("<f4", (MiB // 4,), "int32"),  # the same size, another kind: the bits read as ints
    ("<f4", (MiB // 4,), "bfloat16"),
    (">f4", (MiB // 4,), "float32"),  # torch.from_numpy refuses a byte-swapped array
    ("<f4", (MiB // 4,), "no_such_dtype"),  # no torch dtype of that name
    ("<f4", (MiB // 4,), "Tensor"),  # a name torch has, but not a dtype
])
def test_a_put_whose_torch_dtype_disagrees_with_its_numpy_dtype_is_refused(
        store: Store, daemon: Daemon, dtype: str, shape: tuple[int, ...],
        torch_dtype: str) -> None:
    """The put is refused with a StoreError naming both dtypes; nothing of it stays, and the
    objects already there are still got (before the fix the put was taken and every get of it
    raised torch's RuntimeError, or gave a tensor of another shape or of reinterpreted bits)."""
    pytest.importorskip("torch")
    store.put("good", np.arange(10, dtype=np.int64))
    meta = _torch_meta(dtype, shape, torch_dtype)
    header = {"k": "put", "n": "mismatched", "m": meta, "s": MiB, "t": True, "r": False}
    fd = _memfd(MiB, SEALS | fcntl.F_SEAL_WRITE)
    try:
        with pytest.raises(StoreError) as info:
            store._call(dict(header), [fd])  # what Store.put sends, with the crafted meta
        text = str(info.value)
        assert torch_dtype in text and np.dtype(dtype).str in text, text
        with _raw(daemon.path) as c:  # and a raw peer gets the same refusal
            h = _ask(c, dict(header), [fd])
            assert h["k"] == "err" and h["e"] == "bad" and torch_dtype in h["w"], h
    finally:
        os.close(fd)
    assert "mismatched" not in store
    assert [int(x) for x in store.get("good")] == list(range(10))


def test_a_create_whose_torch_dtype_disagrees_is_refused(store: Store, daemon: Daemon) -> None:
    """create takes the same check (a small object: no memfd, the meta alone)."""
    with _raw(daemon.path) as c:
        h = _ask(c, {"k": "create", "n": "mismatched", "m": _torch_meta("<f8", (8,), "float16"),
                     "s": 64, "t": True})
        assert h["k"] == "err" and h["e"] == "bad" and "float16" in h["w"], h
    assert "mismatched" not in store


@pytest.mark.parametrize("torch_dtype", ["float32", "bfloat16", "float8_e4m3fn", "bool",
                                         "complex64", "uint16", "int8"])
def test_every_torch_dtype_a_put_makes_is_taken(store: Store, torch_dtype: str) -> None:
    """The check takes what the client makes of each torch dtype (the natural numpy dtype, or
    the same-size integer for those numpy lacks)."""
    torch = pytest.importorskip("torch")
    t = torch.zeros(5, dtype=getattr(torch, torch_dtype))
    store.put("t", t)
    got = store.get("t")
    assert got.dtype == t.dtype and tuple(got.shape) == (5,)
    del got
    store.delete("t")
