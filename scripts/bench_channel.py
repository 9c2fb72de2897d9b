#!/usr/bin/env python3
"""Benchmark the zero-copy channel side by side with its anchors, in one process tree.

For each message size, a forked producer makes a buffer per message, fills
it (memset) and sends it; the consumer (this process) receives it, reads one
byte of every 4 KiB page, and drops it. Paths:

- ``shmshare``:   ``tx.empty()`` + fill + ``tx.send()``  /  ``rx.recv()``
- ``torch.mp``:   ``torch.empty()`` + fill + ``torch.multiprocessing.Queue.put()``
                  (file_descriptor sharing: a fresh shm object per tensor) -- when torch is installed
- ``shm fresh``:  a new stdlib ``SharedMemory`` per message, its name through a Pipe
- ``ring/Queue``: a ring of reused stdlib ``SharedMemory`` slots, indices through
                  ``multiprocessing.Queue`` (the usual hand-rolled ring)
- ``ring/Pipe``:  the same ring with indices through ``multiprocessing.Pipe`` (leaner)
- ``fill only``:  the producer's fill alone, in one process, over a rotation of buffers
                  (as a pool's blocks rotate): the ceiling for any path

Printed: messages/s, GB/s, and shmshare's ratio to each path. Run:
``.venv/bin/python scripts/bench_channel.py [--quick] [--sizes 4K,64M]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing import shared_memory

import numpy as np

import shmshare

from _bench import fmt_size as fmt  # scripts/_bench.py: run from scripts/ or by path
from _bench import parse_size

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
PAGE = 4096
WAIT = 120.0  # s: the longest any one receive may wait


def plan(size: int, quick: bool, slow: bool) -> tuple[int, int]:
    """Return (warm-up, total) message counts for a size; fewer for slow paths.

    At least 6 warm-up messages for every path: a pool settles at 3 blocks in
    flight (one filled, one queued, one read), as a ring is made warm before
    it is timed.
    """
    budget = (512 * MiB if quick else 8192 * MiB) // (8 if slow else 1)
    n = max(12, min(4000 if quick else 20000, budget // size))
    if slow:
        n = min(n, 300 if quick else 1500)
    return max(6, n // 10), n


def consume(arr: np.ndarray) -> int:
    """Read one byte of every page (what a consumer that looks at the data must at least do)."""
    return int(arr[::PAGE][-1]) + int(arr[-1])


# -- producers (run in a forked child) -----------------------------------------


def produce_shmshare(tx, size: int, count: int) -> None:
    for i in range(count):
        a = tx.empty(size, np.uint8, timeout=WAIT)
        a.fill(i & 0xFF)
        tx.send({"i": i, "x": a}, timeout=WAIT)
        del a
    tx.close()


def produce_torch(q, size: int, count: int) -> None:
    import torch

    for i in range(count):
        t = torch.empty(size, dtype=torch.uint8)
        t.fill_(i & 0xFF)
        q.put((i, t))
        del t
    q.put(None)
    time.sleep(WAIT)  # torch's fd sharing needs the producer alive until the consumer took them


def produce_fresh(conn, size: int, count: int) -> None:
    from multiprocessing import resource_tracker

    for i in range(count):
        shm = shared_memory.SharedMemory(create=True, size=size)
        resource_tracker.unregister(shm._name, "shared_memory")  # the consumer unlinks it
        np.ndarray(size, np.uint8, buffer=shm.buf).fill(i & 0xFF)
        conn.send((i, shm.name))
        shm.close()
    conn.send(None)


def produce_ring(conn, free, names: list[str], size: int, count: int) -> None:
    slots = [shared_memory.SharedMemory(name=n) for n in names]
    views = [np.ndarray(size, np.uint8, buffer=s.buf) for s in slots]
    get = free.recv if hasattr(free, "recv") else free.get
    put = conn.send if hasattr(conn, "send") else conn.put
    for i in range(count):
        k = get()
        views[k].fill(i & 0xFF)
        put((i, k))
    put(None)
    del views
    for s in slots:
        s.close()


# -- consumers (this process) -------------------------------------------------------


def timed(recv_one, warm: int, count: int) -> float:
    """Receive `count` messages; return seconds for the ones after `warm`."""
    for _ in range(warm):
        recv_one()
    t0 = time.perf_counter()
    for _ in range(count - warm):
        recv_one()
    return time.perf_counter() - t0


def run_shmshare(size: int, warm: int, count: int) -> float:
    tx, rx = shmshare.channel(limit=max(256 * MiB, 8 * size))
    child = start(produce_shmshare, tx, size, count)
    tx.close()

    def one() -> None:
        b = rx.recv(timeout=WAIT)
        consume(b["x"])

    try:
        return timed(one, warm, count)
    finally:
        finish(child)
        rx.close()


def run_torch(size: int, warm: int, count: int) -> float:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("fork")
    q = ctx.Queue(maxsize=8)
    child = start(produce_torch, q, size, count, ctx=ctx)

    def one() -> None:
        _, t = q.get(timeout=WAIT)
        consume(t.numpy())

    try:
        return timed(one, warm, count)
    finally:
        finish(child)
        q.close()


def run_fresh(size: int, warm: int, count: int) -> float:
    a, b = mp.Pipe()
    child = start(produce_fresh, b, size, count)
    b.close()

    def one() -> None:
        if not a.poll(WAIT):
            raise TimeoutError("no message")
        _, name = a.recv()
        shm = shared_memory.SharedMemory(name=name)  # registers it; unlink() unregisters
        view = np.ndarray(size, np.uint8, buffer=shm.buf)
        consume(view)
        del view
        shm.close()
        shm.unlink()

    try:
        return timed(one, warm, count)
    finally:
        finish(child)
        a.close()


def run_ring(size: int, warm: int, count: int, queue: bool = False) -> float:
    nslots = 8 if size <= MiB else 4
    slots = [shared_memory.SharedMemory(create=True, size=size) for _ in range(nslots)]
    views = [np.ndarray(size, np.uint8, buffer=s.buf) for s in slots]
    for v in views:
        v.fill(0)  # fault every page in once: a ring is warm by design
    if queue:
        data_q, free_q = mp.Queue(), mp.Queue()
        for k in range(nslots):
            free_q.put(k)
        child = start(produce_ring, data_q, free_q, [s.name for s in slots], size, count)
        get, give_back = (lambda: data_q.get(timeout=WAIT)), free_q.put
    else:
        a, b = mp.Pipe()
        free_tx, free_rx = mp.Pipe()
        for k in range(nslots):
            free_tx.send(k)
        child = start(produce_ring, b, free_rx, [s.name for s in slots], size, count)
        b.close()
        free_rx.close()

        def get():
            if not a.poll(WAIT):
                raise TimeoutError("no message")
            return a.recv()

        give_back = free_tx.send

    def one() -> None:
        _, k = get()
        consume(views[k])
        give_back(k)

    try:
        return timed(one, warm, count)
    finally:
        finish(child)
        if queue:
            data_q.close()
            free_q.close()
        else:
            a.close()
            free_tx.close()
        views.clear()  # drop the exports before closing the slots
        for s in slots:
            s.close()
            s.unlink()


def run_ring_queue(size: int, warm: int, count: int) -> float:
    return run_ring(size, warm, count, queue=True)


def run_fill(size: int, warm: int, count: int) -> float:
    # Rotate over several buffers, as a pool's blocks rotate: one buffer filled
    # again and again would stay in the CPU cache and overstate the ceiling.
    bufs = [np.empty(size, np.uint8) for _ in range(max(2, min(16, (256 * MiB) // size)))]
    for b in bufs:
        b.fill(1)
    t0 = time.perf_counter()
    for i in range(count - warm):
        bufs[i % len(bufs)].fill(i & 0xFF)
    return time.perf_counter() - t0


# -- process plumbing ------------------------------------------------------------------


def start(target, *args, ctx=None):
    p = (ctx or mp.get_context("fork")).Process(target=target, args=args, daemon=True)
    p.start()
    return p


def finish(p) -> None:
    p.join(2 if p.exitcode is None else 0)
    if p.exitcode is None:
        os.kill(p.pid, signal.SIGKILL)  # by pid: only what this script started
        p.join(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages per cell")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes, e.g. 4K,64M")
    args = ap.parse_args(argv)
    sizes = SIZES if not args.sizes else [parse_size(s) for s in args.sizes.split(",")]
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    paths = [("shmshare", run_shmshare, False), ("torch.mp", run_torch, True),
             ("shm fresh", run_fresh, True), ("ring/Queue", run_ring_queue, False),
             ("ring/Pipe", run_ring, False),
             ("fill only", run_fill, False)]
    if not have_torch:
        paths = [p for p in paths if p[0] != "torch.mp"]
        print("torch is not installed: the torch.multiprocessing column is left out")
    print(f"bench_channel: Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, numpy "
          f"{np.__version__}, producer forked, consumer reads one byte per 4 KiB page")
    names = [p[0] for p in paths]
    head = f"{'size':>7}  " + "  ".join(f"{n:>20}" for n in names)
    print("\nmessages/s (GB/s)")
    print(head)
    results = {}
    for size in sizes:
        row = {}
        for name, fn, slow in paths:
            warm, count = plan(size, args.quick, slow)
            secs = fn(size, warm, count)
            row[name] = (count - warm) / secs
        results[size] = row
        print(f"{fmt(size):>7}  " + "  ".join(
            f"{row[n]:>10,.0f} ({row[n] * size / 1e9:6.2f})" for n in names), flush=True)
    print("\nshmshare's throughput as a multiple of each path (fill only: the share of the "
          "producer's ceiling reached)")
    print(f"{'size':>7}  " + "  ".join(f"{n:>12}" for n in names[1:]))
    for size, row in results.items():
        print(f"{fmt(size):>7}  " + "  ".join(
            f"{row['shmshare'] / row[n]:>11.2f}x" for n in names[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
