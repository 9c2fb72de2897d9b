#!/usr/bin/env python3
"""Benchmark shmshare's named-tensor store side by side with Ray's object store (plasma), in one process tree.

Three paths, each moving a 1-D ``uint8`` numpy array of 4 KiB, 1 MiB, 64 MiB
and 1 GiB from this process (the producer) to a client process:

- ``shmshare``: a daemon started with ``shmshare.store.Daemon.start`` (its own
                socket in a temporary folder, ``limit`` sized to the largest
                array), ``Store.put(name, arr)`` here, ``Store.get(name)`` in a
                client with its own ``Store``, ``Store.delete(name)`` after
- ``ray``:      ``ray.init(num_cpus=2, object_store_memory=...)``, ``ray.put(arr)``
                here, ``ray.get(ref)`` in an actor that was handed the ref inside a
                list (so that Ray does not resolve it for the call); the view Ray
                gives is its zero-copy read-only one
- ``stdlib``:   for reference, ``multiprocessing.shared_memory``: a new
                ``SharedMemory(create=True)`` and a copy of the bytes into it here,
                an attach by name in the client, unlinked after

(1) Put latency: from a filled array in the producer to ``put()`` returning
    (for stdlib: the segment made and the bytes copied in).
(2) Get latency, in a client process, of an object put just before: ``get()``
    returning a usable view, plus reading one byte of every 4 KiB page.
    Each object is new, so the client has never seen its pages; the client
    has seen other objects (its connection and any mapping cache are warm).
(3) Small gets per second: 4 client processes (shmshare: 4 forked clients,
    each with its own ``Store``; Ray: 4 actors) each call get on one 4 KiB
    object in a loop for a fixed time, dropping the view each time, all
    starting at one instant; the table shows the sum over the 4.

Ray's arena is one mapping, reused: once its pages have been touched they
stay resident in the store and mapped in each client, so a warm put is a
copy into resident memory and a warm get reads mapped pages. A shmshare
object of 1 MiB or more owns a new memfd: its pages are allocated by the
put, faulted in by the client's first read, and freed after the delete.
Each round line shows the untimed warm-up put and get of its size (the
first at a size in round 1 is Ray's cold arena).

Every cell runs in ``--rounds`` rounds (default 3, ``--quick`` 1), the paths
interleaved within each size so that other work on the machine spreads over
all of them; a round's figure is the median over its puts/gets (after one
untimed warm-up), and the tables show the median over the rounds. A size
whose cells would not fit (at peak: the source array, the stdlib copy, the
daemon's limit of three objects and Ray's arena in memory; the arena and the
stdlib copy in ``/dev/shm``) is left out with the reason. The last block,
between ``=== bench_store ratios ===`` and ``=== end ===``, has one ``RATIO
name value target verdict`` line per target of the issue ("1 GB put >= 2x
faster than Ray's on /dev/shm here; small get >= 2x Ray's rate (4 clients)")
and ``FIGURE`` lines for the rest; speeds are shmshare's as a multiple of
the other's (for latencies: the other's time / shmshare's). Verdicts are
informational: times are never asserted. Without Ray (``import ray`` fails)
or the store, those rows are left out with a line saying why. A cell that
fails prints its traceback; the others still run (exit 1).

Every process the bench starts dies with it: the clients set
``PR_SET_PDEATHSIG``, and a reaper child SIGKILLs the daemon and Ray's
processes (two of which, Ray's agents, outlive a killed driver otherwise)
should this process die without cleaning up. Every wait is bounded (``WAIT``).

Ray is not a dependency of shmshare; run with a Python that has both. The
checkout this script is in comes first (``sys.path``, and ``PYTHONPATH`` for
the daemon's process), with its C extension built in place, e.g.
``python setup.py build_ext --inplace && /path/to/venv-with-ray/bin/python
scripts/bench_store.py [--quick] [--sizes 4K,64M] [--rounds N] [--secs S]``.
About 80 s on 2 CPUs (``--quick``: about 30 s), Ray's start included.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
from _bench_store_sizes import fitting, fmt_gib, load, meminfo, ray_store_bytes, store_limit

from _bench import fmt_size as fmt  # scripts/_bench.py: run from scripts/ or by path
from _bench import parse_size, table
from _bench_publish import bench_publish
from _bench_store_procs import WAIT, Client, Reaper, descendants, small_loop, touch

# This checkout's shmshare, installed or not (an installed or editable copy elsewhere would shadow it); the
# daemon is `python -m shmshare serve` in a process of its own, which gets it through PYTHONPATH.
ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])

try:
    import shmshare
    import shmshare.store as sstore

    _lacks = [n for n in ("Daemon", "Store") if not hasattr(sstore, n)]
    if _lacks:
        raise ImportError(f"shmshare.store at {os.path.dirname(shmshare.__file__)} lacks {', '.join(_lacks)}")
except Exception as exc:  # noqa: BLE001 - any failure to import leaves shmshare's rows out, with the reason
    sstore = None  # type: ignore[assignment, unused-ignore]
    NO_STORE = f"shmshare.store is not importable ({type(exc).__name__}: {exc})"
else:
    NO_STORE = ""
try:
    import ray
except Exception as exc:  # noqa: BLE001 - Ray is optional: its rows are left out, with the reason
    ray = None  # type: ignore[assignment, unused-ignore]
    NO_RAY = f"ray is not importable ({type(exc).__name__}: {exc}); install it in a separate venv"
else:
    NO_RAY = ""

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [4 * KiB, 1 * MiB, 64 * MiB, 1 * GiB]
SMALL = 4 * KiB
CLIENTS = 4
TARGETS = {"put_1G": 2.0, "get_small_rate": 2.0}
NO_RATE = ("immutable",)  # paths without a small-get loop of their own
# issue 23's: put and get-and-read at 64 MiB and 1 GiB at least Ray's; small gets 3x Ray's
LARGE_TARGETS = {(what, s): 1.0 for what in ("put", "get") for s in (64 * MiB, GiB)}


def plan(size: int, quick: bool) -> int:
    """Timed puts/gets per round at a size (after one warm-up): fewer for large sizes."""
    budget = (256 * MiB if quick else 1 * GiB)
    return max(2 if quick else 3, min(30 if quick else 100, budget // size))


# -- the paths ------------------------------------------------------------------------------


class Side:
    """What a path does: put (timed here), get in a client (timed there), drop, and the small-get loop."""

    name = ""

    def put(self, key: str, arr: np.ndarray) -> tuple[float, Any]:
        raise NotImplementedError

    def get_elsewhere(self, handle: Any, size: int) -> float:
        raise NotImplementedError

    def drop(self, handle: Any) -> None:
        raise NotImplementedError

    def small_rate(self, secs: float) -> tuple[float, list[tuple[int, float]]]:
        raise NotImplementedError

    def note(self, handle: Any) -> str:
        return ""

    def close(self) -> None:
        pass


class Shmshare(Side):
    name = "shmshare"

    def __init__(self, clients: list[Client], daemon: Any, path: str) -> None:
        assert sstore is not None
        self.clients, self.daemon = clients, daemon
        self.store = sstore.Store(path=path, timeout=WAIT)

    def put(self, key: str, arr: np.ndarray) -> tuple[float, Any]:
        t0 = time.perf_counter()
        self.store.put(key, arr)
        return time.perf_counter() - t0, key

    def get_elsewhere(self, handle: Any, size: int) -> float:
        secs, ok = self.clients[0].ask("get", "shm", handle, size)
        if not ok:
            raise RuntimeError(f"get({handle!r}) gave a writable view or the wrong size")
        return float(secs)

    def drop(self, handle: Any) -> None:
        self.store.delete(handle)

    def note(self, handle: Any) -> str:
        try:
            info = self.store.info(handle)
        except Exception as exc:  # noqa: BLE001 - a note only
            return f"info() failed: {exc!r}"
        return f"kind={getattr(info, 'kind', '?')} write_seal={getattr(info, 'write_seal', '?')}"

    def small_rate(self, secs: float) -> tuple[float, list[tuple[int, float]]]:
        self.store.put("small", np.full(SMALL, 7, np.uint8))
        try:
            start_at = time.monotonic() + 0.2
            for c in self.clients:
                c.send("loop", "shm", "small", start_at, secs)
            reps = [c.reply(secs + WAIT) for c in self.clients]
        finally:
            self.store.delete("small")
        return sum(n / t for n, t, _ in reps), [(n, c) for n, _, c in reps]

    def close(self) -> None:
        stats = getattr(self.store, "stats", None)  # not in the API: what the daemon still holds, if it says
        if stats is not None:
            try:
                st = stats()
                print(f"shmshare daemon after the cells: {', '.join(f'{k} {v}' for k, v in st.items())}")
            except Exception as exc:  # noqa: BLE001 - a note only
                print(f"shmshare daemon after the cells: stats() failed: {exc!r}")
        self.store.close()


class ShmshareImmutable(Shmshare):
    """The store's immutable mode: each object its own memfd, sealed against writes."""

    name = "immutable"

    def put(self, key: str, arr: np.ndarray) -> tuple[float, Any]:
        t0 = time.perf_counter()
        self.store.put(key, arr, immutable=True)
        return time.perf_counter() - t0, key

    def small_rate(self, secs: float) -> tuple[float, list[tuple[int, float]]]:
        raise NotImplementedError  # the same gets as shmshare's: not run twice

    def close(self) -> None:
        self.store.close()


class Stdlib(Side):
    name = "stdlib"

    def __init__(self, clients: list[Client]) -> None:
        self.clients = clients

    def put(self, key: str, arr: np.ndarray) -> tuple[float, Any]:
        t0 = time.perf_counter()
        shm = shared_memory.SharedMemory(create=True, size=arr.nbytes)
        np.ndarray(arr.shape, arr.dtype, shm.buf)[...] = arr
        return time.perf_counter() - t0, shm

    def get_elsewhere(self, handle: Any, size: int) -> float:
        return float(self.clients[0].ask("get", "stdlib", handle.name, size)[0])

    def drop(self, handle: Any) -> None:
        handle.close()
        handle.unlink()

    def small_rate(self, secs: float) -> tuple[float, list[tuple[int, float]]]:
        shm = shared_memory.SharedMemory(create=True, size=SMALL)
        try:
            np.ndarray((SMALL,), np.uint8, shm.buf)[...] = 7
            start_at = time.monotonic() + 0.2
            for c in self.clients:
                c.send("loop", "stdlib", shm.name, start_at, secs)
            reps = [c.reply(secs + WAIT) for c in self.clients]
        finally:
            shm.close()
            shm.unlink()
        return sum(n / t for n, t, _ in reps), [(n, c) for n, _, c in reps]


class Getter:
    """Ray's client: an actor (made with ray.remote(num_cpus=0) in Ray.__init__)."""

    def get_time(self, box: list[Any]) -> tuple[float, bool]:
        t0 = time.perf_counter()
        view = ray.get(box[0], timeout=WAIT)
        touch(view)
        secs = time.perf_counter() - t0
        ok = not view.flags.writeable
        del view
        return secs, ok

    def loop(self, box: list[Any], start_at: float, secs: float) -> tuple[int, float, float]:
        ref = box[0]
        return small_loop(lambda: ray.get(ref, timeout=WAIT), start_at, secs)

    def pid(self) -> int:
        return os.getpid()


class Ray(Side):
    name = "ray"

    def __init__(self, store_bytes: int) -> None:
        assert ray is not None
        ray.init(num_cpus=2, object_store_memory=store_bytes, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
        actor = ray.remote(num_cpus=0)(Getter)
        self.actors: list[Any] = [actor.remote() for _ in range(CLIENTS)]
        self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=WAIT)

    def put(self, key: str, arr: np.ndarray) -> tuple[float, Any]:
        t0 = time.perf_counter()
        ref = ray.put(arr)
        return time.perf_counter() - t0, ref

    def get_elsewhere(self, handle: Any, size: int) -> float:
        secs, ok = ray.get(self.actors[0].get_time.remote([handle]), timeout=WAIT)
        if not ok:
            raise RuntimeError("ray.get gave a writable view")
        return float(secs)

    def drop(self, handle: Any) -> None:
        pass  # the last ObjectRef going frees it

    def small_rate(self, secs: float) -> tuple[float, list[tuple[int, float]]]:
        ref = ray.put(np.full(SMALL, 7, np.uint8))
        start_at = time.monotonic() + 0.5  # an actor call takes longer to arrive than a pipe message
        reps = ray.get([a.loop.remote([ref], start_at, secs) for a in self.actors], timeout=secs + WAIT)
        return sum(n / t for n, t, _ in reps), [(n, c) for n, _, c in reps]

    def close(self) -> None:
        ray.shutdown()


# -- the cells ------------------------------------------------------------------------------


Cells = dict[str, dict[int, dict[str, list[float | None]]]]  # {"put"/"get": {size: {path: [round medians]}}}


def one_cell(p: Side, size: int, arr: np.ndarray, reps: int, k: int) -> tuple[float, float, str]:
    """Warm up once, then `reps` put/get/drop; return the median put and get seconds and a note."""
    puts, gets, note = [], [], ""
    for i in range(reps + 1):
        arr.fill((k * 31 + i) % 251)
        secs, handle = p.put(f"x{size}-{k}-{i}", arr)
        try:
            got = p.get_elsewhere(handle, size)
            if i == 0:  # the first put of a size may find memory that no put of that size has touched yet
                note = ", ".join(filter(None, [f"warm-up put {us(secs)} get {us(got)}", p.note(handle)]))
        finally:
            p.drop(handle)
            del handle
        if i:
            puts.append(secs)
            gets.append(got)
    return statistics.median(puts), statistics.median(gets), note


def bench_latency(paths: list[Side], sizes: list[int], quick: bool, rounds: int) -> tuple[Cells, int]:
    runs: Cells = {"put": {s: {p.name: [] for p in paths} for s in sizes},
                   "get": {s: {p.name: [] for p in paths} for s in sizes}}
    failed = 0
    print(f"\n(1, 2) put in this process, get + one byte per page in a client process; {rounds} round(s), "
          "the paths interleaved, median of each round's median shown")
    for k in range(rounds):
        for size in sizes:
            reps = plan(size, quick)
            arr = np.empty(size, np.uint8)
            for p in paths:
                t0 = time.perf_counter()
                try:
                    put, get, note = one_cell(p, size, arr, reps, k)
                except Exception as exc:  # noqa: BLE001 - one broken cell must not lose the others
                    failed += 1
                    runs["put"][size][p.name].append(None)
                    runs["get"][size][p.name].append(None)
                    print(f"  CELL FAILED: {fmt(size)} {p.name} round {k + 1}: {exc!r}")
                    traceback.print_exc()
                    sys.stdout.flush()
                    continue
                runs["put"][size][p.name].append(put)
                runs["get"][size][p.name].append(get)
                print(f"  round {k + 1} {fmt(size):>4} {p.name:<9} put {us(put):>12}  get {us(get):>12}  "
                      f"({reps} timed, cell {time.perf_counter() - t0:.1f} s{', ' + note if note else ''})",
                      flush=True)
            del arr
    return runs, failed


def bench_rate(paths: list[Side], secs: float, rounds: int) -> tuple[dict[str, list[float | None]], int]:
    print(f"\n(3) {CLIENTS} clients each get one {fmt(SMALL)} object in a loop for {secs:g} s (view dropped "
          f"each time); {rounds} round(s)")
    runs: dict[str, list[float | None]] = {p.name: [] for p in paths if p.name not in NO_RATE}
    failed = 0
    for k in range(rounds):
        for p in paths:
            if p.name in NO_RATE:
                continue
            try:
                rate, counts = p.small_rate(secs)
            except Exception as exc:  # noqa: BLE001 - one broken cell must not lose the others
                failed += 1
                runs[p.name].append(None)
                print(f"  CELL FAILED: gets/s {p.name} round {k + 1}: {exc!r}")
                traceback.print_exc()
                sys.stdout.flush()
                continue
            runs[p.name].append(rate)
            cpu = sum(c for _, c in counts) / max(1, sum(n for n, _ in counts)) * 1e6
            print(f"  round {k + 1} {p.name:<9} {rate:>10,.0f} gets/s, client CPU {cpu:,.1f} us/get "
                  f"(per client: {[n for n, _ in counts]})", flush=True)
    return runs, failed


def median(v: list[float | None]) -> float | None:
    return None if not v or None in v else statistics.median(v)  # type: ignore[type-var]


# -- tables and ratios ----------------------------------------------------------------------


def report(runs: Cells, rates: dict[str, list[float | None]], names: list[str],
           extra: list[str]) -> None:
    put = {s: {n: median(v) for n, v in r.items()} for s, r in runs["put"].items()}
    get = {s: {n: median(v) for n, v in r.items()} for s, r in runs["get"].items()}
    for what, res in (("put", put), ("get", get)):
        print(f"\n{what} latency, median (GB/s)")
        table(["size", *names], [[fmt(s), *(lat(r.get(n), s) for n in names)] for s, r in res.items()])
        others = [n for n in names if n != "shmshare"]
        if "shmshare" in names and others:
            print(f"\n{what}: shmshare's speed as a multiple of each path's (its time / shmshare's)")
            table(["size", *others], [[fmt(s), *(times(r.get(n), r.get("shmshare")) for n in others)]
                                      for s, r in res.items()])
    rate = {n: median(v) for n, v in rates.items()}
    if rate:
        print(f"\n{fmt(SMALL)} gets/s, {CLIENTS} clients in all, median")
        table(["path", "gets/s", "shmshare x"],
              [[n, f"{v:,.0f}" if v else "failed", times(rate.get("shmshare"), v)] for n, v in rate.items()])
    lines = []
    top = max(put) if put else 0
    lines.append(ratio(f"put_{fmt(top)}_vs_ray", (put.get(top) or {}).get("ray"), (put.get(top) or {}).get("shmshare"),
                       TARGETS["put_1G"], f"Ray's put time / shmshare's at {fmt(top)} (1 GB put >= 2x faster than "
                       f"Ray's on /dev/shm here){'' if top == GiB else ' -- 1G left out, see above'}"))
    lines.append(ratio(f"get_{fmt(SMALL)}_rate_{CLIENTS}clients_vs_ray", rate.get("shmshare"), rate.get("ray"),
                       TARGETS["get_small_rate"], f"shmshare's {fmt(SMALL)} gets/s / Ray's, {CLIENTS} clients "
                       "(small get >= 2x Ray's rate)"))
    for (what, s), target in LARGE_TARGETS.items():
        r = (put if what == "put" else get).get(s) or {}
        lines.append(ratio(f"{what}_{fmt(s)}_vs_ray", r.get("ray"), r.get("shmshare"), target,
                           f"Ray's {what} time / shmshare's at {fmt(s)} (issue 23: at least Ray's)"))
    lines.append(ratio(f"get_{fmt(SMALL)}_rate_{CLIENTS}clients_vs_ray_x3", rate.get("shmshare"), rate.get("ray"),
                       3.0, f"shmshare's {fmt(SMALL)} gets/s / Ray's, {CLIENTS} clients (issue 23: at least 3x)"))
    lines.append(ratio(f"get_{fmt(SMALL)}_rate_{CLIENTS}clients_vs_stdlib", rate.get("shmshare"), rate.get("stdlib"),
                       1.0, f"shmshare's {fmt(SMALL)} gets/s / the stdlib's attach by name, {CLIENTS} clients "
                       "(issue 23: at least it)"))
    for what, res in (("put", put), ("get", get)):
        for s, r in res.items():
            for other in ("ray", "stdlib", "immutable"):
                if r.get(other) and r.get("shmshare") and not (what == "put" and s == top and other == "ray"):
                    lines.append(f"FIGURE {what}_{fmt(s)}_vs_{other} {r[other] / r['shmshare']:.3f} x  "  # type: ignore[operator]
                                 f"# {other}'s {what} time / shmshare's at {fmt(s)}")
    lines += extra
    print("\n=== bench_store ratios ===")
    for line in lines:
        print(line)
    print("=== end ===")
    sys.stdout.flush()


def ratio(name: str, mine_speed: float | None, base_speed: float | None, target: float, meaning: str) -> str:
    """A RATIO line: `mine_speed / base_speed` (for times, pass the other's time first)."""
    if not mine_speed or not base_speed:
        return f"RATIO {name} n/a target>={target:g} SKIP  # {meaning} (a column is missing)"
    value = mine_speed / base_speed
    return f"RATIO {name} {value:.3f} target>={target:g} {'PASS' if value >= target else 'MISS'}  # {meaning}"


def lat(v: float | None, size: int) -> str:
    return "failed" if v is None else f"{us(v)} ({size / v / 1e9:.2f})"


def us(secs: float) -> str:
    return f"{secs * 1e6:,.1f} us" if secs < 1e-2 else f"{secs * 1e3:,.1f} ms"


def times(base: float | None, mine: float | None) -> str:
    return f"{base / mine:.2f}x" if base and mine else "-"


# -- setup ----------------------------------------------------------------------------------


def set_up(sizes: list[int], reaper: Reaper, folder: str, stack: list[Callable[[], object]]) -> list[Side]:
    """Start the daemon, fork the clients, then start Ray; return the paths, cleanups pushed on `stack`."""
    top = max(sizes)
    daemon, path = None, None
    if sstore is not None:
        path, limit = os.path.join(folder, "store.sock"), store_limit(top)
        try:
            daemon = sstore.Daemon.start(path=path, limit=limit, timeout=WAIT)
        except Exception as exc:  # noqa: BLE001 - without the daemon the other rows still run
            print(f"shmshare's rows are left out: Daemon.start failed: {exc!r}")
            traceback.print_exc()
            path = None
        else:
            reaper.watch([daemon.pid])
            stack.append(daemon.stop)
            print(f"shmshare daemon: pid {daemon.pid}, {daemon.path}, limit {fmt(limit)}")
    clients = [Client(path) for _ in range(CLIENTS)]
    stack.extend(c.close for c in clients)
    paths: list[Side] = []
    if daemon is not None and path is not None:
        paths.append(Shmshare(clients, daemon, path))
        stack.append(paths[-1].close)
        paths.append(ShmshareImmutable(clients, daemon, path))
        stack.append(paths[-1].close)
    if ray is not None:
        store_bytes = ray_store_bytes(top)
        t0 = time.perf_counter()
        try:
            paths.append(Ray(store_bytes))
        except Exception as exc:  # noqa: BLE001 - without Ray the other rows still run
            print(f"ray's rows are left out: ray.init failed: {exc!r}")
            traceback.print_exc()
        else:
            stack.append(paths[-1].close)
            print(f"ray {ray.__version__}: object_store_memory {fmt_gib(store_bytes)} GiB, started in "
                  f"{time.perf_counter() - t0:.1f} s, actors {paths[-1].pids}")  # type: ignore[attr-defined]
        finally:
            reaper.watch(descendants())
    paths.append(Stdlib(clients))
    return paths


def run(args: argparse.Namespace) -> int:
    sizes = fitting(SIZES if not args.sizes else [parse_size(s) for s in args.sizes.split(",")])
    if not sizes:
        print("no size fits; nothing to measure")
        return 1
    rounds = args.rounds or (1 if args.quick else 3)
    secs = args.secs or (1.0 if args.quick else 3.0)
    reaper = Reaper()
    folder = tempfile.mkdtemp(prefix="bench_store-")
    reaper.watch(folder=folder)
    stack: list[Callable[[], object]] = []
    failed = 0
    try:
        paths = set_up(sizes, reaper, folder, stack)
        print(f"paths: {', '.join(p.name for p in paths)}; load average now: {load()}")
        runs, f1 = bench_latency(paths, sizes, args.quick, rounds)
        rates, f2 = bench_rate(paths, secs, rounds)
        failed = f1 + f2
        published = bench_publish(paths, sizes, rounds)
        report(runs, rates, [p.name for p in paths], published)
    finally:
        for undo in reversed(stack):
            try:
                undo()
            except Exception:  # noqa: BLE001 - go on stopping the rest
                traceback.print_exc()
        shutil.rmtree(folder, ignore_errors=True)
        reaper.close()
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer puts/gets per cell, 1 s of small gets")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes, e.g. 4K,64M (default 4K,1M,64M,1G)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every cell (default 3, quick 1)")
    ap.add_argument("--secs", type=float, default=None, help="seconds of each small-get loop (default 3, quick 1)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    rver = f"ray {ray.__version__}" if ray is not None else "no ray"
    print(f"bench_store: Linux {platform.release()}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"numpy {np.__version__}, {rver}, {fmt_gib(meminfo('MemAvailable'))} GiB available, /dev/shm "
          f"{fmt_gib(shutil.disk_usage('/dev/shm').free)} GiB free{', --quick' if args.quick else ''}")
    for why in (NO_STORE, NO_RAY):
        if why:
            print(f"rows left out: {why}")
    print(f"load average before: {load()} (other work on the machine shows in every figure)")
    failed = run(args)
    print(f"load average after: {load()}")
    print(f"bench_store: {time.perf_counter() - started:.0f} s in all"
          + (f", {failed} cell(s) failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
