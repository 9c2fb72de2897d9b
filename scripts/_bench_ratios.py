"""bench_mp's last block: the figures the issue asks for, one greppable ``RATIO``/``FIGURE`` line each.

Printed between ``=== bench_mp ratios ===`` and ``=== end ===``; verdicts are informational (times are never
asserted).
"""

from __future__ import annotations

import sys

from _bench import fmt_size as fmt

__all__ = ["TARGETS", "Report", "report"]

_KiB, _MiB = 1 << 10, 1 << 20
TARGETS = {"queue_4K": 20.0, "queue_64M": 5.0, "pool_map": 5.0}


class Report:
    """The figures the issue asks for, printed last as one greppable block."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def ratio(self, name: str, mine: float | None, base: float | None, target: float, meaning: str) -> None:
        if not mine or not base:
            why = "shmshare" if not mine else "anchor"
            self.lines.append(f"RATIO {name} n/a target>={target:g} SKIP  # {meaning} ({why} column missing)")
            return
        value = mine / base
        verdict = "PASS" if value >= target else "MISS"
        self.lines.append(f"RATIO {name} {value:.3f} target>={target:g} {verdict}  # {meaning}")

    def figure(self, name: str, mine: float | None, base: float | None, meaning: str) -> None:
        if mine and base:
            self.lines.append(f"FIGURE {name} {mine / base:.3f} x  # {meaning}")

    def print(self) -> None:
        print("\n=== bench_mp ratios ===")
        for line in self.lines or ["(no figures)"]:
            print(line)
        print("=== end ===")
        sys.stdout.flush()


def report(queue: dict[int, dict[str, float | None]], pool: dict[str, float | None]) -> None:
    """Print the block for bench_mp's results: {size: {path: messages/s}} of the Queue, {column: maps/s} of Pool."""
    r = Report()
    for size, key in ((4 * _KiB, "queue_4K"), (64 * _MiB, "queue_64M")):
        row = queue.get(size)
        if row is None:
            continue
        for mine, tag in (("shmshare", "copied"), ("shm in-place", "inplace")):
            r.ratio(f"{key}_{tag}_vs_torch", row.get(mine), row.get("torch fd"), TARGETS[key],
                    f"{mine} / torch.mp Queue (file_descriptor) messages/s at {fmt(size)}")
        for mine, tag in (("shmshare", "copied"), ("shm in-place", "inplace")):
            r.figure(f"{key}_{tag}_vs_torch_fs", row.get(mine), row.get("torch fs"),
                     f"{mine} / torch.mp Queue (file_system) at {fmt(size)}")
            r.figure(f"{key}_{tag}_vs_stdlib", row.get(mine), row.get("stdlib"),
                     f"{mine} / stdlib Queue at {fmt(size)}")
    if pool:
        r.ratio("pool_map_vs_stdlib", pool.get("shmshare"), pool.get("stdlib"), TARGETS["pool_map"],
                "smp.Pool(2).map / multiprocessing.Pool(2).map maps/s, plain numpy inputs")
        r.figure("pool_map_inplace_vs_stdlib", pool.get("shm in-place"), pool.get("stdlib"),
                 "smp.Pool(2).map over smp.empty inputs / multiprocessing.Pool(2).map")
        r.figure("pool_map_vs_torch", pool.get("shmshare"), pool.get("torch"),
                 "smp.Pool(2).map / torch.multiprocessing Pool(2).map over tensors")
    r.print()
