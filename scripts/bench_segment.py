"""Benchmark segments and fd hand-off, side by side with the stdlib and torch's fd path.

(a) create / map / close cycle, per segment: shmshare ``Segment`` (memfd and
    posix) against stdlib ``multiprocessing.shared_memory.SharedMemory``
    (create=True, close, unlink), at 4 KiB, 1 MiB and 64 MiB, untouched and
    touched (one byte written per 4 KiB page, so every page is faulted in).
(b) fd hand-off between two processes of one tree: the parent sends a
    segment's fd, the child receives it (and closes it, or maps it with
    ``Segment.from_fd`` and closes), then acknowledges. Over a
    ``shmshare.wire`` connection, against a ``multiprocessing.Queue``
    carrying ``multiprocessing.reduction.DupFd``, which is what
    ``torch.multiprocessing.reductions.reduce_storage`` does for the
    file_descriptor strategy (see Note [The DupFd path]).

Every wait is bounded; children are killed by pid if they do not stop.
Usage: ``.venv/bin/python scripts/bench_segment.py [--quick]``.

Note [The DupFd path]
    torch registers ``reduce_storage`` with ``ForkingPickler``; it returns
    ``(rebuild_storage_fd, (cls, DupFd(fd), size))``. A Queue pickles in its
    feeder thread, where no process is being spawned, so ``DupFd`` is the
    resource sharer's: the sender dups the fd and parks it with a background
    thread listening on a Unix socket. The receiver's ``rebuild_storage_fd``
    calls ``df.detach()``: connect to that socket, authenticate (HMAC
    challenge both ways), ask for the key, receive the fd by SCM_RIGHTS, then
    map it (``_new_shared_fd_cpu``: dup + mmap) and close the received fd.
    One connection and handshake per fd is the cost the wire path avoids.
    torch's cache of storages already received (``shared_cache``) is left
    out: every hand-off here is a new fd, as it is for a new batch.
"""

from __future__ import annotations

import argparse
import array
import functools
import multiprocessing as mp
import os
import platform
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing import reduction
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from shmshare import Segment, wire
from shmshare._errors import PeerDied

from _bench import table as _table  # scripts/_bench.py: run from scripts/ or by path

PAGE = os.sysconf("SC_PAGE_SIZE")
WAIT = 10.0  # s: any one receive; far above any hand-off
SIZES = [(4 << 10, 2000), (1 << 20, 300), (64 << 20, 12)]  # (bytes, cycles per cell)
HANDOFF_ITERS = 2000
HANDOFF_SIZE = 1 << 20
MODES = ("nofd", "fd", "map")
MODE_TITLES = {"nofd": "no fd (baseline)", "fd": "fd: recv + close", "map": "fd: recv + map + close"}
TARGET = 5.0  # issue 2: the wire hand-off must be at least this much faster than DupFd


def main(argv: list[str] | None = None) -> int:
    """Run both benchmarks and print their tables; return 0 (a missed target is printed, not raised)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the iterations")
    args = ap.parse_args(argv)
    scale = 10 if args.quick else 1
    print(f"bench_segment: Linux {platform.release()}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, multiprocessing start method 'fork'{', --quick' if args.quick else ''}")
    print()
    bench_cycles([(n, max(3, k // scale)) for n, k in SIZES])
    print()
    bench_handoff(max(20, HANDOFF_ITERS // scale))
    return 0


# -- (a) create / map / close -------------------------------------------------------


def bench_cycles(sizes: list[tuple[int, int]]) -> None:
    """Time create/map/close cycles of memfd, posix and stdlib segments and print the table."""
    print("(a) create + map + close, one cycle, microseconds: median (mean)")
    print("    untouched: no page written; touched: one byte per 4 KiB page (every page faulted in)")
    head = ["size", "pages", "cycles", "memfd Segment", "posix Segment", "stdlib SharedMemory",
            "memfd vs stdlib", "posix vs stdlib"]
    rows = []
    for nbytes, iters in sizes:
        for touch in (False, True):
            memfd = _timeit(functools.partial(_cycle_segment, "memfd", nbytes, touch), iters)
            posix = _timeit(functools.partial(_cycle_segment, "posix", nbytes, touch), iters)
            std = _timeit(functools.partial(_cycle_stdlib, nbytes, touch), iters)
            rows.append([_size(nbytes), "touched" if touch else "untouched", str(iters),
                         _cell(memfd), _cell(posix), _cell(std),
                         _ratio(memfd, std), _ratio(posix, std)])
    _table(head, rows)
    print("    A Segment reserves its pages at create (posix_fallocate: ENOSPC now, never SIGBUS "
          "later),\n    so an untouched Segment already pays for its pages; SharedMemory pays at "
          "first touch.")


def _cycle_segment(backend: str, nbytes: int, touch: bool) -> None:
    seg = Segment.create(nbytes, backend=backend)
    if touch:
        _touch(seg.view(np.uint8, nbytes))  # the view dies here, so close() unmaps at once
    seg.close()


def _cycle_stdlib(nbytes: int, touch: bool) -> None:
    shm = SharedMemory(create=True, size=nbytes)
    if touch:
        _touch(np.frombuffer(shm.buf, np.uint8))  # type: ignore[arg-type]  # released before close()
    shm.close()
    shm.unlink()


def _touch(pages: np.ndarray) -> None:
    pages[::PAGE] = 1


# -- (b) fd hand-off ----------------------------------------------------------------


def bench_handoff(iters: int) -> None:
    """Time fd hand-offs over wire and over Queue+DupFd, child on our CPU and on another."""
    ctx = mp.get_context("fork")  # what torch's DataLoader uses on Linux
    cpus = sorted(os.sched_getaffinity(0))
    places = [("same CPU", cpus[0])] + ([("two CPUs", cpus[1])] if len(cpus) > 1 else [])
    before = os.sched_getaffinity(0)
    # Pinned, because a wake-up on another CPU costs as much as the rest of a round trip
    # on a VM and the scheduler moves processes at will: unpinned runs were bimodal.
    # Threads inherit the mask, so the Queue's feeder and the resource sharer stay here too.
    os.sched_setaffinity(0, {cpus[0]})
    seg = Segment.create(HANDOFF_SIZE)  # memfd, KEEPFD: the fd every hand-off sends
    try:
        res = {place: (_run_wire(ctx, seg, iters, cpu), _run_queue(ctx, seg, iters, cpu),
                       _run_raw(ctx, seg, iters, cpu)) for place, cpu in places}
    finally:
        seg.close()
        os.sched_setaffinity(0, before)
    print(f"(b) fd hand-off to another process and back, {iters} round trips per cell after "
          f"{_warmup(iters)} warm-up, microseconds: median (mean)")
    print(f"    parent (pinned to CPU {cpus[0]}) sends a {_size(HANDOFF_SIZE)} memfd segment's fd; the "
          "child (on the same CPU, or on another)\n    receives it, maps it with Segment.from_fd "
          "or not, closes it, and acknowledges")
    rows = []
    for place, (w, q, raw) in res.items():
        rows += [[place, "shmshare.wire (SEQPACKET + SCM_RIGHTS)", *(_cell(w[m]) for m in MODES)],
                 [place, "mp.Queue + reduction.DupFd (torch)", *(_cell(q[m]) for m in MODES)],
                 [place, "wire vs DupFd", *(_ratio(w[m], q[m]) for m in MODES)],
                 [place, "floor: bare socketpair, 1-byte messages", *(_cell(raw[m]) for m in MODES)]]
    _table(["child", "path", *(MODE_TITLES[m] for m in MODES)], rows)
    print("    floor: the same round trip with bare sendmsg/recvmsg and no framing, to show what "
          "the host's wake-ups cost")
    for place, (w, q, _) in res.items():
        fd, mapped = (statistics.median(q[m]) / statistics.median(w[m]) for m in ("fd", "map"))
        cost = statistics.median(w["map"]) - statistics.median(w["fd"])
        print(f"    {place}: wire hand-off is {fd:.1f}x faster than DupFd (fd: recv + close; issue 2 "
              f"target >= {TARGET:.0f}x: {'met' if fd >= TARGET else 'NOT met'}); {mapped:.1f}x with "
              f"the mapping, which adds ~{cost * 1e6:.0f} us to both")


def _run_wire(ctx: Any, seg: Segment, iters: int, cpu: int) -> dict[str, list[float]]:
    parent, child = wire.pipe(role="bench")
    proc = ctx.Process(target=_wire_child, args=(child, parent, cpu), daemon=True)
    proc.start()
    child.close()
    try:
        out = {}
        for mode in MODES:
            fds = [] if mode == "nofd" else [seg.fileno()]

            def once(i: int, mode: str = mode, fds: list[int] = fds) -> None:
                parent.send({"i": i, "mode": mode, "size": seg.size}, fds)
                header, _ = parent.recv(timeout=WAIT)
                assert header["ack"] == i, header

            out[mode] = _timeit_i(once, iters)
        parent.send({"stop": True})
        return out
    finally:
        parent.close()
        _stop(proc)


def _wire_child(conn: wire.Connection, other: wire.Connection, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    other.close()  # the parent's end: ours must be the last, so the parent's death ends us
    try:
        while True:
            header, fds = conn.recv(timeout=WAIT)
            if header.get("stop"):
                return
            for f in fds:
                with f:
                    if header["mode"] == "map":
                        Segment.from_fd(f, header["size"]).close()
            conn.send({"ack": header["i"]})
    except PeerDied:
        return


def _run_raw(ctx: Any, seg: Segment, iters: int, cpu: int) -> dict[str, list[float]]:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = ctx.Process(target=_raw_child, args=(child, parent, cpu), daemon=True)
    proc.start()
    child.close()
    parent.settimeout(WAIT)
    try:
        out = {}
        for mode in MODES:
            anc = [] if mode == "nofd" else [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                              array.array("i", [seg.fileno()]))]

            def once(i: int, tag: bytes = mode[:1].encode(), anc: list[Any] = anc) -> None:
                parent.sendmsg([tag], anc)
                assert parent.recv(8) == b"a"

            out[mode] = _timeit_i(once, iters)
        parent.send(b"s")
        return out
    finally:
        parent.close()
        _stop(proc)


def _raw_child(sock: socket.socket, other: socket.socket, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    other.close()
    sock.settimeout(WAIT)
    while True:
        tag, anc, _, _ = sock.recvmsg(8, socket.CMSG_SPACE(4))
        fds = [fd for _, _, data in anc for fd in array.array("i", data[:4])]
        for fd in fds:
            if tag == b"m":
                Segment.from_fd(fd, HANDOFF_SIZE).close()
            os.close(fd)
        if tag in (b"s", b""):
            return
        sock.send(b"a")


class _SharedFd:
    """What the parent puts on the Queue: a fd to hand over, like a torch storage."""

    def __init__(self, fd: int, size: int, i: int, mode: str) -> None:
        self.fd, self.size, self.i, self.mode = fd, size, i, mode


def _reduce_shared_fd(obj: _SharedFd) -> tuple[Callable[..., int], tuple[Any, ...]]:
    # reduce_storage: (rebuild_storage_fd, (cls, DupFd(fd), size))
    return _rebuild_shared_fd, (reduction.DupFd(obj.fd), obj.size, obj.i, obj.mode)


def _rebuild_shared_fd(df: Any, size: int, i: int, mode: str) -> int:
    fd = df.detach()  # connect to the sender's resource sharer and receive the fd
    try:
        if mode == "map":
            Segment.from_fd(fd, size).close()  # _new_shared_fd_cpu: dup + mmap
    finally:
        os.close(fd)  # rebuild_storage_fd closes the received fd
    return i


reduction.ForkingPickler.register(_SharedFd, _reduce_shared_fd)  # as torch's init_reductions does


def _run_queue(ctx: Any, seg: Segment, iters: int, cpu: int) -> dict[str, list[float]]:
    to_child, to_parent = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_queue_child, args=(to_child, to_parent, cpu), daemon=True)
    proc.start()
    try:
        out = {}
        for mode in MODES:
            def once(i: int, mode: str = mode) -> None:
                to_child.put(i if mode == "nofd" else _SharedFd(seg.fileno(), seg.size, i, mode))
                got = to_parent.get(timeout=WAIT)
                assert got == i, got

            out[mode] = _timeit_i(once, iters)
        to_child.put(None)
        return out
    finally:
        _stop(proc)
        for q in (to_child, to_parent):
            q.close()
            q.cancel_join_thread()  # never block exit on a child that is gone


def _queue_child(inbox: Any, outbox: Any, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        item = inbox.get(timeout=WAIT)  # unpickling runs _rebuild_shared_fd: the whole receive
        if item is None:
            return
        outbox.put(item)


def _stop(proc: Any) -> None:
    proc.join(timeout=5)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=5)


# -- timing and printing -----------------------------------------------------


def _warmup(iters: int) -> int:
    return max(2, iters // 20)


def _timeit(fn: Callable[[], None], iters: int) -> list[float]:
    return _timeit_i(lambda i: fn(), iters)


def _timeit_i(fn: Callable[[int], None], iters: int) -> list[float]:
    """Call fn(i) for warm-up and then `iters` times; return each timed call's seconds."""
    for i in range(_warmup(iters)):
        fn(-1 - i)
    out = []
    clock = time.perf_counter
    for i in range(iters):
        t0 = clock()
        fn(i)
        out.append(clock() - t0)
    return out


def _cell(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e6:,.1f} ({statistics.fmean(times) * 1e6:,.1f})"


def _ratio(ours: list[float], anchor: list[float]) -> str:
    x = statistics.median(anchor) / statistics.median(ours)
    return f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


if __name__ == "__main__":
    sys.exit(main())
