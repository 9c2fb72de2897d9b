#!/usr/bin/env python3
"""End-to-end checks of shmshare.cuda on a real GPU, across processes; each prints PASS or FAIL with figures.

(i)   device memory across processes: a spawned producer fills device memory
      on a non-blocking stream that is held back (``cuStreamWaitValue32`` on a
      pinned word, let go 0.3 s later) and sends it at once with
      ``send_device_memory(..., stream=)``, which must order the send after
      that work; the consumer (this process) receives it with
      ``recv_device_memory`` and checks every byte. Sizes from 1 byte to
      600 MiB (300 chunks of 2 MiB: several fd batches of ``wire.MAX_FDS``).
(ii)  a received shm segment on the device: a spawned process creates a
      segment and sends its fd over a ``shmshare.wire`` connection; here it
      is mapped writable and read-only, each mapping registered with
      ``register_segment`` and copied to the device with
      ``copy_host_to_device(..., stream=)``; bytes checked, GB/s printed.
(iii) DLPack and ``__cuda_array_interface__`` with torch: ``torch.from_dlpack``
      of a ``DeviceArray`` is zero-copy (same ``data_ptr``), torch writes and
      shmshare reads back; a ``DeviceArray`` made on a held stream is waited
      for by torch's stream; a torch tensor's memory seen through its
      ``__cuda_array_interface__`` as a ``DeviceArray``, written by shmshare
      and read by torch.

Every wait is bounded (``--timeout`` per message, a faulthandler watchdog on
the whole run) and children are killed by pid. ``FIGURE`` lines are copied
into scripts/gpu_check's summary. Exit status 1 when a check fails, 0 when
all pass or CUDA is not available here (it says why).

From a checkout, installed or not: ``python3 scripts/gpu_e2e.py [--only i,ii,iii]``.
``--model`` runs it over the driver model (tests/cuda/driver_model.py), the
producer of (i) on a thread and (iii) skipped: a smoke run of this script's
code, NOT a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import gc
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# This checkout's shmshare, installed or not (an installed or editable copy elsewhere would shadow it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shmshare import Flags, Segment, cuda, wire
from shmshare.cuda import _driver
from shmshare.memory import CachingAllocator
from shmshare.testing import start_child

MiB = 1 << 20
SIZES = (1, 4096, 5 * MiB + 123, 64 * MiB, 600 * MiB)  # the last: 300 chunks, several fd batches
SEGMENT_BYTES = 256 * MiB
HOLD_S = 0.3  # how long the producer's stream is held back before its fill may run
WATCHDOG_S = 240.0  # the whole run; scripts/gpu_check's own timeout is longer


class Checks:
    """Collect PASS/FAIL lines and figures."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0
        self.figures: list[str] = []

    def result(self, name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(name)

    def figure(self, name: str, value: float, unit: str) -> None:
        self.figures.append(f"FIGURE {name} {value:.3f} {unit}")

    def run(self, name: str, fn: Callable[[Checks], None]) -> None:
        """Run one check; an exception is its FAIL, with the traceback, and the next check still runs."""
        try:
            fn(self)
        except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others' results
            traceback.print_exc()
            self.result(name, False, f"raised {exc!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="i,ii,iii", help="checks to run: i, ii, iii")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any one message may take")
    parser.add_argument("--model", action="store_true", help="over the driver model: a smoke run, NOT a GPU")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hang in a driver call still ends the run
    if args.model:
        _install_model()
    reason = cuda.why_unavailable()
    if reason is not None:
        print(f"gpu_e2e: skipped, CUDA is not available here: {reason}")
        return 0
    ctx = cuda.Context.primary(0)
    print(f"gpu_e2e on {ctx.name()} (device 0){' -- DRIVER MODEL, NOT A GPU' if args.model else ''}", flush=True)
    checks = Checks()
    only = set(args.only.split(","))
    if "i" in only:
        checks.run("(i) device memory across processes", lambda c: check_device_ipc(c, args.timeout, args.model))
    if "ii" in only:
        checks.run("(ii) received segment registered", lambda c: check_segment(c, ctx, args.timeout))
    if "iii" in only:
        checks.run("(iii) DLPack with torch", lambda c: check_dlpack(c, ctx))
    print("=== gpu_e2e figures ===")
    for line in checks.figures:
        print(line)
    print("=== end ===")
    print(f"gpu_e2e: {checks.passed} passed, {len(checks.failed)} failed"
          + (f" ({', '.join(checks.failed)})" if checks.failed else ""))
    faulthandler.cancel_dump_traceback_later()
    return 1 if checks.failed else 0


# --- (i) device memory across processes -----------------------------------------------------------


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Return ``nbytes`` bytes that differ with position and seed (cheap for 600 MiB)."""
    words = np.arange(-(-nbytes // 4), dtype=np.uint32)
    words *= np.uint32(2654435761)  # wraps: Knuth's multiplicative hash
    words += np.uint32(seed * 0x9E3779B9 & 0xFFFFFFFF)
    return words.view(np.uint8)[:nbytes]


def check_device_ipc(checks: Checks, timeout: float, model: bool) -> None:
    mine, theirs = wire.pipe()
    try:
        # Over the driver model the producer is a thread: the model lives in this process only.
        with (_ThreadChild(produce_all, theirs, SIZES, timeout) if model
              else start_child(produce, theirs, SIZES, timeout, method="spawn")) as child:
            if not model:
                theirs.close()  # the child has its own copy
            for k, nbytes in enumerate(SIZES):
                start = time.perf_counter()
                imported = cuda.recv_device_memory(mine, timeout=timeout)
                received = time.perf_counter() - start
                meta = imported.meta
                out = np.empty(nbytes, np.uint8)
                cuda.copy_device_to_host(out, imported.address, nbytes)
                same = imported.nbytes == nbytes and np.array_equal(out, pattern(nbytes, k))
                bad = "" if same else f", first differing byte at {int(np.argmax(out != pattern(nbytes, k)))}"
                chunks = -(-nbytes // (2 * MiB))
                checks.result(f"(i) {nbytes} B", same,
                              f"{'every byte as sent' if same else 'BYTES DIFFER'}{bad}; ~{chunks} chunk(s); "
                              f"received+imported in {received * 1e3:.1f} ms after the producer's "
                              f"{meta.get('hold_s', 0):.1f} s hold; send ordered by "
                              f"{meta.get('ordered_by')}")
                if nbytes >= 64 * MiB:
                    checks.figure(f"e2e_ipc_recv_ms_{nbytes // MiB}MiB", received * 1e3, "ms")
                del out
                imported.close()
                gc.collect()
                mine.send({"next": True}, timeout=timeout)
            status = child.join(timeout)
            checks.result("(i) producer exit", status == 0, f"exit status {status}")
    finally:
        mine.close()
        theirs.close()


def produce(conn: wire.Connection, sizes: tuple[int, ...], timeout: float) -> None:
    """Child (spawned): run the producer, then exit at once (the receiver must not need us)."""
    os._exit(produce_all(conn, sizes, timeout))


def produce_all(conn: wire.Connection, sizes: tuple[int, ...], timeout: float) -> int:
    """Fill device memory on a held stream and send it without waiting, one size at a time; return 0."""
    provider = cuda.CudaDeviceProvider(ipc=True)
    host = cuda.CudaHostProvider(provider.context)
    for k, nbytes in enumerate(sizes):
        config = "expandable_segments:True" if k % 2 else "expandable_segments:False"
        allocator = CachingAllocator(provider, config)
        stream = cuda.Stream(provider.context)
        block = allocator.malloc(nbytes, stream=stream)
        address, handle = host.allocate(nbytes)  # pinned: the copy is truly asynchronous
        np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))[:] = pattern(nbytes, k)
        hold = HeldStream(stream, HOLD_S)
        cuda.memset_device(block.address, 0xAA, nbytes, stream=stream)  # what an early reader would see
        cuda.copy_host_to_device(block.address, address, nbytes, stream=stream)
        meta = {"hold_s": hold.delay, "ordered_by": "stream="}
        cuda.send_device_memory(conn, provider, block, nbytes, stream=stream, meta=meta, timeout=timeout)
        reply = conn.recv(timeout=timeout)[0]
        stream.synchronize()
        hold.close()
        host.free(handle)
        allocator.free(block)
        allocator.empty_cache()
        stream.close()
        if reply != {"next": True}:
            return 3
    return 0


class _ThreadChild:
    """The producer on a thread, with the join of shmshare.testing.Child (driver model runs only)."""

    def __init__(self, target: Callable[..., int], *args: Any) -> None:
        self.status: int | None = None

        def run() -> None:
            self.status = target(*args)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> int | None:
        self._thread.join(timeout)
        return self.status

    def __enter__(self) -> _ThreadChild:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class HeldStream:
    """Hold ``stream`` back (``cuStreamWaitValue32`` on a pinned word) until ``delay`` s from now.

    Work enqueued on it afterwards waits for the host to write the word, so
    a send that is not ordered after that work would go out before it ran.
    Where stream memory operations are not supported, nothing is held
    (``delay`` is then 0, and said so in the check's line).
    """

    def __init__(self, stream: cuda.Stream, delay: float) -> None:
        drv = _driver.driver()
        stream.context.make_current()
        flags = int(getattr(drv, "CU_MEMHOSTALLOC_PORTABLE", 1)) | int(getattr(drv, "CU_MEMHOSTALLOC_DEVICEMAP", 2))
        self._word = int(_driver.call("cuMemHostAlloc", 4, flags))
        ctypes.c_uint32.from_address(self._word).value = 0
        self.delay = delay
        try:
            device_word = _driver.call("cuMemHostGetDevicePointer", self._word, 0)
            geq = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)  # flags are an unsigned int
            _driver.call("cuStreamWaitValue32", stream.handle, device_word, 1, geq)
        except cuda.CudaError as exc:
            print(f"  (no stream hold: {exc})", flush=True)
            self.delay = 0.0
            self.release()
        self._timer = threading.Timer(self.delay, self.release)
        self._timer.daemon = True
        self._timer.start()

    def release(self) -> None:
        if self._word:
            ctypes.c_uint32.from_address(self._word).value = 1

    def close(self) -> None:
        """Free the word; the stream must have run past the wait (synchronize it first)."""
        self._timer.cancel()
        self.release()
        word, self._word = self._word, 0
        if word:
            _driver.call("cuMemFreeHost", word)


# --- (ii) a received shm segment, registered and copied to the device -----------------------------


def check_segment(checks: Checks, ctx: cuda.Context, timeout: float) -> None:
    mine, theirs = wire.pipe()
    device = cuda.CudaDeviceProvider(context=ctx)
    target, handle = device.allocate(SEGMENT_BYTES)
    stream = cuda.Stream(ctx)
    try:
        with start_child(make_segment, theirs, SEGMENT_BYTES, 7, timeout, method="spawn") as child:
            theirs.close()
            header, fds = mine.recv(timeout)
            nbytes = header["nbytes"]
            expected = pattern(nbytes, 7)
            for fd, (label, flags) in zip(fds, (("writable", Flags.FROMFD | Flags.KEEPFD),
                                                ("read-only", Flags.FROMFD | Flags.READONLY)), strict=True):
                seg = Segment.from_fd(fd, nbytes, flags)
                try:
                    reg = cuda.register_segment(seg, ctx)
                    gbps = _h2d_gbps(target, seg.address, nbytes, stream)
                    out = np.empty(nbytes, np.uint8)
                    cuda.copy_device_to_host(out, target, nbytes)
                    same = np.array_equal(out, expected)
                    checks.result(f"(ii) {label} mapping", same,
                                  f"{nbytes // MiB} MiB registered, copied on a stream at {gbps:.1f} GB/s, "
                                  f"{'every byte as written by the other process' if same else 'BYTES DIFFER'}")
                    checks.figure(f"e2e_h2d_gbps_received_segment_{label}", gbps, "GB/s")
                    reg.unregister()
                finally:
                    seg.close()
                cuda.memset_device(target, 0, nbytes)  # the next mapping's copy must bring the bytes again
            mine.send({"done": True}, timeout=timeout)
            status = child.join(timeout)
            checks.result("(ii) segment owner exit", status == 0, f"exit status {status}")
    finally:
        mine.close()
        theirs.close()
        stream.close()
        device.free(handle)
        device.close()


def make_segment(conn: wire.Connection, nbytes: int, seed: int, timeout: float) -> None:
    """Child (spawned, no CUDA): create a segment, write the pattern, send its fd twice, wait, close."""
    seg = Segment.create(nbytes)
    seg.view(np.uint8, nbytes)[:] = pattern(nbytes, seed)
    assert seg.fd is not None
    conn.send({"nbytes": nbytes}, [seg.fd, seg.fd], timeout)  # two fds arrive: one per mapping
    reply = conn.recv(timeout)[0]
    seg.close()
    conn.close()
    sys.exit(0 if reply == {"done": True} else 3)


def _h2d_gbps(target: int, address: int, nbytes: int, stream: cuda.Stream, reps: int = 5) -> float:
    """Return the median GB/s of ``reps`` async copies of ``nbytes`` at ``address`` on ``stream``."""
    times = []
    for _ in range(reps + 1):  # the first one warms up
        start = time.perf_counter()
        cuda.copy_host_to_device(target, address, nbytes, stream=stream)
        stream.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9


# --- (iii) DLPack and __cuda_array_interface__ with torch -------------------------------------------


def check_dlpack(checks: Checks, ctx: cuda.Context) -> None:
    try:
        import torch
    except ImportError:
        print("SKIP (iii): torch is not installed")
        return
    if not torch.cuda.is_available():
        print(f"SKIP (iii): torch {torch.__version__} has no CUDA here")
        return
    torch.cuda.init()
    device = cuda.CudaDeviceProvider(context=ctx)
    allocator = CachingAllocator(device)
    try:
        _dlpack_zero_copy(checks, torch, device, allocator)
        _dlpack_waits_for_the_producer(checks, torch, device, allocator, ctx)
        _torch_memory_through_cai(checks, torch)
    finally:
        gc.collect()
        torch.cuda.synchronize()
        allocator.empty_cache()
        device.close()


def _dlpack_zero_copy(checks: Checks, torch: Any, device: cuda.CudaDeviceProvider,
                      allocator: CachingAllocator) -> None:
    data = np.arange(1 << 16, dtype=np.float32)
    block = allocator.malloc(data.nbytes)
    cuda.copy_host_to_device(block.address, data, data.nbytes)
    arr = device.array(block, data.shape, np.float32)
    t = torch.from_dlpack(arr)
    same_ptr = t.is_cuda and t.data_ptr() == block.address
    read = torch.equal(t.cpu(), torch.from_numpy(data))
    t.mul_(3)  # torch writes into the pool's memory
    torch.cuda.current_stream().synchronize()
    out = np.empty_like(data)
    cuda.copy_device_to_host(out, block.address, data.nbytes)
    back = bool((out == data * 3).all())
    via_cai = torch.as_tensor(arr, device="cuda")
    cai_ptr = via_cai.data_ptr() == block.address
    checks.result("(iii) torch.from_dlpack(DeviceArray)", same_ptr and read and back and cai_ptr,
                  f"data_ptr {'equal' if same_ptr else 'DIFFERS'} (zero copy), torch read "
                  f"{'right' if read else 'WRONG'}, torch's write seen by shmshare {'yes' if back else 'NO'}, "
                  f"torch.as_tensor via __cuda_array_interface__ {'zero copy' if cai_ptr else 'COPIED'}")
    del t, via_cai, arr
    gc.collect()
    allocator.free(block)


def _dlpack_waits_for_the_producer(checks: Checks, torch: Any, device: cuda.CudaDeviceProvider,
                                   allocator: CachingAllocator, ctx: cuda.Context) -> None:
    nbytes = 64 * MiB
    stream = cuda.Stream(ctx)
    block = allocator.malloc(nbytes, stream=stream)
    hold = HeldStream(stream, HOLD_S)
    cuda.memset_device(block.address, 7, nbytes, stream=stream)  # queued behind the hold
    arr = device.array(block, (nbytes,), np.uint8, stream=stream)
    t = torch.from_dlpack(arr)  # torch passes its current stream: it must wait for ours
    total = int(t.to(torch.int64).sum().item())
    stream.synchronize()
    hold.close()
    ok = total == 7 * nbytes
    checks.result("(iii) DLPack stream hand-off", ok,
                  f"torch's sum {total} {'==' if ok else '!='} {7 * nbytes} after a {hold.delay:.1f} s hold "
                  "of the producer's stream")
    del t, arr
    gc.collect()
    allocator.free(block)
    stream.close()


def _torch_memory_through_cai(checks: Checks, torch: Any) -> None:
    tt = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    torch.cuda.current_stream().synchronize()
    cai = tt.__cuda_array_interface__
    address = int(cai["data"][0])
    arr = cuda.DeviceArray(address, cai["shape"], np.dtype(cai["typestr"]), owner=tt)
    out = np.empty(arr.shape, arr.dtype)
    cuda.copy_device_to_host(out, arr, arr.nbytes)
    read = bool((out == np.arange(1 << 16, dtype=np.float32)).all())
    cuda.memset_device(arr, 0, arr.nbytes)  # shmshare writes torch's memory (legacy default stream: synchronous)
    written = int(torch.count_nonzero(tt).item()) == 0
    again = torch.from_dlpack(arr)
    same_ptr = again.data_ptr() == tt.data_ptr()
    checks.result("(iii) a torch tensor through __cuda_array_interface__", read and written and same_ptr,
                  f"shmshare read torch's values {'right' if read else 'WRONG'}, torch saw shmshare's memset "
                  f"{'yes' if written else 'NO'}, back into torch by DLPack {'zero copy' if same_ptr else 'COPIED'}")
    del again, arr, tt


def _install_model() -> None:
    """Make the driver model (tests/cuda/driver_model.py) the driver of this process: NOT a GPU."""
    from tests.cuda.driver_model import DriverModel

    try:
        real = _driver._import_driver()
    except ImportError:
        real = None
    _driver._state = (DriverModel(real), None)
    print("DRIVER MODEL -- NOT A GPU: a smoke run of this script's code", flush=True)


if __name__ == "__main__":
    sys.exit(main())
