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

    A process that opted in to the stats socket (Note [The stats socket] in
    ``_statsd.py``: ``SHMSHARE_STATS=1`` or ``shmshare.serve_stats()``) is
    also asked for what only it knows: its pools by kind (shm, pinned,
    device, ...: reserved, allocated, peaks) and its leases out with the age
    of the oldest. Every socket is asked at once, each step bounded by
    ASK_TIMEOUT, so a stopped or hung process costs stat half a second and a
    note, never a hang. The answer is matched to /proc by the pid the kernel
    gives for the socket's peer (``SO_PEERCRED``, in stat's pid namespace).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import _procfs, _statsd
from ._errors import ShmshareTimeout

__all__ = ["Segment", "Process", "Report", "scan", "ask_stats", "render", "main_stat", "ASK_TIMEOUT"]

ASK_TIMEOUT = 0.5  # s for each step of asking one stats socket (connect, request, reply)

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
    stats: dict[str, Any] | None = None  # its stats socket's answer, if it has one (_statsd.py)


@dataclass
class Report:
    """A scan of the host: the processes that hold shmshare memory, and the segments."""

    processes: list[Process]
    segments: list[Segment]
    skipped: int  # processes we may not read (other users', without root)
    unanswered: list[dict[str, Any]] = field(default_factory=list)  # stats sockets silent: why
    stores: list[dict[str, Any]] = field(default_factory=list)  # store daemons: what each holds

    def as_json(self) -> dict[str, Any]:
        return {
            "processes": [_process_json(p) for p in self.processes],
            "segments": [
                {"dev": s.dev, "inode": s.inode, "name": s.name, "size": s.size,
                 "mapped_by": sorted(s.mapped_by), "fd_holders": sorted(s.fd_holders)}
                for s in self.segments],
            "skipped_processes": self.skipped,
            "stats_unanswered": self.unanswered,
            "stores": self.stores,
        }


def _process_json(p: Process) -> dict[str, Any]:
    out: dict[str, Any] = {
        "pid": p.pid, "command": p.command, "mapped_bytes": p.mapped_bytes,
        "resident_bytes": p.resident_bytes, "fds": p.fds, "segments": len(p.segments),
        "shares_with": sorted(p.shares_with)}
    if p.stats is not None:
        out["stats"] = p.stats
    return out


def scan(pids: list[int] | None = None, ask: bool = True) -> Report:
    """Read /proc for every process (or those in `pids`) that holds shmshare memory; with `ask`,
    add what the processes with a stats socket say (each listed, with or without memory)."""
    want = None if pids is None else set(pids)
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
    answers, unanswered = ask_stats(want) if ask else ({}, [])
    for pid, stats in answers.items():
        if want is not None and pid not in want:
            continue
        got = procs.get(pid)
        if got is None:
            got = procs[pid] = Process(pid, _command(pid))
        got.stats = stats
    stores = _stores(want) if ask else []
    return Report(sorted(procs.values(), key=lambda p: -p.mapped_bytes),
                  sorted(segs.values(), key=lambda s: -s.size), skipped, unanswered, stores)


_STORE_ROWS = 20  # objects shown per store in the table (all of them, up to _STORE_MAX, in JSON)
_STORE_MAX = 10_000


def _stores(want: set[int] | None) -> list[dict[str, Any]]:
    """Each store daemon of the host (found from /proc), and what it holds (its own answer)."""
    from .store._find import describe, find_daemons

    out = []
    for pid, path in find_daemons(None if want is None else sorted(want)):
        got = describe(path, timeout=ASK_TIMEOUT)
        got["pid"] = pid
        objects = got.get("objects")
        if objects is not None and len(objects) > _STORE_MAX:
            got["objects_cut"] = len(objects) - _STORE_MAX
            got["objects"] = sorted(objects, key=lambda o: -o["size"])[:_STORE_MAX]
        out.append(got)
    return out


def ask_stats(pids: set[int] | None = None, timeout: float = ASK_TIMEOUT
              ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Ask every stats socket at once (only ``<pid>.sock`` of `pids`, if given).

    Returns ({pid: its answer}, [{"socket", "why"} of each that did not answer]); sockets
    nobody listens on (a process killed) are left out. Takes about `timeout` s when one hangs.
    """
    paths = _statsd.stats_sockets(all_users=os.getuid() == 0)
    if pids is not None:
        paths = [p for p in paths if _name_pid(p) in pids]
    if not paths:
        return {}, []
    with ThreadPoolExecutor(max_workers=min(16, len(paths)), thread_name_prefix="shmshare-stat") as pool:
        got = list(pool.map(lambda p: _ask_one(p, timeout), paths))
    answers: dict[int, dict[str, Any]] = {}
    unanswered = []
    for path, (pid, reply, why) in zip(paths, got, strict=True):
        if reply is not None:
            reply = {k: v for k, v in reply.items() if k not in ("k", "v")}
            answers[pid] = reply
        elif why is not None:
            unanswered.append({"socket": path, "pid": _name_pid(path), "why": why})
    return answers, unanswered


def _ask_one(path: str, timeout: float) -> tuple[int, dict[str, Any] | None, str | None]:
    """(pid, reply, None), or (0, None, why it did not answer), or (0, None, None): stale."""
    try:
        uid = os.lstat(path).st_uid
        pid, reply = _statsd.ask(path, timeout, allow_uids=(uid,))
        return pid, reply, None
    except ConnectionRefusedError:
        return 0, None, None  # nobody listens: a process killed (the next server removes it)
    except FileNotFoundError:
        return 0, None, None  # it exited meanwhile
    except ShmshareTimeout:
        return 0, None, f"no answer within {timeout} s (stopped, or busy)"
    except Exception as exc:  # noqa: BLE001 -- whatever one socket does, stat reports the rest
        return 0, None, f"{type(exc).__name__}: {exc}"[:200]


def _name_pid(path: str) -> int:
    name = os.path.basename(path)
    head = name.split("-", 1)[0].split(".", 1)[0]
    return int(head) if head.isdigit() else 0


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
    lines += _render_pools(report, width)
    lines += _render_stores(report, width)
    if report.skipped:
        lines.append(f"({report.skipped} processes of other users not read: run as root to see them)")
    return "\n".join(lines)


_KIND_ORDER = {"shm": 0, "pinned": 1, "device": 2, "host": 3, "simulated": 4}


def _render_pools(report: Report, width: int) -> list[str]:
    """The pools of the processes that answered on their stats socket, a row per pool kind."""
    answered = [p for p in report.processes if p.stats is not None]
    if not answered and not report.unanswered:
        return []
    lines = ["", "pools, from the processes' stats sockets (SHMSHARE_STATS=1 or shmshare.serve_stats()):",
             f"{'PID':>7}  {'KIND':<9}  {'POOLS':>5}  {'RESERVED':>8}  {'ALLOCATED':>9}  "
             f"{'PEAK RES':>8}  {'LEASES':>6}  {'OLDEST':>7}"]
    for p in answered:
        assert p.stats is not None
        by_kind = (p.stats.get("totals") or {}).get("by_kind") or {}
        if not by_kind:
            lines.append(f"{p.pid:>7}  (no pool)")
        for kind in sorted(by_kind, key=lambda k: (_KIND_ORDER.get(k, 9), k)):
            t = by_kind[kind]
            age = t.get("oldest_lease_s")
            row = (f"{p.pid:>7}  {kind:<9}  {t.get('pools', 0):>5}  {_size(t.get('reserved_bytes', 0)):>8}  "
                   f"{_size(t.get('allocated_bytes', 0)):>9}  {_size(t.get('peak_reserved_bytes', 0)):>8}  "
                   f"{t.get('leases_out') or '-':>6}  {'-' if age is None else f'{age:.1f}s':>7}")
            lines.append(row[:width])
        if p.stats.get("truncated"):
            lines.append(f"{'':>7}  ({p.stats['truncated']} entries cut from its answer; totals are whole)")
    for u in report.unanswered:
        lines.append(f"(pid {u['pid']}: {u['why']})"[:width])
    return lines


def _render_stores(report: Report, width: int) -> list[str]:
    """The objects of each store daemon, largest first."""
    lines: list[str] = []
    for st in report.stores:
        lines.append("")
        if "error" in st:
            lines.append(f"store pid {st['pid']} at {st['path']}: {st['error']}"[:width])
            continue
        f = st["stats"]
        limit = f" of --limit {_size(f['limit'])}" if f.get("limit") else ""
        lines.append(f"store pid {st['pid']} at {st['path']}: {f['objects']} objects, "
                     f"{_size(f['held_bytes'])} held{limit}, {f['deleted_viewed']} deleted but "
                     f"viewed, {f['connected']} clients"[:width])
        objects = sorted(st["objects"], key=lambda o: -o["size"])
        if objects:
            lines.append(f"  {'SIZE':>8}  {'REFS':>5}  {'HOLDERS':>7}  {'AGE':>8}  {'KIND':<6}  "
                         f"{'SEAL':<6}  NAME")
        for o in objects[:_STORE_ROWS]:
            seal = o["write_seal"] if o["sealed"] else "open"
            lines.append(f"  {_size(o['size']):>8}  {o['refs']:>5}  {o['holders']:>7}  "
                         f"{o['age']:>7.1f}s  {o['kind']:<6}  {seal:<6}  {o['name']}"[:width])
        more = len(objects) - _STORE_ROWS + st.get("objects_cut", 0)
        if more > 0:
            lines.append(f"  ... and {more} smaller objects (--json lists them)")
    return lines


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
