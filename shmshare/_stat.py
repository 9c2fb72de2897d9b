"""``shmshare stat``: what every process of the host holds of shmshare's memory, from /proc.

Note [Stat reads /proc, not the processes]
    Every figure comes from ``/proc/<pid>/maps``, ``/proc/<pid>/smaps``
    and ``/proc/<pid>/fd``: a process that hangs, is stopped, or never
    called into shmshare past making a segment is seen all the same, and
    nothing is asked of it. A segment is known by its (device, inode) --
    the same object whether a process maps it, holds a fd of it, or both
    -- so "shared with" is exact: the other pids that map or hold that very
    object. What /proc cannot tell (a pool's free and used blocks, leases
    out) is each process's own business; ``stat`` reports what the kernel
    says each one pins. Processes of other users are skipped unless we may
    read them (root).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from . import _procfs

__all__ = ["Segment", "Process", "Report", "scan", "render", "main_stat"]

# shmshare's names: memfds "shmshare_<pid>_<hex>", POSIX shm "/dev/shm/shmshare_<pid>_<hex>"
_MARKS = ("/memfd:shmshare_", "/dev/shm/shmshare_")


def _ours(path: str) -> bool:
    return any(m in path for m in _MARKS)


@dataclass
class Segment:
    """One shared-memory object of shmshare's: who maps it, who holds a fd of it."""

    dev: str
    inode: int
    name: str  # as /proc shows it ("/memfd:shmshare_12_ab (deleted)")
    size: int = 0  # bytes of the object (from a fd's fstat), or the largest mapping of it
    mapped_by: set[int] = field(default_factory=set)
    fd_holders: set[int] = field(default_factory=set)

    @property
    def pids(self) -> set[int]:
        return self.mapped_by | self.fd_holders


@dataclass
class Process:
    """What one process holds of shmshare's memory."""

    pid: int
    command: str
    mapped_bytes: int = 0  # sum of its mappings of shmshare segments
    resident_bytes: int = 0  # of which in its page tables now (smaps Rss)
    fds: int = 0  # fds it holds of shmshare segments
    segments: set[tuple[str, int]] = field(default_factory=set)
    shares_with: set[int] = field(default_factory=set)


@dataclass
class Report:
    """A scan of the host: the processes that hold shmshare memory, and the segments."""

    processes: list[Process]
    segments: list[Segment]
    skipped: int  # processes we may not read (other users', without root)

    def as_json(self) -> dict[str, Any]:
        return {
            "processes": [
                {"pid": p.pid, "command": p.command, "mapped_bytes": p.mapped_bytes,
                 "resident_bytes": p.resident_bytes, "fds": p.fds,
                 "segments": len(p.segments), "shares_with": sorted(p.shares_with)}
                for p in self.processes],
            "segments": [
                {"dev": s.dev, "inode": s.inode, "name": s.name, "size": s.size,
                 "mapped_by": sorted(s.mapped_by), "fd_holders": sorted(s.fd_holders)}
                for s in self.segments],
            "skipped_processes": self.skipped,
        }


def scan(pids: list[int] | None = None) -> Report:
    """Read /proc for every process (or those in `pids`) that holds shmshare memory."""
    if pids is None:
        pids = sorted(int(n) for n in os.listdir("/proc") if n.isdigit())
    procs: dict[int, Process] = {}
    segs: dict[tuple[str, int], Segment] = {}
    skipped = 0
    for pid in pids:
        if not os.access(f"/proc/{pid}/maps", os.R_OK):
            skipped += os.path.exists(f"/proc/{pid}")
            continue
        proc = Process(pid, _command(pid))
        rss = _rss_by_start(pid)
        for m in _procfs.shm_mappings(pid):
            if not _ours(m.path):
                continue
            key = (m.dev, m.inode)
            seg = segs.get(key)
            if seg is None:
                seg = segs[key] = Segment(m.dev, m.inode, m.path)
            seg.size = max(seg.size, m.size)
            seg.mapped_by.add(pid)
            proc.mapped_bytes += m.size
            proc.resident_bytes += rss.get(m.start, 0)
            proc.segments.add(key)
        for n, target in _procfs.fds(pid).items():
            if not _ours(target):
                continue
            try:
                st = os.stat(f"/proc/{pid}/fd/{n}")  # the object itself
            except OSError:
                continue  # closed while we looked
            key = (_procfs.dev_of(st.st_dev), st.st_ino)
            seg = segs.get(key)
            if seg is None:
                seg = segs[key] = Segment(key[0], key[1], target)
            seg.size = max(seg.size, st.st_size)
            seg.fd_holders.add(pid)
            proc.fds += 1
            proc.segments.add(key)
        if proc.segments:
            procs[pid] = proc
    for proc in procs.values():
        for key in proc.segments:
            proc.shares_with |= segs[key].pids
        proc.shares_with.discard(proc.pid)
    return Report(sorted(procs.values(), key=lambda p: -p.mapped_bytes),
                  sorted(segs.values(), key=lambda s: -s.size), skipped)


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        text = " ".join(a.decode(errors="replace") for a in argv if a).replace("\n", " ")
        if text:
            return text
        with open(f"/proc/{pid}/comm") as f:
            return f"[{f.read().strip()}]"
    except OSError:
        return "?"


def _rss_by_start(pid: int) -> dict[int, int]:
    """{mapping start: resident bytes} of the shared-memory mappings in /proc/<pid>/smaps."""
    out: dict[int, int] = {}
    try:
        with open(f"/proc/{pid}/smaps") as f:
            start = None
            for line in f:
                if "-" in line[:20] and not line[0].isupper():
                    head = line.split(maxsplit=5)
                    start = int(head[0].split("-")[0], 16) if len(head) == 6 and _ours(head[5]) else None
                elif start is not None and line.startswith("Rss:"):
                    out[start] = int(line.split()[1]) * 1024
    except OSError:
        pass  # gone, or not ours to read
    return out


def _size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def render(report: Report, width: int = 100) -> str:
    """The report as a table for a terminal."""
    if not report.processes:
        lines = ["no process of this host holds shmshare memory"]
    else:
        lines = [f"{'PID':>7}  {'MAPPED':>8}  {'RESIDENT':>8}  {'FDS':>4}  {'SEGS':>4}  "
                 f"{'SHARES WITH':<16}  COMMAND"]
        for p in report.processes:
            shares = ",".join(str(x) for x in sorted(p.shares_with)) or "-"
            row = (f"{p.pid:>7}  {_size(p.mapped_bytes):>8}  {_size(p.resident_bytes):>8}  "
                   f"{p.fds:>4}  {len(p.segments):>4}  {shares:<16}  {p.command}")
            lines.append(row[:width])
        total = sum(s.size for s in report.segments)
        lines.append(f"{len(report.segments)} segments, {_size(total)} in all")
    if report.skipped:
        lines.append(f"({report.skipped} processes of other users not read: run as root to see them)")
    return "\n".join(lines)


def main_stat(as_json: bool, watch: float | None, pids: list[int] | None) -> int:
    """``shmshare stat``: print once, or every `watch` seconds until Ctrl-C."""
    import json
    import shutil

    while True:
        report = scan(pids)
        if as_json:
            print(json.dumps(report.as_json(), indent=None if watch else 2), flush=True)
        else:
            text = render(report, shutil.get_terminal_size((100, 24)).columns)
            if watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")  # home, clear: refresh in place
            print(text, flush=True)
        if not watch:
            return 0
        time.sleep(watch)
