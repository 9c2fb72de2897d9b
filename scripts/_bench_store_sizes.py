"""bench_store's sizing: what fits in this machine's memory and /dev/shm, and the limits each path gets."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from _bench import fmt_size as fmt

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

__all__ = ["meminfo", "fitting", "store_limit", "fmt_gib", "ray_store_bytes", "load"]


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * KiB
    return 0


def fitting(sizes: list[int]) -> list[int]:
    """The sizes whose cells fit: at most, the source array and the stdlib copy, shmshare's limit and Ray's arena
    (each a few times the size) in memory; Ray's arena and the stdlib copy in /dev/shm."""
    avail, shm = meminfo("MemAvailable"), shutil.disk_usage("/dev/shm").free
    keep = []
    for s in sizes:
        mem, dev = 2 * s + store_limit(s) + ray_store_bytes(s), s + ray_store_bytes(s)
        if mem > avail or dev > shm:
            print(f"{fmt(s)} is left out: its cells would need {fmt_gib(mem)} GiB of memory ({fmt_gib(avail)} GiB "
                  f"available) and {fmt_gib(dev)} GiB of /dev/shm ({fmt_gib(shm)} GiB free)")
        else:
            keep.append(s)
    return keep


def store_limit(top: int) -> int:
    """The daemon's --limit: three of the largest objects (a deleted one's bytes stay until its views are gone)."""
    return 3 * top + 256 * MiB


def fmt_gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def ray_store_bytes(top: int) -> int:
    """Plasma's size: the largest object three times over, at least 1 GiB, at most 4 GiB."""
    return min(max(3 * top + 512 * MiB, 1 * GiB), 4 * GiB)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
