"""DLPack capsules made with ctypes: a ``DLManagedTensor`` over memory someone else owns.

Note [DLPack with ctypes]
~~~~~~~~~~~~~~~~~~~~~~~~~
A consumer (``torch.from_dlpack``, ``numpy.from_dlpack``, CuPy) takes a
PyCapsule named ``"dltensor"`` holding a ``DLManagedTensor*``, renames it
``"used_dltensor"`` and calls the tensor's ``deleter`` once it is done with
the memory, maybe from another thread. Here the struct, its shape and
strides arrays and the Python object that owns the memory are kept in a
module-level table under the struct's address (``manager_ctx``); the
deleter, a ctypes callback (which takes the GIL itself), drops that entry.
A capsule that is never consumed calls the deleter from its own destructor,
which checks the name first: a consumed capsule is not ours to clean.

The layout follows ``dlpack.h``: ``DLTensor`` is data, device (type, id),
ndim, dtype (code, bits, lanes), shape, strides (in elements),
byte_offset. The unversioned (0.8) capsule, ``"dltensor"``, has no way to
say "read-only", so read-only memory goes only as a versioned (1.x)
capsule, ``"dltensor_versioned"`` (``DLManagedTensorVersioned``: version,
manager_ctx, deleter, flags, then the tensor), with
``DLPACK_FLAG_BITMASK_READ_ONLY`` set; its consumer renames it
``"used_dltensor_versioned"``. Both are exercised on CPU memory in the
tests (numpy consumes either), so the layouts and the lifetime are proven
without a GPU.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

__all__ = ["CPU", "CUDA", "CUDA_HOST", "READ_ONLY", "dtype_code", "make_capsule"]

CPU, CUDA, CUDA_HOST = 1, 2, 3  # DLDeviceType: kDLCPU, kDLCUDA, kDLCUDAHost
_INT, _UINT, _FLOAT, _COMPLEX, _BOOL = 0, 1, 2, 5, 6  # DLDataTypeCode
_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
READ_ONLY = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
VERSION = (1, 0)  # the versioned layout this module writes


class DLDevice(ctypes.Structure):
    """Mirror ``DLDevice``: where the memory is."""

    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    """Mirror ``DLDataType``: the element type."""

    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    """Mirror ``DLTensor``: the array description."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    """Mirror ``DLManagedTensor``: the description, its owner, and the deleter to call."""


class DLPackVersion(ctypes.Structure):
    """Mirror ``DLPackVersion``."""

    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """Mirror ``DLManagedTensorVersioned`` (DLPack 1.x): with a version and flags (read-only)."""


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]
_DeleterVersioned = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                                     ("deleter", _DeleterVersioned), ("flags", ctypes.c_uint64),
                                     ("dl_tensor", DLTensor)]
_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_live: dict[int, tuple[Any, ...]] = {}  # struct address -> what must live until the deleter runs
_live_lock = threading.RLock()  # re-entrant: a consumer may run a deleter during a collection under it


def make_capsule(address: int, shape: tuple[int, ...], dtype: np.dtype[Any], strides: tuple[int, ...] | None,
                 device_type: int, device_id: int, owner: Any, *, versioned: bool = False,
                 readonly: bool = False) -> Any:
    """Return a capsule over ``address`` that keeps ``owner`` alive until consumed and freed.

    ``"dltensor"`` (DLPack 0.8), or ``"dltensor_versioned"`` (1.0) when
    ``versioned``; ``readonly`` needs ``versioned``, since only the
    versioned struct has the read-only flag. ``strides`` are in bytes (as
    numpy and ``__cuda_array_interface__`` give them), None for C order;
    DLPack wants elements, so each must divide by the item size.
    """
    if readonly and not versioned:
        raise ValueError("a read-only capsule must be versioned: DLPack 0.8 cannot say read-only")
    code = dtype_code(dtype)
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = None
    if strides is not None:
        if any(s % dtype.itemsize for s in strides):
            raise ValueError(f"DLPack needs strides in whole items; {strides} bytes are not multiples of "
                             f"{dtype.itemsize}")
        strides_arr = (ctypes.c_int64 * max(ndim, 1))(*(s // dtype.itemsize for s in strides))
    managed: Any = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    tensor = managed.dl_tensor
    tensor.data = address
    tensor.device = DLDevice(device_type, device_id)
    tensor.ndim = ndim
    tensor.dtype = DLDataType(code, dtype.itemsize * 8, 1)
    tensor.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64)) if strides_arr else None
    tensor.byte_offset = 0
    key = ctypes.addressof(managed)
    managed.manager_ctx = key
    if versioned:
        managed.version = DLPackVersion(*VERSION)
        managed.flags = READ_ONLY if readonly else 0
        managed.deleter = _deleter_versioned
    else:
        managed.deleter = _deleter
    with _live_lock:
        _live[key] = (managed, shape_arr, strides_arr, owner)
    try:
        if versioned:
            return _capsule_new(key, _NAME_VERSIONED, _capsule_destructor_versioned)
        return _capsule_new(key, _NAME, _capsule_destructor)
    except BaseException:
        with _live_lock:
            _live.pop(key, None)
        raise


def dtype_code(dtype: np.dtype[Any]) -> int:
    """Return the ``DLDataTypeCode`` of a numpy dtype, or raise ``TypeError`` for one DLPack lacks."""
    kinds = {"i": _INT, "u": _UINT, "f": _FLOAT, "c": _COMPLEX, "b": _BOOL}
    code = kinds.get(dtype.kind)
    if code is None or not dtype.isnative:
        raise TypeError(f"DLPack cannot describe dtype {dtype} (native int, uint, float, complex and bool only)")
    return code


def live_count() -> int:
    """Return how many capsules' tensors have not been deleted yet (for leak tests)."""
    with _live_lock:
        return len(_live)


# ctypes types what a CFUNCTYPE wraps as Callable[..., Any]: the callbacks' own signatures stay.
@_Deleter  # type: ignore[untyped-decorator]
def _deleter(managed: Any) -> None:
    key = ctypes.cast(managed, ctypes.c_void_p).value
    if key is None:
        return  # a NULL tensor: nothing was registered under it
    with _live_lock:
        _live.pop(key, None)


@_DeleterVersioned  # type: ignore[untyped-decorator]
def _deleter_versioned(managed: Any) -> None:
    key = ctypes.cast(managed, ctypes.c_void_p).value
    if key is None:
        return
    with _live_lock:
        _live.pop(key, None)


def _destroy_unconsumed(capsule: int, name: bytes) -> None:
    # A consumed capsule was renamed "used_...": the consumer calls the deleter.
    if _capsule_is_valid(capsule, name):
        pointer = _capsule_get_pointer(capsule, name)
        with _live_lock:
            entry = _live.pop(pointer, None)
        del entry


@_CapsuleDestructor  # type: ignore[untyped-decorator]
def _capsule_destructor(capsule: int) -> None:
    _destroy_unconsumed(capsule, _NAME)


@_CapsuleDestructor  # type: ignore[untyped-decorator]
def _capsule_destructor_versioned(capsule: int) -> None:
    _destroy_unconsumed(capsule, _NAME_VERSIONED)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
