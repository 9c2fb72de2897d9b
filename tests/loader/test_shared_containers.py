"""shmshare.loader.share: read-only containers in sealed shared memory (Note [One copy of the dataset])."""

from __future__ import annotations

import copy
import fcntl
import gc
import multiprocessing
import os
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmshare.loader import SharedMapping, SharedSequence, share
from shmshare.loader._frozen import _attach, _Packed

_WAIT = 60  # s any child is given


def _paths(n: int) -> list[str]:
    return [f"/data/train/class_{i % 1000:04d}/img_{i:08d}.JPEG" for i in range(n)]


@pytest.mark.parametrize(("items", "kind"), [
    (["a", "", "ééé", "b\udcff", "\x00"], "str"),
    ([b"", b"\x00\xff", b"abc"], "bytes"),
    ([0, -1, 1 << 62, -(1 << 63)], "int"),
    ([0.5, float("inf"), -0.0], "float"),
    ([True, False], "bool"),
    ([1, 2.5, "x", None, (1, 2)], "pickle"),
    ([1 << 64], "pickle"),
    ([], "pickle"),
])
def test_a_sequence_reads_back_as_it_was_given(items, kind):
    s = share(items)
    assert s.kind == kind
    assert len(s) == len(items)
    assert list(s) == items
    assert [type(x) for x in s] == [type(x) for x in items]
    assert [s[i] for i in range(-len(items), 0)] == items
    assert s[1:3] == items[1:3]
    assert s[::-1] == items[::-1]


def test_arrays_of_any_shape_and_dtype_are_read_only_views():
    arrays = [np.arange(6).reshape(2, 3), np.ones(3, np.float32), np.array(5, np.int8),
              np.zeros((0, 4)), np.arange(10)[::2], np.array(["ab", "c"])]
    s = share(arrays)
    assert s.kind == "arrays"
    for got, want in zip(s, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        s[0][0, 0] = 1


def test_numpy_scalars_and_structured_dtypes():
    assert share([np.int64(3), np.int32(4)]).kind == "pickle"  # two types: kept exactly
    ints = share([np.int64(3), np.int64(4)])
    assert ints.kind == "int" and list(ints) == [3, 4]
    dt = np.dtype([("a", "<i4"), ("b", "<f8", (2,))])
    x = np.zeros(3, dt)
    x["a"] = [1, 2, 3]
    s = share(x)
    assert s.array.dtype == dt and s.array["a"].tolist() == [1, 2, 3]
    assert share([x, np.ones(2)])[0].dtype == dt


def test_a_tensor_is_shared_as_its_array():
    torch = pytest.importorskip("torch")
    s = share(torch.arange(5))
    assert s.kind == "ndarray" and s.array.tolist() == [0, 1, 2, 3, 4]


def test_a_numpy_array_stays_numpy():
    a = np.arange(12, dtype=np.int32).reshape(4, 3)
    s = share(a)
    assert s.kind == "ndarray" and len(s) == 4
    np.testing.assert_array_equal(s.array, a)
    np.testing.assert_array_equal(s[2], a[2])
    assert not s.array.flags.writeable
    assert share([1, 2]).array.tolist() == [1, 2]
    with pytest.raises(TypeError, match="has no single array"):
        share(["x"]).array  # noqa: B018


def test_a_mapping_from_str():
    d = {f"k{i}": i * i for i in range(1000)} | {"": -1, "é\udcff": 7}
    m = share(d)
    assert isinstance(m, SharedMapping) and m.values_kind == "int"
    assert dict(m) == d and list(m) == list(d) and len(m) == len(d)
    assert all(m[k] == v for k, v in d.items())
    assert "k999" in m and "k1000" not in m and 5 not in m
    assert m.get("nope") is None
    with pytest.raises(KeyError, match="nope"):
        m["nope"]
    assert dict(share({"a": "x", "b": "y"})) == {"a": "x", "b": "y"}
    assert dict(share({"a": np.ones(2), "b": np.zeros(3)}, kind="arrays"))["b"].shape == (3,)


def test_colliding_hashes_are_told_apart(monkeypatch):
    from shmshare import _native
    from shmshare.loader import _frozen

    def same_hash(data, offsets, out):  # every key hashes alike: the lookup compares the bytes
        out[:] = 42

    monkeypatch.setattr(_frozen._native, "hash_spans", same_hash)
    m = share({"a": 1, "b": 2, "c": 3})
    # find_key hashes the key it is given with the real hash: only keys hashing to 42 could match
    assert _native.find_key(b"a", m._hashes, m._order, m._keys._offsets, m._keys._data) == -1
    monkeypatch.undo()
    m = share({"a": 1, "b": 2, "c": 3})
    hashes = np.full(3, _native.hash_bytes(b"b"), np.int64)
    assert _native.find_key(b"b", hashes, m._order, m._keys._offsets, m._keys._data) == \
        list(m).index("b")


@pytest.mark.parametrize(("args", "error", "match"), [
    (("abc",), TypeError, "not one str"),
    ((b"abc",), TypeError, "not one bytes"),
    (({1: "a"},), TypeError, "str keys only"),
    ((["a", 1], "str"), TypeError, "every element to be a str"),
    (([1, "a"], "int"), TypeError, "every element to be a int"),
    (([[1, 2]], "int"), TypeError, "every element to be a int"),
    (([1.7], "int"), TypeError, "1.7 is a float"),
    ((["False"], "bool"), TypeError, "'False' is a str"),
    ((np.array(5),), TypeError, "a 0-d array is one value"),
    (([1], "arrays"), TypeError, "numpy array"),
    (([1], "ndarray"), ValueError, "kind must be one of"),
    (([1], "strings"), ValueError, "kind must be one of"),
])
def test_bad_input_is_refused_with_the_fix(args, error, match):
    with pytest.raises(error, match=match):
        share(*args)


def test_indexing_errors_are_a_tuples():
    s = share(["a", "b"])
    with pytest.raises(IndexError, match="out of range"):
        s[2]
    with pytest.raises(IndexError, match="out of range"):
        s[-3]
    with pytest.raises(TypeError, match="integers or slices"):
        s["0"]
    assert s[np.int64(1)] == "b"


def test_the_memory_is_sealed_read_only():
    s = share(["abc"] * 10)
    fd = s._packed.fd.fileno()
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SEAL
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)


def test_an_unsealed_fd_is_refused():
    r = os.memfd_create("not-ours", os.MFD_CLOEXEC)
    os.ftruncate(r, 4096)

    class Dup:
        def detach(self):
            return r

    with pytest.raises(ValueError, match="not sealed read-only"):
        _attach(Dup())
    with pytest.raises(OSError):
        os.fstat(r)  # attach closed it


def test_copies_are_the_object_and_pickles_go_by_value():
    s = share(_paths(100))
    assert copy.copy(s) is s and copy.deepcopy(s) is s
    back = pickle.loads(pickle.dumps(s))
    assert back is not s and list(back) == list(s)
    m = share({"a": [1], "b": [2]})
    assert dict(pickle.loads(pickle.dumps(m))) == {"a": [1], "b": [2]}
    assert repr(s).startswith("<SharedSequence kind='str' len=100")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text()), st.dictionaries(st.text(), st.integers(-(1 << 63), (1 << 63) - 1)))
def test_any_text_round_trips(texts, mapping):
    assert list(share(texts)) == texts
    assert dict(share(mapping)) == mapping


def _read_all(seq, out):
    out.put((len(seq), seq[len(seq) - 1], sum(len(p) for p in seq), os.getpid()))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_child_reads_the_same_pages(method):
    s = share(_paths(20_000))
    m = share({"x": s[5]})
    n, last, total, _ = _in_child(method, _read_all, s)
    assert (n, last, total) == (len(s), s[-1], sum(len(x) for x in s))
    assert m["x"] == s[5]


def _in_child(method, target, seq):
    """Run target(seq, queue) in a child started with `method`; its one answer (the child waited for and
    killed by pid if it does not exit)."""
    ctx = multiprocessing.get_context(method)
    out = ctx.Queue()
    p = ctx.Process(target=target, args=(seq, out))
    p.start()
    try:
        return out.get(timeout=_WAIT)
    finally:
        p.join(_WAIT)
        if p.is_alive():
            os.kill(p.pid, 9)
            p.join()
        out.close()
        out.join_thread()
        assert p.exitcode == 0


def _pss_anon() -> int:
    """This process's share of anonymous memory: a heap page the fork shared counts half, once copied
    whole (a memfd's pages are shmem, never anonymous)."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Pss_Anon:"))


def _anon_growth(seq, out):
    gc.freeze()
    before = _pss_anon()
    total = 0
    for _ in range(2):
        for i in range(len(seq)):
            total += len(seq[i])
    out.put(_pss_anon() - before)


def test_reading_in_a_forked_child_copies_nothing_a_list_would():
    """The copy-on-read of pytorch #13246: a forked child reading a list of str copies its pages."""
    paths = _paths(200_000)
    shared = share(paths)
    growth = {name: _in_child("fork", _anon_growth, seq) for name, seq in (("list", paths), ("shared", shared))}
    assert growth["list"] > 4 << 20, growth  # the str objects' pages, copied into the child
    assert growth["shared"] < growth["list"] / 20, growth
    assert isinstance(shared, SharedSequence) and shared.nbytes < 16 << 20


def test_a_bad_header_is_refused():
    from shmshare._fd import Fd

    r = os.memfd_create("junk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(r, b"\x00" * 100)
    fd = Fd(r)
    with pytest.raises(ValueError, match="header is wrong"):
        _Packed(fd, 100)
    fd.close()
