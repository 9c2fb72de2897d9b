"""bench_loader's view of its process tree: a forked sampler of fds and shared memory, CPU time, stragglers.

Imports neither torch nor shmshare at its top (a spawned loader worker imports bench_loader, and this, again).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import psutil

__all__ = ["Sampler", "meminfo_kb", "tree_cpu", "wait_children"]

SAMPLE_S = 0.01  # the sampler's period


# Note [Sampling from a process]
#     A sampling thread takes the GIL from the loader under test: with 0 workers on a busy 2-CPU
#     machine it slowed rows 2-4x (holding the GIL, descheduled, it stalls the consumer for a time
#     slice). A forked sampler reads /proc and costs this process nothing.


class Sampler:
    """A forked process that samples this process's fd count, its descendants' and /proc/meminfo Shmem."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_sample_loop, args=(theirs, os.getpid()), daemon=True, name="bench-sampler")
        self._proc.start()
        theirs.close()
        self.pid = self._proc.pid

    def ask(self, what: str) -> Any:
        """"start": take the bases (Shmem kB, fds of this process), returned, and sample; "stop": return the
        peaks (fds_main, fds_tree, shm_kb: Shmem above the base, tree_bytes)."""
        self._conn.send(what)
        return self._conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("quit")
        self._proc.join(5)
        if self._proc.exitcode is None:
            self._proc.kill()  # by its pid: only what this script started
            self._proc.join(5)
        self._conn.close()


def meminfo_kb(field: str) -> int:
    """/proc/meminfo's `field` in kB (shmshare._procfs's, imported here only when called)."""
    from shmshare._procfs import meminfo_kb as read

    return int(read(field))


def _sample_loop(conn: Connection, pid: int) -> None:
    """The sampler's body: between "start" and "stop", sample every SAMPLE_S; "quit" ends it."""
    main, me = psutil.Process(pid), os.getpid()
    while conn.recv() == "start":
        shm_base = meminfo_kb("Shmem")
        conn.send((shm_base, len(os.listdir(f"/proc/{pid}/fd"))))
        peaks = dict.fromkeys(("fds_main", "fds_tree", "shm_kb", "tree_bytes"), 0)
        kids: list[int] = []
        rescan, scanned_at = 0.0, -1
        while True:
            now, n = time.monotonic(), len(os.listdir(f"/proc/{pid}/fd"))
            # Listing the tree reads all of /proc: only when this process's fd count moved (a new worker's
            # pipes) or every 0.1 s, not at every sample.
            if now >= rescan or n != scanned_at:
                kids = [k.pid for k in main.children(recursive=True) if k.pid != me]
                rescan, scanned_at = now + 0.1, n
            fds, objects = _fds_and_shm([pid, *kids])
            sample = {"fds_main": fds[0], "fds_tree": sum(fds), "shm_kb": meminfo_kb("Shmem") - shm_base,
                      "tree_bytes": sum(objects.values())}
            peaks = {k: max(v, sample[k]) for k, v in peaks.items()}
            if conn.poll(SAMPLE_S):
                break
        conn.recv()  # "stop"
        conn.send(peaks)


def _fds_and_shm(pids: list[int]) -> tuple[list[int], dict[tuple[int, int], int]]:
    """Return each process's fd count, and the bytes allocated to each shm object (dev, inode) they hold fds of.

    The tree's own figure beside the host's Shmem, which other work on the machine moves too: a memfd or
    /dev/shm object counts once however many fds of the tree refer to it (st_blocks: pages really
    allocated). An object that is only mapped, its fds all closed, is not seen.
    """
    counts, objects = [], {}
    for p in pids:
        d = f"/proc/{p}/fd"
        try:
            names = os.listdir(d)
        except OSError:  # gone between the scan and now
            names = []
        counts.append(len(names))
        for n in names:
            with contextlib.suppress(OSError):  # closed while we looked
                if os.readlink(f"{d}/{n}").startswith(("/memfd:", "/dev/shm/")):
                    st = os.stat(f"{d}/{n}")
                    objects[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return counts, objects


def tree_cpu(me: psutil.Process, skip: int) -> float:
    """Return the CPU seconds (user + system) of this process and its descendants but `skip`, so far."""
    t = me.cpu_times()
    total = t.user + t.system
    for k in me.children(recursive=True):
        if k.pid != skip:
            with contextlib.suppress(psutil.Error):
                c = k.cpu_times()
                total += c.user + c.system
    return total


def wait_children(me: psutil.Process, before: set[int], limit: float = 10.0) -> int:
    """Wait up to `limit` s for the processes started since `before` to end; return how many remain."""
    deadline = time.monotonic() + limit
    while True:
        left = []
        for p in me.children(recursive=True):
            if p.pid in before:
                continue
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
        if not left or time.monotonic() > deadline:
            return len(left)
        time.sleep(0.02)
