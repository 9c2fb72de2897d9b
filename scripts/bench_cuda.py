"""Benchmark shmshare's CUDA pools and copy paths, side by side with the driver's own calls.

(a) cached pinned allocation: ``CachingHostAllocator`` allocate/free pairs
    against ``cuMemHostAlloc``/``cuMemFreeHost`` per call, at 1 MiB and 64 MiB;
(b) getting 1 GiB of pinned memory: ``cuMemHostAlloc`` against the register
    path (mmap + prefault on 1, 4 and 8 threads + ``cuMemHostRegister``);
(c) host-to-device bandwidth of a 256 MiB async copy from ``cuMemHostAlloc``
    memory, from a registered shm segment, and from pageable memory
    (goal: registered shm >= 0.9 x cuMemHostAlloc);
(d) device pool: ``CachingAllocator`` malloc/free pairs against
    ``cuMemAlloc``/``cuMemFree``, and against torch's caching allocator when
    torch with CUDA is installed.

Without a GPU it prints why (``shmshare.cuda.why_unavailable()``) and exits 0.
Usage: ``.venv/bin/python scripts/bench_cuda.py [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shmshare import Segment, cuda
from shmshare.cuda import _driver
from shmshare.memory import CachingAllocator
from shmshare.memory._host import CachingHostAllocator

MiB = 1 << 20
GiB = 1 << 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    reason = cuda.why_unavailable()
    if reason is not None:
        print(f"bench_cuda: skipped, CUDA is not available here: {reason}")
        return 0
    reps = 3 if args.quick else 10
    ctx = cuda.Context.primary(0)
    print(f"bench_cuda on {ctx.name()} (device 0), {ctx.total_memory() / GiB:.1f} GiB")
    bench_pinned_cache(ctx, 200 if args.quick else 2000)
    bench_pinned_sources(ctx, 1 if args.quick else 3)
    bench_h2d(ctx, reps)
    bench_device_pool(ctx, 500 if args.quick else 5000)
    return 0


def timed(fn: Callable[[], object], reps: int) -> float:
    """Return the median seconds of ``reps`` runs of ``fn``."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(label: str, value: float, unit: str, base: float | None = None, higher_is_better: bool = False) -> None:
    ratio = ""
    if base:
        ratio = f"  x{(value / base if higher_is_better else base / value):.2f} vs baseline"
    print(f"  {label:<44} {value:>12.2f} {unit}{ratio}")


def bench_pinned_cache(ctx: cuda.Context, iters: int) -> None:
    print("(a) pinned allocate+free pairs (us per pair; ratio = speed-up over the driver)")
    ctx.make_current()  # the raw driver calls below act on the current context
    provider = cuda.CudaHostProvider(ctx)
    pool = CachingHostAllocator(provider, "")
    for size in (MiB, 64 * MiB):
        n = max(10, iters // (1 if size == MiB else 20))
        pool.free(pool.allocate(size))  # warm: the steady state is a cache hit
        base = timed(functools.partial(_host_alloc_pairs, size, n), 3) / n * 1e6
        row(f"cuMemHostAlloc/cuMemFreeHost {size // MiB} MiB", base, "us")
        pooled = timed(functools.partial(_pool_pairs, pool, size, n), 3) / n * 1e6
        row(f"CachingHostAllocator {size // MiB} MiB", pooled, "us", base)
    pool.close()
    provider.close()


def bench_pinned_sources(ctx: cuda.Context, reps: int) -> None:
    print("(b) 1 GiB of pinned memory, allocate + free (ms; ratio = speed-up over cuMemHostAlloc)")

    def make(provider: cuda.CudaHostProvider) -> Callable[[], None]:
        return lambda: provider.free(provider.allocate(GiB)[1])

    plain = cuda.CudaHostProvider(ctx, register=False)
    base = timed(make(plain), reps) * 1e3
    row("cuMemHostAlloc", base, "ms")
    for threads in (1, 4, 8):
        provider = cuda.CudaHostProvider(ctx, register=True, register_threads=threads)
        row(f"mmap + prefault x{threads} + cuMemHostRegister", timed(make(provider), reps) * 1e3, "ms", base)
        provider.close()
    plain.close()


def bench_h2d(ctx: cuda.Context, reps: int) -> None:
    nbytes = 256 * MiB
    print(f"(c) host-to-device bandwidth, {nbytes // MiB} MiB async copies (GB/s; ratio = share of cuMemHostAlloc)")
    device = cuda.CudaDeviceProvider(context=ctx)
    target, handle = device.allocate(nbytes)
    stream = cuda.Stream(ctx)

    def copy_from(address: int) -> float:
        def once() -> None:
            cuda.copy_host_to_device(target, address, nbytes, stream=stream)
            stream.synchronize()
        once()  # warm-up
        return nbytes / timed(once, reps) / 1e9

    pinned = cuda.CudaHostProvider(ctx)
    address, pinned_handle = pinned.allocate(nbytes)
    base = copy_from(address)
    row("(a) from cuMemHostAlloc memory", base, "GB/s")
    seg = Segment.create(nbytes)
    seg.view(np.uint8, nbytes)[:] = 1
    reg = cuda.register_segment(seg, ctx)
    shm = copy_from(seg.address)
    row("(b) from a registered shm segment", shm, "GB/s", base, higher_is_better=True)
    pageable = np.ones(nbytes, np.uint8)
    row("(c) from pageable memory", copy_from(pageable.ctypes.data), "GB/s", base, higher_is_better=True)
    print(f"  goal (b) >= 0.9 x (a): {'met' if shm >= 0.9 * base else 'NOT met'} ({shm / base:.2f})")
    reg.unregister()
    seg.close()
    pinned.free(pinned_handle)
    pinned.close()
    stream.close()
    device.free(handle)
    device.close()


def bench_device_pool(ctx: cuda.Context, iters: int) -> None:
    print("(d) device malloc+free pairs (us per pair; ratio = speed-up over the driver)")
    sizes = (4096, MiB, 16 * MiB)
    for size in sizes:
        ctx.make_current()
        base = timed(functools.partial(_device_alloc_pairs, size, iters), 3) / iters * 1e6
        row(f"cuMemAlloc/cuMemFree {size} B", base, "us")
        for config in ("expandable_segments:False", "expandable_segments:True"):
            provider = cuda.CudaDeviceProvider(context=ctx)
            allocator = CachingAllocator(provider, config)
            allocator.free(allocator.malloc(size))  # warm: the steady state is a cache hit
            kind = "expandable" if config.endswith("True") else "classic"
            row(f"CachingAllocator {kind} {size} B",
                timed(functools.partial(_pool_pairs, allocator, size, iters), 3) / iters * 1e6, "us", base)
            allocator.empty_cache()
            provider.close()
        torch_pairs = _torch_pairs(size, iters)
        if torch_pairs is not None:
            row(f"torch caching allocator {size} B", timed(torch_pairs, 3) / iters * 1e6, "us", base)


def _host_alloc_pairs(size: int, n: int) -> None:
    for _ in range(n):
        _driver.call("cuMemFreeHost", _driver.call("cuMemHostAlloc", size, 1))


def _device_alloc_pairs(size: int, n: int) -> None:
    for _ in range(n):
        _driver.call("cuMemFree", _driver.call("cuMemAlloc", size))


def _pool_pairs(pool: Any, size: int, n: int) -> None:
    """Run allocate/free (host pool) or malloc/free (device pool) pairs."""
    take = pool.allocate if isinstance(pool, CachingHostAllocator) else pool.malloc
    for _ in range(n):
        pool.free(take(size))


def _torch_pairs(size: int, iters: int) -> Callable[[], None] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def pairs() -> None:
        for _ in range(iters):
            torch.empty(size, dtype=torch.uint8, device="cuda")  # allocate, and free when dropped

    torch.empty(size, dtype=torch.uint8, device="cuda")
    return pairs


if __name__ == "__main__":
    sys.exit(main())
