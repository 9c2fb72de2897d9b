"""The store's API against a real daemon: values in and out, names, create and seal, waits."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import shmshare
from shmshare import ShmshareTimeout
from shmshare.store import ObjectExists, Store, StoreError
from shmshare.store._protocol import LARGE
from shmshare.testing import pattern, wait_until

SIZES = {"small": 1000, "large": LARGE // 4 + 1000}  # items of 4 bytes: one below LARGE, one above


@pytest.mark.parametrize("immutable", [False, True], ids=["warm", "immutable"])
@pytest.mark.parametrize("size", list(SIZES))
def test_a_nested_value_comes_back_the_same(store: Store, size: str, immutable: bool) -> None:
    n = SIZES[size]
    rec = np.zeros(3, dtype=[("a", "<i2"), ("b", "<f8")])
    rec["a"], rec["b"] = [1, 2, 3], [0.5, 1.5, 2.5]
    value = {
        "x": pattern(1, n),
        "strided": pattern(2, 2 * n)[::2],  # not contiguous: stored C order
        "fortran": np.asfortranarray(pattern(3, 64).reshape(8, 8)),
        "nested": [(pattern(4, 5, "<i8"), "text", 7, 2.5, None, b"raw"), {"deep": {"d": rec}}],
        "empty": np.zeros((0, 4), np.float32),
        "scalar0d": np.array(3.25),
        "npscalar": np.float32(1.5),
        "big_endian": pattern(5, 16, ">u4"),
        "bools": np.array([True, False, True]),
        "strings": np.array(["ab", "cde"]),
    }
    store.put("v", value, immutable=immutable)
    got = store.get("v")
    assert got.keys() == value.keys()
    for k in ("x", "strided", "fortran", "big_endian", "bools", "strings", "empty", "scalar0d"):
        assert got[k].dtype == value[k].dtype, k
        np.testing.assert_array_equal(got[k], value[k])
        assert not got[k].flags.writeable, k
    assert isinstance(got["nested"][0], tuple)
    np.testing.assert_array_equal(got["nested"][0][0], value["nested"][0][0])
    assert got["nested"][0][1:] == ("text", 7, 2.5, None, b"raw")
    np.testing.assert_array_equal(got["nested"][1]["deep"]["d"], rec)
    assert got["npscalar"] == np.float32(1.5) and type(got["npscalar"]) is np.float32
    info = store.info("v")
    assert info.kind == ("memfd" if immutable else "arena")  # Note [Warm memory]
    assert info.write_seal == ("full" if immutable else "none")
    assert info.sealed and info.refs == 1 and info.holders == 1


def test_views_are_read_only_and_zero_copy(store: Store) -> None:
    a = pattern(6, LARGE)
    store.put("big", a)
    v1, v2 = store.get("big"), store.get("big")
    with pytest.raises(ValueError, match="read-only"):
        v1[0] = 1
    # both gets view the one mapping of the object: same address, no copy
    assert v1.__array_interface__["data"][0] == v2.__array_interface__["data"][0]
    assert store.info("big").refs == 2


def test_a_value_without_arrays_and_an_empty_array(store: Store) -> None:
    store.put("plain", {"a": 1, "b": [None, "x"]})
    assert store.get("plain") == {"a": 1, "b": [None, "x"]}
    store.put("none", np.zeros(0, np.int64))
    got = store.get("none")
    assert got.shape == (0,) and got.dtype == np.int64
    assert store.info("none").kind == "empty"
    gc.collect()
    wait_until(lambda: store.info("plain").refs == 0, "the references of arrayless gets come back")


def test_names_are_checked(store: Store) -> None:
    with pytest.raises(TypeError, match="a store name is a str"):
        store.put(b"bytes", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be empty"):
        store.get("")
    with pytest.raises(ValueError, match="at most 1024 bytes"):
        store.put("n" * 1025, 1)
    with pytest.raises(ValueError, match="UTF-8"):
        store.put("\udc80", 1)
    store.put("ünïcødé/ and spaces", 1)
    assert store.get("ünïcødé/ and spaces") == 1


def test_what_cannot_be_stored_is_refused_with_its_path(store: Store) -> None:
    with pytest.raises(TypeError, match="object"):
        store.put("o", {"a": np.array([object()])})
    with pytest.raises(TypeError, match="cannot be sent"):
        store.put("s", {"a": {1, 2}})
    assert "o" not in store and "s" not in store
    with pytest.raises(ValueError, match="description is"):
        store.put("many", [np.zeros(1)] * 5000)


def test_a_taken_name_is_refused_unless_replaced(store: Store) -> None:
    store.put("k", pattern(7, 10))
    old = store.get("k")
    with pytest.raises(ObjectExists, match="delete it first, or put"):
        store.put("k", pattern(8, 10))
    with pytest.raises(KeyError):  # ObjectExists is a KeyError too
        store.put("k", 1)
    store.put("k", pattern(8, 10), replace=True)
    np.testing.assert_array_equal(store.get("k"), pattern(8, 10))
    np.testing.assert_array_equal(old, pattern(7, 10))  # the old object lives while viewed


def test_missing_names_are_key_errors_and_delete_of_nothing_too(store: Store) -> None:
    with pytest.raises(KeyError, match="no object 'nope'"):
        store.get("nope")
    with pytest.raises(KeyError):
        store.delete("nope")
    with pytest.raises(KeyError):
        store.info("nope")
    assert "nope" not in store and 3 not in store


def test_get_waits_for_a_put_from_another_thread_and_times_out(store: Store, daemon) -> None:
    def later() -> None:
        time.sleep(0.2)
        with Store(daemon.path) as other:
            other.put("late", pattern(9, 100))

    t = threading.Thread(target=later)
    t.start()
    try:
        got = store.get("late", timeout=20)
        np.testing.assert_array_equal(got, pattern(9, 100))
    finally:
        t.join(30)
    with pytest.raises(ShmshareTimeout, match="no sealed object 'never'"):
        store.get("never", timeout=0.3)  # returns (the suite's per-test timeout bounds a hang)


@pytest.mark.parametrize(("n", "immutable"), [(1000, False), (LARGE, False), (1000, True),
                                              (LARGE, True)])
def test_create_fill_seal(store: Store, daemon, n: int, immutable: bool) -> None:
    arr = store.create("c", (n,), np.uint32, immutable=immutable)
    assert arr.flags.writeable and arr.shape == (n,)
    with pytest.raises(KeyError, match="not sealed yet"):
        store.get("c")
    assert "c" not in store and not store.info("c").sealed
    arr[:] = pattern(10, n)
    waiter: list[object] = []

    def wait() -> None:
        with Store(daemon.path) as other:
            waiter.append(np.array(other.get("c", timeout=20)))

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    store.seal("c")
    t.join(30)
    np.testing.assert_array_equal(waiter[0], pattern(10, n))  # type: ignore[arg-type]
    assert not arr.flags.writeable  # the array create() gave is read-only once sealed
    np.testing.assert_array_equal(store.get("c"), pattern(10, n))
    info = store.info("c")
    if immutable:
        assert info.kind == "memfd"
        assert info.write_seal == "future"  # `arr` still maps it writable
        del arr
        gc.collect()
        wait_until(lambda: store.info("c").write_seal == "full", "the full write seal")
    elif n >= LARGE:  # a block of the pool, which `arr` holds as a get's views do
        assert (info.kind, info.write_seal, info.holders) == ("arena", "none", 1)
        del arr
        gc.collect()
        wait_until(lambda: store.info("c").refs == 0, "the creator's reference given back")
    with pytest.raises(KeyError, match="not created through this Store"):
        store.seal("c")


@pytest.mark.parametrize(("shape", "error"), [
    ((2.5, 3), TypeError), ((2.0, 3), TypeError), ("34", TypeError), (("3",), TypeError), (None, TypeError),
    ((-1, 3), ValueError),
])
def test_create_takes_shapes_as_numpy_empty_does(store: Store, shape: object, error: type) -> None:
    """Not int() of each: (2.5, 3) made a (2, 3) array and "34" a (34,) one (a new user's review)."""
    with pytest.raises(error, match=r"a shape is an int or a sequence of ints|negative dimensions"):
        store.create("c", shape, np.uint8)  # type: ignore[arg-type]
    assert "c" not in store
    assert store.create("d", [2, np.int64(3)], np.uint8).shape == (2, 3)


def test_create_with_a_torch_dtype_gives_a_tensor(store: Store) -> None:
    torch = pytest.importorskip("torch")
    t = store.create("t", (4, LARGE // 8), torch.bfloat16)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
    t.fill_(1.5)
    store.seal("t")
    got = store.get("t")
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert float(got[3, -1]) == 1.5


@pytest.mark.parametrize("n", [100, LARGE])
def test_torch_tensors_come_back_as_tensors_and_a_write_stays_private(store: Store, n: int) -> None:
    torch = pytest.importorskip("torch")
    src = {"f": torch.arange(n, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16),
           "np": pattern(11, 10)}
    store.put("t", src)
    got = store.get("t")
    assert isinstance(got["f"], torch.Tensor) and got["b"].dtype == torch.bfloat16
    assert torch.equal(got["f"], src["f"])
    assert not got["np"].flags.writeable
    got["f"][0] = -1.0  # torch has no read-only tensors: copy-on-write, never the store's bytes
    again = store.get("t")
    assert float(again["f"][0]) == 0.0 and float(got["f"][0]) == -1.0


def test_list_info_contains_and_stats(store: Store) -> None:
    for i in range(300):  # more than one page of list replies
        store.put(f"obj{i:03d}", np.full(4, i))
    names = [o.name for o in store.list()]
    assert names == [f"obj{i:03d}" for i in range(300)]
    assert "obj123" in store
    info = store.info("obj007")
    assert info.size == 32 and info.refs == 0 and info.age >= 0
    st = store.stats()
    assert st["objects"] == 300 and st["put"] >= 300 and st["pid"] == store.daemon_pid


def test_a_store_is_a_context_manager_and_refuses_use_after_close(daemon) -> None:
    with Store(daemon.path) as s:
        s.put("x", 1)
    with pytest.raises(StoreError, match="closed"):
        s.get("x")
    assert repr(s).endswith("closed>")


def test_no_daemon_is_a_clear_error(sockdir: str) -> None:
    with pytest.raises(StoreError, match="shmshare serve"):
        Store(sockdir + "/nobody.sock", timeout=1)


def test_store_is_exported_at_the_top() -> None:
    assert shmshare.Store is Store


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_a_get_timeout_that_is_not_seconds_is_refused(store: Store, bad: float) -> None:
    with pytest.raises(ValueError, match="seconds >= 0"):
        store.get("x", timeout=bad)


@pytest.mark.parametrize("timeout", ["x", True, -1, float("nan"), [1]])
def test_a_timeout_that_is_not_seconds_names_the_call_and_the_value(store: Store, timeout) -> None:
    with pytest.raises(ValueError, match=r"Store\(timeout=\.\.\.\) takes None or seconds > 0, got"):
        Store(store.path, timeout=timeout)
    with pytest.raises(ValueError, match=r"get\(timeout=\.\.\.\) takes None or seconds >= 0, got"):
        store.get("anything", timeout=timeout)


def test_a_path_that_is_not_a_path_says_what_a_store_takes() -> None:
    with pytest.raises(TypeError, match=r"Store\(path=\.\.\.\) takes the daemon's socket path.*got 123"):
        Store(123)  # type: ignore[arg-type]


def test_a_sparse_tensor_is_refused_with_what_to_send_instead(store: Store) -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"sparse_coo tensor has no one block.*to_dense\(\)"):
        store.put("s", torch.eye(3).to_sparse())
    assert "s" not in store
