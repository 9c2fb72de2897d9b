"""The driver model is as strict as the driver: registration, flags, VMM, pointers, fork, capture.

Each test calls the model directly and shows it refusing what the real
driver refuses. The model is NOT a GPU (tests/cuda/driver_model.py).
Devices, contexts and stream order: test_driver_model.py.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable
from typing import Any

import pytest

from shmshare.testing import wait_exit

from .driver_model import DriverModel
from .driver_model_memory import PAGE
from .model_calls import (
    ALREADY_REGISTERED,
    CAPTURE_IMPLICIT,
    CAPTURE_INVALIDATED,
    CAPTURE_UNSUPPORTED,
    ILLEGAL_STATE,
    INVALID_DEVICE,
    INVALID_VALUE,
    NON_BLOCKING,
    NOT_INITIALIZED,
    NOT_PERMITTED,
    NOT_SUPPORTED,
    MiB,
    code,
    device_buffer,
    enter,
    map_anonymous,
    mapping,
    ok,
    pageable,
    pinned,
    stream,
    unmap,
)

TWO = pytest.mark.parametrize("driver_model", [{"devices": 2}], indirect=True)
READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY


# --- registration -----------------------------------------------------------------------------------


def test_register_needs_whole_pages(driver_model: DriverModel) -> None:
    enter(driver_model)
    with mapping(4 * PAGE) as address:
        assert code(driver_model.cuMemHostRegister(address + 64, PAGE, 0)) == INVALID_VALUE
        assert code(driver_model.cuMemHostRegister(address, PAGE + 64, 0)) == INVALID_VALUE
        ok(driver_model.cuMemHostRegister(address, 2 * PAGE, 0))
        ok(driver_model.cuMemHostUnregister(address))


def test_register_refuses_memory_already_page_locked(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    with mapping(4 * PAGE) as address:
        ok(model.cuMemHostRegister(address, 2 * PAGE, 0))
        assert code(model.cuMemHostRegister(address + PAGE, 2 * PAGE, 0)) == ALREADY_REGISTERED
        ok(model.cuMemHostRegister(address + 2 * PAGE, 2 * PAGE, 0))  # beside it: fine
        ok(model.cuMemHostUnregister(address))
        ok(model.cuMemHostUnregister(address + 2 * PAGE))
    locked = pinned(model, 4 * PAGE)
    first_page = (locked + PAGE - 1) // PAGE * PAGE
    assert code(model.cuMemHostRegister(first_page, PAGE, 0)) == ALREADY_REGISTERED  # cuMemHostAlloc's


def test_register_of_read_only_memory_needs_the_read_only_flag(driver_model: DriverModel) -> None:
    enter(driver_model)
    with mapping(2 * PAGE, mmap.PROT_READ) as address:
        assert code(driver_model.cuMemHostRegister(address, 2 * PAGE, 0)) == INVALID_VALUE
        ok(driver_model.cuMemHostRegister(address, 2 * PAGE, READ_ONLY))
        ok(driver_model.cuMemHostUnregister(address))


def test_the_read_only_flag_needs_the_device_attribute(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    model.attributes["CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED"] = 0
    attribute = model.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
    assert ok(model.cuDeviceGetAttribute(attribute, ok(model.cuDeviceGet(0)))) == 0
    with mapping(PAGE) as address:
        assert code(model.cuMemHostRegister(address, PAGE, READ_ONLY)) == NOT_SUPPORTED


def test_unregister_of_memory_munmapped_while_registered_fails_the_test(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    address = map_anonymous(2 * PAGE)
    ok(model.cuMemHostRegister(address, 2 * PAGE, 0))
    unmap(address, 2 * PAGE)  # the stale-DMA-target bug: the driver still has it pinned
    assert model.stale_registrations() == [(address, 2 * PAGE)]  # the fixture fails a test that leaves one
    with pytest.raises(AssertionError, match="unregister of memory already unmapped"):
        model.cuMemHostUnregister(address)
    del model.registered[address]


@pytest.mark.parametrize(("call", "flags"), [
    ("cuStreamCreate", 2), ("cuEventCreate", 8), ("cuEventCreate", 4),  # INTERPROCESS needs DISABLE_TIMING
    ("cuMemHostAlloc", 8), ("cuMemHostRegister", 16),
])
def test_unknown_flag_bits_are_invalid(driver_model: DriverModel, call: str, flags: int) -> None:
    enter(driver_model)
    with mapping(PAGE) as address:
        args: tuple[Any, ...] = (flags,) if call in ("cuStreamCreate", "cuEventCreate") else (
            (PAGE, flags) if call == "cuMemHostAlloc" else (address, PAGE, flags))
        assert code(getattr(driver_model, call)(*args)) == INVALID_VALUE


# --- VMM ----------------------------------------------------------------------------------------------


def _prop(model: DriverModel, device: int = 0, shareable: bool = True) -> Any:
    prop = model.CUmemAllocationProp()
    prop.type = model.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = model.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if shareable:
        prop.requestedHandleTypes = model.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def test_export_needs_the_posix_fd_type_requested_at_create(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    posix = model.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    private = ok(model.cuMemCreate(2 * MiB, _prop(model, shareable=False), 0))
    assert code(model.cuMemExportToShareableHandle(private, posix, 0)) == NOT_PERMITTED
    shared = ok(model.cuMemCreate(2 * MiB, _prop(model), 0))
    fd = ok(model.cuMemExportToShareableHandle(shared, posix, 0))
    os.close(fd)
    none = model.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    assert code(model.cuMemExportToShareableHandle(shared, none, 0)) == NOT_PERMITTED


def test_granularity_is_two_mib_minimum_and_recommended_unless_a_test_says_otherwise(
        driver_model: DriverModel) -> None:
    model = driver_model
    flags = model.CUmemAllocationGranularity_flags
    minimum, recommended = flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    assert ok(model.cuMemGetAllocationGranularity(_prop(model), minimum)) == 2 * MiB
    assert ok(model.cuMemGetAllocationGranularity(_prop(model), recommended)) == 2 * MiB
    model.recommended_granularity = 8 * MiB
    assert ok(model.cuMemGetAllocationGranularity(_prop(model), recommended)) == 8 * MiB
    assert ok(model.cuMemGetAllocationGranularity(_prop(model), minimum)) == 2 * MiB


def test_vmm_sizes_must_be_whole_minimum_granules(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    assert code(model.cuMemCreate(1 * MiB, _prop(model), 0)) == INVALID_VALUE
    assert code(model.cuMemAddressReserve(3 * MiB, 0, 0, 0)) == INVALID_VALUE
    ok(model.cuMemRelease(ok(model.cuMemCreate(4 * MiB, _prop(model), 0))))


@TWO
def test_vmm_memory_belongs_to_the_device_its_prop_names(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    assert code(model.cuMemCreate(2 * MiB, _prop(model, 2), 0)) == INVALID_DEVICE
    handle = ok(model.cuMemCreate(2 * MiB, _prop(model, 1), 0))
    assert model.devices[1].used == 2 * MiB and model.devices[0].used == 0
    start = ok(model.cuMemAddressReserve(2 * MiB, 0, 0, 0))
    ok(model.cuMemMap(start, 2 * MiB, 0, handle, 0))
    desc = model.CUmemAccessDesc()
    desc.location.type = model.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 2
    desc.flags = model.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert code(model.cuMemSetAccess(start, 2 * MiB, [desc], 1)) == INVALID_DEVICE
    ordinal = model.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    assert ok(model.cuPointerGetAttribute(ordinal, int(start) + 4096)) == 1  # inside the mapping


def test_unmap_with_work_pending_on_the_range_fails_the_test_free_waits(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s = stream(model)
    handle = ok(model.cuMemCreate(2 * MiB, _prop(model), 0))
    start = ok(model.cuMemAddressReserve(2 * MiB, 0, 0, 0))
    ok(model.cuMemMap(start, 2 * MiB, 0, handle, 0))
    model.hold(s)
    ok(model.cuMemsetD8Async(start, 1, 4096, s))
    with pytest.raises(AssertionError, match=r"cuMemUnmap of .* while cuMemsetD8Async"):
        model.cuMemUnmap(start, 2 * MiB)  # cuMemUnmap does not wait
    ok(model.cuStreamSynchronize(s))
    ok(model.cuMemUnmap(start, 2 * MiB))
    dst = device_buffer(model)
    model.hold(s)
    ok(model.cuMemsetD8Async(dst, 1, 4096, s))
    ok(model.cuMemFree(dst))  # waits for the work using it, as cudaFree does
    assert model.pending(s) == []


# --- pointer attributes -------------------------------------------------------------------------------


@TWO
def test_pointer_attributes_name_the_device_and_context_of_device_memory(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model, 0)
    ctx1 = enter(model, 1)
    address = device_buffer(model)
    attrs = model.CUpointer_attribute
    assert ok(model.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address)) == 1
    assert int(ok(model.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_CONTEXT, address))) == int(ctx1)
    unknown = ctypes.addressof(pageable())
    assert code(model.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, unknown)) == INVALID_VALUE


# --- a forked child may not use CUDA ------------------------------------------------------------------


def test_a_forked_child_gets_not_initialized(driver_model: DriverModel) -> None:
    enter(driver_model)
    pid = os.fork()
    if pid == 0:  # the child: report what the call returned in the exit code, run nothing else
        try:
            os._exit(10 if code(driver_model.cuDeviceGetCount()) == NOT_INITIALIZED else 11)
        finally:
            os._exit(12)
    assert wait_exit(pid) == 10
    ok(driver_model.cuDeviceGetCount())  # the parent still may


# --- graph capture ------------------------------------------------------------------------------------


def _global(model: DriverModel) -> Any:
    return model.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL


def _status(model: DriverModel, s: Any) -> str:
    return str(model.CUstreamCaptureStatus(int(ok(model.cuStreamIsCapturing(s)))).name)


def test_the_legacy_stream_cannot_capture(driver_model: DriverModel) -> None:
    enter(driver_model)
    assert code(driver_model.cuStreamBeginCapture(0, _global(driver_model))) == CAPTURE_UNSUPPORTED


def test_captured_work_is_recorded_not_run(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, dst = stream(model), device_buffer(model)
    ok(model.cuStreamBeginCapture(s, _global(model)))
    assert code(model.cuStreamBeginCapture(s, _global(model))) == ILLEGAL_STATE
    ok(model.cuMemsetD8Async(dst, 1, 4096, s))
    assert _status(model, s) == "CU_STREAM_CAPTURE_STATUS_ACTIVE" and model.capturing() == [int(s)]
    graph = ok(model.cuStreamEndCapture(s))
    assert model.read(int(dst), 4096) == bytes(4096) and _status(model, s) == "CU_STREAM_CAPTURE_STATUS_NONE"
    ok(model.cuGraphDestroy(graph))


def _unsafe_calls(model: DriverModel, s: Any, event: Any, host: int) -> dict[str, Callable[[], Any]]:
    dst, out, locked = device_buffer(model), pageable(), pinned(model)
    return {
        "cuMemFreeHost": lambda: model.cuMemFreeHost(locked),
        "cuMemHostRegister": lambda: model.cuMemHostRegister(host, PAGE, 0),
        "cuMemcpyHtoD": lambda: model.cuMemcpyHtoD(dst, ctypes.addressof(out), 4096),
        "cuCtxSynchronize": model.cuCtxSynchronize,
        "cuMemAlloc": lambda: model.cuMemAlloc(4096),
        "cuMemFree": lambda: model.cuMemFree(dst),
        "cuMemHostAlloc": lambda: model.cuMemHostAlloc(4096, 0),
        "cuMemcpyDtoH": lambda: model.cuMemcpyDtoH(ctypes.addressof(out), dst, 4096),
        "cuMemsetD8": lambda: model.cuMemsetD8(dst, 1, 4096),
        "cuStreamSynchronize": lambda: model.cuStreamSynchronize(s),
        "cuStreamQuery": lambda: model.cuStreamQuery(s),
        "cuEventQuery": lambda: model.cuEventQuery(event),
        "cuEventSynchronize": lambda: model.cuEventSynchronize(event),
    }


UNSAFE = ["cuMemFreeHost", "cuMemHostRegister", "cuMemcpyHtoD", "cuCtxSynchronize", "cuMemAlloc", "cuMemFree",
          "cuMemHostAlloc", "cuMemcpyDtoH", "cuMemsetD8", "cuStreamSynchronize", "cuStreamQuery", "cuEventQuery",
          "cuEventSynchronize"]


@pytest.mark.parametrize("unsafe", UNSAFE)
def test_an_unsafe_call_during_a_global_capture_fails_and_invalidates_it(driver_model: DriverModel,
                                                                          unsafe: str) -> None:
    model = driver_model
    enter(model)
    s, event = stream(model, NON_BLOCKING), ok(model.cuEventCreate(0))
    with mapping(PAGE) as host:
        calls = _unsafe_calls(model, s, event, host)
        ok(model.cuStreamBeginCapture(s, _global(model)))
        ok(model.cuEventRecord(event, s))
        assert code(calls[unsafe]()) == CAPTURE_UNSUPPORTED
        assert _status(model, s) == "CU_STREAM_CAPTURE_STATUS_INVALIDATED"
        assert code(model.cuStreamEndCapture(s)) == CAPTURE_INVALIDATED
        ok(model.cuStreamSynchronize(s))  # capture over: an ordinary stream again
        assert not model.registered


def test_a_relaxed_capture_lets_process_wide_calls_through_but_not_a_sync_of_itself(
        driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s = stream(model)
    ok(model.cuStreamBeginCapture(s, model.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
    ok(model.cuMemFree(device_buffer(model)))
    assert code(model.cuStreamSynchronize(s)) == CAPTURE_UNSUPPORTED
    assert code(model.cuStreamEndCapture(s)) == CAPTURE_INVALIDATED


def test_the_legacy_stream_is_implicitly_in_a_blocking_stream_s_capture(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    free, blocking = stream(model, NON_BLOCKING), stream(model)
    ok(model.cuStreamBeginCapture(free, _global(model)))
    assert _status(model, 0) == "CU_STREAM_CAPTURE_STATUS_NONE"  # a non-blocking capture does not involve it
    ok(model.cuStreamEndCapture(free))
    ok(model.cuStreamBeginCapture(blocking, _global(model)))
    assert code(model.cuStreamIsCapturing(0)) == CAPTURE_IMPLICIT
    ok(model.cuStreamEndCapture(blocking))


def test_a_thread_in_relaxed_interaction_mode_may_make_unsafe_calls_during_a_global_capture(
        driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, before = stream(model, NON_BLOCKING), ok(model.cuEventCreate(0))
    ok(model.cuEventRecord(before, 0))  # recorded before the capture, on another stream
    ok(model.cuStreamBeginCapture(s, _global(model)))
    relaxed = model.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = ok(model.cuThreadExchangeStreamCaptureMode(relaxed))
    assert int(previous) == 0  # GLOBAL, every thread's default
    ok(model.cuEventQuery(before))
    ok(model.cuMemFree(device_buffer(model)))
    ok(model.cuThreadExchangeStreamCaptureMode(previous))
    assert code(model.cuEventQuery(before)) == CAPTURE_UNSUPPORTED  # global again: even an event from before
    assert code(model.cuStreamEndCapture(s)) == CAPTURE_INVALIDATED
