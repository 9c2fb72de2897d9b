"""bench_loader.py's table for issue 24, item 1: ``--table resume``: resuming mid-epoch, ours beside torchdata's.

Loaders: shmshare.DataLoader and torchdata's StatefulDataLoader (0.11), the same
arguments (batch 256, 2 workers, fork, prefetch 2), and torch's DataLoader for
the rate alone (it cannot resume). Datasets: ``map``, a map-style dataset of
``--paths`` paths (sample i: ``(len(path), i)``), shuffled with a seeded
``torch.Generator``; ``iterable``, an iterable dataset of as many items with no
``state_dict``, which both loaders resume by fetching the epoch's first
batches again (torchdata sends them to the main process and drops them there;
ours fetches them in the workers and sends nothing).

Per loader and dataset: the rate of an uninterrupted epoch (batches/s, and the
tree's CPU per batch); ``state_dict()`` in the middle of the epoch (µs per call,
the median of 21); the state's size (pickled, and JSON where it is plain data);
the time from a new loader's ``load_state_dict(state)`` to the first batch of
the resumed half-epoch (workers started, sampler or dataset brought where it was);
and whether the resumed half equals the uninterrupted run's (it must). Each cell
runs in a fresh process. Times are never asserted.
``.venv/bin/python scripts/bench_loader.py --table resume [--quick] [--rounds N]``.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from typing import Any

LOADERS = ("torch", "torchdata", "shmshare")
DATASETS = ("map", "iterable")


def _loader_class(name: str) -> Any:
    if name == "torch":
        from torch.utils.data import DataLoader
        return DataLoader
    if name == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader
    import shmshare
    return shmshare.DataLoader


def _dataset(kind: str, n: int) -> Any:
    import torch.utils.data as tud

    paths = [f"/data/train/class_{i % 1000:04d}/img_{i:08d}.JPEG" for i in range(n)]

    class Paths(tud.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> tuple[int, int]:
            return len(paths[i]), i

    class Stream(tud.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            info = tud.get_worker_info()
            w, nw = (info.id, info.num_workers) if info else (0, 1)
            for i in range(w, len(paths), nw):
                yield len(paths[i]), i

    return Paths() if kind == "map" else Stream()


def _make(name: str, kind: str, n: int) -> Any:
    import torch

    torch.manual_seed(0)
    kw: dict[str, Any] = {"batch_size": 256, "num_workers": 2, "multiprocessing_context": "fork",
                          "prefetch_factor": 2}
    if kind == "map":
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(7))
    return _loader_class(name)(_dataset(kind, n), **kw)


def _cpu() -> float:
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for c in me.children(recursive=True):
        try:
            total += sum(c.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def cell(name: str, kind: str, n: int) -> dict[str, Any]:
    """One loader over one dataset, in this (fresh) process."""
    out: dict[str, Any] = {"loader": name, "dataset": kind}
    dl = _make(name, kind, n)
    cpu0, t0 = _cpu(), time.perf_counter()
    whole = [b[1].tolist() for b in dl]
    out["rate"] = len(whole) / (time.perf_counter() - t0)
    out["cpu_ms_per_batch"] = 1000 * (_cpu() - cpu0) / len(whole)
    if name == "torch":
        return out
    half = len(whole) // 2
    dl = _make(name, kind, n)
    it = iter(dl)
    for _ in range(half):
        next(it)
    calls = []
    for _ in range(21):
        t = time.perf_counter()
        state = dl.state_dict()
        calls.append(time.perf_counter() - t)
    out["state_dict_us"] = 1e6 * statistics.median(calls)
    out["state_pickled_bytes"] = len(pickle.dumps(state))
    try:
        out["state_json_bytes"] = len(json.dumps(state))
    except TypeError:
        out["state_json_bytes"] = None  # a generator's state: a tensor
    del it
    getattr(dl, "close", lambda: None)()
    dl = _make(name, kind, n)
    t = time.perf_counter()
    dl.load_state_dict(state)
    it = iter(dl)
    first = next(it)
    out["resume_to_first_ms"] = 1000 * (time.perf_counter() - t)
    rest = [first[1].tolist()] + [b[1].tolist() for b in it]
    out["resumed_equal"] = rest == whole[half:]
    getattr(dl, "close", lambda: None)()
    return out


def run(quick: bool, rounds: int) -> int:
    n = 200_000 if quick else 1_000_000
    print(f"bench_loader --table resume: {n:,} paths, batch 256, 2 workers, fork, prefetch 2; "
          f"{rounds} round(s) per cell, each in a fresh process; medians shown", flush=True)
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for kind in DATASETS:
            for name in LOADERS:
                r = subprocess.run([sys.executable, os.path.abspath(__file__), name, kind, str(n)],
                                   capture_output=True, text=True, timeout=900)
                if r.returncode != 0:
                    print(f"  {name}/{kind}: ERROR\n{r.stderr[-2000:]}", flush=True)
                    continue
                rows.setdefault((name, kind), []).append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"{'loader':>10} {'dataset':>8} {'batches/s':>10} {'CPU ms/b':>9} {'state_dict':>11} "
          f"{'pickled':>9} {'JSON':>9} {'resume->1st':>12} {'equal':>6}")
    for (name, kind), cells in rows.items():
        def med(key: str, cells: list[dict[str, Any]] = cells) -> Any:
            vals = [c[key] for c in cells if c.get(key) is not None]
            return statistics.median(vals) if vals else None
        sd, pk, js, rs = med("state_dict_us"), med("state_pickled_bytes"), med("state_json_bytes"), \
            med("resume_to_first_ms")
        eq = "-" if name == "torch" else str(all(c.get("resumed_equal") for c in cells))
        print(f"{name:>10} {kind:>8} {med('rate'):>10.0f} {med('cpu_ms_per_batch'):>9.2f} "
              f"{'-' if sd is None else f'{sd:.0f} us':>11} {'-' if pk is None else f'{pk / 1024:.1f}K':>9} "
              f"{'-' if js is None else f'{js / 1024:.1f}K':>9} {'-' if rs is None else f'{rs:.0f} ms':>12} "
              f"{eq:>6}", flush=True)
    for kind in DATASETS:
        ours, theirs = rows.get(("shmshare", kind)), rows.get(("torchdata", kind))
        if ours and theirs:
            a = statistics.median(c["resume_to_first_ms"] for c in theirs)
            b = statistics.median(c["resume_to_first_ms"] for c in ours)
            r1 = statistics.median(c["rate"] for c in ours) / statistics.median(c["rate"] for c in theirs)
            print(f"RATIO {kind}: resume to first batch, torchdata/ours {a / b:.2f}x; "
                  f"rate ours/torchdata {r1:.2f}x")
    return 0


if __name__ == "__main__":
    print(json.dumps(cell(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
