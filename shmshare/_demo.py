"""``shmshare demo``: the seed's fd-sharing walk-through, live, with two processes; then the DataLoader.

``shmshare doctor`` checks, line by line, what shmshare needs from the host
and says what each fact means for the user; ``--json`` prints the same as a
report for machines. ``shmshare demo`` runs the seed's parent/child
walk-through (``docs/architecture.md``, "Lifetimes") with two real processes and
prints, at every step, who holds the shared object: fds and mappings read
from ``/proc/<pid>/fd`` and ``/proc/<pid>/maps``, and its ``/dev/shm`` name.
After the walk, ``shmshare.DataLoader`` runs for a moment over a numpy
dataset with two workers (``numpy_collate``: no torch needed), and torch's
DataLoader beside it when torch is importable: batches/s, the fds and the
shared memory each holds, and what is left once it is closed.

Note [What the demo can and cannot see]
    The seed counts ``i_count``: every reference that keeps the object alive.
    From user space we see ``nlink`` (``fstat().st_nlink``), every fd (matched
    by inode through ``/proc/<pid>/fd``) and every mapping (``/proc/<pid>/maps``),
    so ``refs`` = fds + mappings in both processes. The one reference that no
    fd table shows is a fd in flight inside the socket between ``sendmsg`` and
    ``recvmsg``; the demo adds it by hand, and says so.
"""


from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _procfs, wire
from ._doctor import _fmt
from ._errors import ShmshareError
from .segment import Flags, Segment

__all__ = ["demo"]

_GiB, _MiB = 1 << 30, 1 << 20
_STEP_TIMEOUT = 10.0  # s: any one demo step; far above what a step takes
_SHMEM_VISIBLE = 16 * _MiB  # below this, other processes' Shmem noise hides the segment


def demo(backend: str = "memfd", size: int = 64 * _MiB, loader_seconds: float | None = None) -> int:
    """Run the seed's fd walk-through with a forked child, then the loader; return 0 if both went right."""
    ctl, ctl_child = wire.pipe(role="demo")
    data, data_child = wire.pipe(role="demo")
    sys.stdout.flush()  # the child must not inherit (and never prints) unflushed output
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ctl.close()
            data.close()
            code = _child_loop(ctl_child, data_child)
        finally:
            os._exit(code)
    ctl_child.close()
    data_child.close()
    try:
        ok = _Walk(ctl, data, pid, backend, size).run()
    except (OSError, RuntimeError, ShmshareError) as exc:
        print(f"demo failed: {exc}")
        ok = False
    finally:
        ctl.close()
        data.close()
        status = _reap(pid, timeout=5.0)
    if status != 0:
        print(f"child {pid} ended with status {status}")
    seconds = _LOADER_SECONDS if loader_seconds is None else loader_seconds
    if ok and status == 0 and seconds > 0:
        ok = loader_demo(seconds)
    return 0 if ok and status == 0 else 1


class _Walk:
    """The parent's side of the demo: drive the child step by step and print who holds what."""

    def __init__(self, ctl: wire.Connection, data: wire.Connection, child: int, backend: str,
                 size: int) -> None:
        self.ctl, self.data, self.child, self.backend, self.size = ctl, data, child, backend, size
        self.parent = os.getpid()
        self.ino, self.dev, self.name, self.step = 0, 0, "", 0
        self.salt = self.parent & 0xFFFFFFFF
        self.read_ok = False
        self.shmem0 = _procfs.meminfo_kb("Shmem")

    def run(self) -> bool:
        """Walk every step; return whether the object is gone at the end and the child read it right."""
        print(f"shmshare demo: parent pid {self.parent}, child pid {self.child} (forked first, so the "
              f"fd can only reach it through the socket), {self.backend}, {_fmt(self.size)}")
        print("  refs = fds + mappings in both processes: the seed's i_count, as /proc shows it")
        flags = Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.KEEPFD  # UNLINK is done by hand below
        seg = Segment.create(self.size, flags, backend=self.backend)
        try:
            self._create(seg)
            self._hand_over(seg)
            seg.close()
            self.show("parent: Segment.close() -> close(fd) + munmap", "i_count=2: only the child's fd "
                      "and mapping hold it; with nlink=0 nothing else can reach it")
            read_ok = self._verify("read the pattern again", "still valid after its creator let go: "
                                   "the mapping, not the sender, keeps the pages")
            self.ask("close")
            left = self.show("child: Segment.close() -> close(fd) + munmap",
                             "nlink=0 and i_count=0: the kernel frees the inode and its pages")
        finally:
            seg.close()
        self.ask("exit", reply=False)
        gone = left == 0 and not os.path.exists(f"/dev/shm{self.name}")
        read_ok = read_ok and self.read_ok
        print(f"object gone: {'yes' if gone else 'no'} (no fd, mapping or /dev/shm name left in "
              f"either process{self._shmem_note()}); child read the pattern: "
              f"{'yes' if read_ok else 'no'}")
        return gone and read_ok

    def _create(self, seg: Segment) -> None:
        assert seg.fd is not None
        st = os.fstat(seg.fd)
        self.ino, self.dev, self.name = st.st_ino, st.st_dev, seg.name or ""
        _fill(seg, self.salt)
        call = "memfd_create" if self.backend == "memfd" else "shm_open(O_CREAT|O_EXCL)"
        nl = "nlink=0 from birth (no name at all)" if self.backend == "memfd" else "nlink=1 (the name)"
        seen = self.show(f"parent: {call} + ftruncate + fallocate + mmap -> fd {seg.fd}, pattern "
                         "written", f"a new inode, {nl}; the fd and the mapping hold it: i_count=2")
        if seen != 2:  # /proc hides what we hold (hidepid?): "gone" would prove nothing
            raise RuntimeError(f"/proc/{self.parent} shows {seen} references to the segment, not 2; "
                               "the demo cannot trace it on this host")
        if self.backend == "posix":
            os.unlink(f"/dev/shm{self.name}")  # what shm_unlink does (Flags.UNLINK does it in create)
            self.show(f"parent: shm_unlink({self.name})", "nlink=0: nobody can open it again; "
                      "the fd and the mapping keep it alive: i_count=2")

    def _hand_over(self, seg: Segment) -> None:
        self.data.send({"size": self.size, "salt": self.salt}, [seg.fileno()])
        self.show(f"parent: sendmsg(SCM_RIGHTS, fd {seg.fd})", "the fd is in flight: the socket "
                  "holds a reference no fd table shows: i_count=3", in_flight=1)
        got = self.ask("recv")["fd"]
        self.show(f"child: recvmsg -> fd {got}", "the kernel installed a new fd in the child: "
                  "same object, another number: i_count=3")
        mapped = self.ask("map")["fd"]
        self.show(f"child: Segment.from_fd(fd {got}) -> dup fd {mapped} + mmap",
                  "dup + mmap before the received fd is closed: i_count=5 for a moment")
        self.ask("close_received")
        self.show(f"child: close(fd {got}) (the received one)", "i_count=4: one fd and one "
                  "mapping in each process, the seed's steady state")
        self.read_ok = self._verify("read the pattern", "one set of pages, mapped in two "
                                    "processes: the child sees the parent's writes")

    def _verify(self, what: str, why: str) -> bool:
        ok = bool(self.ask("verify")["ok"])
        self.show(f"child: {what}: {'ok' if ok else 'WRONG'}", why)
        return ok

    def ask(self, op: str, reply: bool = True) -> dict[str, Any]:
        """Send the child one step and return its answer (raising what the child raised)."""
        self.ctl.send({"op": op})
        if not reply:
            return {}
        header, fds = self.ctl.recv(timeout=_STEP_TIMEOUT)
        for f in fds:
            f.close()
        if "error" in header:
            raise RuntimeError(f"child {self.child} failed at step {op!r}: {header['error']}")
        return header

    def show(self, what: str, why: str, in_flight: int = 0) -> int:
        """Print one step: who holds the object now, and why; return the refs seen in /proc."""
        self.step += 1
        sides, total, nlink = [], in_flight, None
        for role, pid in (("parent", self.parent), ("child", self.child)):
            fds, maps, nl = _holders(pid, self.dev, self.ino)
            nlink = nl if nl is not None else nlink
            total += len(fds) + maps
            sides.append(f"{role} {pid} fds {fds} maps {maps}")
        refs = f"{total - in_flight}+{in_flight} in flight" if in_flight else str(total)
        print(f"{self.step:2}. {what}")
        print(f"    {' | '.join(sides)} | refs {refs} | nlink {'-' if nlink is None else nlink}"
              f" | {self._entry()}{self._shmem()}")
        print(f"    {why}")
        return total - in_flight

    def _entry(self) -> str:
        if self.backend == "memfd":
            return "no name"
        return f"/dev/shm{self.name}" if os.path.exists(f"/dev/shm{self.name}") else "/dev/shm: gone"

    def _shmem_delta(self) -> str | None:
        """Return the host's Shmem change since the start ("+64 MiB"), None for small segments."""
        if self.size < _SHMEM_VISIBLE:
            return None
        return f"{(_procfs.meminfo_kb('Shmem') - self.shmem0) / 1024:+.0f} MiB"

    def _shmem(self) -> str:
        delta = self._shmem_delta()
        return f" | Shmem {delta}" if delta else ""

    def _shmem_note(self) -> str:
        # Other processes change the host's Shmem too, so it is reported, not judged.
        delta = self._shmem_delta()
        return f"; host Shmem {delta} vs start" if delta else ""


def _holders(pid: int, dev: int, ino: int) -> tuple[list[int], int, int | None]:
    """Return (fds, mapping count, nlink) of the object (dev, ino) in process `pid`."""
    fds, maps, nlink = _procfs.holders(pid, dev, ino)
    return fds, len(maps), nlink


def _child_loop(ctl: wire.Connection, data: wire.Connection) -> int:
    """Run the child's side: do one step per command and answer; return the exit code."""
    state: dict[str, Any] = {}
    while True:
        header, _ = ctl.recv(timeout=_STEP_TIMEOUT)
        op = header.get("op")
        if op == "exit":
            return 0
        try:
            reply = _CHILD_STEPS[op](state, data)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which prints it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        ctl.send(reply)


def _child_recv(state: dict[str, Any], data: wire.Connection) -> dict[str, Any]:
    header, fds = data.recv(timeout=_STEP_TIMEOUT)
    state.update(size=header["size"], salt=header["salt"], fd=fds[0])
    return {"fd": fds[0].fileno()}


def _child_map(state: dict[str, Any], data: wire.Connection) -> dict[str, Any]:
    # the seed's step dups (an int is dup'ed; a wire.Fd would be taken): i_count=5 for a moment
    state["seg"] = Segment.from_fd(state["fd"].fileno(), state["size"])
    return {"fd": state["seg"].fd}


def _child_close_received(state: dict[str, Any], data: wire.Connection) -> dict[str, Any]:
    state["fd"].close()
    return {}


def _child_verify(state: dict[str, Any], data: wire.Connection) -> dict[str, Any]:
    return {"ok": _check(state["seg"], state["salt"])}


def _child_close(state: dict[str, Any], data: wire.Connection) -> dict[str, Any]:
    state["seg"].close()
    return {}


_CHILD_STEPS: dict[Any, Callable[[dict[str, Any], wire.Connection], dict[str, Any]]] = {
    "recv": _child_recv, "map": _child_map, "close_received": _child_close_received,
    "verify": _child_verify, "close": _child_close,
}


def _fill(seg: Segment, salt: int) -> None:
    words = seg.view(np.uint32, seg.size // 4)
    words[:] = np.arange(words.size, dtype=np.uint32) ^ np.uint32(salt)
    del words  # no view may outlive the step: close() must unmap at once


def _check(seg: Segment, salt: int) -> bool:
    words = seg.view(np.uint32, seg.size // 4)
    ok = bool(np.array_equal(words, np.arange(words.size, dtype=np.uint32) ^ np.uint32(salt)))
    del words
    return ok


def _reap(pid: int, timeout: float) -> int:
    """Wait for child `pid` up to `timeout` s, SIGKILL it if still there; return its exit status."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.01)


# -- the loader, after the walk-through ----------------------------------------------

_LOADER_SECONDS = 1.5  # s per loader: shmshare's, then torch's beside it when torch is importable
_LOADER_SHAPE = (3, 128, 128)  # uint8: a batch of 32 is 1.5 MiB, small enough for any host
_LOADER_BATCH = 32
_LOOK_S = 0.05  # how often the loop looks at fds and shared memory


class _Images:
    """The loader demo's dataset: sample i is a copy of one of four uint8 images, and the label i."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.src = np.random.default_rng(0).integers(0, 256, (4, *_LOADER_SHAPE), dtype=np.uint8)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.src[i % len(self.src)].copy(), i


def loader_demo(seconds: float = _LOADER_SECONDS) -> bool:
    """Run shmshare's DataLoader for `seconds` (and torch's beside it when importable); return if shmshare's ran."""
    from .loader import DataLoader, numpy_collate

    mib = _LOADER_BATCH * int(np.prod(_LOADER_SHAPE)) / _MiB
    print(f"\nshmshare.DataLoader: 2 workers, batches of {_LOADER_BATCH} x {_LOADER_SHAPE} uint8 ({mib:.1f} MiB), "
          f"prefetch 2, persistent workers, {seconds:g} s; this process reads one element per batch")
    ok = _show_loader("shmshare (numpy batches)", DataLoader, seconds, collate_fn=numpy_collate)
    try:
        tud = importlib.import_module("torch.utils.data")
    except ImportError:
        print("  (torch is not installed: no torch DataLoader beside it)")
        return ok
    _show_loader("torch (tensors)", tud.DataLoader, seconds)
    return ok


def _show_loader(label: str, cls: Any, seconds: float, **kw: Any) -> bool:
    """Run one loader and print its line; return False (after printing why) if it failed."""
    fds0, shm0 = len(_procfs.fds()), _procfs.meminfo_kb("Shmem")
    try:
        rate, fds, shm = _run_loader(cls(_Images(64 * _LOADER_BATCH), batch_size=_LOADER_BATCH, num_workers=2,
                                         persistent_workers=True, prefetch_factor=2, timeout=_STEP_TIMEOUT, **kw),
                                     seconds, fds0, shm0)
    except Exception as exc:  # noqa: BLE001 - the demo reports it and goes on
        print(f"  {label:<25} failed: {type(exc).__name__}: {exc}")
        return False
    left_fds, left_shm = len(_procfs.fds()) - fds0, (_procfs.meminfo_kb("Shmem") - shm0) / 1024
    print(f"  {label:<25} {rate:7,.0f} batches/s | held: fds +{fds} here, shared memory {shm:+.0f} MiB "
          f"(host-wide) | after close: fds {left_fds:+d}, {left_shm:+.0f} MiB")
    return True


def _run_loader(loader: Any, seconds: float, fds0: int, shm0: int) -> tuple[float, int, float]:
    """Iterate `loader` for `seconds`, then close it; return (batches/s, peak fds added, peak MiB added)."""
    try:
        it = iter(loader)
        next(it)[0][0, 0, 0, 0].item()  # the workers have started: time from here
        n, fds, shm = 0, 0, 0.0
        t0 = look = time.perf_counter()
        deadline = t0 + seconds
        while True:
            for batch in it:
                batch[0][0, 0, 0, 0].item()
                n += 1
                now = time.perf_counter()
                if now >= look:
                    fds = max(fds, len(_procfs.fds()) - fds0)
                    shm = max(shm, (_procfs.meminfo_kb("Shmem") - shm0) / 1024)
                    look = now + _LOOK_S
                if now >= deadline:
                    return n / (now - t0), fds, shm
            it = iter(loader)  # the next epoch (persistent workers)
    finally:
        closer = getattr(loader, "close", None)  # shmshare's
        shutdown = getattr(getattr(loader, "_iterator", None), "_shutdown_workers", None)  # torch's
        for stop in (closer, shutdown):
            if callable(stop):
                stop()
