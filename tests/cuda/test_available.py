"""What shmshare.cuda does without a GPU: say why, import lazily, and build its descriptors."""

from __future__ import annotations

import gc
import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest

from shmshare import cuda
from shmshare.cuda import _dlpack, _driver
from shmshare.memory import ProviderOutOfMemory


@pytest.mark.skipif(cuda.available(), reason="CUDA is available on this machine")
def test_without_a_gpu_available_is_false_with_a_reason() -> None:
    reason = cuda.why_unavailable()
    assert not cuda.available() and reason
    assert "cuda-python" in reason or "libcuda" in reason or "CUDA_ERROR" in reason or "device" in reason
    with pytest.raises(cuda.CudaUnavailable, match="CUDA is not available"):
        cuda.Context.primary(0)
    with pytest.raises(cuda.CudaUnavailable):
        cuda.CudaDeviceProvider()


def test_importing_shmshare_imports_no_cuda_module() -> None:
    code = ("import sys, shmshare, shmshare.cuda, shmshare.memory; "
            "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def _stub_driver(**calls: Any) -> types.SimpleNamespace:
    names = {0: "CUDA_SUCCESS", 100: "CUDA_ERROR_NO_DEVICE", 999: "CUDA_ERROR_UNKNOWN"}

    class CUresult(int):
        @property
        def name(self) -> str:
            return names[int(self)]

    def bind(answer: Any) -> Any:
        return lambda *args: answer(CUresult)

    defaults = {"cuInit": lambda flags: (CUresult(0),), "cuDeviceGetCount": lambda: (CUresult(0), 1)}
    defaults.update({name: bind(answer) for name, answer in calls.items()})
    return types.SimpleNamespace(CUresult=CUresult, **defaults)


def _raise(exc: BaseException) -> Any:
    raise exc


@pytest.mark.parametrize("stub, reason", [
    (None, "cuda-python is not installed"),
    ({"cuInit": lambda R: _raise(RuntimeError("libcuda.so.1: cannot open"))}, "libcuda.so could not be loaded"),
    ({"cuInit": lambda R: (R(100),)}, "cuInit(0) failed with CUDA_ERROR_NO_DEVICE"),
    ({"cuDeviceGetCount": lambda R: (R(999), 0)}, "cuDeviceGetCount() failed with CUDA_ERROR_UNKNOWN"),
    ({"cuDeviceGetCount": lambda R: (R(0), 0)}, "no CUDA device is visible"),
])
def test_each_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch, stub: Any, reason: str) -> None:
    def importer() -> Any:
        if stub is None:
            raise ImportError("No module named 'cuda'")
        return _stub_driver(**stub)

    monkeypatch.setattr(_driver, "_import_driver", importer)
    monkeypatch.setattr(_driver, "_state", None)
    monkeypatch.setattr(_driver, "_forked_after_init", False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert reason in (cuda.why_unavailable() or "")
    assert not cuda.available()


def test_a_forked_child_is_told_to_use_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_driver, "_forked_after_init", True)
    assert "spawn" in (cuda.why_unavailable() or "")


def test_a_driver_error_names_the_call_and_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = _stub_driver(cuMemAlloc=lambda R: (R(999), None), cuMemFree=lambda R: (R(0),))
    monkeypatch.setattr(_driver, "_state", (stub, None))
    monkeypatch.setattr(_driver, "_forked_after_init", False)
    with pytest.raises(cuda.CudaError, match=r"cuMemAlloc\(4096\) failed with CUDA_ERROR_UNKNOWN") as info:
        _driver.call("cuMemAlloc", 4096)
    assert (info.value.call, info.value.result, info.value.result_name) == ("cuMemAlloc", 999, "CUDA_ERROR_UNKNOWN")
    assert _driver.call("cuMemFree", 1) is None


def test_out_of_memory_is_the_providers_out_of_memory() -> None:
    exc = cuda.CudaOutOfMemory("cuMemAlloc(...) failed with CUDA_ERROR_OUT_OF_MEMORY", call="cuMemAlloc", result=2)
    assert isinstance(exc, ProviderOutOfMemory) and isinstance(exc, MemoryError) and isinstance(exc, cuda.CudaError)


class _TorchLike:
    cuda_stream = 0x5000


class _CupyLike:
    ptr = 0x6000


class _Protocol:
    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0x7000)


@pytest.mark.parametrize("stream, handle", [(None, 0), (0, 0), (0x1234, 0x1234), (_TorchLike(), 0x5000),
                                            (_CupyLike(), 0x6000), (_Protocol(), 0x7000)])
def test_any_stream_object_gives_its_handle(stream: Any, handle: int) -> None:
    assert cuda.stream_handle(stream) == handle


@pytest.mark.parametrize("bad, error", [(True, TypeError), ("s", TypeError), (-1, ValueError), (1.5, TypeError)])
def test_bad_streams_are_refused(bad: Any, error: type) -> None:
    with pytest.raises(error):
        cuda.stream_handle(bad)


def test_a_device_array_describes_itself_in_cuda_array_interface_v3() -> None:
    arr = cuda.DeviceArray(0x7F00_0000_0000, (3, 4), np.float16, device=1)
    cai = arr.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (3, 4) and cai["typestr"] == "<f2"
    assert cai["data"] == (0x7F00_0000_0000, False) and cai["strides"] is None
    assert "stream" not in cai  # ready on any stream (an array with a stream is synchronized first: the model tests)
    assert arr.__dlpack_device__() == (2, 1) and arr.nbytes == 24
    for bad in ({"address": -1}, {"address": True}, {"shape": (-1,)}, {"strides": (1, 2)}):
        kw = {"address": 0x10, "shape": (4,), **bad}
        with pytest.raises(ValueError):
            cuda.DeviceArray(kw.pop("address"), kw.pop("shape"), **kw)


def test_dlpack_refuses_copies_other_devices_and_stream_zero() -> None:
    arr = cuda.DeviceArray(0x10, 4, device=0)
    with pytest.raises(BufferError):
        arr.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        arr.__dlpack__(dl_device=(2, 1))
    with pytest.raises(ValueError, match="ambiguous"):
        arr.__dlpack__(stream=0)


class _HostDLPack:
    """A CPU array exported through shmshare's ctypes DLManagedTensor (what DeviceArray uses)."""

    def __init__(self, arr: np.ndarray, shape: tuple[int, ...] | None = None,
                 strides: tuple[int, ...] | None = None) -> None:
        self.arr, self.shape, self.strides = arr, shape or arr.shape, strides

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.CPU, 0)

    def __dlpack__(self, **kw: Any) -> Any:
        return _dlpack.make_capsule(self.arr.ctypes.data, self.shape, self.arr.dtype, self.strides,
                                    _dlpack.CPU, 0, self)


def test_dlpack_capsules_go_into_numpy_without_a_copy_and_are_deleted() -> None:
    src = np.arange(12, dtype=np.int32).reshape(3, 4)
    before = _dlpack.live_count()
    out = np.from_dlpack(_HostDLPack(src))
    assert out.ctypes.data == src.ctypes.data and (out == src).all()
    transposed = np.from_dlpack(_HostDLPack(src, (4, 3), (4, 16)))
    assert (transposed == src.T).all()
    del out, transposed
    gc.collect()
    assert _dlpack.live_count() == before
    capsule = _HostDLPack(src).__dlpack__()
    assert _dlpack.live_count() == before + 1
    del capsule  # never consumed: its destructor deletes the tensor
    assert _dlpack.live_count() == before


def test_dlpack_capsules_go_into_torch_without_a_copy() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional test dependency")
    src = np.arange(6, dtype=np.float64)
    before = _dlpack.live_count()
    t = torch.from_dlpack(_HostDLPack(src))
    assert t.data_ptr() == src.ctypes.data and t.tolist() == src.tolist()
    flags = torch.from_dlpack(_HostDLPack(np.array([True, False, True])))
    assert flags.dtype == torch.bool and flags.tolist() == [True, False, True]
    del t, flags
    gc.collect()
    assert _dlpack.live_count() == before


@pytest.mark.parametrize("dtype", ["U3", ">i4", "O", "M8[s]"])
def test_dlpack_refuses_dtypes_it_cannot_describe(dtype: str) -> None:
    with pytest.raises(TypeError, match="DLPack cannot describe"):
        _dlpack.dtype_code(np.dtype(dtype))


def test_dlpack_refuses_strides_that_are_not_whole_items() -> None:
    with pytest.raises(ValueError, match="whole items"):
        _dlpack.make_capsule(0x10, (2,), np.dtype(np.int32), (6,), _dlpack.CPU, 0, None)


def test_copies_refuse_host_buffers_they_would_overrun():
    import numpy as np

    from shmshare.cuda import copy_device_to_host, copy_host_to_device

    small = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="holds 16 bytes, 64 were asked"):
        copy_host_to_device(0x1000, small, 64)
    with pytest.raises(ValueError, match="C-contiguous"):
        copy_host_to_device(0x1000, np.zeros((4, 4), np.uint8)[:, 1], 2)
    ro = np.zeros(16, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_device_to_host(ro, 0x1000, 8)


class _VersionedHostDLPack(_HostDLPack):
    """The same, as a DLPack 1.x capsule, read-only when asked."""

    def __init__(self, arr: np.ndarray, readonly: bool) -> None:
        super().__init__(arr)
        self.readonly = readonly

    def __dlpack__(self, **kw: Any) -> Any:
        return _dlpack.make_capsule(self.arr.ctypes.data, self.shape, self.arr.dtype, None, _dlpack.CPU, 0,
                                    self, versioned=True, readonly=self.readonly)


def test_versioned_capsules_carry_read_only_into_numpy_and_are_deleted() -> None:
    src = np.arange(8, dtype=np.int16)
    before = _dlpack.live_count()
    ro = np.from_dlpack(_VersionedHostDLPack(src, readonly=True))
    assert ro.ctypes.data == src.ctypes.data and not ro.flags.writeable and (ro == src).all()
    rw = np.from_dlpack(_VersionedHostDLPack(src, readonly=False))
    assert rw.flags.writeable
    del ro, rw
    gc.collect()
    assert _dlpack.live_count() == before
    capsule = _VersionedHostDLPack(src, readonly=True).__dlpack__()
    assert "dltensor_versioned" in repr(capsule)
    del capsule  # never consumed: its destructor deletes the tensor
    assert _dlpack.live_count() == before
    with pytest.raises(ValueError, match="must be versioned"):
        _dlpack.make_capsule(src.ctypes.data, (8,), src.dtype, None, _dlpack.CPU, 0, None, readonly=True)


def test_a_read_only_device_array_goes_only_to_a_versioned_consumer() -> None:
    arr = cuda.DeviceArray(0x10, 4, device=0, readonly=True)
    with pytest.raises(BufferError, match="read-only"):
        arr.__dlpack__()  # an unversioned capsule would be taken as writable
    with pytest.raises(BufferError, match="read-only"):
        arr.__dlpack__(max_version=(0, 8))
    before = _dlpack.live_count()
    capsule = arr.__dlpack__(max_version=(1, 0), stream=-1)
    assert "dltensor_versioned" in repr(capsule)
    del capsule
    assert _dlpack.live_count() == before
    assert "dltensor\"" in repr(cuda.DeviceArray(0x10, 4).__dlpack__(max_version=(1, 0), stream=-1))
