#!/usr/bin/env python3
"""Benchmark shmshare's channel against other same-host transports, side by side in one run.

For each payload size (64 B, 4 KiB, 64 KiB, 1 MiB, 64 MiB) and transport, two forked processes:

- throughput: a producer sends N messages (after a warm-up), each a fresh payload whose every byte it writes, the
  first 8 being the sequence number; a consumer checks that number (in order, none lost) and the last byte.
  Messages/s is the consumer's, from the end of the warm-up (both ends meet at a barrier) to the last message.
  CPU per message: each process's own ``resource.getrusage(RUSAGE_SELF)`` (user + system, all its threads: a
  Queue's feeder too) over the timed messages, reported back through a pipe. The producer's runs until the
  consumer has the last message (a barrier), so work a transport left to a thread is in it.
- ping-pong: one message each way per round trip, the reply over a second link the other way (shmshare: a
  second channel); only the header and last byte are written, so the figure is the transport's, not a memset's.
  The p50 and p99 round trip, timed in the first process.

Transports (``_bench_peers_links.py`` says how each is used):

- ``shmshare``: ``tx.empty()`` + fill + ``tx.send()`` / ``rx.recv()``, with its shared-memory rings (default)
- ``shmshare no-rings``: the same with ``SHMSHARE_RINGS=0`` in both children (frames on the socket)
- ``shmshare plain``: a plain ``np.empty()`` payload each message + ``tx.send()``: by value in the frame up to
  256 bytes (Note [Inline arrays]), copied into the pool past that
- ``iceoryx2``: publish-subscribe of a ``Slice[c_uint8]``, loan + fill in place + send; an event wakes the reader
- ``faster-fifo``: ``faster_fifo.Queue`` of raw bytes
- ``tachyon-ipc``: ``TachyonBus``, acquire_tx + fill in place + commit/flush, zero-copy acquire_rx
- ``mp.Queue``: stdlib ``multiprocessing.Queue`` of bytes
- ``ring``: a hand-rolled ring of reused stdlib ``SharedMemory`` slots, two semaphores as the SPSC index protocol

Each transport may hold ``depth`` messages between the ends: 64 up to 64 KiB, 8 at 1 MiB, 2 at 64 MiB (the machine
is shared and small: never more than 2 payloads of 64 MiB queued; shmshare's pool limit is 2 of them). tachyon-ipc
needs room for 32 (see its link) and is left out at 64 MiB, where that is 4 GiB. A transport that does not import
is reported as not installed. Then an idle test: a shmshare Receiver blocked in ``recv()`` for 2 s with nothing
arriving, its CPU as % of one core. Each table shows every transport's figure as a multiple of shmshare's (with
rings). Cells run in rounds, the transports interleaved, the median shown (default 3 rounds, 1 with ``--quick``).
A cell that fails prints why; the others still run (exit 1). Every child is killed by its pid if it outlives its
cell. About 3-4 minutes on 2 CPUs; ``--quick`` (fewer messages, no 64 MiB, one round): about 15 s. Run:
``.venv/bin/python scripts/bench_peers.py [--quick] [--sizes 64,4K] [--only shmshare,ring] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import multiprocessing as mp
import os
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any

import numpy as np

from _bench import fmt_size as fmt  # scripts/_bench.py: run from scripts/ or by path
from _bench import parse_size, table
from _bench_peers_links import LINKS, WAIT, Link, cleanup, missing
from _bench_peers_links import capacity as tachyon_capacity

# This checkout's shmshare, installed or not (an installed or editable copy elsewhere would shadow it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64, 4 * KiB, 64 * KiB, 1 * MiB, 64 * MiB]
BASE = "shmshare"  # the column every ratio is taken against
CELL_WAIT = 3 * WAIT  # s: the longest one cell may take before its children are killed
IDLE_S = 2.0
FORK = mp.get_context("fork")


@dataclasses.dataclass
class Plan:
    count: int  # timed messages of a throughput cell
    trips: int  # timed round trips of a ping-pong cell
    depth: int  # messages a transport may hold between the ends

    @property
    def warm(self) -> int:
        return max(5, self.count // 10)

    @property
    def warm_trips(self) -> int:
        return max(5, self.trips // 10)


def plan(size: int, quick: bool) -> Plan:
    if size <= 4 * KiB:
        return Plan(4000, 200, 64) if quick else Plan(20000, 1000, 64)
    if size <= 64 * KiB:
        return Plan(2000, 200, 64) if quick else Plan(10000, 1000, 64)
    if size <= MiB:
        return Plan(300, 100, 8) if quick else Plan(1000, 300, 8)
    return Plan(10, 10, 2) if quick else Plan(40, 20, 2)


def unfit(name: str, size: int) -> str:
    """Why a transport sits out a size ('' if it does not)."""
    if name == "tachyon-ipc" and tachyon_capacity(size) > 256 * MiB:
        return (f"n/a at {fmt(size)}: its reader frees ring space only every 32 messages, so its ring must hold 34 "
                f"({tachyon_capacity(size) >> 20} MiB, populated at once): over this benchmark's memory cap")
    return ""


# -- the children ---------------------------------------------------------------------------------------------------


def cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def expect(got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(f"message {got} arrived where {want} was due (lost or reordered)")


def child(role: str, links: list[Link], mode: str, p: Plan, barrier: Any, out: Any) -> None:
    """A producer ("a": writes links[0], reads links[1]) or consumer ("b": the other way round)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the script
    if os.getppid() == 1:
        return
    ends: list[Link] = []
    try:
        first = links[0].writer() if role == "a" else links[0].reader()
        ends.append(first)
        if len(links) > 1:  # a ping-pong's reply link (tachyon: a then listens, b connects)
            ends.append(links[1].reader() if role == "a" else links[1].writer())
        barrier.wait(WAIT)  # both ends exist before the first message
        for e in ends:
            e.ready()
        result = MODES[mode, role](ends, p, barrier)
        for e in ends:
            e.end()
        out.send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - whatever it was goes to the parent, and the peer is let go
        barrier.abort()
        out.send(("error", f"{'producer' if role == 'a' else 'consumer'}: {type(exc).__name__}: {exc}\n"
                  + "".join(traceback.format_exc(limit=-4))))


def stream_a(ends: list[Link], p: Plan, barrier: Any) -> float:
    w = ends[0]
    for i in range(p.warm):
        w.send(i, True)
    barrier.wait(WAIT)  # the consumer has the warm-up
    c0 = cpu()
    for i in range(p.warm, p.warm + p.count):
        w.send(i, True)
    barrier.wait(WAIT)  # the consumer has them all: a feeder thread's work is done and counted
    return cpu() - c0


def stream_b(ends: list[Link], p: Plan, barrier: Any) -> tuple[float, float]:
    r = ends[0]
    for i in range(p.warm):
        expect(r.recv(), i)
    barrier.wait(WAIT)
    t0, c0 = time.perf_counter(), cpu()
    for i in range(p.warm, p.warm + p.count):
        expect(r.recv(), i)
    secs, used = time.perf_counter() - t0, cpu() - c0
    barrier.wait(WAIT)
    return secs, used


def ping_a(ends: list[Link], p: Plan, barrier: Any) -> list[int]:
    w, r = ends
    rtts = []
    clock = time.perf_counter_ns
    for i in range(p.warm_trips + p.trips):
        t0 = clock()
        w.send(i, False)
        got = r.recv()
        t1 = clock()
        expect(got, i)
        if i >= p.warm_trips:
            rtts.append(t1 - t0)
    barrier.wait(WAIT)
    return rtts


def ping_b(ends: list[Link], p: Plan, barrier: Any) -> None:
    r, w = ends
    for i in range(p.warm_trips + p.trips):
        expect(r.recv(), i)
        w.send(i, False)
    barrier.wait(WAIT)


def idle_a(ends: list[Link], p: Plan, barrier: Any) -> None:
    ends[0].send(0, True)  # the first send sets the rings up (with SHMSHARE_RINGS=1)
    barrier.wait(WAIT)
    barrier.wait(WAIT + IDLE_S)  # silent while the receiver waits


def idle_b(ends: list[Link], p: Plan, barrier: Any) -> tuple[float, float]:
    import shmshare

    link = ends[0]
    expect(link.recv(), 0)
    barrier.wait(WAIT)
    t0, c0 = time.perf_counter(), cpu()
    try:
        link.rx.recv(timeout=IDLE_S)  # type: ignore[attr-defined]
        raise RuntimeError("a message arrived during the idle test")
    except shmshare.ShmshareTimeout:
        pass
    secs, used = time.perf_counter() - t0, cpu() - c0
    barrier.wait(WAIT)
    return secs, used


MODES = {("stream", "a"): stream_a, ("stream", "b"): stream_b, ("ping", "a"): ping_a, ("ping", "b"): ping_b,
         ("idle", "a"): idle_a, ("idle", "b"): idle_b}


# -- the parent -----------------------------------------------------------------------------------------------------


def run_cell(name: str, size: int, mode: str, p: Plan) -> tuple[Any, Any]:
    """Fork the two children of one cell and return their results; RuntimeError naming what went wrong."""
    cls, _, env = LINKS[name]
    saved = {k: os.environ.get(k) for k in env}
    links: list[Link] = []
    procs: list[Any] = []
    pipes: list[Any] = []
    try:
        os.environ.update(env)  # before the links are made and the children forked: they inherit it
        try:
            links.append(cls(size, p.depth))
            if mode == "ping":
                links.append(cls(size, p.depth))
            barrier = FORK.Barrier(2)
            for role in ("a", "b"):
                rx, tx = FORK.Pipe(duplex=False)
                proc = FORK.Process(target=child, args=(role, links, mode, p, barrier, tx), daemon=True,
                                    name=f"bench-peers-{role}")
                proc.start()
                tx.close()
                procs.append(proc)
                pipes.append(rx)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        results: dict[Any, Any] = {}
        deadline = time.monotonic() + CELL_WAIT
        while len(results) < 2:
            left = deadline - time.monotonic()
            ready = wait_any([c for c in pipes if c not in results], timeout=max(0.0, left))
            if not ready:
                gone = ", ".join("producer" if c is pipes[0] else "consumer" for c in pipes if c not in results)
                raise RuntimeError(f"no word from the {gone} in time (killed): "
                                   + "\n".join(str(r[1]) for r in results.values()))
            for c in ready:
                try:
                    results[c] = c.recv()
                except EOFError:
                    results[c] = ("error", f"{'producer' if c is pipes[0] else 'consumer'} died without a word "
                                           f"(exit code {procs[pipes.index(c)].exitcode})")
                if results[c][0] != "ok":  # the other may be stuck where no barrier reaches it (a listen)
                    deadline = min(deadline, time.monotonic() + 10)
        got = [results[c] for c in pipes]
        errors = [g[1] for g in got if g[0] != "ok"]
        if errors:
            # The peer of the one that failed reports a broken barrier: show the cause first.
            errors.sort(key=lambda e: "BrokenBarrierError" in e)
            raise RuntimeError("\n".join(errors))
        return got[0][1], got[1][1]
    finally:
        for proc in procs:
            finish(proc)
        for c in pipes:
            c.close()
        for link in links:
            link.close()


def finish(proc: Any) -> None:
    proc.join(10 if proc.exitcode is None else 0)
    if proc.exitcode is None:
        os.kill(proc.pid, signal.SIGKILL)  # by pid: only what this script started
        proc.join(10)


@dataclasses.dataclass
class Cell:
    rate: list[float] = dataclasses.field(default_factory=list)  # messages/s per round
    cpu_a: list[float] = dataclasses.field(default_factory=list)  # s per message, producer
    cpu_b: list[float] = dataclasses.field(default_factory=list)  # s per message, consumer
    p50: list[float] = dataclasses.field(default_factory=list)  # s
    p99: list[float] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def bench(names: list[str], sizes: list[int], quick: bool, rounds: int) -> tuple[dict[tuple[str, int], Cell], int]:
    cells = {(n, s): Cell() for n in names for s in sizes}
    failed = 0
    for k in range(rounds):
        for size in sizes:
            p = plan(size, quick)
            for name in names:
                if unfit(name, size):
                    continue
                cell = cells[name, size]
                for mode in ("stream", "ping"):
                    t0 = time.perf_counter()
                    try:
                        a, b = run_cell(name, size, mode, p)
                    except Exception as exc:  # noqa: BLE001 - one broken cell must not lose the others
                        failed += 1
                        cell.failed.append(mode)
                        print(f"  CELL FAILED: round {k + 1} {fmt(size)} {name} {mode}: {exc}", flush=True)
                        continue
                    if mode == "stream":
                        secs, cons = b
                        cell.rate.append(p.count / secs)
                        cell.cpu_a.append(a / p.count)
                        cell.cpu_b.append(cons / p.count)
                        line = (f"{p.count / secs:>11,.0f} msg/s  CPU {a / p.count * 1e6:,.1f} / "
                                f"{cons / p.count * 1e6:,.1f} us/msg")
                    else:
                        rtts = sorted(a)
                        cell.p50.append(rtts[len(rtts) // 2] / 1e9)
                        cell.p99.append(rtts[min(len(rtts) - 1, len(rtts) * 99 // 100)] / 1e9)
                        line = f"RTT p50 {cell.p50[-1] * 1e6:,.1f} us  p99 {cell.p99[-1] * 1e6:,.1f} us"
                    print(f"  round {k + 1} {fmt(size):>4} {name:<18} {mode:<6} {line}  "
                          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return cells, failed


def times(mine: float | None, base: float | None) -> str:
    return f"{mine / base:.2f}x" if mine and base else "-"


def report(names: list[str], sizes: list[int], cells: dict[tuple[str, int], Cell], quick: bool,
           why_not: dict[str, str]) -> None:
    print(f"\nPer size: msg/s and 'x' = the transport's msg/s / {BASE}'s (above 1: faster than {BASE}); CPU us per "
          f"message of producer / consumer; ping-pong RTT p50 and p99 in us and 'x' = its p50 / {BASE}'s (above 1: "
          f"slower than {BASE}). Medians over the rounds.")
    for size in sizes:
        p = plan(size, quick)
        base = cells.get((BASE, size))
        b_rate = med(base.rate) if base else None
        b_p50 = med(base.p50) if base else None
        print(f"\n== {fmt(size)}: {p.count:,} messages after {p.warm:,} warm-up; ping-pong {p.trips:,} round trips "
              f"after {p.warm_trips}; depth {p.depth}")
        rows, notes = [], []
        for name in names:
            c = cells[name, size]
            why = unfit(name, size)
            if why:
                rows.append([name, "n/a", "", "", "", "", ""])
                notes.append(f"{name}: {why}")
                continue
            rate, p50, p99 = med(c.rate), med(c.p50), med(c.p99)
            ca, cb = med(c.cpu_a), med(c.cpu_b)
            rows.append([
                name,
                "failed" if "stream" in c.failed or rate is None else f"{rate:,.0f}",
                times(rate, b_rate),
                f"{ca * 1e6:,.1f} / {cb * 1e6:,.1f}" if ca is not None and cb is not None else "-",
                "failed" if "ping" in c.failed or p50 is None else f"{p50 * 1e6:,.1f}",
                f"{p99 * 1e6:,.1f}" if p99 is not None else "-",
                times(p50, b_p50),
            ])
        for name in why_not:
            rows.append([name, "not installed", "", "", "", "", ""])
        table(["transport", "msg/s", "x", "CPU us/msg", "p50 us", "p99 us", "x p50"], rows)
        for note in notes:
            print(f"    {note}")


def rings_summary(sizes: list[int], cells: dict[tuple[str, int], Cell]) -> None:
    if ("shmshare no-rings", sizes[0]) not in cells or (BASE, sizes[0]) not in cells:
        return
    print("\nshmshare with rings against without (SHMSHARE_RINGS=0): msg/s ratio, CPU us/msg producer / consumer "
          "(rings vs socket), RTT p50 ratio (below 1: rings are faster)")
    rows = []
    for size in sizes:
        r, s = cells[BASE, size], cells["shmshare no-rings", size]
        cpu_r = (med(r.cpu_a), med(r.cpu_b))
        cpu_s = (med(s.cpu_a), med(s.cpu_b))
        cpus = "-"
        if None not in cpu_r and None not in cpu_s:
            cpus = (f"{cpu_r[0] * 1e6:,.1f} / {cpu_r[1] * 1e6:,.1f} vs "  # type: ignore[operator]
                    f"{cpu_s[0] * 1e6:,.1f} / {cpu_s[1] * 1e6:,.1f}")  # type: ignore[operator]
        rows.append([fmt(size), times(med(r.rate), med(s.rate)), cpus, times(med(r.p50), med(s.p50))])
    table(["size", "msg/s rings/socket", "CPU us/msg rings vs socket", "p50 rings/socket"], rows)


def idle_test() -> tuple[list[str], int]:
    """A shmshare Receiver blocked in recv() for IDLE_S with nothing arriving: its CPU, rings and not."""
    lines = [f"\nidle: a shmshare Receiver blocked in recv(timeout={IDLE_S:g}) after one message, nothing arriving"]
    failed = 0
    for name in (BASE, "shmshare no-rings"):
        try:
            _, (secs, used) = run_cell(name, 64, "idle", Plan(1, 1, 64))
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            failed += 1
            lines.append(f"  FAILED: idle {name}: {exc}")
            continue
        lines.append(f"  {name:<18} {used / secs * 100:6.2f}% of one core ({used * 1e3:.1f} ms of CPU in {secs:.2f} s)")
    return lines, failed


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def versions() -> str:
    from importlib import metadata

    out = []
    for dist in ("iceoryx2", "faster-fifo", "tachyon-ipc"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out) or "no peers installed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages, no 64 MiB, one round")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes, e.g. 64,4K,1M")
    ap.add_argument("--only", default=None, help=f"comma-separated transports of: {', '.join(LINKS)}")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every cell (default 3, quick 1)")
    ap.add_argument("--no-idle", action="store_true", help="leave out the idle test")
    args = ap.parse_args(argv)
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        sizes = [s for s in SIZES if not (args.quick and s > MiB)]
    wanted = list(LINKS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in wanted if n not in LINKS]
    if unknown:
        ap.error(f"unknown transport(s) {', '.join(unknown)}; known: {', '.join(LINKS)}")
    why_not = {n: missing(LINKS[n][1]) for n in wanted}
    names = [n for n in wanted if not why_not[n]]
    why_not = {n: w for n, w in why_not.items() if w}
    started = time.perf_counter()
    import shmshare

    print(f"bench_peers: Linux {platform.release()}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"numpy {np.__version__}, shmshare from {os.path.dirname(shmshare.__file__)}, {versions()}"
          f"{', --quick' if args.quick else ''}")
    for w in why_not.values():
        print(w)
    print(f"load average before: {load()} (other work on the machine shows in every figure)", flush=True)
    idle: list[str] = []
    try:
        cells, failed = bench(names, sizes, args.quick, args.rounds or (1 if args.quick else 3))
        if not args.no_idle and BASE in names:
            idle, more = idle_test()
            failed += more
    finally:
        cleanup()
    report(names, sizes, cells, args.quick, why_not)
    rings_summary(sizes, cells)
    print("\n".join(idle))
    for w in why_not.values():
        print(w)
    print(f"\nload average after: {load()}")
    print(f"bench_peers: {time.perf_counter() - started:.0f} s in all"
          + (f", {failed} cell(s) failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
