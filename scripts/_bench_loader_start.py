"""bench_loader.py's tables for issue 24: ``--table pss`` (one copy of the dataset) and ``--table startup``.

The dataset of both: ``--paths`` (1,000,000; quick 200,000) paths like
``/data/train/class_0123/img_00012345.JPEG``, held as a plain Python list or as
``shmshare.loader.share(paths)`` (a read-only ``SharedSequence`` in one sealed
memfd). Sample i is ``(len(paths[i]), i)``: cheap, so that the figures are the
loader's and the dataset's. Both loaders get the same arguments: batch 256,
``shuffle=True``, ``persistent_workers=True``, prefetch 2, and the start method as
``multiprocessing_context``; torch is imported in the main process for every row
(shmshare's loader runs in torch mode, as it would beside a torch model).
Variants (``--variants``): ``torch/list``, ``torch/share``, ``shmshare/list``,
``shmshare/share`` (torch's loader takes the ``share()`` dataset too: a plain
picklable object); a shmshare one may end in ``:each`` or ``:one`` (its
``worker_start``: under spawn and forkserver, by default, one "zygote" process
takes the dataset and forks the workers; ``each`` starts every worker, as torch).

PSS ("One copy of the dataset", Note [One copy of the dataset] in
shmshare/loader/_frozen.py): each cell runs in a fresh process (``bench_loader.py
--table pss --cell ...``), so that no other cell's memory is counted: it imports
torch, builds the list (and shares it, dropping the list), builds the loader and
runs one full epoch (every element read once, by whichever worker), then, with
the persistent workers still alive, sums ``psutil``'s PSS of the workers (the
iterator's ``_workers``), of the loader's other processes (shmshare's zygote;
not multiprocessing's resource tracker) and of the main process; and the same
sum of ``Pss_Anon + Pss_Shmem`` (smaps_rollup): PSS without file pages, which
move with whatever else on the machine maps torch's libraries. A forked worker
copies each page of the list it reads into (copy-on-read: the reference counts
are written); a spawned torch worker unpickles a copy of its own (shmshare's
zygote unpickles one, which the workers it forks then copy as they read). Default: fork with 1, 2, 4, 8 workers
(quick 1, 2, 4), spawn with 1 and 4.

Start-up ("time to first batch"): every cell in this process (the forkserver
started first; a throwaway cell per loader and start method before the table, so
that lazy imports and the page cache are not the first cell's), from
``iter(loader)`` to its first batch, and, per worker, when it got where, stamped
inside the worker with ``CLOCK_BOOTTIME`` (the clock of /proc's start times) and
returned in the samples as a float64 row, so that nothing goes through files:
process start (/proc/self/stat field 22, 10 ms ticks), dataset arrival (the
dataset's ``__setstate__``: "-" under fork, where nothing is unpickled),
``worker_init_fn`` (imports and the dataset done), the first sample (first
``__getitem__``). The first ``workers`` batches come one from each worker
(in-order delivery); reported: worker 0's phases and those of the worker whose
first sample came last, in ms after ``iter()``, and the start of worker 0's
parent where it started after ``iter()`` (shmshare's zygote). Default: fork, spawn and
forkserver with 1, 2, 4, 8 workers (quick 1, 2, 4); ``--rounds`` cells per row,
interleaved, the median first batch's round reported.

Times are never asserted. ``.venv/bin/python scripts/bench_loader.py --table pss|startup [--quick]
[--workers 1,2,4,8] [--start fork,spawn] [--paths N] [--variants torch/list,shmshare/share] [--json FILE]``.
Imports neither torch nor shmshare at its top (spawned workers import bench_loader, and this, again).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from _bench import table
from _bench_tree import tree_cpu, wait_children

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's shmshare (as bench_loader)

__all__ = ["add_arguments", "run_table"]

MiB = 1 << 20
BATCH = 256
PREFETCH = 2
WAIT = 300  # s: the loaders' timeout for one batch (a spawned worker on a busy 2-CPU machine imports torch slowly)
VARIANTS = ("torch/list", "torch/share", "shmshare/list", "shmshare/share")
STARTUP_VARIANTS = ("torch/list", "shmshare/list", "shmshare/share")
NAN = float("nan")
# a stamped sample's row: worker id, process start, its parent's start, dataset arrival, worker_init_fn, first
# sample, this sample, len(path), index
WID, START, PARENT, DATA, INIT, FIRST, MADE = range(7)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of these tables, on bench_loader's parser (its --quick, --workers, --start, --rounds,
    --loaders and --json apply too)."""
    ap.add_argument("--table", choices=("pss", "startup", "resume"), help="issue 24's tables instead of the "
                    "rows: the workers' PSS after an epoch over 1M paths, the time to the first batch by phase "
                    "(scripts/_bench_loader_start.py), or resuming mid-epoch beside torchdata "
                    "(scripts/_bench_loader_resume.py)")
    ap.add_argument("--paths", type=int, default=None, help="--table: paths in the dataset (default 1,000,000; "
                    "quick 200,000)")
    ap.add_argument("--variants", default=None, help="--table: loader/dataset pairs (default pss: "
                    f"{','.join(VARIANTS)}; startup: {','.join(STARTUP_VARIANTS)})")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # --table pss: one cell, in this fresh process (JSON)


# -- the dataset (module level: picklable for spawn/forkserver) ----------------------------


def make_paths(n: int) -> list[str]:
    return [f"/data/train/class_{i % 1000:04d}/img_{i:08d}.JPEG" for i in range(n)]


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_STAMPS: dict[str, float] = {}  # this process's (a forked worker's starts empty: see _stamps)


def _stamps() -> dict[str, float]:
    if _STAMPS.get("pid") != os.getpid():  # inherited from the parent by fork: not this process's
        _STAMPS.clear()
        _STAMPS["pid"] = os.getpid()
    return _STAMPS


def proc_start(pid: int | str = "self") -> float:
    """The process's start (fork) on CLOCK_BOOTTIME, from /proc/<pid>/stat field 22 (clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # field 3 on, after the command's name
    return int(fields[22 - 3]) / os.sysconf("SC_CLK_TCK")


def worker_init(worker_id: int) -> None:
    """worker_init_fn of the start-up cells: stamp it, the worker's id and its process's start."""
    st = _stamps()
    st["init"], st["wid"], st["start"], st["parent"] = now(), worker_id, proc_start(), proc_start(os.getppid())


class Paths:
    """Map-style: sample i is (len(paths[i]), i); with `stamps`, a float64 row of when this worker got where."""

    def __init__(self, paths: Any, stamps: bool = False) -> None:
        self.paths = paths
        self.stamps = stamps
        self.arrived = NAN  # when a copy was unpickled (spawn, forkserver); never under fork

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.arrived = now()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        p = self.paths[i]
        if not self.stamps:
            return len(p), i
        st = _stamps()
        t = now()
        first = st.setdefault("first", t)
        return np.array([st.get("wid", -1), st.get("start", NAN), st.get("parent", NAN), self.arrived,
                         st.get("init", NAN), first, t, len(p), i])


def parse_variant(v: str) -> tuple[str, bool, str | None]:
    """"shmshare/share:each" -> ("shmshare", True, "each"): the loader, whether the dataset is share()d, and
    shmshare's worker_start (None: the loader's default)."""
    kind, _, rest = v.partition("/")
    ds, _, worker_start = rest.partition(":")
    bad = kind not in ("torch", "shmshare") or ds not in ("list", "share") or worker_start not in ("", "one", "each")
    if bad or (worker_start and kind == "torch"):
        raise SystemExit(f"unknown variant {v!r}: {', '.join(VARIANTS)}, and shmshare's with ':one' or ':each' "
                         "(worker_start)")
    return kind, ds == "share", worker_start or None


def make_loader(variant: str, dataset: Any, workers: int, start: str,
                init: Callable[[int], None] | None = None) -> Any:
    kind, _, worker_start = parse_variant(variant)
    kw: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "num_workers": workers, "worker_init_fn": init}
    if workers:
        kw.update(persistent_workers=True, prefetch_factor=PREFETCH, timeout=WAIT, multiprocessing_context=start)
    if worker_start:
        kw["worker_start"] = worker_start
    if kind == "torch":
        from torch.utils.data import DataLoader

        return DataLoader(dataset, **kw)
    from shmshare.loader import DataLoader as Ours

    return Ours(dataset, **kw)


def close(loader: Any, it: Any) -> None:
    """Shut the workers down: shmshare's close(), torch's iterator's _shutdown_workers()."""
    for stop in (getattr(loader, "close", None), getattr(it, "_shutdown_workers", None)):
        if callable(stop):
            stop()


def worker_pids(it: Any, before: set[int]) -> list[int]:
    """The iterator's workers' pids (`_workers`, both loaders), or the processes started since `before`."""
    with contextlib.suppress(AttributeError, TypeError):
        pids = [int(w.pid) for w in it._workers]
        if pids:
            return pids
    return [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]


def import_torch() -> str:
    import torch

    torch.set_num_threads(1)  # bench_loader's Note [One torch thread]
    return str(torch.__version__)


def dataset_for(variant: str, paths: list[str], stamps: bool = False) -> Paths:
    if parse_variant(variant)[1]:
        from shmshare.loader import share

        return Paths(share(paths), stamps)
    return Paths(paths, stamps)


# -- entry ---------------------------------------------------------------------------------


def run_table(args: argparse.Namespace, compile_shmshare: Callable[[], int] | None = None) -> int:
    """Run --table pss or startup as bench_loader's `args` say; print the tables; return 0."""
    if args.cell:
        print(json.dumps(pss_cell(json.loads(args.cell))))
        return 0
    if args.table == "resume":
        import _bench_loader_resume

        return _bench_loader_resume.run(args.quick, args.rounds or 1)
    with contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext():
        report = _run(args, compile_shmshare)
    if args.json:
        text = json.dumps(report, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


def _run(args: argparse.Namespace, compile_shmshare: Callable[[], int] | None) -> dict[str, Any]:
    quick = args.quick
    n = args.paths or (200_000 if quick else 1_000_000)
    default_workers = "1,2,4" if quick else "1,2,4,8"
    workers = [int(w) for w in (args.workers or default_workers).split(",") if int(w) > 0]
    starts = [s.strip() for s in args.start.split(",") if s.strip() and s.strip() != "default"]
    loaders = {k.strip() for k in args.loaders.split(",")}
    variants = [v.strip() for v in (args.variants or ",".join(VARIANTS if args.table == "pss" else
                                                                STARTUP_VARIANTS)).split(",") if v.strip()]
    variants = [v for v in variants if parse_variant(v)[0] in loaders]
    compiled = compile_shmshare() if compile_shmshare is not None else None
    started = time.perf_counter()
    print(f"bench_loader --table {args.table}: Linux {platform.release()}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs; {n:,} paths, batch {BATCH}, shuffle, prefetch {PREFETCH}, persistent workers"
          f"{', --quick' if quick else ''}; shmshare's bytecode compiled first ({compiled} stale)")
    print(f"load average before: {_load()} (other work on the machine shows in every figure)\n")
    if args.table == "pss":
        cells = [(s, w) for s in (starts or ["fork", "spawn"]) for w in workers
                 if starts or s == "fork" or w in (1, 4)]
        report = pss_table(n, cells, variants)
    else:
        report = startup_table(n, [(s, w) for s in (starts or ["fork", "spawn", "forkserver"]) for w in workers],
                               variants, args.rounds or 1)
    print(f"load average after: {_load()}\n(whole run: {time.perf_counter() - started:.1f} s)")
    return report | {"paths": n, "quick": quick}


# -- PSS ---------------------------------------------------------------------------------


def pss_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """One cell, in this fresh process: build the dataset and loader, run an epoch, read the tree's PSS."""
    torch_version = import_torch()
    me = psutil.Process()
    t0 = time.perf_counter()
    paths = make_paths(spec["paths"])
    ds = dataset_for(spec["variant"], paths)
    del paths
    gc.collect()
    built = time.perf_counter() - t0
    out: dict[str, Any] = {"torch": torch_version, "build_s": built, "main_before": me.memory_full_info().pss}
    before = {p.pid for p in me.children(recursive=True)}
    loader = make_loader(spec["variant"], ds, spec["workers"], spec["start"])
    it: Any = None
    try:
        cpu0, t0 = tree_cpu(me, 0), time.perf_counter()
        it = iter(loader)
        batches = sum(1 for _ in it)
        out.update(epoch_s=time.perf_counter() - t0, batches=batches, cpu_s=tree_cpu(me, 0) - cpu0)
        pids = worker_pids(it, before)
        infos = [psutil.Process(p).memory_full_info() for p in pids]
        # the other processes the loader started: shmshare's zygote (spawn, forkserver), a forkserver
        others = [p.pid for p in me.children(recursive=True) if p.pid not in {*pids, *before, *_trackers()}]
        out.update(workers_pss=[i.pss for i in infos], workers_uss=[i.uss for i in infos],
                   workers_mem=[rollup(p) for p in pids], main=me.memory_full_info().pss, main_mem=rollup(me.pid),
                   others_pss=[psutil.Process(p).memory_full_info().pss for p in others],
                   others_mem=[rollup(p) for p in others])
    finally:
        close(loader, it)
        del it, loader
        gc.collect()
        out["stragglers"] = wait_children(me, before | set(_trackers()))
    return out


def rollup(pid: int) -> int:
    """The process's PSS of anonymous and shared memory (Pss_Anon + Pss_Shmem of /proc/<pid>/smaps_rollup), in
    bytes: its PSS less file pages (torch's libraries' are shared with any process on the machine mapping them,
    other work's too, so they move with it)."""
    kb = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                kb += int(line.split()[1])
    return kb * 1024


def _trackers() -> list[int]:
    """multiprocessing's resource tracker (spawn, forkserver start one, and it lives on): not the loader's."""
    return [p.pid for p in psutil.Process().children() if "resource_tracker" in " ".join(_cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def pss_table(n: int, cells: list[tuple[str, int]], variants: list[str]) -> dict[str, Any]:
    bench = str(Path(__file__).with_name("bench_loader.py"))
    rows: list[dict[str, Any]] = []
    for start, w in cells:
        for v in variants:
            spec = {"paths": n, "variant": v, "workers": w, "start": start}
            proc = subprocess.run([sys.executable, bench, "--table", "pss", "--cell", json.dumps(spec)],
                                  capture_output=True, text=True, timeout=900, check=False)
            row: dict[str, Any] = dict(spec)
            if proc.returncode:
                row["error"] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200]
                print(f"  {v:>14} {start} {w} workers: ERROR (exit {proc.returncode})\n{proc.stderr[-3000:]}",
                      flush=True)
            else:
                row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                row["total"] = row["main"] + sum(row["workers_pss"]) + sum(row["others_pss"])
                row["total_mem"] = row["main_mem"] + sum(row["workers_mem"]) + sum(row["others_mem"])
                print(f"  {v:>14} {start} {w} workers: {row['total'] / MiB:,.0f} MiB (workers "
                      f"{sum(row['workers_pss']) / MiB:,.0f}), epoch {row['epoch_s']:.1f} s", flush=True)
            rows.append(row)
    print("\nPSS after one epoch (MiB; persistent workers still alive): main = the main process (its dataset, "
          "torch, the\nloader), workers = the sum of the workers', per worker = their mean (USS: private pages); "
          "main before =\nthe main process once the dataset was built, before the loader; others = the loader's "
          "other processes\n(shmshare's zygote under spawn/forkserver); total = main + workers + others; anon+shm = "
          "the same total of\nPss_Anon + Pss_Shmem only (no file pages); epoch and its CPU (whole tree)")
    out = []
    for r in rows:
        head = [r["variant"], r["start"], str(r["workers"])]
        if "error" in r:
            out.append([*head, "error", *[""] * 8, r["error"][:100]])
            continue
        ws = r["workers_pss"]
        out.append([*head, _mib(r["main_before"]), _mib(r["main"]), _mib(sum(ws)),
                    f"{_mib(sum(ws) / len(ws))} ({_mib(sum(r['workers_uss']) / len(ws))})",
                    _mib(sum(r["others_pss"])) if r["others_pss"] else "-", _mib(r["total"]),
                    _mib(r["total_mem"]), f"{r['epoch_s']:.1f}", f"{r['cpu_s']:.1f}", str(r["stragglers"] or "")])
    table(["variant", "start", "workers", "main before", "main", "workers", "per worker (USS)", "others", "total",
           "anon+shm", "epoch s", "CPU s", "alive after"], out)
    pairs = [(a, b) for a, b in (("torch/list", "shmshare/share"), ("torch/list", "shmshare/list"),
                                 ("torch/share", "shmshare/share"), ("torch/list", "torch/share"))
             if a in variants and b in variants]
    for key, what in (("total", "Total PSS (main + workers + others, MiB)"),
                      ("total_mem", "PSS of anonymous and shared memory only (Pss_Anon + Pss_Shmem: no file pages, "
                       "which other\nprocesses mapping torch's libraries move), main + workers + others, MiB")):
        by = {(r["start"], r["workers"], r["variant"]): r[key] for r in rows if "error" not in r}
        if pairs:
            print(f"\n{what}, and the ratios a / b (higher: b holds less)")
            table(["start", "workers", *variants, *(f"{a} / {b}" for a, b in pairs)],
                  [[s, str(w), *(_mib(by[(s, w, v)]) if (s, w, v) in by else "-" for v in variants),
                    *(_ratio(by.get((s, w, a), 0), by.get((s, w, b), 0)) for a, b in pairs)] for s, w in cells])
    return {"table": "pss", "rows": rows}


# -- start-up ------------------------------------------------------------------------------


def startup_cell(variant: str, ds: Paths, workers: int, start: str) -> dict[str, Any]:
    """Time one loader from iter() to its first batch, and to one batch of each worker; the workers' stamps."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    gc.collect()
    loader = make_loader(variant, ds, workers, start, worker_init)
    it: Any = None
    row: dict[str, Any] = {"variant": variant, "start": start, "workers": workers}
    try:
        cpu0, t0 = tree_cpu(me, 0), now()
        it = iter(loader)
        row["iter"] = now() - t0
        batch = np.asarray(next(it))
        row["first"] = now() - t0
        got = {int(batch[0, WID]): (batch[0], row["first"])}
        for _ in range(workers - 1):  # in order: the next batches come one from each worker
            b = np.asarray(next(it))
            got[int(b[0, WID])] = (b[0], now() - t0)
        row["all"] = now() - t0
        row["cpu"] = tree_cpu(me, 0) - cpu0
        row["stamps"] = {w: [float(x) - t0 for x in s[START:MADE + 1]] + [t] for w, (s, t) in sorted(got.items())}
    except Exception as e:  # noqa: BLE001 -- a failing loader is a row of the report, not the end of the run
        import traceback

        row["error"] = f"{type(e).__name__}: {e}"[:200]
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):  # reported through the stragglers count below
            close(loader, it)
        del it, loader
        gc.collect()
        row["stragglers"] = wait_children(me, before)
    return row


def startup_table(n: int, cells: list[tuple[str, int]], variants: list[str], rounds: int) -> dict[str, Any]:
    torch_version = import_torch()
    import shmshare.loader  # noqa: F401 -- imported before the clock runs, as a training script would

    # both loaders warn at every cell with more workers than CPUs (torch's check_worker_number_rationality)
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)

    if any(s == "forkserver" for s, _ in cells):  # once per process, before any cell: not a loader's cost
        from multiprocessing import forkserver

        forkserver.ensure_running()
    t0 = time.perf_counter()
    paths = make_paths(n)
    datasets = {v: dataset_for(v, paths, stamps=True) for v in variants}
    print(f"torch {torch_version} imported for every row; dataset built in {time.perf_counter() - t0:.1f} s")
    tiny = Paths(make_paths(4 * BATCH), stamps=True)
    for v in variants:  # lazy imports, the page cache: no cell's
        for start in dict.fromkeys(s for s, _ in cells):
            r = startup_cell(v, tiny, 1, start)
            if "error" in r:
                print(f"  warm-up {v} {start}: {r['error']}")
    rows: list[dict[str, Any]] = []
    for start, w in cells:
        found: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for _ in range(rounds):  # interleaved: a burst of other work on the machine hits every variant
            for v in variants:
                r = startup_cell(v, datasets[v], w, start)
                found[v].append(r)
                print(f"  {v:>14} {start:>10} {w} workers: " + (r.get("error") or f"first batch {_ms(r['first'])} ms, "
                      f"all workers' {_ms(r['all'])} ms"), flush=True)
        for v in variants:
            ok = sorted((r for r in found[v] if "error" not in r), key=lambda r: r["first"])
            rows.append(ok[(len(ok) - 1) // 2] if ok else found[v][0])
    print("\nTime to the first batch (ms after iter(); the median round): iter = until iter() returned, 1st = the "
          "first\nbatch, all = one batch of every worker in; CPU = the whole tree's until then. Per worker, when it "
          "got\nwhere (ms after iter()): start = process start (10 ms ticks: up to 10 ms early), data = dataset "
          "unpickled\n('-': fork, nothing unpickled; a worker forked from shmshare's zygote inherits the zygote's), "
          "init = worker_init_fn,\nsample = first __getitem__; w0 = worker 0, last = the worker whose first sample "
          "came last; zygote = the start of\nworker 0's parent where it started after iter() (shmshare's zygote under "
          "spawn and forkserver; '-': the main\nprocess or the forkserver)")
    out = []
    for r in rows:
        head = [r["variant"], r["start"], str(r["workers"])]
        if "error" in r:
            out.append([*head, "error", *[""] * 12, r["error"][:100]])
            continue
        st = r["stamps"]  # per worker: start, parent, data, init, first sample, this sample, batch in
        w0, last = st[min(st)], st[max(st, key=lambda w: st[w][FIRST - START])]
        phases = [START - START, DATA - START, INIT - START, FIRST - START]
        out.append([*head, _ms(r["iter"]), _ms(r["first"]), _ms(r["all"]), _ms(r["cpu"]),
                    _ms(w0[PARENT - START] if w0[PARENT - START] > -0.02 else NAN),  # (ticks: up to 10 ms early)
                    *(_ms(w0[i]) for i in phases), *(_ms(last[i]) for i in phases), str(r["stragglers"] or "")])
    table(["variant", "start", "workers", "iter", "1st", "all", "CPU", "zygote", "w0 start", "data", "init",
           "sample", "last start", "data", "init", "sample", "alive after"], out)
    by = {(r["start"], r["workers"], r["variant"]): r["first"] for r in rows if "error" not in r}
    pairs = [(a, b) for a, b in (("torch/list", "shmshare/list"), ("torch/list", "shmshare/share"))
             if a in variants and b in variants]
    if pairs:
        print("\nFirst batch (ms) and the ratios a / b (higher: b is faster)")
        table(["start", "workers", *variants, *(f"{a} / {b}" for a, b in pairs)],
              [[s, str(w), *(_ms(by[(s, w, v)]) if (s, w, v) in by else "-" for v in variants),
                *(_ratio(by.get((s, w, a), 0), by.get((s, w, b), 0)) for a, b in pairs)] for s, w in cells])
    return {"table": "startup", "torch": torch_version, "rounds": rounds, "rows": rows}


def _mib(b: float) -> str:
    return f"{b / MiB:,.0f}" if b >= 10 * MiB else f"{b / MiB:.1f}"


def _ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1e3:,.0f}" if abs(s) >= 0.01 else f"{s * 1e3:.1f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a > 0 and b > 0 else "-"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit("run it through bench_loader.py: .venv/bin/python scripts/bench_loader.py --table pss|startup")
