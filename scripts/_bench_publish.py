"""bench_store's last cell: the time to make a filled array and publish it, from nothing.

``put`` copies; ``create`` + fill in place + ``seal`` does not. So this cell
times the whole of what a producer does: for Ray and for ``Store.put``, a fresh
``np.empty`` filled and put; for ``Store.create``, the object made, filled in
place and sealed. Each fresh array's page faults are part of every row, as they
are of a producer's work. One line per size; FIGURE lines for the ratios.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import numpy as np

from _bench import fmt_size as fmt
from _bench import table

MiB = 1 << 20


def _fresh(size: int, k: int) -> np.ndarray:
    arr = np.empty(size, np.uint8)
    arr.fill(k % 251)
    return arr


def _via_put(p: Any, size: int, k: int) -> float:
    t0 = time.perf_counter()
    arr = _fresh(size, k)
    _, handle = p.put(f"pub-{size}-{k}", arr)
    took = time.perf_counter() - t0
    del arr
    p.drop(handle)
    return took


def _via_create(store: Any, size: int, k: int) -> float:
    name = f"pubc-{size}-{k}"
    t0 = time.perf_counter()
    arr = store.create(name, (size,), np.uint8)
    arr.fill(k % 251)
    store.seal(name)
    took = time.perf_counter() - t0
    del arr
    gc.collect()
    store.delete(name)
    return took


def bench_publish(paths: list[Any], sizes: list[int], rounds: int) -> list[str]:
    """Run the cell for the sizes of 64 MiB and more; return its FIGURE lines."""
    sizes = [s for s in sizes if s >= 64 * MiB]
    byname = {p.name: p for p in paths}
    if not sizes or "shmshare" not in byname:
        return []
    print(f"\n(4) make a filled array and publish it, from nothing (fresh memory each time); "
          f"{rounds} round(s), median")
    rows, lines = [], []
    for size in sizes:
        got: dict[str, list[float]] = {"shmshare create+seal": [], "shmshare put": []}
        if "ray" in byname:
            got["ray put"] = []
        for k in range(rounds + 1):  # the first is a warm-up
            one = {"shmshare create+seal": _via_create(byname["shmshare"].store, size, k),
                   "shmshare put": _via_put(byname["shmshare"], size, k)}
            if "ray" in byname:
                one["ray put"] = _via_put(byname["ray"], size, k)
            if k:
                for name, secs in one.items():
                    got[name].append(secs)
        med = {name: statistics.median(v) for name, v in got.items()}
        rows.append([fmt(size), *(f"{1e3 * med[n]:,.1f} ms" for n in got)])
        if "ray put" in med:
            for n in ("shmshare create+seal", "shmshare put"):
                tag = n.split()[1].split("+")[0]
                lines.append(f"FIGURE publish_{fmt(size)}_{tag}_vs_ray {med['ray put'] / med[n]:.3f} x  "
                             f"# Ray's fill+put time / shmshare's {n} (fresh memory each time)")
        print(f"  {fmt(size)}: " + ", ".join(f"{n} {1e3 * statistics.median(v):,.1f} ms"
                                            for n, v in got.items()), flush=True)
    table(["size", *got], rows)
    return lines
