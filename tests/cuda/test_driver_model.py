"""The driver model is as strict as the driver: devices, contexts, streams, events, stream order.

Each test calls the model directly (``model.cuXxx(...)``, cuda-python-style
tuples back) and shows it refusing what the real driver refuses, or
ordering work as a GPU would. The model is NOT a GPU (tests/cuda/driver_model.py).
Memory, registration, VMM, fork and capture: test_driver_model_memory.py.
"""

from __future__ import annotations

import ctypes
import threading

import pytest

from .driver_model import DriverModel
from .model_calls import (
    CONTEXT_IS_DESTROYED,
    INVALID_CONTEXT,
    INVALID_DEVICE,
    INVALID_HANDLE,
    NON_BLOCKING,
    NOT_READY,
    code,
    device_buffer,
    enter,
    fill,
    ok,
    pageable,
    pinned,
    stream,
)

TWO = pytest.mark.parametrize("driver_model", [{"devices": 2}], indirect=True)


def landed(model: DriverModel, address: object, nbytes: int = 4096) -> bytes:
    return model.read(int(address), nbytes)  # type: ignore[call-overload]


# --- several devices, a context stack per thread ----------------------------------------------------


@TWO
def test_each_device_has_its_own_context_uuid_and_memory(driver_model: DriverModel) -> None:
    model = driver_model
    assert ok(model.cuDeviceGetCount()) == 2
    assert code(model.cuDeviceGet(2)) == INVALID_DEVICE
    devs = [ok(model.cuDeviceGet(d)) for d in (0, 1)]
    ctxs = [ok(model.cuDevicePrimaryCtxRetain(dev)) for dev in devs]
    assert int(ctxs[0]) != int(ctxs[1])
    uuids = [bytes(ok(model.cuDeviceGetUuid(dev)).bytes) for dev in devs]
    assert uuids[0] != uuids[1]
    ok(model.cuCtxPushCurrent(ctxs[1]))
    assert int(ok(model.cuCtxGetDevice())) == 1
    device_buffer(model, 4 << 20)
    free1, total1 = ok(model.cuMemGetInfo())
    ok(model.cuCtxSetCurrent(ctxs[0]))
    free0, total0 = ok(model.cuMemGetInfo())
    assert total0 == total1 and free1 == total1 - (4 << 20) and free0 == total0  # device 1's, not 0's


def test_the_context_stack_pushes_pops_and_replaces_its_top(driver_model: DriverModel) -> None:
    model = driver_model
    ctx = ok(model.cuDevicePrimaryCtxRetain(ok(model.cuDeviceGet(0))))
    assert int(ok(model.cuCtxGetCurrent())) == 0
    assert code(model.cuCtxPopCurrent()) == INVALID_CONTEXT  # nothing to pop
    ok(model.cuCtxSetCurrent(ctx))  # an empty stack: pushed
    ok(model.cuCtxPushCurrent(ctx))
    assert int(ok(model.cuCtxPopCurrent())) == int(ctx)
    assert int(ok(model.cuCtxGetCurrent())) == int(ctx)  # the one SetCurrent pushed is still there
    ok(model.cuCtxSetCurrent(0))  # NULL pops the top
    assert int(ok(model.cuCtxGetCurrent())) == 0
    seen: list[int] = []
    ok(model.cuCtxPushCurrent(ctx))
    thread = threading.Thread(target=lambda: seen.append(int(ok(model.cuCtxGetCurrent()))))
    thread.start()
    thread.join(30)
    assert seen == [0]  # each thread has its own stack


def test_a_call_that_needs_a_context_fails_without_one_or_with_a_released_one(driver_model: DriverModel) -> None:
    model = driver_model
    assert code(model.cuMemAlloc(4096)) == INVALID_CONTEXT
    assert code(model.cuStreamCreate(0)) == INVALID_CONTEXT
    enter(model)
    ok(model.cuDevicePrimaryCtxRelease(ok(model.cuDeviceGet(0))))  # the last release resets it
    assert code(model.cuMemAlloc(4096)) == CONTEXT_IS_DESTROYED


def test_the_primary_context_is_active_while_retained(driver_model: DriverModel) -> None:
    model = driver_model
    dev = ok(model.cuDeviceGet(0))
    assert ok(model.cuDevicePrimaryCtxGetState(dev))[1] == 0
    ok(model.cuDevicePrimaryCtxRetain(dev))
    ok(model.cuDevicePrimaryCtxRetain(dev))
    ok(model.cuDevicePrimaryCtxRelease(dev))
    assert ok(model.cuDevicePrimaryCtxGetState(dev))[1] == 1
    ok(model.cuDevicePrimaryCtxRelease(dev))
    assert ok(model.cuDevicePrimaryCtxGetState(dev))[1] == 0


# --- streams and events belong to a context ---------------------------------------------------------


@TWO
def test_a_stream_of_another_context_is_an_invalid_handle(driver_model: DriverModel) -> None:
    model = driver_model
    ctx1 = enter(model, 1)
    theirs = stream(model)
    dst = device_buffer(model)
    ok(model.cuCtxPopCurrent())
    enter(model, 0)
    assert int(ok(model.cuStreamGetCtx(theirs))) == int(ctx1)
    assert code(model.cuStreamSynchronize(theirs)) == INVALID_HANDLE
    assert code(model.cuStreamQuery(theirs)) == INVALID_HANDLE
    assert code(model.cuMemsetD8Async(dst, 1, 4096, theirs)) == INVALID_HANDLE
    assert code(model.cuStreamDestroy(theirs)) == INVALID_HANDLE
    ok(model.cuCtxPushCurrent(ctx1))
    ok(model.cuStreamDestroy(theirs))


@TWO
def test_an_event_of_another_context_is_refused_but_may_be_waited_on(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model, 1)
    theirs = ok(model.cuEventCreate(0))
    ok(model.cuCtxPopCurrent())
    enter(model, 0)
    mine = stream(model)
    assert code(model.cuEventRecord(theirs, mine)) == INVALID_HANDLE  # not the stream's context
    assert code(model.cuEventQuery(theirs)) == INVALID_HANDLE
    assert code(model.cuEventSynchronize(theirs)) == INVALID_HANDLE
    assert code(model.cuEventDestroy(theirs)) == INVALID_HANDLE
    ok(model.cuStreamWaitEvent(mine, theirs, 0))  # the driver allows a wait across contexts


def test_an_interprocess_event_needs_its_flags_and_opens_as_the_exported_event(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    assert code(model.cuIpcGetEventHandle(ok(model.cuEventCreate(0)))) == INVALID_HANDLE
    exported = ok(model.cuEventCreate(2 | 4))  # DISABLE_TIMING | INTERPROCESS
    opened = ok(model.cuIpcOpenEventHandle(ok(model.cuIpcGetEventHandle(exported))))
    s = stream(model)
    model.hold(s)
    ok(model.cuEventRecord(exported, s))
    assert code(model.cuEventQuery(opened)) == NOT_READY
    model.finish(s)
    ok(model.cuEventQuery(opened))


@TWO
def test_the_legacy_handles_name_the_current_context_s_stream(driver_model: DriverModel) -> None:
    model = driver_model
    assert code(model.cuStreamGetCtx(0)) == INVALID_CONTEXT  # no current context to name
    ctx0 = enter(model, 0)
    dst = device_buffer(model)
    ctx1 = enter(model, 1)
    assert int(ok(model.cuStreamGetCtx(0))) == int(ctx1)
    model.hold(0)  # device 1's legacy stream
    ok(model.cuCtxPushCurrent(ctx0))
    ok(model.cuMemsetD8(dst, 7, 4096))  # device 0's legacy stream is not held
    assert landed(model, dst) == b"\7" * 4096
    assert model.pending(1) == []
    ok(model.cuCtxPopCurrent())
    assert model.pending(0) == ["hold (a long kernel)"]


# --- stream order -------------------------------------------------------------------------------------


def test_a_held_stream_holds_its_memsets_and_copies(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, dst, src = stream(model), device_buffer(model), pageable(fill=5)
    model.hold(s)
    ok(model.cuMemsetD8Async(dst, 1, 4096, s))
    ok(model.cuMemcpyHtoDAsync(dst, ctypes.addressof(src), 4096, s))
    assert landed(model, dst) == bytes(4096) and code(model.cuStreamQuery(s)) == NOT_READY
    model.finish(s)
    assert landed(model, dst) == b"\5" * 4096 and code(model.cuStreamQuery(s)) == 0


def test_a_pageable_source_is_staged_at_the_call_a_pinned_one_read_when_the_copy_runs(
        driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, staged, direct = stream(model), device_buffer(model), device_buffer(model)
    src, locked = pageable(fill=1), pinned(model)
    fill(locked, 1)
    model.hold(s)
    ok(model.cuMemcpyHtoDAsync(staged, ctypes.addressof(src), 4096, s))
    ok(model.cuMemcpyHtoDAsync(direct, locked, 4096, s))
    fill(ctypes.addressof(src), 2)
    fill(locked, 2)
    model.finish(s)
    assert landed(model, staged) == b"\1" * 4096  # what the source held at the call
    assert landed(model, direct) == b"\2" * 4096  # what it holds when the DMA runs


def test_a_copy_into_pageable_memory_completes_before_it_returns_a_pinned_one_in_order(
        driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, src = stream(model), device_buffer(model)
    ok(model.cuMemsetD8(src, 3, 4096))
    model.hold(s)
    locked = pinned(model)
    ok(model.cuMemcpyDtoHAsync(locked, src, 4096, s))
    assert ctypes.string_at(locked, 4096) == bytes(4096)  # held with its stream
    dst = pageable()
    ok(model.cuMemcpyDtoHAsync(ctypes.addressof(dst), src, 4096, s))
    assert dst.raw == b"\3" * 4096  # synchronous: its stream ran up to it, the hold included
    assert ctypes.string_at(locked, 4096) == b"\3" * 4096


def test_queries_never_force_and_synchronizing_completes_held_work(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, dst, event = stream(model), device_buffer(model), ok(model.cuEventCreate(0))
    ok(model.cuEventQuery(event))  # never recorded: complete
    model.hold(s)
    ok(model.cuMemsetD8Async(dst, 9, 4096, s))
    ok(model.cuEventRecord(event, s))
    for _ in range(3):
        assert code(model.cuStreamQuery(s)) == code(model.cuEventQuery(event)) == NOT_READY
    ok(model.cuEventSynchronize(event))  # a kernel finishes eventually
    assert landed(model, dst) == b"\x09" * 4096 and code(model.cuStreamQuery(s)) == 0
    model.hold(s)
    ok(model.cuStreamSynchronize(s))
    model.hold(s)
    ok(model.cuCtxSynchronize())
    assert model.pending(s) == []


def test_wait_event_orders_after_the_record_current_at_the_call(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    first, second = stream(model, NON_BLOCKING), stream(model, NON_BLOCKING)
    dst, event, word = device_buffer(model), ok(model.cuEventCreate(0)), pinned(model, 4)
    model.hold(first)
    ok(model.cuEventRecord(event, first))
    ok(model.cuStreamWaitEvent(second, event, 0))
    ok(model.cuStreamWaitValue32(first, ok(model.cuMemHostGetDevicePointer(word, 0)), 1, 0))
    ok(model.cuEventRecord(event, first))  # a later record: the wait does not move to it
    ok(model.cuMemsetD8Async(dst, 4, 4096, second))
    assert landed(model, dst) == bytes(4096)  # waits for the first record, which waits for the hold
    model.finish(first)
    assert landed(model, dst) == b"\4" * 4096
    assert code(model.cuEventQuery(event)) == NOT_READY  # its latest record waits for the word
    ctypes.c_uint32.from_address(word).value = 1
    ok(model.cuEventQuery(event))


def test_a_host_word_wait_needs_the_word_even_when_synchronized(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, word = stream(model), pinned(model, 4)
    ok(model.cuStreamWaitValue32(s, ok(model.cuMemHostGetDevicePointer(word, 0)), 1, 0))
    assert code(model.cuStreamQuery(s)) == NOT_READY
    writer = threading.Timer(0.05, lambda: setattr(ctypes.c_uint32.from_address(word), "value", 1))
    writer.start()
    try:
        ok(model.cuStreamSynchronize(s))  # polls the word (for up to WAIT_LIMIT)
    finally:
        writer.cancel()
        writer.join(30)
    assert ctypes.c_uint32.from_address(word).value == 1


def test_the_legacy_stream_and_blocking_streams_wait_for_each_other(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    blocking, free = stream(model), stream(model, NON_BLOCKING)
    a, b = device_buffer(model), device_buffer(model)
    model.hold(blocking)
    ok(model.cuMemsetD8(a, 1, 4096))  # on the legacy stream: after the blocking stream's work
    assert landed(model, a) == bytes(4096)
    model.finish(blocking)
    assert landed(model, a) == b"\1" * 4096
    model.hold(0)
    ok(model.cuMemsetD8Async(a, 2, 4096, blocking))  # after the legacy stream's work
    ok(model.cuMemsetD8Async(b, 3, 4096, free))  # a non-blocking stream does not wait
    assert landed(model, a) == b"\1" * 4096 and landed(model, b) == b"\3" * 4096
    out = pageable()
    ok(model.cuMemcpyDtoH(ctypes.addressof(out), a, 4096))  # synchronous: completes what it follows
    assert out.raw == b"\2" * 4096


def test_a_destroyed_stream_s_work_still_runs_in_order(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, dst = stream(model), device_buffer(model)
    model.hold(s)
    ok(model.cuMemsetD8Async(dst, 1, 4096, s))
    ok(model.cuStreamDestroy(s))  # returns at once; the work goes on
    ok(model.cuMemsetD8(dst, 2, 4096))  # the legacy stream still waits for it: no race
    model.settle()
    assert landed(model, dst) == b"\2" * 4096 and not model.violations


def test_a_synchronous_copy_from_pageable_memory_may_land_later_one_from_pinned_may_not(
        driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    staged, direct, src, locked = device_buffer(model), device_buffer(model), pageable(fill=6), pinned(model)
    fill(locked, 8)
    model.hold(0)
    ok(model.cuMemcpyHtoD(staged, ctypes.addressof(src), 4096))
    assert landed(model, staged) == bytes(4096)  # staged; the DMA waits for the legacy stream
    ok(model.cuMemcpyHtoD(direct, locked, 4096))
    assert landed(model, direct) == b"\x08" * 4096 and landed(model, staged) == b"\6" * 4096


def test_unordered_access_from_two_streams_is_a_race(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    first, second, dst = stream(model, NON_BLOCKING), stream(model, NON_BLOCKING), device_buffer(model)
    model.hold(first)
    ok(model.cuMemsetD8Async(dst, 1, 4096, first))
    with pytest.raises(AssertionError, match=r"unordered access: cuMemsetD8Async on stream .* cuMemsetD8Async"):
        model.cuMemsetD8Async(dst, 2, 4096, second)
    assert model.violations
    model.violations.clear()  # shown; the fixture would fail the test on it


def test_access_ordered_by_an_event_is_no_race(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    first, second, dst = stream(model, NON_BLOCKING), stream(model, NON_BLOCKING), device_buffer(model)
    event = ok(model.cuEventCreate(0))
    model.hold(first)
    ok(model.cuMemsetD8Async(dst, 1, 4096, first))
    ok(model.cuEventRecord(event, first))
    ok(model.cuStreamWaitEvent(second, event, 0))
    ok(model.cuMemsetD8Async(dst, 2, 4096, second))
    model.finish(first)
    assert landed(model, dst) == b"\2" * 4096 and not model.violations


def test_a_dma_into_memory_freed_before_it_ran_fails(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, src, locked = stream(model), device_buffer(model), pinned(model)
    model.hold(s)
    ok(model.cuMemcpyDtoHAsync(locked, src, 4096, s))
    ok(model.cuMemFreeHost(locked))  # the copy still pending: its target is gone
    with pytest.raises(AssertionError, match="stale target"):
        model.finish(s)


def test_settle_completes_every_context_s_work(driver_model: DriverModel) -> None:
    model = driver_model
    enter(model)
    s, dst = stream(model), device_buffer(model)
    model.hold(s)
    ok(model.cuMemsetD8Async(dst, 5, 4096, s))
    model.settle()
    assert landed(model, dst) == b"\5" * 4096 and model.pending(s) == []
