"""Shared pieces of the shmshare.multiprocessing tests: child targets (module level, so that
spawn can import them), fingerprints of what arrived, and bounded process handling.

This module imports numpy and shmshare only: a spawned child that imports it does not pay
for torch unless what it unpickles needs it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmshare.multiprocessing as smp
from shmshare import _native
from shmshare.testing import procs

WAIT = 30.0  # s: the bound of every wait on a child


@pytest.fixture(autouse=True)
def _mp_shutdown() -> Iterator[None]:
    """Stop this process's pool and links after each test, once the test's arrays are gone
    (tests/mp/conftest.py will do this too; until then each test module imports this)."""
    try:
        yield
    finally:
        smp.shutdown()


# -- what arrived ---------------------------------------------------------------------------------


def is_handle_view(arr: Any) -> bool:
    """Whether numpy array `arr` (or a tensor's numpy view) is a view over a pool block, as an
    unpickled handle (or an array of smp.empty()) is; an array unpickled by value is not."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, _native.Lease)


def tensor_is_handle_view(t: Any) -> bool:
    """Whether torch tensor `t` lies over a pool block (its storage is a numpy array's)."""
    import torch

    probe = t.detach()
    try:
        arr = probe.numpy()
    except TypeError:  # bfloat16, float8, ...: look at the bytes of the same storage
        size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[probe.element_size()]
        arr = probe.view(size).numpy()
    # torch.from_numpy keeps the numpy array alive, not as .base of .numpy(): compare addresses
    # with the pool's blocks instead of walking bases
    return _in_received_segment(arr)


def _in_received_segment(arr: np.ndarray) -> bool:
    from shmshare.multiprocessing import _client

    c = _client._client
    if c is None or arr.size == 0:
        return False
    ptr, lo, span = _native.extent(arr)
    start = ptr + lo
    for link in list(c.links.values()):
        for root in list(link.segments.roots.values()):
            if root.address <= start and start + span <= root.address + root.nbytes:
                return True
    return False


def fingerprint(obj: Any) -> Any:
    """What must be equal on both sides: type, dtype, shape, flags, and the bytes of the data
    (field by field for structured dtypes: padding is no data)."""
    if isinstance(obj, np.ndarray):
        dt = obj.dtype
        if dt.hasobject:
            data: Any = obj.tolist()
        elif dt.names:
            data = tuple(np.ascontiguousarray(obj[n]).tobytes() for n in dt.names)
        else:
            data = np.ascontiguousarray(obj).tobytes()
        return ("ndarray", type(obj).__name__, dt.descr if dt.names else dt.str, obj.shape, data)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout is not torch.strided:
            dense = t.to_dense()
            body: Any = (str(t.layout), t.is_coalesced() if t.is_sparse else None,
                         _tensor_bytes(dense))
        elif t.device.type != "cpu":
            body = (str(t.device),)
        else:
            body = _tensor_bytes(t)
        return ("tensor", type(obj).__name__, str(obj.dtype), tuple(obj.shape),
                bool(obj.requires_grad), bool(obj.is_leaf), body)
    if isinstance(obj, (tuple, list)):
        return type(obj).__name__, tuple(fingerprint(x) for x in obj)
    if isinstance(obj, dict):
        return "dict", tuple((k, fingerprint(v)) for k, v in obj.items())
    return obj


def _tensor_bytes(t: Any) -> bytes:
    import torch

    flat = t.contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return bytes(flat.numpy().tobytes())


def received(obj: Any) -> Any:
    """What a child reports of `obj`: its fingerprint and whether it came as a handle."""
    import_torch = sys.modules.get("torch")
    if isinstance(obj, np.ndarray):
        as_handle = is_handle_view(obj)
    elif import_torch is not None and isinstance(obj, import_torch.Tensor) \
            and obj.layout is import_torch.strided and obj.device.type == "cpu":
        as_handle = tensor_is_handle_view(obj)
    else:
        as_handle = None
    return fingerprint(obj), as_handle, bool(getattr(obj, "flags", None) is None
                                              or obj.flags.writeable)


# -- child targets ----------------------------------------------------------------------------------


def echo(inq: Any, outq: Any) -> None:
    """Report what arrives on `inq` and send it back on `outq`, until None."""
    while True:
        obj = inq.get(timeout=WAIT)
        if obj is None:
            break
        outq.put((received(obj), obj))
        del obj
    outq.put(("stats", smp.statistics()))


def report(inq: Any, outq: Any) -> None:
    """Report what arrives on `inq` (fingerprint only, nothing sent back), until None."""
    while True:
        obj = inq.get(timeout=WAIT)
        if obj is None:
            break
        outq.put(received(obj))
        del obj


def write_into(inq: Any, outq: Any) -> None:
    """Take one array off `inq` (a get-able queue), write 7 into its first element (and 8 into its
    last), report (sum after, came as a handle, writable); then wait for the parent's word."""
    arr = inq.get()
    arr.reshape(-1)[0] = 7  # reshape(-1) of a contiguous array is a view
    arr.reshape(-1)[-1] = 8
    _fp, as_handle, writable = received(arr)
    outq.put((float(arr.sum()), as_handle, writable))
    del arr


def joinable_task(inq: Any, outq: Any) -> None:
    arr = inq.get(timeout=WAIT)
    out = (received(arr), float(arr.sum()))
    arr[0] = -1
    del arr
    inq.task_done()
    outq.put(out)


def pipe_peer(conn: Any) -> None:
    """Over one end of a Pipe: receive an array, write into it, send back (its fingerprint, a new
    array of this process's); wait for the parent's word; send this process's statistics."""
    if not conn.poll(WAIT):
        return
    arr = conn.recv()
    info = received(arr)
    arr[0] = 42.0
    del arr
    reply = np.arange(2048, dtype=np.float64) * 3
    conn.send((info, reply))
    del reply
    if conn.poll(WAIT):
        conn.recv()
    conn.send(smp.statistics())
    conn.close()


def check_args(arr: Any, expect: Any, outq: Any) -> None:
    """A Process target under spawn: its argument `arr` came pickled by the parent."""
    ok = fingerprint(arr) == expect
    as_handle = is_handle_view(arr)
    arr.reshape(-1)[0] = 5
    outq.put((ok, as_handle, os.getpid()))
    del arr


def triple(arr: np.ndarray) -> np.ndarray:
    """A Pool / executor task: a result big enough to go as a handle of the worker's pool."""
    return arr * 3


def triple_and_report(arr: np.ndarray) -> tuple[np.ndarray, bool, int]:
    return arr * 3, is_handle_view(arr), os.getpid()


def worker_statistics(_: Any = None) -> Any:
    return smp.statistics()


def torch_spawn_target(rank: int, arr: Any, expect: Any, outq: Any) -> None:
    outq.put((rank, fingerprint(arr) == expect, is_handle_view(arr)))
    del arr


# -- bounded processes ---------------------------------------------------------------------------


def kill_children() -> None:
    """Kill every child multiprocessing still knows of, by pid, and reap it (bounded)."""
    procs.kill(*multiprocessing.active_children())


def close_queue(q: Any) -> None:
    """Close a Queue/SimpleQueue/JoinableQueue and wait (bounded by its feeder) for its thread."""
    q.close()
    join = getattr(q, "join_thread", None)
    if join is not None:
        join()


@contextlib.contextmanager
def child(target: Any, *args: Any, method: str = "fork") -> Iterator[procs.Child]:
    """Start `target(*args)` in a process of the `method` context; on leaving, join it (bounded,
    killed by pid if still there) and check that it exited 0."""
    with procs.start_child(target, *args, method=method) as c:
        yield c
        assert c.join(WAIT) == 0, f"child pid {c.pid} exit code {c.exitcode}"


class EchoChild:
    """A child that reports each object the parent sends it and sends it back (Queues of the
    `method` context): ``trip(obj)`` -> (the child's report, what came back)."""

    def __init__(self, method: str = "fork") -> None:
        ctx = smp.get_context(method)
        self.inq, self.outq = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=echo, args=(self.inq, self.outq), daemon=True)
        self.proc.start()
        self.pid = self.proc.pid
        self.child_stats: Any = None

    def trip(self, obj: Any) -> tuple[Any, Any]:
        self.inq.put(obj)
        got = self.outq.get(timeout=WAIT)
        return got

    def close(self) -> None:
        try:
            if self.proc.exitcode is None and self.proc.is_alive():
                self.inq.put(None)
                _tag, self.child_stats = self.outq.get(timeout=WAIT)
                self.proc.join(WAIT)
        finally:
            procs.kill(self.proc)
            close_queue(self.inq)
            close_queue(self.outq)
            # a fixture's value outlives its teardown (pytest drops it after the leak check):
            # let go of the queues' pipes and semaphores and the process's sentinel now
            self.inq = self.outq = None
            if self.proc.exitcode is not None:
                self.proc.close()

    def __enter__(self) -> EchoChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_one_to_parameters(model: Any, outq: Any) -> None:
    """A Process target under spawn (Hogwild): write into the model's parameters it was given."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    outq.put([p.is_shared() for p in model.parameters()])
    del model
