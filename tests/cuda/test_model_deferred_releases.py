"""A hostile review of issue 11 (deferred releases, contexts, capture) over the driver model. NOT a GPU.

Each test here FAILS on the library as reviewed: it shows one defect. Where
the model is more permissive than the driver (cuEventQuery during a global
capture), the test makes the model stricter for itself and says why.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from shmshare import Segment, cuda
from shmshare.cuda import _deferred
from shmshare.memory._host import CachingHostAllocator
from shmshare.testing import wait_exit

from . import driver_model as driver_model_module
from .driver_model import DriverModel
from .model_calls import begin_global_capture, end_capture

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
CHILD_LIMIT = 12  # s: each child script must be done by then, or it hung


_global_capture, _end_capture = begin_global_capture, end_capture


def _run_child(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter; a child still running after CHILD_LIMIT is killed by pid."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=CHILD_LIMIT)
    except subprocess.TimeoutExpired:
        child.kill()  # by its pid: only the child this test started
        out, err = child.communicate(timeout=10)
        return subprocess.CompletedProcess(child.args, -9, out, err + "\n[killed: it hung]")
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


# --- H1. a deferred release runs its driver call during another stream's global capture --------------


def test_a_segment_collected_during_a_non_blocking_global_capture_does_not_break_it(
        driver_model: DriverModel) -> None:
    # The capture is on a NON-blocking stream, so the legacy stream is not "capturing": _fence records
    # its event, the query finds it done, and the task's action calls cuMemHostUnregister right there,
    # inside the finalizer, while a GLOBAL-mode capture is active. The driver refuses that with
    # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the user's capture (the model does too).
    segment = Segment.create(MiB)
    cuda.register_segment(segment)
    capturing = cuda.Stream()  # non-blocking, as torch's side streams are
    _global_capture(driver_model, capturing)
    del segment
    gc.collect()
    assert _end_capture(driver_model, capturing) == 0, "a finalizer invalidated the user's capture"
    cuda.finish_releases()
    assert driver_model.live()["registered"] == 0
    capturing.close()


def test_a_pinned_pool_dropped_during_a_non_blocking_global_capture_does_not_break_it(
        driver_model: DriverModel) -> None:
    # Same root cause through the pinned provider: cuMemFreeHost from a finalizer during a capture.
    provider = cuda.CudaHostProvider(register=False)
    pool = CachingHostAllocator(provider, "")
    kept = pool.allocate(MiB)
    capturing = cuda.Stream()
    _global_capture(driver_model, capturing)
    del kept, pool, provider
    gc.collect()
    assert _end_capture(driver_model, capturing) == 0, "a finalizer invalidated the user's capture"
    cuda.finish_releases()
    assert driver_model.live()["host"] == 0
    capturing.close()


# --- H2. fence events are queried during a global capture ---------------------------------------------


def test_a_drain_during_a_global_capture_queries_no_event(driver_model: DriverModel,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The driver refuses cuEventQuery (and cuEventSynchronize, cuStreamQuery) while any stream captures
    # in GLOBAL mode, even for an event recorded before the capture: PyTorch skips process_events()
    # during capture for that reason ("cudaEventQueries, illegal during CUDA graph capture",
    # CUDACachingAllocator.cpp; CUDAGraph.cpp: "in the default capture mode, event queries are not
    # allowed during graph capture"). The model only refuses querying an event recorded *in* a
    # capture, so it is made that strict here. A task fenced before the capture is queried by the
    # next drain, i.e. by any finalizer during the capture.
    monkeypatch.setattr(driver_model_module, "UNSAFE_DURING_CAPTURE",
                        driver_model_module.UNSAFE_DURING_CAPTURE | {"cuEventQuery", "cuEventSynchronize",
                                                                     "cuStreamQuery"})
    first, second = Segment.create(MiB), Segment.create(MiB)
    cuda.register_segment(first)
    cuda.register_segment(second)
    cuda.Context.primary(0).make_current()
    driver_model.hold(0)  # work on the legacy stream: the first release's fence is pending
    del first
    gc.collect()
    assert cuda.pending_releases()
    capturing = cuda.Stream()
    _global_capture(driver_model, capturing)
    begun = len(driver_model.calls)
    del second  # any finalizer during the capture drains the queue
    gc.collect()
    during = [name for name, _ in driver_model.calls[begun:]]
    assert _end_capture(driver_model, capturing) == 0, f"a drain queried an event during the capture: {during}"
    cuda.Context.primary(0).make_current()
    driver_model.finish(0)
    cuda.finish_releases()
    capturing.close()


# --- H3. a finalizer run by the garbage collector inside _deferred._lock deadlocks --------------------

# _FROZEN: the H3 children freeze what their imports made before their loops. Each loop collects in full
# dozens of times, each time over the whole imported heap: the H3b loop took 7.9 s under load (0.9 s
# frozen), past faulthandler's 8 s hang bound, and failed a passing run; H3's took 2 s (0.0 s frozen).
# The Cycle and Holder objects are made after the freeze, so collections (full or set off by the
# thresholds) still find them; both children still hang on the code before aa7bd7e, frozen or not.


def test_a_gc_finalizer_inside_the_deferred_lock_does_not_deadlock() -> None:
    # _deferred._lock is a plain Lock, and release_later() allocates under it (_Task(...), its lists),
    # as do drain() (list(_tasks)) and _pool() (EventPool(...)). An allocation can start a collection,
    # and a collected Segment / pinned range / imported mapping runs its finalizer right there, on the
    # same thread: release_later() -> `with _lock:` again -> the thread deadlocks on itself.
    script = """
        import faulthandler, gc
        faulthandler.dump_traceback_later(8, exit=True)  # says where it hangs, then ends the child
        from shmshare.cuda import _deferred
        gc.collect()
        gc.freeze()  # the imports out of the collector's sight (see _FROZEN); the cycles below are still found

        class Cycle:  # stands for any cyclic garbage that holds a registered segment or a DeviceArray
            def __init__(self):
                self.me = self
            def __del__(self):
                _deferred.release_later("from a finalizer", lambda: None, [])

        for threshold in range(1, 40):  # walk the next collection through release_later's allocations
            gc.collect()
            gc.set_threshold(threshold, 1000, 1000)
            Cycle()  # garbage now; the next collection finds it
            _deferred.release_later("plain", lambda: None, [])
            gc.set_threshold(700, 10, 10)
        print("no deadlock")
    """
    done = _run_child(script)
    assert done.returncode == 0, f"the child deadlocked or failed: rc {done.returncode}\n{done.stderr[-2000:]}"


def test_a_segment_finalizer_inside_context_primary_does_not_deadlock() -> None:
    # The same trap with _context._primary_lock (a plain Lock): Context.primary() creates the owner
    # under it (cuDeviceGetCount, cuDevicePrimaryCtxRetain: allocations), a collection there runs a
    # registered Segment's finalizer, and _unregister_quietly -> _defer -> _contexts ->
    # active_primaries() -> Context.primary() takes _primary_lock again on the same thread. The
    # pinned ranges' finalizer (_release_dropped -> active_primaries) does the same. Happens at the
    # first use of each device (or after its owner was closed): the loop below replays that first use.
    script = """
        import faulthandler, gc
        faulthandler.dump_traceback_later(8, exit=True)  # says where it hangs, then ends the child
        from tests.cuda.driver_model import DriverModel
        from shmshare.cuda import _driver, _context
        _driver._state = (DriverModel(None), None)
        from shmshare import Segment, cuda
        gc.collect()
        gc.freeze()  # the imports out of the collector's sight (see _FROZEN); the cycles below are still found

        class Holder:  # cyclic garbage holding the last reference to a registered segment
            def __init__(self, segment):
                self.me, self.segment = self, segment

        for threshold in range(1, 200, 3):  # walk the next collection through Context.primary()
            segment = Segment.create(1 << 20)
            cuda.register_segment(segment)
            _context._primary.clear()  # the first use of the device's context
            gc.collect()
            gc.set_threshold(threshold, 1000, 1000)
            Holder(segment)
            del segment
            cuda.Context.primary(0)
            gc.set_threshold(700, 10, 10)
            gc.collect()
        print("no deadlock")
    """
    done = _run_child(script)
    assert done.returncode == 0, f"the child deadlocked: rc {done.returncode}\n{done.stderr[-3000:]}"


# --- H4. a fork while another thread drains leaves the child's locks held for ever --------------------


def test_a_child_forked_while_another_thread_drains_can_still_exit() -> None:
    # _forget_after_fork clears _tasks and _pools but not _drain_lock / _lock (Note [At fork]: "wait on
    # a lock a vanished thread held"). A fork while a thread of the parent is inside drain() (a
    # DataLoader's pin thread running an unregister, say) gives a child whose _drain_lock is held by a
    # thread that does not exist there: the child's next finalizer queues a task, and its atexit
    # drain(wait=True) blocks for ever, so the child never exits.
    script = """
        import os, sys, threading, time
        from shmshare.cuda import _deferred

        inside, go = threading.Event(), threading.Event()
        def slow():  # a release that takes a while (cuMemHostUnregister of a large range)
            inside.set()
            go.wait(30)
        _deferred.release_later("slow", slow, [])
        threading.Thread(target=_deferred.drain, daemon=True).start()  # a drain that runs it, holding its lock
        assert inside.wait(10)
        pid = os.fork()
        if pid == 0:
            _deferred.release_later("a finalizer in the child", lambda: None, [])
            sys.exit(0)  # a normal exit: atexit runs _deferred._at_exit
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            go.set()
            print("the child hung at exit", file=sys.stderr)
            sys.exit(3)
        go.set()
        sys.exit(os.waitstatus_to_exitcode(status))
    """
    done = _run_child(script)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"


# --- H5. a task queued while another thread drains waits for some later, unrelated call --------------


def test_a_release_queued_while_another_thread_drains_is_run_by_that_drain(driver_model: DriverModel) -> None:
    # drain() does not block: when another thread holds _drain_lock it returns, trusting that "another
    # thread is draining: it will see the new task". That drain took its snapshot of _tasks before: the
    # new task, ready at once, stayed queued until the next shmshare call (maybe never, until exit),
    # with its memory still pinned or mapped. (release_later drained then; it only queues now.)
    inside, go = threading.Event(), threading.Event()
    ran: list[str] = []

    def slow() -> None:
        inside.set()
        go.wait(10)
        ran.append("slow")

    _deferred.release_later("slow", slow, [])
    worker = threading.Thread(target=_deferred.drain, daemon=True)  # holds the drain lock while slow() runs
    worker.start()
    assert inside.wait(10)
    _deferred.release_later("ready at once", lambda: ran.append("ready"), [])
    _deferred.drain()  # returns at once: the other thread drains, and must go round again for this one
    go.set()
    worker.join(10)
    assert not worker.is_alive()
    assert "ready" in ran, f"still queued after the only drain ended: {cuda.pending_releases()}"


# --- H6. streams named with record_stream are used after they are destroyed ---------------------------


def test_a_stream_named_then_destroyed_does_not_wedge_the_release(driver_model: DriverModel) -> None:
    # Registration.record_stream (and _Mapping.record_stream, DLPack consumers, the pinned provider's
    # _streams) keep raw stream handles; the deferred release uses them later. A stream destroyed in
    # between is a dangling handle (the model refuses it; on the driver it is undefined, and the handle
    # can be reused by another stream): the release fails at every drain and stays queued for ever,
    # with the range still pinned. _fence expects CUDA_ERROR_INVALID_HANDLE from cuEventRecord, but
    # cuStreamIsCapturing runs first, outside the try.
    segment = Segment.create(MiB)
    registration = cuda.register_segment(segment)
    side = cuda.Stream()
    registration.record_stream(side)
    side.close()  # the user's stream is done and destroyed: normal
    del segment, registration
    gc.collect()
    cuda.finish_releases()
    assert driver_model.live()["registered"] == 0


# --- H7. Stream.wrap picks device 0 for another device's stream ---------------------------------------


def test_a_wrapped_device_1_stream_belongs_to_device_1(two_gpus: DriverModel) -> None:
    # Stream.wrap(handle) without context= takes device 0's, and Context.of_stream trusts a Stream's
    # .context without asking cuStreamGetCtx: a wrapped torch stream of cuda:1 is used in device 0's
    # context everywhere (record_event -> CUDA_ERROR_INVALID_HANDLE; a deferred fence on it fails at
    # every drain, so that release is stuck).
    owned = cuda.Stream(cuda.Context.primary(1))
    wrapped = cuda.Stream.wrap(owned.handle)
    try:
        assert cuda.Context.of_stream(wrapped).device == 1
        provider = cuda.CudaHostProvider()
        provider.record_event(wrapped).synchronize()
        provider.close()
    finally:
        owned.close()


# --- H8. Context.of_stream creates a context on every device it looks at --------------------------------


@pytest.mark.parametrize("driver_model", [{"devices": 3}], indirect=True)
def test_looking_up_a_streams_context_creates_no_other_devices_context(driver_model: DriverModel) -> None:
    # For a stream whose context shmshare has not cached (torch's stream of cuda:2, say), of_stream
    # walks every ordinal with Context.primary(device), which RETAINS each primary context on the way:
    # device 1, which nobody uses, gets a context (hundreds of MiB of device memory on a real GPU, and a
    # failure on an exclusive-process GPU another process owns). Worse, it then counts as active, so
    # every later deferred release fences it and every unregister synchronizes it. Asking
    # cuCtxGetDevice with the raw context pushed (or cuDevicePrimaryCtxGetState first) costs nothing.
    torch_like = cuda.Context(2)  # someone else's retain of device 2's primary context
    stream = cuda.Stream(torch_like)
    try:
        assert cuda.Context.of_stream(stream.handle).device == 2
        assert driver_model.devices[1].retains == 0, "device 1's primary context was created by a lookup"
    finally:
        stream.close()
        torch_like.close()


# --- H9. interpreter exit waits, without a bound, for GPU work that may never end -----------------------


def test_exit_does_not_hang_on_gpu_work_that_never_completes() -> None:
    # _at_exit runs drain(wait=True): cuEventSynchronize on every fence, with no bound. Work that never
    # completes (a kernel spinning on a flag of a peer that died, a collective stuck on a dead rank:
    # the usual reason a training process is exiting) behind a queued release makes the process hang
    # at exit for ever, where without shmshare it would exit and the driver would reclaim everything.
    # Here the legacy stream waits on a host word nobody writes (cuStreamWaitValue32); the model's own
    # bound on such waits is lifted to stand for the driver's, which has none.
    script = """
        import ctypes, gc
        from tests.cuda import driver_model_streams
        driver_model_streams.WAIT_LIMIT = 3600.0  # the driver waits for ever
        from tests.cuda.driver_model import DriverModel
        from shmshare.cuda import _driver
        _driver._state = (DriverModel(None), None)
        from shmshare import Segment, cuda

        model = _driver._state[0]
        flag = ctypes.c_uint32(0)
        segment = Segment.create(1 << 20)
        cuda.register_segment(segment)
        cuda.Context.primary(0).make_current()
        model.cuStreamWaitValue32(0, ctypes.addressof(flag), 1, 0)  # a hung kernel on the legacy stream
        del segment
        gc.collect()  # the unregister is queued behind it
        print("exiting", flush=True)
    """
    done = _run_child(script)
    assert "exiting" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0, f"the process did not exit: rc {done.returncode} {done.stderr[-500:]}"


# --- H10. a forked child queues releases it can never run, and keeps their mappings ---------------------


def test_a_registered_segment_dropped_in_a_forked_child_leaves_no_mapping_there(driver_model: DriverModel) -> None:
    # A forked child (a DataLoader worker) inherits the parent's Segment objects, their finalizers and
    # their registrations, but may not use CUDA (the model refuses, as the driver does). When the
    # child drops its copy, _unregister_quietly queues a deferred unregister that can never succeed
    # there: it fails at every drain and holds the registration's Lease, so the child keeps the shm
    # mapping (and the segment's pages) until it exits. The child has nothing to unpin: its pages
    # were never pinned in its address space; the release should just let go.
    segment = Segment.create(MiB)
    cuda.register_segment(segment)
    address = segment.address
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            del segment
            gc.collect()
            with open("/proc/self/maps") as maps:
                mapped = any(int(line.split("-")[0], 16) <= address < int(line.split("-")[1].split()[0], 16)
                             for line in maps)
            code = 2 if mapped else 3 if _deferred.pending() else 0
        finally:
            os._exit(code)
    code = wait_exit(pid, 10)
    cuda.unregister_segment(segment)
    segment.close()
    assert code == 0, {1: "the child failed", 2: "the child still maps the dropped segment",
                       3: "the child queued a release it can never run"}.get(code, code)
