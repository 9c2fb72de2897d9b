"""Every dtype and layout the handles take arrives equal (values, dtype, shape) through a real
smp.Queue to a child and back; object arrays and what torch must reduce itself (non-CPU, sparse)
fall back; and what arrives matches what torch.multiprocessing delivers."""

from __future__ import annotations

import io
import multiprocessing.resource_sharer
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions as torch_reductions

import shmshare.multiprocessing as smp
from shmshare.multiprocessing import _reduce
from tests.mp import helpers
from tests.mp.helpers import _mp_shutdown, fingerprint  # noqa: F401

NP_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
             np.uint64, np.float16, np.float32, np.float64, np.longdouble, np.complex64,
             np.complex128, ">i2", ">i4", ">u8", ">f4", ">f8", ">c16", "<f8", "U7", "S5", "S1",
             "V12", "M8[ns]", "M8[D]", "m8[s]", "m8[us]",
             [("a", "<i4"), ("b", "<f8", (2,))],
             np.dtype([("x", "u1"), ("y", "<i8")], align=True),
             [("outer", [("u", ">u2"), ("s", "S3")]), ("t", "M8[ms]")]]


def _random(dt: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    n = int(np.prod(shape))
    raw = np.random.default_rng(seed).integers(0, 256, dt.itemsize * n, dtype=np.uint8)
    arr = np.frombuffer(raw.tobytes(), dtype=dt).reshape(shape).copy()
    if dt == np.bool_:
        arr = raw.reshape(shape) % 2 == 1
    return arr


@pytest.fixture(scope="module")
def _echo_child():
    """One echo child for the module (made before the first test's leak snapshot, so its
    queues and sentinel are no test's leak); each test's shutdown() ends only this process's
    pool, and the next test's handles name a fresh one. Spawned, not forked: the child runs
    torch ops (to_dense, comparisons), which hang in a forked child once the parent has used
    torch's OpenMP pool -- as every earlier test module of the suite may have (torch's own
    fork hazard)."""
    with helpers.EchoChild("spawn") as child:
        yield child


@pytest.fixture
def echo(_echo_child):
    assert _echo_child.proc.is_alive(), "the echo child died in an earlier test"
    try:
        yield _echo_child
    finally:
        # what went by torch's own reducer (fd strategy) started multiprocessing's fd sharer
        multiprocessing.resource_sharer.stop(timeout=10)


def _assert_trip(echo, arr, *, as_handle=True, handles=1):
    before = smp.statistics()
    (info, got_handle, _), back = echo.trip(arr)
    assert info == fingerprint(arr)  # what the child saw
    assert got_handle is as_handle
    assert fingerprint(back) == fingerprint(arr)  # what came back
    assert back.dtype == arr.dtype and back.shape == arr.shape
    made = smp.statistics().handles_pickled - before.handles_pickled
    assert made == (handles if as_handle else 0)
    return back


def _assert_tensor_trip(echo, t):
    """A tensor there and back: the child sends on what it received, so our pool lends the block
    a second time (Note [Lending on]) and what comes back is our own storage."""
    back = _assert_trip(echo, t, handles=2)
    assert back.untyped_storage()._cdata == t.untyped_storage()._cdata
    return back


# -- numpy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NP_DTYPES, ids=str)
def test_every_numpy_dtype_round_trips(echo, dtype):
    dt = np.dtype(dtype)
    arr = _random(dt, (max(2, 4096 // dt.itemsize // 8), 8))
    assert arr.nbytes >= smp.BY_VALUE_BELOW
    _assert_trip(echo, arr)


def _layouts():
    base = np.arange(160 * 80, dtype=np.float64).reshape(160, 80)
    return {
        "C": base.copy(),
        "fortran": np.asfortranarray(base),
        "transposed": base.T,
        "stepped": base[1::3, 2::5],
        "negative": base[::-1, ::-2],
        "column": base[:, 7],
        "3d-swapped": base.reshape(20, 8, 80).swapaxes(0, 2),
        "broadcast": np.broadcast_to(base[0], (40, 80)),
        "big-0d": np.array(b"x" * 3000, dtype="S3000"),
        "fortran-int8": np.asfortranarray(np.arange(64 * 64, dtype=np.int64).reshape(64, 64)
                                          .astype(np.int8)),
    }


def test_every_layout_round_trips(echo):
    # one test for all (each test costs the leak checker's gc twice): the name is in the message
    for name, arr in _layouts().items():
        try:
            back = _assert_trip(echo, arr)
            np.testing.assert_array_equal(back, arr)
        except AssertionError as exc:
            raise AssertionError(f"layout {name!r}: {exc}") from exc


def test_layouts_of_pool_arrays_go_in_place(echo):
    pool = smp.empty((160, 80))
    pool[...] = np.arange(160 * 80, dtype=np.float64).reshape(160, 80)
    views = {"stepped": pool[1::3, 2::5], "negative": pool[::-1, ::-2], "transposed": pool.T,
             "3d-swapped": pool.reshape(20, 8, 80).swapaxes(0, 2), "row": pool[3]}
    src = _layouts()
    src["row"] = src["C"][3]
    for name, view in views.items():
        try:
            before = smp.statistics()
            back = _assert_trip(echo, view)
            assert smp.statistics().arrays_in_place - before.arrays_in_place == 1
            np.testing.assert_array_equal(back, src[name])
        except AssertionError as exc:
            raise AssertionError(f"view {name!r} of a pool array: {exc}") from exc


def test_small_0d_and_empty_arrays_go_by_value(echo):
    for arr in [np.array(3.5), np.array(-2, dtype="<i8"), np.zeros((0, 3)),
                np.zeros((0, 3), dtype="U4"), np.zeros((5, 0), dtype=[("a", "i4")]),
                smp.zeros((0, 3)), np.arange(5, dtype=np.uint16)]:
        back = _assert_trip(echo, arr, as_handle=False)
        assert back.shape == arr.shape and back.dtype == arr.dtype


def test_small_big_endian_arrays_arrive_as_plain_pickle_delivers_them(echo):
    """By value, an array is pickled as multiprocessing always did (numpy's own reduction at
    ForkingPickler's protocol), which gives a non-native byte order back as native: the values
    are right, the dtype is what plain pickle makes of it. A handle keeps the byte order."""
    for arr in [np.array(-2, dtype=">i8"), np.arange(9, dtype=">f4").reshape(3, 3)]:
        plain = pickle.loads(pickle.dumps(arr, protocol=pickle.DEFAULT_PROTOCOL))
        (info, got_handle, _), back = echo.trip(arr)
        assert got_handle is False
        assert info == fingerprint(plain) and fingerprint(back) == fingerprint(plain)
        np.testing.assert_array_equal(back, arr)


def test_large_array_round_trips(echo):
    arr = np.random.default_rng(3).standard_normal(1 << 20)  # 8 MiB
    back = _assert_trip(echo, arr)
    assert back.nbytes == 8 << 20
    np.testing.assert_array_equal(back, arr)


def test_object_arrays_pickle_by_value(echo):
    arr = np.array([1, "two", None, (3,), 4.5] * 400, dtype=object)
    struct = np.array([(1, "a"), (2, None)] * 300, dtype=[("i", "i8"), ("o", "O")])
    for obj in (arr, struct):
        assert obj.nbytes >= smp.BY_VALUE_BELOW
        before = smp.statistics()
        (info, got_handle, _), back = echo.trip(obj)
        assert got_handle is False and info == fingerprint(obj)
        assert smp.statistics().handles_pickled == before.handles_pickled
        assert back.dtype == obj.dtype and back.shape == obj.shape
        assert back.tolist() == obj.tolist()


def test_memmap_subclass_pickles_as_before(echo, tmp_path):
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(1024,))
    mm[:] = np.arange(1024)
    before = smp.statistics()
    (info, got_handle, _), back = echo.trip(mm)
    assert got_handle is False and info[1] == "memmap"
    assert smp.statistics().handles_pickled == before.handles_pickled
    np.testing.assert_array_equal(back, np.arange(1024, dtype=np.float32))
    del mm, back


# -- torch ----------------------------------------------------------------------------------------

TORCH_DTYPES = [d for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    getattr(torch, "complex32", None),
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
    getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None),
    getattr(torch, "float8_e8m0fnu", None), getattr(torch, "float4_e2m1fn_x2", None),
) if d is not None]


def _random_tensor(dtype: torch.dtype, n: int = 2048, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        return raw[:n] % 2 == 1
    return raw.view(dtype)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_torch_dtype_round_trips(echo):
    # one test for all (each test costs the leak checker's gc twice): the dtype is in the message
    assert len(TORCH_DTYPES) >= 15
    for dtype in TORCH_DTYPES:
        try:
            t = _random_tensor(dtype).reshape(32, -1)
            back = _assert_tensor_trip(echo, t)
            assert type(back) is torch.Tensor and back.dtype == dtype
        except AssertionError as exc:
            raise AssertionError(f"{dtype}: {exc}") from exc


def _noncontiguous():
    base = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    return {
        "t": base.t(),
        "step": base[::2],
        "step-cols": base[:, 1::3],
        "expand": torch.arange(512, dtype=torch.float64).expand(6, 512),
        "expand-0": torch.tensor([1.5], dtype=torch.float64).expand(3000),
        "permute": base.reshape(4, 16, 48).permute(2, 0, 1),
        "offset": base[10:, 5:],
        "0d": torch.tensor(2.5),  # any size: its storage is shared, as torch shares it
    }


def test_noncontiguous_tensors_round_trip(echo):
    for name, t in _noncontiguous().items():
        try:
            back = _assert_tensor_trip(echo, t)
            assert torch.equal(back, t)
            assert back.stride() == t.stride() and back.storage_offset() == t.storage_offset()
        except AssertionError as exc:
            raise AssertionError(f"tensor {name!r}: {exc}") from exc


def test_requires_grad_leaf_and_parameters_keep_what_they_are(echo):
    leaf = torch.randn(1024, requires_grad=True)
    (info, got_handle, _), back = echo.trip(leaf)
    assert info == fingerprint(leaf) and got_handle
    assert back.requires_grad and back.is_leaf and type(back) is torch.Tensor
    assert torch.equal(back.detach(), leaf.detach())
    for rg in (True, False):
        p = torch.nn.Parameter(torch.randn(16, 64), requires_grad=rg)
        before = smp.statistics()
        (info, got_handle, _), back = echo.trip(p)
        assert info == fingerprint(p) and got_handle
        assert smp.statistics().handles_pickled - before.handles_pickled == 2  # out, and lent back
        assert type(back) is torch.nn.Parameter and back.requires_grad is rg
        assert torch.equal(back.detach(), p.detach())


def _dumps_with(reducer, obj):
    buf = io.BytesIO()
    p = ForkingPickler(buf)
    p.dispatch_table[torch.Tensor] = reducer
    p.dispatch_table[torch.nn.Parameter] = reducer
    p.dump(obj)
    return buf.getvalue()


def test_non_leaf_requiring_grad_raises_what_torch_raises():
    leaf = torch.randn(1024, requires_grad=True)
    nonleaf = leaf * 2
    with pytest.raises(RuntimeError) as theirs:
        _dumps_with(torch_reductions.reduce_tensor, nonleaf)
    with pytest.raises(RuntimeError) as ours:
        _dumps_with(_reduce.reduce_tensor, nonleaf)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(RuntimeError) as registered:
        ForkingPickler.dumps(nonleaf)  # what smp.Queue would do
    assert str(registered.value) == str(theirs.value)
    sq = smp.get_context("fork").SimpleQueue()
    try:
        with pytest.raises(RuntimeError, match="Cowardly refusing"):
            sq.put(nonleaf)
    finally:
        sq.close()
    assert smp.statistics().handles_pickled == 0


def test_meta_tensors_fall_back_to_torchs_reducer(echo):
    t = torch.empty(4096, device="meta")
    assert _reduce.reduce_tensor(t)[0] is torch_reductions.reduce_tensor(t)[0]
    (info, _, _), back = echo.trip(t)
    assert info == fingerprint(t)
    assert back.device.type == "meta" and back.shape == t.shape and back.dtype == t.dtype
    assert smp.statistics().handles_pickled == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_tensors_fall_back_to_torchs_reducer():
    t = torch.ones(1024, device="cuda")
    assert _reduce.reduce_tensor(t)[0] is torch_reductions.reduce_tensor(t)[0]


def test_sparse_coo_round_trips_through_torchs_reducer_and_our_storages(echo):
    idx = torch.stack([torch.arange(0, 2000, 2), torch.arange(1000) % 7])
    t = torch.sparse_coo_tensor(idx, torch.randn(1000), (2000, 7)).coalesce()
    assert _reduce.reduce_tensor(t)[0] is torch_reductions.reduce_tensor(t)[0]
    (info, _, _), back = echo.trip(t)
    assert info == fingerprint(t)
    assert back.is_sparse and back.shape == t.shape
    assert torch.equal(back.to_dense(), t.to_dense())
    # torch's reduce_sparse_tensor calls its own reduce_tensor on the indices and values, which
    # leaves their storages to the pickler: ours, two handles, and two more lent for the way back
    assert smp.statistics().handles_pickled == 4


def test_quantized_tensors_fall_back_to_torchs_reducer(echo):
    t = torch.quantize_per_tensor(torch.randn(2048), 0.1, 3, torch.qint8)
    assert _reduce.reduce_tensor(t)[0] is torch_reductions.reduce_tensor(t)[0]
    _, back = echo.trip(t)
    # torch.multiprocessing itself loses the quantizer (q_scale() then fails) in 2.13: only the
    # representation is compared
    assert back.is_quantized and back.dtype == torch.qint8
    assert torch.equal(back.int_repr(), t.int_repr())
    assert smp.statistics().handles_pickled == 2  # its storage, through ours, and lent back


def test_empty_torch_dtype_tensors_are_pool_tensors_and_go_in_place(echo):
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        t = smp.zeros((16, 128), dtype=dtype)
        assert type(t) is torch.Tensor and t.dtype == dtype
        t.copy_(_random_tensor(dtype).reshape(16, 128))
        before = smp.statistics()
        (info, got_handle, _), back = echo.trip(t)
        assert info == fingerprint(t) and got_handle
        assert smp.statistics().arrays_in_place - before.arrays_in_place == 2  # out, and lent back
        assert fingerprint(back) == fingerprint(t)  # random bits: NaNs, so bytes, not equal()


def test_share_memory_tensor_goes_in_place_and_writes_are_shared():
    """Note [What goes as a handle]: a tensor torch has put in shared memory goes with no copy
    (statistics count it in arrays_in_place); so a child's writes land in the parent's tensor."""
    t = torch.zeros(2048, dtype=torch.float64).share_memory_()
    ctx = smp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    before = smp.statistics()
    try:
        with helpers.child(helpers.write_into, inq, outq):
            inq.put(t)
            total, _as_handle, _writable = outq.get(timeout=helpers.WAIT)
            after = smp.statistics()
            seen = (float(t[0]), float(t[-1]))
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)
        del t, inq, outq  # asserted below, after the tensor and the queues are gone
    assert total == 15.0
    assert after.handles_pickled - before.handles_pickled == 1
    assert (after.arrays_in_place - before.arrays_in_place,
            after.arrays_copied - before.arrays_copied) == (1, 0)
    assert seen == (7.0, 8.0)  # the child wrote into our tensor's memory


# -- side by side with torch.multiprocessing --------------------------------------------------------


def _side_by_side_tensors():
    leaf = torch.randn(256, 8, requires_grad=True)
    return [
        torch.arange(4096, dtype=torch.float32).reshape(64, 64),
        torch.arange(4096, dtype=torch.float32).reshape(64, 64).t(),
        torch.arange(600, dtype=torch.int64)[::3],
        _random_tensor(torch.bfloat16, 1024),
        torch.randn(512, dtype=torch.complex64),
        torch.arange(512, dtype=torch.float64).expand(4, 512),
        torch.tensor([True, False] * 1024),
        leaf,
        torch.nn.Parameter(torch.randn(64, 64)),
        torch.nn.Parameter(torch.randn(64, 64), requires_grad=False),
        torch.tensor(7, dtype=torch.int16),  # shared on both sides, however small
    ]


def test_what_arrives_matches_torch_multiprocessing():
    """Each tensor goes once through a Queue with torch's reducers and once with ours; the same
    child reports both, and the reports must be equal."""
    ctx = smp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    tensors = _side_by_side_tensors()
    try:
        with helpers.child(helpers.report, inq, outq):
            for t in tensors:
                want = fingerprint(t)
                before = smp.statistics()
                inq.put(t)  # ours first: torch's moves the tensor's storage to shared memory
                ours, ours_handle, _ = outq.get(timeout=helpers.WAIT)
                made = smp.statistics().handles_pickled - before.handles_pickled
                try:
                    torch_mp.reductions.init_reductions()
                    inq.put(t)
                    theirs, theirs_handle, _ = outq.get(timeout=helpers.WAIT)  # pickled by now
                finally:
                    smp.init_reductions()
                assert ours == theirs == want, t
                assert ours_handle is (made == 1)
                assert theirs_handle is False  # torch's own storage, not a view of our pool
                assert made == 1  # one storage, one handle, whatever its size
            inq.put(None)
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)
        multiprocessing.resource_sharer.stop(timeout=10)
        del tensors


def test_reducers_are_ours_after_torch_multiprocessing():
    assert ForkingPickler._extra_reducers[torch.Tensor] is _reduce.reduce_tensor
    assert ForkingPickler._extra_reducers[torch.nn.Parameter] is _reduce.reduce_tensor
    assert ForkingPickler._extra_reducers[torch.UntypedStorage] is _reduce.reduce_storage
    assert ForkingPickler._extra_reducers[np.ndarray] is _reduce.reduce_ndarray


@pytest.mark.parametrize("shape", [(2.5, 1.9), 2.0, "abc", None, (3, "4"), (True, 2), {2: 0}, iter([2])])
def test_a_shape_of_anything_but_ints_is_a_type_error_as_numpys(shape):
    with pytest.raises(TypeError, match=r"a shape is an int or a sequence of ints"):
        smp.zeros(shape, np.float32)
    with pytest.raises(TypeError):
        np.zeros(shape, np.float32)  # what numpy says too (no silent rounding down)
    assert smp.zeros((np.int64(2), 3)).shape == (2, 3) and smp.empty(np.int32(4)).shape == (4,)


@pytest.mark.parametrize("linger", ["x", None, -1, True, float("nan")])
def test_shutdown_with_a_bad_linger_says_so_and_stops_nothing(linger):
    ForkingPickler.dumps(np.ones(4096))  # an owner and its fd server are up
    with pytest.raises(ValueError, match=r"shutdown\(linger=\.\.\.\) takes seconds >= 0"):
        smp.shutdown(linger=linger)
    assert smp.statistics().pid != 0  # still this process's, and shutdown() then stops it
    smp.shutdown()
