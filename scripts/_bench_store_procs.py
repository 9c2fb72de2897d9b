"""bench_store's processes: the forked clients that get (timed there), and the reaper that kills what
the bench started should the bench itself die.

The clients are forked before Ray starts (Ray's threads must not be forked); each sets
``PR_SET_PDEATHSIG`` so that it dies with the bench.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import select
import shutil
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

PAGE = 4096
WAIT = 60.0  # s: the longest any one put, get, reply or child exit may wait
PR_SET_PDEATHSIG = 1


def touch(arr: np.ndarray) -> int:
    """Read one byte of every page (what a client that looks at the data must at least do)."""
    flat = arr.reshape(-1).view(np.uint8)
    return int(np.add.reduce(flat[::PAGE], dtype=np.uint64)) + int(flat[-1])


def client_main(conn: Connection, path: str | None) -> None:
    """Serve the parent's commands until it says stop or goes: get (timed) or a loop of small gets."""
    import shmshare.store as sstore  # this checkout's: bench_store put it first on the path

    store = None
    parent = os.getppid()
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent:
                return
        msg = conn.recv()
        if msg[0] == "stop":
            break
        try:
            if msg[1] == "shm" and store is None:
                assert path is not None
                store = sstore.Store(path=path, timeout=WAIT)
            conn.send(("ok", *serve(store, msg)))
        except Exception as exc:  # noqa: BLE001 - the parent prints it; this client goes on
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    if store is not None:
        store.close()
    conn.send(("ok",))


def serve(store: Any, msg: tuple[Any, ...]) -> tuple[Any, ...]:
    kind, path, name, *rest = msg
    if kind == "get" and path == "shm":
        t0 = time.perf_counter()
        view = store.get(name)
        touch(view)
        secs = time.perf_counter() - t0
        ok = not view.flags.writeable and view.nbytes == rest[0]
        del view
        return secs, ok
    if kind == "get" and path == "stdlib":
        t0 = time.perf_counter()
        shm = shared_memory.SharedMemory(name=name)
        view = np.ndarray((rest[0],), np.uint8, shm.buf)
        touch(view)
        secs = time.perf_counter() - t0
        del view
        _untrack(shm)
        shm.close()
        return secs, True
    if kind == "loop" and path == "shm":
        start_at, secs = rest
        return small_loop(lambda: store.get(name), start_at, secs)
    if kind == "loop" and path == "stdlib":  # attach by name, view, detach: each get
        start_at, secs = rest
        return small_loop(lambda: _attach(name), start_at, secs)
    raise ValueError(f"unknown command {msg!r}")


def small_loop(get: Callable[[], Any], start_at: float, secs: float) -> tuple[int, float, float]:
    """From `start_at` (time.monotonic, one clock for every process), get and drop for `secs`; return the count,
    the seconds and this process's CPU seconds over them."""
    while time.monotonic() < start_at:
        time.sleep(min(0.001, max(0.0, start_at - time.monotonic())))
    n, end, cpu = 0, start_at + secs, time.process_time()
    while time.monotonic() < end:
        view = get()
        int(view[0])
        del view
        n += 1
    return n, time.monotonic() - start_at, time.process_time() - cpu


def _attach(name: str) -> np.ndarray:
    """A stdlib get: SharedMemory(name=...) attached, a copy of its first byte's array, detached."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        return np.ndarray((SMALL_BYTES,), np.uint8, shm.buf).copy()[:1]  # no view past close()
    finally:
        _untrack(shm)
        shm.close()


SMALL_BYTES = 4096


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Python 3.11 registers an attach with the resource tracker too, which would unlink the owner's segment."""
    from multiprocessing import resource_tracker

    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


class Client:
    """One forked client process and the pipe to it."""

    def __init__(self, path: str | None) -> None:
        ctx = mp.get_context("fork")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_orphan_proof, args=(client_main, theirs, path), daemon=True)
        self.proc.start()
        theirs.close()

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def reply(self, wait: float = WAIT) -> tuple[Any, ...]:
        if not self.conn.poll(wait):
            raise TimeoutError(f"client {self.proc.pid} did not answer within {wait:.0f} s")
        rep: tuple[Any, ...] = self.conn.recv()
        if rep[0] == "err":
            raise RuntimeError(f"client {self.proc.pid}: {rep[1]}")
        return rep[1:]

    def ask(self, *msg: Any) -> tuple[Any, ...]:
        self.send(*msg)
        return self.reply()

    def close(self) -> None:
        try:
            self.ask("stop")
        except Exception as exc:  # noqa: BLE001 - a client that does not say goodbye is killed below
            print(f"  client {self.proc.pid} did not stop: {exc!r}")
        self.proc.join(WAIT / 4 if self.proc.exitcode is None else 0)
        if self.proc.exitcode is None and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)  # by pid: only what this script started
            self.proc.join(10)
        self.conn.close()


def _orphan_proof(target: Callable[..., None], *args: Any) -> None:
    """Run `target` in a child that dies with this script, even a SIGKILLed one."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        return  # the parent went before the line above
    target(*args)


class Reaper:
    """A forked child that SIGKILLs the pids it was told about (and removes the folders) once this process dies.

    The daemon is started by ``Daemon.start`` and Ray's processes by ``ray.init``: neither lets this script set
    ``PR_SET_PDEATHSIG`` on them, and Ray's agents outlive a SIGKILLed driver. On a normal exit the bench stops
    them itself and tells the reaper to go without killing anything.
    """

    def __init__(self) -> None:
        r, self.w = os.pipe()
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            os.close(self.w)
            try:
                _reap(r, parent)
            finally:
                os._exit(0)
        os.close(r)

    def watch(self, pids: list[int] = (), folder: str | None = None) -> None:  # type: ignore[assignment]
        lines = [f"pid {p}" for p in pids] + ([f"dir {folder}"] if folder else [])
        if lines:
            os.write(self.w, ("\n".join(lines) + "\n").encode())

    def close(self) -> None:
        try:
            os.write(self.w, b"done\n")
        finally:
            os.close(self.w)
        deadline = time.monotonic() + 10
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return
            time.sleep(0.01)


def _reap(r: int, parent: int) -> None:
    pids: list[int] = []
    dirs: list[str] = []
    buf = b""
    while True:
        ready, _, _ = select.select([r], [], [], 0.5)
        gone = os.getppid() != parent
        if ready:
            chunk = os.read(r, 65536)
            gone = gone or not chunk
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                word, _, arg = line.decode().partition(" ")
                if word == "done":
                    return
                (pids.append(int(arg)) if word == "pid" else dirs.append(arg))
        if gone:
            for pid in pids:
                if pid != os.getpid():  # descendants() lists this reaper too
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
            return


def descendants() -> list[int]:
    """Every process below this one (psutil is a dependency of shmshare)."""
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]
