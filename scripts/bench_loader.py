#!/usr/bin/env python3
"""Benchmark shmshare.DataLoader side by side with torch.utils.data.DataLoader, in one process tree.

Both loaders get the same dataset object and the same arguments: batch_size 32,
and with workers ``persistent_workers=True, prefetch_factor=2``. The consumer
reads one element per batch (``batch[0][0, 0, 0, 0].item()``), so the rate
measures the loader. Map-style datasets, sample i -> (a (3, 224, 224) image, i):
``float32`` / ``uint8`` copy the image out of a few preallocated ones (the cost
is the transport); ``cpu`` (uint8) costs about 1 ms of CPU per sample (a JPEG
decode with Pillow when installed, topped up, or a numpy stand-in) to show
scaling with workers.

Each row builds a loader and runs epoch 1 (time to its first batch includes
starting the workers; the rest is warm-up), then ``--runs`` epochs, in
``--rounds`` interleaved with the other loader's: the best epoch's rate, the
median time to a later epoch's first batch and the tree's CPU per batch. A
forked sampler records peak fds of this process and of the tree and peak
shared memory (the tree's own objects, and the host's Shmem).
Loaders are closed and their workers waited for between rows. Without torch,
shmshare's rows run alone, with ``collate_fn=shmshare.loader.numpy_collate``.
The issue's targets get PASS/MISS, informational only (times are never
asserted). From a checkout, installed or not: ``.venv/bin/python
scripts/bench_loader.py [--quick] [--workers 0,1,2] [--dtypes float32,uint8,cpu] [--start fork,spawn]
[--json FILE]``.

Start-up (issue 21, item 10): ``--start fork,spawn,forkserver`` runs every row under each start method
(``multiprocessing_context``); "iter ep1" is the time from building the loader until
its first iter() returned (the main process starting the workers), "1st ep1" until its first batch, and
"CPU ep1" the whole tree's CPU time until then (starting the workers: mostly their imports). For the
start-up table alone: ``--dtypes uint8 --workers 1,2,4 --start fork,spawn,forkserver --batches 16 --runs 1
--rounds 3``. This module imports neither torch nor shmshare at its top, so that a spawned worker, which
imports the main module again, imports each loader's own modules and no more; the forkserver is started
before the first row (a one-time cost of the process, not of a loader). shmshare's bytecode is compiled
first, as ``pip install`` does and as torch's is: in a checkout run with PYTHONDONTWRITEBYTECODE (these
machines), every spawned worker would otherwise compile shmshare's ~110 modules from source, about 0.2 s
of CPU each (``--from-source`` measures that).

Issue 24's tables (scripts/_bench_loader_start.py): ``--table pss`` (the tree's PSS after an epoch over 1M
paths, held as a list or as ``shmshare.loader.share()``) and ``--table startup`` (time to the first batch,
by phase inside the workers), and ``--table resume`` (scripts/_bench_loader_resume.py: resuming mid-epoch
beside torchdata's StatefulDataLoader), each instead of the rows above; ``--quick``, ``--workers``, ``--start``,
``--rounds``, ``--loaders`` and ``--json`` apply, with ``--paths`` and ``--variants``.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import gc
import importlib
import io
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from _bench import table  # scripts/_bench.py: run from scripts/ or by path
from _bench_tree import Sampler, meminfo_kb, tree_cpu, wait_children  # the process tree's fds, shm, CPU

# This checkout's shmshare, installed or not (an installed or editable copy elsewhere would shadow it). Imported
# where used, not here: a spawned worker imports this module again (see the docstring).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20
BATCH = 32
PREFETCH = 2
SHAPE = (3, 224, 224)
WAIT = 120  # s: the loaders' timeout for one batch, so that a hung worker ends the row, not the run
FD_CONST = 8  # target: at most 2 fds per worker plus this many in the main process
CPU_MS = 1.0  # the cpu dataset's aim per sample
LOADERS = ("torch", "shmshare")
STARTS = ("default", "fork", "spawn", "forkserver")  # --start: multiprocessing_context (default: None)


# -- datasets (module level: picklable for spawn/forkserver contexts) ---------------------


class Images:
    """Map-style dataset: sample i is a copy of one of a few preallocated images, and the label i."""

    def __init__(self, length: int, dtype: str, distinct: int = 8) -> None:
        rng = np.random.default_rng(0)
        self.length = length
        self.src = rng.integers(0, 256, (distinct, *SHAPE), dtype=np.uint8).astype(dtype)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.src[i % len(self.src)].copy(), i


class Decoded:
    """Map-style dataset whose samples cost about ``CPU_MS`` of CPU each: decode (Pillow) and/or numpy work."""

    def __init__(self, length: int, reps: int, jpeg: bytes | None) -> None:
        self.length = length
        self.reps = reps  # rounds of the numpy workload per sample
        self.jpeg = jpeg  # a 224x224 RGB JPEG to decode per sample, when Pillow is installed
        self.src = np.random.default_rng(1).integers(0, 256, SHAPE, dtype=np.uint8)
        self._x: np.ndarray | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if self.jpeg is not None:
            from PIL import Image

            img = np.asarray(Image.open(io.BytesIO(self.jpeg)).convert("RGB")).transpose(2, 0, 1)
        else:
            img = self.src
        if self._x is None:  # a scratch image per process (each worker's copy of the dataset gets its own)
            self._x = np.empty(SHAPE, np.float32)
        x = self._x
        np.copyto(x, img)
        for _ in range(self.reps):  # a stand-in for decode/augment: elementwise passes, in place (no page faults)
            np.multiply(x, x, out=x)
            np.add(x, 1.0, out=x)
            np.sqrt(x, out=x)
        return x.astype(np.uint8), i


def make_jpeg() -> bytes | None:
    """Return a 224x224 JPEG of a smooth, noisy picture, or None without Pillow."""
    try:
        from PIL import Image
    except ImportError:
        return None
    yy, xx = np.mgrid[0:224, 0:224]
    rgb = np.stack([xx, yy, (xx + yy) // 2], axis=-1) + np.random.default_rng(2).integers(0, 40, (224, 224, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB").save(buf, "JPEG", quality=90)
    return buf.getvalue()


def calibrate(jpeg: bytes | None) -> tuple[int, float]:
    """Return (numpy rounds, measured ms per sample) so that one cpu sample costs about CPU_MS."""

    def cost(reps: int) -> float:
        ds = Decoded(1, reps, jpeg)
        ds[0]
        t0 = time.thread_time()  # CPU time: other work on the machine preempting this thread does not count
        for _ in range(15):
            ds[0]
        return (time.thread_time() - t0) / 15 * 1e3

    base, per_rep = cost(0), (cost(8) - cost(0)) / 8
    reps = max(0, round((CPU_MS - base) / max(per_rep, 1e-3)))
    return reps, cost(reps)


# -- one row -------------------------------------------------------------------------------


@dataclass
class Row:
    """What one (loader, dataset, workers) measurement found; times in seconds, memory in MiB."""

    loader: str
    dataset: str
    workers: int
    batch_mib: float  # one batch's images and labels
    start: str = "default"  # the start method (multiprocessing_context; default: None, the platform's)
    rate: float = 0.0  # batches/s, the best of the measured epochs (the least disturbed by other work)
    cpu_ms: float = 0.0  # CPU time of the whole tree (this process and the workers) per measured batch
    first1: float = 0.0  # time to the first batch of epoch 1 (loader built, workers started)
    iter1: float = 0.0  # time until epoch 1's iter() returned: the main process starting the workers
    cpu1: float = 0.0  # CPU time of the whole tree from building the loader to epoch 1's first batch
    first2: float = 0.0  # time to the first batch of a later epoch (median)
    fds_base: int = 0  # this process's fds before the loader was built
    fds_main: int = 0  # peak fds of this process above fds_base
    fds_tree: int = 0  # peak fds of this process and all its descendants, above fds_base
    shm_mib: float = 0.0  # peak Shmem above its value before the row (host-wide)
    tree_mib: float = 0.0  # peak of the shm objects the tree holds fds of (see _bench_tree._fds_and_shm)
    shm_left_mib: float = 0.0  # Shmem above that value once the loader was closed
    stragglers: int = 0  # processes the row started that were still alive after close
    rates: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def mib_s(self) -> float:
        return self.rate * self.batch_mib

    @property
    def label(self) -> str:
        """The dataset, and the start method where it is not the default (workers only)."""
        return self.dataset if self.start == "default" or not self.workers else f"{self.dataset} {self.start}"


def touch(batch: Any) -> float:
    """Read one element of the batch's images: all a consumer does here."""
    return float(batch[0][0, 0, 0, 0].item())


def make_loader(kind: str, dataset: Any, workers: int, numpy_collate: bool,
                start: str = "default") -> Iterable[Any]:
    """Build `kind`'s DataLoader over `dataset` with the arguments every row uses."""
    kw: dict[str, Any] = {"batch_size": BATCH, "num_workers": workers}
    if workers:
        kw.update(persistent_workers=True, prefetch_factor=PREFETCH, timeout=WAIT)
        if start != "default":
            kw["multiprocessing_context"] = start
    if kind == "torch":
        from torch.utils.data import DataLoader

        return DataLoader(dataset, **kw)  # type: ignore[no-any-return]
    if numpy_collate:
        kw["collate_fn"] = importlib.import_module("shmshare.loader").numpy_collate
    return shmshare_loader()(dataset, **kw)  # type: ignore[no-any-return]


def shmshare_loader() -> Any:
    """Return shmshare's DataLoader class, or None where this checkout has none yet."""
    try:
        return importlib.import_module("shmshare.loader").DataLoader
    except (ImportError, AttributeError):
        return None


def close_loader(loader: Any) -> None:
    """Shut the loader's workers down: its close() (shmshare), its cached iterator's shutdown (torch)."""
    torch_it = getattr(loader, "_iterator", None)
    for stop in (getattr(loader, "close", None), getattr(torch_it, "_shutdown_workers", None)):
        if callable(stop):
            stop()


def run_row(sampler: Sampler, kind: str, name: str, dataset: Any, workers: int, runs: int,
            numpy_collate: bool, start: str = "default") -> Row:
    """Measure one loader over `dataset`: epoch 1, then `runs` epochs; close it and wait for its workers."""
    sample, _ = dataset[0]
    row = Row(kind, name, workers, (sample.nbytes + 8) * BATCH / MiB, start)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    gc.collect()
    shm_base, row.fds_base = sampler.ask("start")
    loader: Any = None
    try:
        cpu_built = tree_cpu(me, sampler.pid)
        t0 = time.perf_counter()
        loader = make_loader(kind, dataset, workers, numpy_collate, start)
        built = time.perf_counter() - t0

        def at_first() -> None:  # the tree's CPU for starting the workers, read once the first batch is in
            row.cpu1 = tree_cpu(me, sampler.pid) - cpu_built

        first1, _, _, row.iter1 = epoch(loader, at_first)
        row.first1, row.iter1 = built + first1, built + row.iter1
        cpu0, firsts = tree_cpu(me, sampler.pid), []  # (the rest of epoch 1 is the warm-up)
        for _ in range(runs):
            first, rest, n, _ = epoch(loader)
            row.rates.append((n + 1) / (first + rest))  # the whole epoch: no batch was prefetched before it
            firsts.append(first)
        row.cpu_ms = (tree_cpu(me, sampler.pid) - cpu0) / (runs * len(loader)) * 1e3
        row.rate, row.first2 = max(row.rates), statistics.median(firsts)
    except Exception as e:  # noqa: BLE001 -- a failing loader is a row of the report, not the end of the run
        row.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        if loader is not None:
            with contextlib.suppress(Exception):  # reported through the stragglers count below
                close_loader(loader)
        del loader
        gc.collect()
        row.stragglers = wait_children(me, before)
        peaks = sampler.ask("stop")
    row.fds_main, row.fds_tree = peaks["fds_main"] - row.fds_base, peaks["fds_tree"] - row.fds_base
    row.shm_mib, row.tree_mib = peaks["shm_kb"] / 1024, peaks["tree_bytes"] / MiB
    row.shm_left_mib = (meminfo_kb("Shmem") - shm_base) / 1024
    return row


def epoch(loader: Iterable[Any], at_first: Callable[[], None] | None = None) -> tuple[float, float, int, float]:
    """Run one epoch; return (seconds to its first batch, seconds for the rest, batches after the first,
    seconds until iter() returned).

    `at_first` is called once the first batch is in, outside the times (it may take a while).
    """
    t0 = time.perf_counter()
    it = iter(loader)
    made = time.perf_counter() - t0
    touch(next(it))
    first = time.perf_counter() - t0
    if at_first is not None:
        at_first()
    t1, n = time.perf_counter(), 0
    for batch in it:
        touch(batch)
        n += 1
    return first, time.perf_counter() - t1, n, made


# -- the report ----------------------------------------------------------------------------


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:,.0f}" if s >= 0.01 else f"{s * 1e3:.1f}"


def ratio(a: float, b: float) -> str:
    if a <= 0 or b <= 0:
        return "-"
    return f"{a / b:.2f}x" if a / b >= 0.1 else f"{a / b:.1g}x"


def print_rows(rows: list[Row]) -> None:
    head = ["loader", "dataset", "workers", "batches/s", "MiB/s", "CPU ms/batch", "iter ep1 ms", "1st ep1 ms",
            "CPU ep1 ms", "1st ep2 ms", "fds main", "fds tree", "shm tree MiB", "Shmem peak", "Shmem left"]
    out = []
    for r in rows:
        if r.error:
            out.append([r.loader, r.label, str(r.workers), "error", r.error[:60], *[""] * 10])
            continue
        out.append([r.loader, r.label, str(r.workers), f"{r.rate:,.1f}", f"{r.mib_s:,.0f}", f"{r.cpu_ms:.1f}",
                    fmt_ms(r.iter1), fmt_ms(r.first1), fmt_ms(r.cpu1), fmt_ms(r.first2), f"+{r.fds_main}",
                    f"+{r.fds_tree}",
                    f"{r.tree_mib:,.1f}", f"{r.shm_mib:,.1f}", f"{r.shm_left_mib:,.1f}"
                    + (f" ({r.stragglers} alive)" if r.stragglers else "")])
    table(head, out)


def index(rows: list[Row]) -> dict[tuple[str, str, int], Row]:
    """Return the rows without errors by (loader, dataset and start method, workers)."""
    return {(r.loader, r.label, r.workers): r for r in rows if not r.error}


def print_ratios(rows: list[Row]) -> None:
    by = index(rows)
    out = [[d, str(w), ratio(s.rate, t.rate), ratio(s.cpu_ms, t.cpu_ms), ratio(s.iter1, t.iter1),
            ratio(s.first1, t.first1), ratio(s.cpu1, t.cpu1), ratio(s.first2, t.first2),
            f"{s.fds_main:+d} / {t.fds_main:+d}", f"{s.tree_mib:,.0f} / {t.tree_mib:,.0f}",
            ratio(s.rate, by[("torch", s.dataset, 0)].rate) if w == 2 and ("torch", s.dataset, 0) in by else ""]
           for (k, d, w), s in by.items() if k == "shmshare" and ("torch", d, w) in by for t in [by[("torch", d, w)]]]
    if out:
        print("\nshmshare / torch, per row (rate: higher is better; CPU and times: lower is better)")
        table(["dataset", "workers", "batches/s", "CPU/batch", "iter ep1", "1st ep1", "CPU ep1", "1st ep2",
               "fds main (s / t)",
               "shm tree MiB (s / t)", "2 workers vs torch 0"], out)


def targets(rows: list[Row]) -> list[dict[str, Any]]:
    """Check the issue's targets on the shmshare rows; return one record per check."""
    by = index(rows)
    found: list[dict[str, Any]] = []

    def check(what: str, value: float, limit: float, unit: str, at_least: bool = False) -> None:
        ok = value >= limit if at_least else value <= limit
        found.append({"target": what, "value": round(value, 3), "limit": round(limit, 3), "unit": unit, "pass": ok})

    for (kind, d, w), s in by.items():
        if kind != "shmshare":
            continue
        for tw, times in ((2, 3.0), (0, 1.0)):
            t = by.get(("torch", d if tw else s.dataset, tw))
            if w == 2 and s.dataset != "cpu" and t is not None:
                check(f"{d}, 2 workers: rate >= {times:g}x torch {tw} workers", s.rate / t.rate, times, "x",
                      at_least=True)
        if w and ("torch", d, w) in by:  # issue 21, item 10: start-up no slower than torch's
            check(f"{d}, {w} workers: first batch <= torch's", s.first1 / by[("torch", d, w)].first1, 1.0, "x")
        check(f"{d}, {w} workers: main fds <= 2/worker + {FD_CONST}", s.fds_main, 2 * w + FD_CONST, "fds")
        if w:
            check(f"{d}, {w} workers: shm in flight <= {PREFETCH}x{w}+2 batches", s.tree_mib,
                  (PREFETCH * w + 2) * s.batch_mib, "MiB")
    return found


def print_targets(found: list[dict[str, Any]]) -> None:
    print("\ntargets of the issue (informational; shmshare rows)" if found else "\ntargets: no shmshare rows")
    table(["target", "measured", "limit", "result"],
          [[f["target"], _num(f["value"], f["unit"]), _num(f["limit"], f["unit"]), "PASS" if f["pass"] else "MISS"]
           for f in found])


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run every (dataset, workers, loader) row, print the tables; return 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds in all (smoke tests)")
    ap.add_argument("--batches", type=int, default=None, help="batches per measured epoch (default 120, quick 8)")
    ap.add_argument("--cpu-batches", type=int, default=None, help="batches per epoch of the cpu dataset "
                    "(default 32, quick 4)")
    ap.add_argument("--runs", type=int, default=None, help="measured epochs per round, after epoch 1 (default 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per row, the loaders interleaved (default 2)")
    ap.add_argument("--dtypes", default="float32,uint8,cpu", help="datasets: float32, uint8, cpu")
    ap.add_argument("--workers", default=None, help="worker counts (default 0,1,2; quick 0,2)")
    ap.add_argument("--loaders", default=",".join(LOADERS), help="torch, shmshare")
    ap.add_argument("--start", default="default", help="start methods of the workers' rows: default (the "
                    "platform's), fork, spawn, forkserver (comma-separated; 0-worker rows run once)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads() in this process "
                    "(default 1; 0: torch's own default) -- see Note [One torch thread]")
    ap.add_argument("--from-source", action="store_true", help="do not compile shmshare's bytecode first "
                    "(a checkout under PYTHONDONTWRITEBYTECODE: each spawned worker compiles it)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows and targets as JSON ('-': stdout, "
                    "tables to stderr)")
    from _bench_loader_start import add_arguments, run_table  # issue 24's --table pss/startup

    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.table:
        return run_table(args, None if args.from_source or args.cell else compile_shmshare)
    args.batches = args.batches or (8 if args.quick else 120)
    args.cpu_batches = args.cpu_batches or (4 if args.quick else 32)
    args.runs = args.runs or (1 if args.quick else 2)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.workers = [int(w) for w in (args.workers or ("0,2" if args.quick else "0,1,2")).split(",")]
    args.start = [m.strip() for m in args.start.split(",") if m.strip()]
    if set(args.dtypes) - {"float32", "uint8", "cpu"}:
        ap.error(f"unknown dataset(s) in {args.dtypes}: float32, uint8 and cpu exist")
    if set(args.start) - set(STARTS) or not args.start:
        ap.error(f"unknown start method(s) in {args.start}: {', '.join(STARTS)} exist")
    with contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext():
        report = bench(args)
    if args.json:
        text = json.dumps(report, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every row (timed as main() set `args` up), print the tables; return the report for --json."""
    batches, cpu_batches, runs, dtypes = args.batches, args.cpu_batches, args.runs, args.dtypes
    started = time.perf_counter()
    compiled = None if args.from_source else compile_shmshare()
    torch_version, threads = set_torch_threads(args.torch_threads)
    have_torch = torch_version is not None
    missing = {"torch": not have_torch, "shmshare": shmshare_loader() is None}
    loaders = [k for k in args.loaders.split(",") if k in LOADERS and not missing[k]]
    torch_note = f", torch {torch_version} ({threads} thread(s) here)" if have_torch else ""
    print(f"bench_loader: Linux {platform.release()}, Python {platform.python_version()}, numpy {np.__version__}"
          f"{torch_note}, {os.cpu_count()} CPUs; batch {BATCH}, prefetch {PREFETCH}, persistent workers; "
          f"{batches} batches per epoch ({cpu_batches} for cpu), "
          f"{args.rounds} round(s) of {runs} measured epoch(s) after epoch 1{', --quick' if args.quick else ''}; "
          f"workers started by {', '.join(args.start)} (default: {mp.get_start_method()})")
    for k in (k for k, gone in missing.items() if gone):
        print(f"{k}'s rows are left out: " + ("torch is not installed (shmshare's use numpy_collate)" if k == "torch"
                                              else "this checkout has no shmshare.DataLoader yet"))
    print("shmshare's bytecode: " + ("not compiled first (--from-source); written on import: "
                                     f"{not sys.dont_write_bytecode}" if compiled is None else
                                     f"compiled first, {compiled} module(s) were missing or stale"))
    print(f"load average before: {_load()} (other work on the machine shows in every figure)")
    meta: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "torch_threads": threads,
                            "batch_size": BATCH, "prefetch_factor": PREFETCH, "batches": batches,
                            "cpu_batches": cpu_batches, "runs": runs, "loaders": loaders, "starts": args.start,
                            "bytecode_compiled": compiled}
    jpeg, reps = None, 0
    if "cpu" in dtypes:
        jpeg = make_jpeg()
        reps, ms = calibrate(jpeg)
        how = "Pillow JPEG decode 224x224" + (f" + {reps} numpy rounds" if reps else "") if jpeg else \
            f"numpy stand-in, {reps} rounds (Pillow is not installed)"
        print(f"cpu dataset: {ms:.2f} ms of CPU per sample in this process ({how})")
        meta.update(cpu_ms=ms, cpu_reps=reps, cpu_pillow=jpeg is not None)
    print()
    if "forkserver" in args.start:  # once per process, before any row: not a loader's cost
        from multiprocessing import forkserver

        forkserver.ensure_running()
    sampler = Sampler()
    try:
        rows = run_all(sampler, loaders, args, reps, jpeg, have_torch)
    finally:
        sampler.close()
    print(f"load average after: {_load()}")
    print("\nper row: batches/s and MiB/s (best measured epoch); CPU time of the whole tree per batch (all measured"
          "\nepochs: steadier than rates when other work shares the CPUs); time to the first batch of epoch 1"
          "\n(includes starting workers; 'iter': until iter() returned) and the tree's CPU time until then; time"
          "\nto the first batch of a later epoch (median); peak fds above this process's count before"
          "\nthe row (main, and the whole tree); peak shared memory of the objects the tree holds fds of (the"
          "\ntargets use it); the host's Shmem (MiB) above its value before the row, its peak and after close")
    print_rows(rows)
    print_ratios(rows)
    found = targets(rows)
    print_targets(found)
    print(f"\n(whole run: {time.perf_counter() - started:.1f} s)")
    return {"meta": meta, "rows": [asdict(r) | {"mib_s": r.mib_s} for r in rows], "targets": found}


def run_all(sampler: Sampler, loaders: list[str], args: argparse.Namespace, reps: int, jpeg: bytes | None,
            have_torch: bool) -> list[Row]:
    """Run the rows one after the other (torch then shmshare for each dataset and worker count)."""
    for kind in loaders:  # one-time costs (lazy imports, first kernels) must not land on the first row
        for d in args.dtypes:
            ds = Decoded(2 * BATCH, reps, jpeg) if d == "cpu" else Images(2 * BATCH, d)
            for batch in make_loader(kind, ds, 0, numpy_collate=not have_torch):
                touch(batch)
    rows: list[Row] = []
    for d in args.dtypes:
        n = (args.cpu_batches if d == "cpu" else args.batches) * BATCH
        dataset = Decoded(n, reps, jpeg) if d == "cpu" else Images(n, d)
        for start in args.start:
            for w in args.workers:
                if not w and start != args.start[0]:
                    continue  # no workers: no start method
                rounds: dict[str, list[Row]] = {k: [] for k in loaders}
                for i in range(args.rounds):  # interleaved: a burst of other work on the machine hits both loaders
                    for kind in loaders:
                        r = run_row(sampler, kind, d, dataset, w, args.runs, not have_torch, start)
                        rounds[kind].append(r)
                        print(f"  {kind:>8} {r.label:>7} {w} workers, round {i + 1}: " +
                              (r.error or f"{r.rate:,.1f} batches/s, first batch {fmt_ms(r.first1)} ms"), flush=True)
                rows += [merge(rounds[kind]) for kind in loaders]
    return rows


def merge(rounds: list[Row]) -> Row:
    """Return one row for rounds of one measurement: the best rate, median times and CPU, the highest peaks."""
    if any(r.error for r in rounds):
        return next(r for r in rounds if r.error)
    peaks = {f: max(getattr(r, f) for r in rounds) for f in ("fds_main", "fds_tree", "tree_mib", "shm_mib",
                                                                "shm_left_mib", "stragglers")}
    medians = {f: statistics.median(getattr(r, f) for r in rounds)
               for f in ("iter1", "first1", "cpu1", "first2", "cpu_ms")}
    return replace(max(rounds, key=lambda r: r.rate), rates=[x for r in rounds for x in r.rates],
                               **peaks, **medians)


# Note [One torch thread]
#     With 0 workers the whole loader runs in this process, and torch's
#     default_collate stacks with torch's intra-op pool (2 threads here). On
#     this 2-CPU machine, with other work on it, that pool's waiting threads
#     turned a 1.3 ms uint8 batch (715 batches/s) into 30-60 ms of CPU and
#     16-24 batches/s, from one epoch to the next. Workers run with one
#     thread already (torch's _worker_loop sets it), so this process gets one
#     too by default: the 0-worker anchor is then the steady figure.


def compile_shmshare() -> int:
    """Compile this checkout's shmshare modules whose bytecode is missing or stale; return how many there were.

    What an installed package has from ``pip install``, and torch has: without it, under
    PYTHONDONTWRITEBYTECODE, each spawned worker compiles every module it imports.
    """
    from importlib.util import cache_from_source

    root = Path(__file__).resolve().parents[1] / "shmshare"
    stale = 0
    for src in root.rglob("*.py"):
        pyc = Path(cache_from_source(str(src)))
        stale += not pyc.exists() or pyc.stat().st_mtime < src.stat().st_mtime
    if stale:
        compileall.compile_dir(str(root), quiet=1)
    return stale


def set_torch_threads(n: int) -> tuple[str | None, int]:
    """Set torch's intra-op threads here (0: torch's default); return (torch's version, threads), or (None, 0)."""
    try:
        import torch
    except ImportError:
        return None, 0
    if n > 0:
        torch.set_num_threads(n)
    return str(torch.__version__), int(torch.get_num_threads())


def _num(x: float, unit: str) -> str:
    return f"{x:,.0f} {unit}" if unit == "fds" else f"{x:,.2f}{unit}" if unit == "x" else f"{x:,.1f} {unit}"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
