#!/usr/bin/env python3
"""Benchmark shmshare.multiprocessing side by side with torch's and the stdlib's, in one process tree.

(1) A Queue of arrays/tensors at 4 KiB, 1 MiB and 64 MiB. A forked producer
    makes a fresh buffer per message, fills it (``fill_(i)``) and puts it on
    the Queue; the consumer (this process) gets it, reads one byte of every
    4 KiB page, and drops it. Throughput is taken in the consumer, from the
    end of a warm-up (10% of the messages, at least 5) to the last message.
    CPU per message, beside it: the producer's ``time.process_time()`` (all its
    threads: the Queue's feeder that pickles, torch's fd sharer, shmshare's pool
    server) from its first message until the consumer has taken the last,
    over every message it sent; the consumer's over the timed loop, per timed
    message. Helper processes are not in it (torch fs's ``torch_shm_manager``).
    Paths:

    - ``torch fd``:     ``torch.empty`` + fill, ``torch.multiprocessing`` Queue with its
                        default sharing strategy (file_descriptor: a fresh shm object per
                        tensor, its fd fetched from the producer per message)
    - ``torch fs``:     the same with ``set_sharing_strategy('file_system')`` in producer
                        and consumer (a named shm file per tensor, torch_shm_manager)
    - ``stdlib``:       ``numpy.empty`` + fill, stdlib ``multiprocessing`` Queue (the array
                        pickled: its bytes go through the Queue's pipe)
    - ``shmshare``:     ``torch.empty`` + fill, ``shmshare.multiprocessing`` Queue (torch's
                        semantics: the tensor's storage moved into the producer's pool in place,
                        copied once and its data pointer swapped, then a handle sent)
    - ``shm in-place``: ``smp.empty(shape, torch.uint8)`` + fill, the same Queue (the tensor is
                        in the pool already: no copy)

(2) ``Pool(2).map(plus_one, arrays)`` over 64 arrays of 1 MiB (each task
    returns a new 1 MiB array; this process reads one byte per page of every
    result): stdlib ``multiprocessing.Pool`` over numpy arrays, torch's Pool
    over tensors (file_descriptor: the inputs move to shm on the first map),
    ``smp.Pool`` over plain numpy arrays, and ``smp.Pool`` over arrays made by
    ``smp.empty`` (in place). Pools are made before timing; one warm-up map,
    then maps/s over several maps, with the CPU per map of this process
    (``time.process_time()``: the pool's threads, pickling arguments, reading
    results) and of the two workers together (utime+stime from
    ``/proc/<pid>/stat``, in clock ticks: 10 ms steps over all the timed maps).

Everything uses the fork start method (``get_context('fork')`` of each module).
Importing ``shmshare.multiprocessing`` registers its reducers on
multiprocessing's ``ForkingPickler`` for the whole process, so the anchors'
cells run with the reducers as they were before that import (torch's; none
for ndarray) and shmshare's cells with its own, set before each cell forks.
shmshare's cells print the sender's ``smp.statistics()`` (handles copied, in
place, by value), to show which way the arrays went.
The last block, between ``=== bench_mp ratios ===`` and ``=== end ===``, has
one ``RATIO name value target verdict`` line per figure the issue asks for.
Verdicts are informational: times are never asserted. Without
``shmshare.multiprocessing`` (or torch) those columns are left out, with a line
saying why. A cell that fails prints its traceback; the others still run (exit 1).

The Queue cells run in 3 rounds (1 with ``--quick``), the paths interleaved so
that other work on the machine spreads over all of them; the tables show the
median. About 4 minutes on 2 CPUs (``--quick``: under a minute). Run:
``.venv/bin/python scripts/bench_mp.py [--quick] [--sizes 4K,64M] [--rounds N] [--no-pool]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np

from _bench import fmt_size as fmt  # scripts/_bench.py: run from scripts/ or by path
from _bench import parse_size, table
from _bench_ratios import report  # the last block: the RATIO/FIGURE lines

# This checkout's shmshare, installed or not (an installed or editable copy elsewhere would shadow it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import torch
    import torch.multiprocessing as tmp
except ImportError as exc:
    torch = tmp = None  # type: ignore[assignment]
    NO_TORCH = f"torch is not importable ({exc})"
else:
    NO_TORCH = ""
# Importing shmshare.multiprocessing registers its reducers on ForkingPickler, for every multiprocessing user in
# the process: the anchors' cells run with the reducers as they were before that import (see use_reducers()).
ANCHOR_REDUCERS = dict(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
SMP_API = ("get_context", "Queue", "Pool", "empty", "shutdown", "statistics")
try:
    import shmshare
    import shmshare.multiprocessing as smp

    # An editable install's finder may resolve the name to another checkout's folder when this one has none:
    # take it only from the shmshare package imported above, and only with the API used here.
    _where = getattr(smp, "__file__", None) or ", ".join(getattr(smp, "__path__", []))
    if not _where.startswith(os.path.dirname(shmshare.__file__) + os.sep):
        raise ImportError(f"this shmshare ({os.path.dirname(shmshare.__file__)}) has none; "
                          f"the name resolved to {_where}")
    _lacks = [name for name in SMP_API if not hasattr(smp, name)]
    if _lacks:
        raise ImportError(f"the module at {_where} lacks {', '.join(_lacks)}")
except Exception as exc:  # noqa: BLE001 - any failure to import leaves shmshare's columns out, with the reason
    smp = None  # type: ignore[assignment]
    NO_SMP = f"shmshare.multiprocessing is not importable ({type(exc).__name__}: {exc})"
else:
    NO_SMP = ""
SMP_REDUCERS = dict(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 1 * MiB, 64 * MiB]
PAGE = 4096
WAIT = 60.0  # s: the longest any one get, map or child exit may wait
POOL_ITEMS, POOL_ITEM = 64, 1 * MiB


def plan(size: int, quick: bool, slow: bool) -> tuple[int, int]:
    """Return (warm-up, total) message counts for a size; fewer for slow paths and large sizes."""
    budget = (1024 * MiB if quick else 8192 * MiB) // (4 if slow else 1)
    n = max(24, min(4000 if quick else 20000, budget // size))
    if slow:
        n = min(n, 2000 if quick else 6000)
    return max(5, n // 10), n


def consume(arr: np.ndarray) -> int:
    """Read one byte of every page (what a consumer that looks at the data must at least do)."""
    flat = arr.reshape(-1).view(np.uint8)  # bytes: a stride of PAGE is one page
    return int(np.add.reduce(flat[::PAGE], dtype=np.uint64)) + int(flat[-1])


def as_numpy(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.numpy()


def use_reducers(ours: bool) -> None:
    """Make multiprocessing pickle arrays and tensors shmshare's way (`ours`) or as it did before the import.

    Set in this process before a cell forks its children, which inherit it. Unpickling does not depend on it
    (a pickle names its own rebuild function).
    """
    table_ = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    table_.clear()
    table_.update(SMP_REDUCERS if ours else ANCHOR_REDUCERS)


def smp_stats() -> dict[str, int]:
    got = smp.statistics()
    return dataclasses.asdict(got) if dataclasses.is_dataclass(got) else dict(got)


def stats_note(st: dict[str, int] | None) -> str:
    if not st:
        return ""
    return (f"; {st.get('handles_pickled')} handles: {st.get('arrays_copied')} copied, "
            f"{st.get('arrays_in_place')} in place, {st.get('by_value')} by value")


# -- Queue: producers (run in a forked child) ----------------------------------------


def make_buffer(kind: str, size: int) -> Any:
    if kind == "numpy":
        return np.empty(size, np.uint8)
    if kind == "torch":
        return torch.empty(size, dtype=torch.uint8) if torch is not None else np.empty(size, np.uint8)
    assert kind == "pool", kind
    return smp.empty((size,), torch.uint8 if torch is not None else np.uint8)


def produce(q: Any, done: Any, stats: Any, kind: str, strategy: str | None, size: int, count: int,
            uses_smp: bool) -> None:
    if strategy is not None:
        tmp.set_sharing_strategy(strategy)
    try:
        cpu0 = time.process_time()
        for i in range(count):
            x = make_buffer(kind, size)
            if isinstance(x, np.ndarray):
                x.fill(i & 0xFF)
            else:
                x.fill_(i & 0xFF)
            q.put((i, x))
            del x
        q.put(None)
        # torch's fd sharing (and a pool's server) needs the producer alive until the consumer took them all
        done.wait(WAIT)
        cpu = time.process_time() - cpu0  # every thread's: the feeder pickled them all, the consumer has them
        stats.send((cpu, smp_stats() if uses_smp else None))
    finally:
        if uses_smp:
            smp.shutdown()  # this child's pool server


# -- Queue: consumer (this process) ---------------------------------------------------


@dataclasses.dataclass
class QueueRun:
    """One Queue cell's figures."""

    secs: float  # wall time of the timed messages, in the consumer
    producer_cpu: float  # s of the producer's CPU per message it sent
    consumer_cpu: float  # s of the consumer's CPU per timed message
    stats: dict[str, int] | None  # the producer's smp.statistics() at the end (if it used smp)


def run_queue(ctx: Any, kind: str, strategy: str | None, size: int, warm: int, count: int,
              uses_smp: bool = False) -> QueueRun:
    """Run one cell: a forked producer of `count` messages; time the ones after `warm`."""
    use_reducers(uses_smp)
    q = ctx.Queue(maxsize=8 if size <= MiB else 4)
    done = mp.get_context("fork").Event()
    stats_rx, stats_tx = mp.get_context("fork").Pipe(duplex=False)
    child = start(ctx, produce, q, done, stats_tx, kind, strategy, size, count, uses_smp)
    stats_tx.close()

    def one() -> int:
        item = q.get(timeout=WAIT)
        if item is None:
            raise RuntimeError("the producer ended early")
        _, x = item
        got = consume(as_numpy(x))
        del x, item
        return got

    try:
        for _ in range(warm):
            one()
        t0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(count - warm):
            one()
        secs, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if q.get(timeout=WAIT) is not None:
            raise RuntimeError("more messages than sent")
        done.set()
        if not stats_rx.poll(WAIT / 4):
            raise TimeoutError("the producer sent no statistics")
        producer_cpu, st = stats_rx.recv()
        return QueueRun(secs, producer_cpu / count, cpu / (count - warm), st)
    finally:
        done.set()
        finish(child)
        q.close()
        stats_rx.close()


Cell = Callable[[int, int, int], QueueRun]


def queue_paths() -> list[tuple[str, Cell, bool, str]]:
    """(name, cell runner, slow, why it is left out or '') per Queue path."""
    fork = mp.get_context("fork")
    paths: list[tuple[str, Cell, bool, str]] = []

    def torch_fs(size: int, warm: int, count: int) -> QueueRun:
        before = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")  # here (the consumer) and in the forked producer
        try:
            return run_queue(tmp.get_context("fork"), "torch", "file_system", size, warm, count)
        finally:
            tmp.set_sharing_strategy(before)

    tctx = tmp.get_context("fork") if tmp is not None else None
    sctx = smp.get_context("fork") if smp is not None else None
    paths.append(("torch fd", lambda s, w, n: run_queue(tctx, "torch", None, s, w, n), True, NO_TORCH))
    paths.append(("torch fs", torch_fs, True, NO_TORCH))
    paths.append(("stdlib", lambda s, w, n: run_queue(fork, "numpy", None, s, w, n), True, ""))
    paths.append(("shmshare", lambda s, w, n: run_queue(sctx, "torch", None, s, w, n, True), False, NO_SMP))
    paths.append(("shm in-place", lambda s, w, n: run_queue(sctx, "pool", None, s, w, n, True), False, NO_SMP))
    return paths


def bench_queue(sizes: list[int], quick: bool, rounds: int) -> tuple[dict[int, dict[str, float | None]], int]:
    """Run every (size, path) cell `rounds` times, the paths interleaved; print the tables.

    Return {size: {path: median messages/s over the rounds, None if a round failed}} and the failures.
    The CPU per message (producer, consumer) is the median over the rounds too.
    """
    paths = queue_paths()
    names = [p[0] for p in paths if not p[3]]
    for name, _, _, why in paths:
        if why:
            print(f"Queue: the {name} column is left out: {why}")
    print(f"\n(1) Queue of fresh arrays/tensors, producer forked, consumer reads one byte per 4 KiB page; "
          f"{rounds} round(s), the paths interleaved, median shown")
    runs: dict[int, dict[str, list[float | None]]] = {s: {n: [] for n in names} for s in sizes}
    cpus: dict[int, dict[str, list[tuple[float, float]]]] = {s: {n: [] for n in names} for s in sizes}
    failed = 0
    for k in range(rounds):
        for size in sizes:
            for name, fn, slow, why in paths:
                if why:
                    continue
                warm, count = plan(size, quick, slow)
                t0 = time.perf_counter()
                try:
                    got = fn(size, warm, count)
                except Exception as exc:  # noqa: BLE001 - one broken cell must not lose the others
                    failed += 1
                    runs[size][name].append(None)
                    print(f"  CELL FAILED: Queue {fmt(size)} {name} round {k + 1} ({count} messages): {exc!r}")
                    traceback.print_exc()
                    sys.stdout.flush()
                    continue
                runs[size][name].append((count - warm) / got.secs)
                cpus[size][name].append((got.producer_cpu, got.consumer_cpu))
                print(f"  round {k + 1} {fmt(size):>4} {name:<12} {(count - warm) / got.secs:>10,.0f} msg/s  "
                      f"CPU {cpu_us(got.producer_cpu, got.consumer_cpu)} us/msg  ({count - warm} timed of "
                      f"{count}, cell {time.perf_counter() - t0:.1f} s{stats_note(got.stats)})", flush=True)
    results = {s: {n: (None if None in v or not v else statistics.median(v)) for n, v in r.items()}  # type: ignore[type-var]
               for s, r in runs.items()}
    print("\nQueue: messages/s (GB/s)")
    table(["size", *names], [[fmt(s), *(rate(r.get(n), s) for n in names)] for s, r in results.items()])
    print("\nQueue: CPU \u00b5s per message (producer / consumer)")
    table(["size", *names], [[fmt(s), *(median_cpu(cpus[s][n], None in runs[s][n]) for n in names)]
                             for s in results])
    for mine in ("shmshare", "shm in-place"):
        if mine not in names:
            continue
        others = [n for n in names if n not in ("shmshare", "shm in-place")]
        print(f"\nQueue: {mine}'s messages/s as a multiple of each path's")
        table(["size", *others], [[fmt(s), *(times(r.get(mine), r.get(n)) for n in others)]
                                  for s, r in results.items()])
    return results, failed


# -- Pool.map ---------------------------------------------------------------------------------


def plus_one(a: Any) -> Any:
    """The task: a new array (tensor) of the same size."""
    return a + 1


def pool_inputs(kind: str) -> list[Any]:
    if kind == "numpy":
        return [np.full(POOL_ITEM, k, np.uint8) for k in range(POOL_ITEMS)]
    if kind == "torch":
        return [torch.full((POOL_ITEM,), k, dtype=torch.uint8) for k in range(POOL_ITEMS)]
    assert kind == "pool", kind
    out = []
    for k in range(POOL_ITEMS):
        a = smp.empty((POOL_ITEM,), np.uint8)
        a[:] = k
        out.append(a)
    return out


def proc_cpu(pid: int) -> float | None:
    """Seconds of CPU (user + system) a live process has used, from /proc (in clock ticks); None if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def workers_cpu(procs: list[Any]) -> float | None:
    got = [proc_cpu(p.pid) for p in procs]
    return None if not got or None in got else sum(got)  # type: ignore[arg-type]


@dataclasses.dataclass
class PoolRun:
    """One Pool column's figures."""

    maps_per_s: float
    parent_cpu: float  # s of this process's CPU per map
    workers_cpu: float | None  # s of the workers' CPU per map, together (None if /proc did not say)


def run_pool(ctx: Any, kind: str, reps: int, ours: bool = False) -> PoolRun:
    """Make a Pool(2), warm it with one map, time `reps` maps; return maps/s and CPU per map."""
    use_reducers(ours)  # before the fork: the workers inherit it
    pool = ctx.Pool(2)
    procs = list(getattr(pool, "_pool", []))  # the workers, to kill by pid should the pool not end them
    try:
        inputs = pool_inputs(kind)

        def one() -> float:
            t0 = time.perf_counter()
            out = pool.map_async(plus_one, inputs).get(WAIT)
            for o in out:
                consume(as_numpy(o))
            secs = time.perf_counter() - t0
            first, last = as_numpy(out[0]), as_numpy(out[-1])
            if int(first[0]) != 1 or int(last[-1]) != POOL_ITEMS or len(out) != POOL_ITEMS:
                raise RuntimeError(f"wrong results: {len(out)} arrays, {first[0]} ... {last[-1]}")
            del out, first, last
            return secs

        one()  # warm-up
        live = [p for p in getattr(pool, "_pool", []) if p.exitcode is None]
        w0, cpu0 = workers_cpu(live), time.process_time()
        secs = [one() for _ in range(reps)]
        cpu, w1 = time.process_time() - cpu0, workers_cpu(live)
        wcpu = None if w0 is None or w1 is None or live != list(getattr(pool, "_pool", [])) else (w1 - w0) / reps
        return PoolRun(reps / sum(secs), cpu / reps, wcpu)
    finally:
        # close(), not terminate(): the workers exit by themselves and run their exit hooks (shmshare's removes
        # each worker's fd server directory; a SIGTERM would leave it behind). terminate() if they do not.
        ender = threading.Thread(target=lambda: (pool.close(), pool.join()), daemon=True)
        ender.start()
        ender.join(WAIT / 4)
        if ender.is_alive():
            ender = threading.Thread(target=lambda: (pool.terminate(), pool.join()), daemon=True)
            ender.start()
            ender.join(WAIT / 4)
        if ender.is_alive():  # the pool did not end its workers: kill them by pid, only what it started
            for p in procs:
                if p.exitcode is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(10)


def bench_pool(quick: bool) -> tuple[dict[str, float | None], int]:
    """Run every Pool column; print the table; return {column: maps/s} and failures."""
    reps = 5 if quick else 20
    cols: list[tuple[str, Callable[[], PoolRun], str]] = [
        ("stdlib", lambda: run_pool(mp.get_context("fork"), "numpy", reps), ""),
        ("torch", lambda: run_pool(tmp.get_context("fork"), "torch", reps), NO_TORCH),
        ("shmshare", lambda: run_pool(smp.get_context("fork"), "numpy", reps, True), NO_SMP),
        ("shm in-place", lambda: run_pool(smp.get_context("fork"), "pool", reps, True), NO_SMP),
    ]
    print(f"\n(2) Pool(2).map(plus_one, {POOL_ITEMS} arrays of {fmt(POOL_ITEM)}), one warm-up map, "
          f"then {reps} maps; this process reads one byte per page of every result")
    res: dict[str, float | None] = {}
    cpu: dict[str, PoolRun] = {}
    failed = 0
    for name, fn, why in cols:
        if why:
            print(f"Pool: the {name} column is left out: {why}")
            continue
        t0 = time.perf_counter()
        before = smp_stats() if smp is not None else {}
        try:
            got = fn()
        except Exception as exc:  # noqa: BLE001 - one broken column must not lose the others
            failed += 1
            res[name] = None
            print(f"  CELL FAILED: Pool.map {name}: {exc!r}")
            traceback.print_exc()
            sys.stdout.flush()
            continue
        res[name], cpu[name] = got.maps_per_s, got
        st = None
        if name.startswith("shm"):  # this process's handles for this column's arguments
            st = {k: v - before.get(k, 0) for k, v in smp_stats().items()}
        print(f"  {name:<12} {got.maps_per_s:>8.2f} maps/s  CPU per map: this process {ms(got.parent_cpu)} ms, "
              f"workers {ms(got.workers_cpu)} ms  (column {time.perf_counter() - t0:.1f} s{stats_note(st)})",
              flush=True)
    moved = 2 * POOL_ITEMS * POOL_ITEM  # in and out
    print("\nPool.map: maps/s (GB/s of arguments and results), CPU ms per map (this process / the 2 workers), "
          "and shmshare's multiple of each maps/s")
    rows = [[n, f"{v:.2f}" if v else "failed", f"{v * moved / 1e9:.2f}" if v else "-",
             f"{ms(cpu[n].parent_cpu)} / {ms(cpu[n].workers_cpu)}" if n in cpu else "-",
             times(res.get("shmshare"), v), times(res.get("shm in-place"), v)] for n, v in res.items()]
    table(["column", "maps/s", "GB/s", "CPU ms/map", "shmshare x", "in-place x"], rows)
    return res, failed


# -- process plumbing ------------------------------------------------------------------


def start(ctx: Any, target: Callable[..., None], *args: Any) -> Any:
    p = ctx.Process(target=_orphan_proof, args=(target, *args), daemon=True)
    p.start()
    return p


def _orphan_proof(target: Callable[..., None], *args: Any) -> None:
    """Run `target` in a child that dies with this script, even a SIGKILLed one (a producer
    blocked on a full Queue outlived a `timeout` kill once, holding 449 MB of its pool)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        return  # the parent went before the line above
    target(*args)


def finish(p: Any) -> None:
    p.join(WAIT / 4 if p.exitcode is None else 0)
    if p.exitcode is None:
        os.kill(p.pid, signal.SIGKILL)  # by pid: only what this script started
        p.join(10)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def rate(v: float | None, size: int) -> str:
    return "failed" if v is None else f"{v:,.0f} ({v * size / 1e9:.2f})"


def cpu_us(producer: float, consumer: float) -> str:
    return f"{producer * 1e6:,.1f} / {consumer * 1e6:,.1f}"


def median_cpu(got: list[tuple[float, float]], failed: bool) -> str:
    """The median (producer / consumer) CPU per message over the rounds, in microseconds."""
    if failed or not got:
        return "failed"
    return cpu_us(statistics.median(p for p, _ in got), statistics.median(c for _, c in got))


def ms(secs: float | None) -> str:
    return "?" if secs is None else f"{secs * 1e3:.1f}"


def times(mine: float | None, base: float | None) -> str:
    return f"{mine / base:.2f}x" if mine and base else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages per cell and fewer maps")
    ap.add_argument("--sizes", default=None, help="comma-separated Queue sizes, e.g. 4K,64M")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the Queue cells (default 3, quick 1)")
    ap.add_argument("--no-pool", action="store_true", help="leave out the Pool.map section")
    args = ap.parse_args(argv)
    sizes = SIZES if not args.sizes else [parse_size(s) for s in args.sizes.split(",")]
    if torch is not None:
        torch.set_num_threads(1)  # 2 cores, 2+ processes: no intra-op threads anywhere (the children inherit it)
    started = time.perf_counter()
    tver = f"torch {torch.__version__}" if torch is not None else "no torch"
    print(f"bench_mp: Linux {platform.release()}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"numpy {np.__version__}, {tver}, fork start method{', --quick' if args.quick else ''}")
    if NO_SMP:
        print(f"shmshare's columns are left out: {NO_SMP}")
    else:
        print(f"shmshare.multiprocessing from {os.path.dirname(smp.__file__)}")
    print(f"load average before: {load()} (other work on the machine shows in every figure)")
    failed = 0
    try:
        queue, f1 = bench_queue(sizes, args.quick, args.rounds or (1 if args.quick else 3))
        pool, f2 = ({}, 0) if args.no_pool else bench_pool(args.quick)
        failed = f1 + f2
        report(queue, pool)
    finally:
        if smp is not None:
            smp.shutdown()
    print(f"load average after: {load()}")
    print(f"bench_mp: {time.perf_counter() - started:.0f} s in all" + (f", {failed} cell(s) failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
