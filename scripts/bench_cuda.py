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

The last block, between ``=== bench_cuda ratios ===`` and ``=== end ===``,
has one ``RATIO name value target verdict`` or ``FIGURE name value unit`` line
per figure the issue asks for (scripts/gpu_check copies them into its
summary). Verdicts are informational: times are never asserted.

Without a GPU it prints why (``shmshare.cuda.why_unavailable()``) and exits 0.
From a checkout, installed or not: ``python3 scripts/bench_cuda.py [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# This checkout's shmshare, installed or not (an installed or editable copy elsewhere would shadow it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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
    report = Report()
    sections: list[Callable[[], None]] = [
        functools.partial(bench_pinned_cache, ctx, 200 if args.quick else 2000, report),
        functools.partial(bench_pinned_sources, ctx, 1 if args.quick else 3),
        functools.partial(bench_h2d, ctx, reps, report),
        functools.partial(bench_device_pool, ctx, 500 if args.quick else 5000, report),
    ]
    failed = 0
    for section in sections:
        try:
            section()
        except Exception as exc:  # noqa: BLE001 - one broken section must not lose the other figures
            failed += 1
            print(f"  SECTION FAILED: {section.func.__name__}: {exc!r}")  # type: ignore[attr-defined]
            traceback.print_exc()
        sys.stdout.flush()
    report.print()
    return 1 if failed else 0


class Report:
    """The figures the issue asks for, printed last as one greppable block."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def figure(self, name: str, value: float, unit: str) -> None:
        self.lines.append(f"FIGURE {name} {value:.3f} {unit}")

    def ratio(self, name: str, value: float, op: str, target: float, meaning: str) -> None:
        met = value >= target if op == ">=" else value <= target
        self.lines.append(f"RATIO {name} {value:.3f} target{op}{target:g} {'PASS' if met else 'MISS'}  # {meaning}")

    def print(self) -> None:
        print("=== bench_cuda ratios ===")
        for line in self.lines or ["(no figures: every section failed)"]:
            print(line)
        print("=== end ===")
        sys.stdout.flush()


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


def bench_pinned_cache(ctx: cuda.Context, iters: int, report: Report) -> None:
    print("(a) pinned allocate+free pairs (us per pair; ratio = speed-up over the driver)")
    ctx.make_current()  # the raw driver calls below act on the current context
    provider = cuda.CudaHostProvider(ctx)
    pool = CachingHostAllocator(provider, "")
    try:
        for size in (MiB, 64 * MiB):
            n = max(10, iters // (1 if size == MiB else 20))
            pool.free(pool.allocate(size))  # warm: the steady state is a cache hit
            base = timed(functools.partial(_host_alloc_pairs, size, n), 3) / n * 1e6
            row(f"cuMemHostAlloc/cuMemFreeHost {size // MiB} MiB", base, "us")
            pooled = timed(functools.partial(_pool_pairs, pool, size, n), 3) / n * 1e6
            row(f"CachingHostAllocator {size // MiB} MiB", pooled, "us", base)
            report.figure(f"pinned_pair_us_hostalloc_{size // MiB}MiB", base, "us")
            report.figure(f"pinned_pair_us_cached_{size // MiB}MiB", pooled, "us")
            report.ratio(f"pinned_cached_speedup_{size // MiB}MiB", base / pooled, ">=", 100,
                         "cuMemHostAlloc+cuMemFreeHost time / cached allocate+free time")
    finally:
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


def bench_h2d(ctx: cuda.Context, reps: int, report: Report) -> None:
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
    paged = copy_from(pageable.ctypes.data)
    row("(c) from pageable memory", paged, "GB/s", base, higher_is_better=True)
    print(f"  goal (b) >= 0.9 x (a): {'met' if shm >= 0.9 * base else 'NOT met'} ({shm / base:.2f})")
    report.figure("h2d_gbps_hostalloc", base, "GB/s")
    report.figure("h2d_gbps_registered_shm", shm, "GB/s")
    report.figure("h2d_gbps_pageable", paged, "GB/s")
    report.ratio("h2d_registered_vs_hostalloc", shm / base, ">=", 0.9,
                 "registered shm GB/s / cuMemHostAlloc GB/s")
    report.figure("h2d_pageable_share_of_hostalloc", paged / base, "x (no target: what pinning saves)")
    reg.unregister()
    seg.close()
    pinned.free(pinned_handle)
    pinned.close()
    stream.close()
    device.free(handle)
    device.close()


def bench_device_pool(ctx: cuda.Context, iters: int, report: Report) -> None:
    print("(d) device malloc+free pairs (us per pair; ratio = speed-up over the driver)")
    sizes = (4096, MiB, 16 * MiB)
    anchors = _torch_anchors(iters)
    if not anchors:
        print("  (torch with CUDA is not installed here: no torch rows, no ratio)")
    for size in sizes:
        ctx.make_current()
        base = timed(functools.partial(_device_alloc_pairs, size, iters), 3) / iters * 1e6
        row(f"cuMemAlloc/cuMemFree {size} B", base, "us")
        ours: dict[str, float] = {}
        for config in ("expandable_segments:False", "expandable_segments:True"):
            provider = cuda.CudaDeviceProvider(context=ctx)
            allocator = CachingAllocator(provider, config)
            allocator.free(allocator.malloc(size))  # warm: the steady state is a cache hit
            kind = "expandable" if config.endswith("True") else "classic"
            ours[kind] = timed(functools.partial(_pool_pairs, allocator, size, iters), 3) / iters * 1e6
            row(f"CachingAllocator {kind} {size} B", ours[kind], "us", base)
            allocator.empty_cache()
            provider.close()
        for anchor, pairs in anchors.items():
            theirs = timed(functools.partial(pairs, size), 3) / iters * 1e6
            row(f"torch {anchor} {size} B", theirs, "us", base)
            for kind, us in ours.items():
                report.ratio(f"device_pool_{kind}_vs_torch_{anchor}_{size}B", us / theirs, "<=", 3,
                             f"CachingAllocator malloc+free us / torch {anchor} us")


def _torch_anchors(iters: int) -> dict[str, Callable[[int], None]]:
    """Return torch's caching allocator from Python, two ways, or {} without torch with CUDA.

    ``caching_allocator_alloc``/``caching_allocator_delete`` are the allocator's own Python entry
    points (the like-for-like anchor); ``torch.empty`` adds a tensor's creation, as users meet it.
    """
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

    def raw(size: int) -> None:
        for _ in range(iters):
            delete(alloc(size))

    def empty(size: int) -> None:
        for _ in range(iters):
            torch.empty(size, dtype=torch.uint8, device="cuda")  # allocate, and free when dropped

    torch.empty(1, device="cuda")  # torch's context and allocator up before the first timing
    return {"caching_allocator_alloc": raw, "empty": empty}


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


if __name__ == "__main__":
    sys.exit(main())
