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
    of the oldest. Every socket is asked at once, in one poll loop against
    one ASK_TIMEOUT, so stopped or hung processes, however many, cost stat
    half a second and a note each, never a hang (Note [Asking every stats
    socket at once] in ``_statask.py``). The answer is matched to /proc by
    the pid the kernel gives for the socket's peer (``SO_PEERCRED``, in
    stat's pid namespace), and kept only as far as its types are right
    (Note [An answer is hostile]). The store daemons are asked meanwhile, in
    parallel, all within STORE_BUDGET. Whatever a process calls itself, or
    a daemon its objects, the table escapes what is not printable.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import _procfs, _statask, _statsd
from ._termtable import Col, fit, printable, table

__all__ = ["Segment", "Process", "Report", "scan", "ask_stats", "render", "main_stat", "ASK_TIMEOUT",
           "STORE_BUDGET"]

ASK_TIMEOUT = 0.5  # s for asking all the stats sockets; and at most, each step of asking a store
STORE_BUDGET = 1.0  # s for asking all the store daemons (listing their objects included)

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
    asked_pids: set[int] | None = None  # the processes asked about (--pid), or None: every one

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
    answers: dict[int, dict[str, Any]] = {}
    unanswered: list[dict[str, Any]] = []
    stores: list[dict[str, Any]] = []
    if ask:
        with ThreadPoolExecutor(1, thread_name_prefix="shmshare-stat") as pool:
            asking = pool.submit(_stores, want)  # meanwhile
            answers, unanswered = ask_stats(want)
            stores = asking.result()
    for pid, stats in answers.items():
        if want is not None and pid not in want:
            continue
        got = procs.get(pid)
        if got is None:
            got = procs[pid] = Process(pid, _command(pid))
        got.stats = stats
    return Report(sorted(procs.values(), key=lambda p: -p.mapped_bytes),
                  sorted(segs.values(), key=lambda s: -s.size), skipped, unanswered, stores, want)


_STORE_ROWS = 20  # objects shown per store in the table (all of them, up to _STORE_MAX, in JSON)
_STORE_MAX = 10_000
_STORE_ASKERS = 16  # daemon sockets asked at once (each thread's wait ends by the one deadline)


def _stores(want: set[int] | None) -> list[dict[str, Any]]:
    """Each store daemon of the host (found from /proc), and what it holds (its own answer)."""
    from .store._find import describe, find_daemons

    daemons = find_daemons(None if want is None else sorted(want))
    if not daemons:
        return []
    deadline = time.monotonic() + STORE_BUDGET
    with ThreadPoolExecutor(max_workers=min(_STORE_ASKERS, len(daemons)),
                            thread_name_prefix="shmshare-stat-store") as pool:
        got = list(pool.map(lambda d: describe(d[1], ASK_TIMEOUT, deadline), daemons))
    out = []
    for (pid, _), st in zip(daemons, got, strict=True):
        st["pid"] = pid
        objects = st.get("objects")
        if objects is not None and len(objects) > _STORE_MAX:
            st["objects_cut"] = len(objects) - _STORE_MAX
            st["objects"] = sorted(objects, key=lambda o: -o["size"])[:_STORE_MAX]
        out.append(st)
    return out


def ask_stats(pids: set[int] | None = None, timeout: float = ASK_TIMEOUT
              ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Ask every stats socket at once (only ``<pid>.sock`` of `pids`, if given), all within
    `timeout` s.

    Returns ({pid: its answer, checked}, [{"socket", "pid", "why"} of each that did not answer
    or answered what stat cannot use]); sockets nobody listens on (a process killed) are left
    out.
    """
    paths = _statsd.stats_sockets(all_users=os.getuid() == 0)
    if pids is not None:
        paths = [p for p in paths if _name_pid(p) in pids]
    if not paths:
        return {}, []
    answers: dict[int, dict[str, Any]] = {}
    unanswered = []
    for path, (pid, reply, why) in _statask.ask_all(paths, timeout).items():
        if reply is not None:
            answers[pid] = reply
        elif why is not None:
            unanswered.append({"socket": path, "pid": pid or _name_pid(path), "why": why})
    return answers, sorted(unanswered, key=lambda u: u["socket"])


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


def _size(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


# The process table's columns; on a narrow terminal the lowest `keep` goes first (Note [Fitting
# the table to the terminal])
_PROCESS_COLS = [Col("PID"), Col("MAPPED", keep=5), Col("RESIDENT", keep=3),
                 Col("FDS", keep=2), Col("SEGS", keep=1), Col("SHARES WITH", left=True, keep=4),
                 Col("COMMAND", left=True)]
_SHARES_ROOM = 16  # characters of SHARES WITH before the rest of the pids are counted ("+3")


def render(report: Report, width: int = 100) -> str:
    """The report as tables for a terminal `width` characters wide."""
    if not report.processes:
        lines = ["no process of this host holds shmshare memory" if report.asked_pids is None else
                 f"no process asked about ({', '.join(map(str, sorted(report.asked_pids)))}) holds "
                 "shmshare memory"]
    else:
        rows = [[str(p.pid), _size(p.mapped_bytes), _size(p.resident_bytes), str(p.fds),
                 str(len(p.segments)), _pid_list(p.shares_with), p.command] for p in report.processes]
        lines = table(_PROCESS_COLS, rows, width, fit_last=_fit_command)
        total = sum(s.size for s in report.segments)
        lines.append(f"{len(report.segments)} segments, {_size(total)} in all")
    lines += _render_pools(report, width)
    lines += _render_loaders(report, width)
    lines += _render_stores(report, width)
    if report.skipped:
        lines.append(f"({report.skipped} processes of other users not read: run as root to see them)")
    return "\n".join(printable(line) for line in lines)  # cut rows are escaped already


def _cut(row: str, width: int) -> str:
    """A line of the report in the terminal's width, cut with "..." (docs/stat.md)."""
    return fit(printable(row), width)


def _pid_list(pids: set[int]) -> str:
    """`pids` comma-separated, in _SHARES_ROOM characters: those past it counted ("101,102,+3")."""
    ordered = [str(p) for p in sorted(pids)]
    for shown in range(len(ordered), -1, -1):  # as many as fit, the count of the rest last
        text = ",".join(ordered[:shown] + ([f"+{len(ordered) - shown}"] if shown < len(ordered) else []))
        if len(text) <= _SHARES_ROOM:
            break
    return text or "-"


def _fit_command(command: str, room: int) -> str:
    """A command line in `room` characters: whole if it fits; else without the program's
    directory, then without the directories of the other absolute paths (a script's name says
    more than where it lies, and ``--json`` has it whole), then cut (Note [Fitting the table to
    the terminal])."""
    if len(command) <= room:
        return command
    words = command.split(" ")
    words[0] = os.path.basename(words[0]) or words[0]
    if len(" ".join(words)) > room:
        words = [os.path.basename(w) if w.startswith("/") and os.path.basename(w) else w
                 for w in words]
    return fit(" ".join(words), room)


_POOL_COLS = [Col("PID"), Col("KIND", left=True), Col("POOLS", keep=1),
              Col("RESERVED", keep=6), Col("ALLOCATED", keep=5), Col("PEAK RES", keep=2),
              Col("LEASES", keep=4), Col("OLDEST", keep=3)]
_STORE_COLS = [Col("SIZE"), Col("REFS", keep=4), Col("HOLDERS", keep=2),
               Col("AGE", keep=3), Col("KIND", left=True, keep=1), Col("SEAL", left=True, keep=0),
               Col("NAME", left=True)]
_KIND_ORDER = {"shm": 0, "pinned": 1, "device": 2, "host": 3, "simulated": 4}


def _render_pools(report: Report, width: int) -> list[str]:
    """The pools of the processes that answered on their stats socket, a row per pool kind."""
    answered = [p for p in report.processes if p.stats is not None]
    if not answered and not report.unanswered:
        return []
    lines = ["", fit("pools, from the stats sockets (SHMSHARE_STATS=1 or shmshare.serve_stats()):",
                     width)]
    rows: list[list[str]] = []
    notes: list[str] = []
    for p in answered:
        assert p.stats is not None
        by_kind = (p.stats.get("totals") or {}).get("by_kind") or {}
        if not by_kind:
            rows.append([str(p.pid), "(no pool)"] + [""] * 6)
        for kind in sorted(by_kind, key=lambda k: (_KIND_ORDER.get(k, 9), k)):
            t = by_kind[kind]
            age = t.get("oldest_lease_s")
            rows.append([str(p.pid), kind, str(t.get("pools", 0)), _size(t.get("reserved_bytes", 0)),
                         _size(t.get("allocated_bytes", 0)), _size(t.get("peak_reserved_bytes", 0)),
                         str(t.get("leases_out") or "-"), "-" if age is None else f"{age:.1f}s"])
        if p.stats.get("truncated"):
            notes.append(f"(pid {p.pid}: {p.stats['truncated']} entries cut from its answer; "
                         "totals are whole)")
    if rows:
        lines += table(_POOL_COLS, rows, width)
    lines += [_cut(n, width) for n in notes]
    for u in report.unanswered:
        lines.append(_cut(f"(pid {u['pid']}: {u['why']})", width))
    return lines


_LOADER_COLS = [Col("PID"), Col("WORKER"), Col("BATCHES", keep=3), Col("FETCH", keep=5),
                Col("COLLATE", keep=4), Col("SEND/WAIT", keep=2), Col("HELD", keep=1),
                Col("FIRST SAMPLE", keep=0)]


def _render_loaders(report: Report, width: int) -> list[str]:
    """The DataLoaders of the processes that answered: where their time goes (Note [Where the time
    goes] in loader/_stats.py)."""
    lines: list[str] = []
    for p in report.processes:
        for ld in (p.stats or {}).get("loaders") or []:
            try:
                lines += _render_loader(p.pid, ld, width)
            except (TypeError, ValueError, AttributeError, KeyError):  # an answer is hostile: plain, not right
                lines.append(_cut(f"(pid {p.pid}: a DataLoader report stat cannot read)", width))
    return lines


def _render_loader(pid: int, ld: dict[str, Any], width: int) -> list[str]:
    """One loader: a line of the main process's figures, a row per worker."""
    frac = float(ld.get("wait_fraction", 0))
    lines = ["", _cut(
        f"DataLoader in pid {pid}: {ld.get('batches', '?')} batches in {float(ld.get('elapsed_s', 0)):.1f}s, "
        f"waiting for batches {float(ld.get('wait_s', 0)):.1f}s ({100 * frac:.0f}%: "
        f"{'input-bound' if frac > 0.5 else 'the program is the bottleneck'}), "
        f"starting workers {float(ld.get('start_s', 0)):.1f}s, {_size_or(ld.get('bytes_in_flight'))} in flight",
        width)]
    rows = []
    for w in ld["workers"]:
        first = dict(w.get("startup") or []).get("first sample")
        rows.append([str(w.get("pid") or "?"), str(w.get("worker_id")), str(w.get("batches")),
                     f"{float(w.get('fetch_s', 0)):.2f}s", f"{float(w.get('collate_s', 0)):.2f}s",
                     f"{float(w.get('send_s', 0)):.2f}s", _size_or(w.get("bytes_held")),
                     "-" if first is None else f"{float(first):.2f}s"])
    return lines + table(_LOADER_COLS, rows, width, indent="  ")


def _render_stores(report: Report, width: int) -> list[str]:
    """The objects of each store daemon, largest first (what describe() checked; "?" where a
    figure is missing)."""
    lines: list[str] = []
    for st in report.stores:
        lines.append("")
        who, where = f"store pid {st.get('pid', '?')}", f"at {st.get('path', '?')}"
        if "error" in st:
            lines.append(_cut(f"{who}: {st['error']}, {where}", width))
            continue
        f = st.get("stats") or {}
        limit = f" of --limit {_size_or(f.get('limit'))}" if f.get("limit") else ""
        # the figures before the path, which may be long: a narrow terminal cuts the path
        spilled = (f"{f['spilled']} spilled ({_size_or(f.get('spilled_bytes'))} in "
                   f"{f.get('spill_dir')}), " if f.get("spilled") else "")
        lines.append(_cut(f"{who}: {f.get('objects', '?')} objects, {_size_or(f.get('held_bytes'))} "
                          f"held{limit}, {spilled}{f.get('deleted_viewed', '?')} deleted but viewed, "
                          f"{f.get('connected', '?')} clients, {where}", width))
        objects = sorted(st.get("objects") or [], key=lambda o: -o["size"])
        if objects:
            lines += table(_STORE_COLS, [
                [_size(o["size"]), str(o["refs"]), str(o["holders"]), f"{o['age']:.1f}s", o["kind"],
                 o["write_seal"] if o["sealed"] else "open", o["name"]] for o in objects[:_STORE_ROWS]],
                width, indent="  ")
        more = len(objects) - _STORE_ROWS + st.get("objects_cut", 0)
        if more > 0:
            lines.append(f"  ... and {more} smaller objects (--json lists them)")
        if st.get("unlisted"):
            lines.append(_cut(f"  (not all listed: {st['unlisted']})", width))
    return lines


def _size_or(n: Any) -> str:
    return _size(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else "?"


def main_stat(as_json: bool, watch: float | None, pids: list[int] | None) -> int:
    """``shmshare stat``: print once, or every `watch` seconds until Ctrl-C."""
    import json
    import shutil

    missing = [pid for pid in pids or () if not os.path.exists(f"/proc/{pid}")]
    if missing:
        print(f"shmshare stat: no process {', '.join(map(str, missing))} on this host (see ps)",
              file=sys.stderr)
        return 1
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
