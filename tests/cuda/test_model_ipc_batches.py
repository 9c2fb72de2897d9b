"""Device memory over fds in batches (Note [Device memory in batches], cuda/_ipc.py), over the driver MODEL.

No GPU is involved (see tests/cuda/driver_model.py), but the fds are real
(a memfd stands for each exported chunk), and so are the sockets, the
forked child and its RLIMIT_NOFILE. The model's chunks are shrunk to
64 KiB so that a block of many chunks costs a few MiB.
"""

from __future__ import annotations

import errno
import gc
import os
import resource
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shmshare import FdLimitError, PeerDied, ProtocolError, ShmshareTimeout, cuda, wire
from shmshare.cuda import _driver, _ipc
from shmshare.testing import pattern, start_child

from .driver_model import DriverModel
from .gpu_helpers import read_device as _read

CHUNK = 64 << 10  # the model's granularity in these tests
MANY = 2 * wire.MAX_FDS + 5  # chunks: a full header batch, a full continuation and a short one
ROOM = wire.MAX_FDS + 16  # new fds the receiving child may open: one batch and a few more, far below MANY


@pytest.fixture
def model(driver_model: DriverModel) -> DriverModel:
    driver_model.granularity = driver_model.recommended_granularity = CHUNK  # MINIMUM and RECOMMENDED
    return driver_model


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _filled_block(provider: cuda.CudaDeviceProvider, seed: int) -> tuple[int, Any, int, int]:
    """Return (address, handle, offset, nbytes) of a filled block of MANY chunks, starting and ending mid-chunk."""
    address, handle = provider.allocate(MANY * CHUNK)
    offset, nbytes = 1000, MANY * CHUNK - 1000 - 123
    cuda.copy_host_to_device(address + offset, pattern(seed, nbytes, np.uint8), nbytes)
    return address, handle, offset, nbytes


def _room_limit(room: int) -> int:
    """Return the RLIMIT_NOFILE under which exactly ``room`` fd numbers are free (fds take the lowest free one)."""
    taken = {int(n) for n in os.listdir("/proc/self/fd")}
    limit = free = 0
    while free < room:
        free += limit not in taken
        limit += 1
    return limit


def _receive_with_few_fds(conn: wire.Connection, nbytes: int, seed: int) -> None:
    """Child (forked): receive a block of MANY chunks allowed only ROOM new fds, check it, report."""
    # The model is plain Python, copied by fork with the parent's chunks and their contents:
    # it serves the child as it served the parent (a real driver would not survive the fork:
    # the child stands for another process that initialized CUDA itself, so it adopts the model).
    _driver._forked_after_init = False
    _driver._state[0].adopt_after_fork()
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (_room_limit(ROOM), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        imported = cuda.recv_device_memory(conn, timeout=30)
        same = imported.nbytes == nbytes and bool(
            (_read(imported.address, nbytes) == pattern(seed, nbytes, np.uint8)).all())
        reply: dict[str, Any] = {"ok": same}
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which fails on it
        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    conn.send(reply, (), 10)


def test_a_block_of_many_chunks_reaches_a_process_with_room_for_one_batch_of_fds(
        model: DriverModel, pipe: tuple[wire.Connection, wire.Connection], monkeypatch: pytest.MonkeyPatch) -> None:
    mine, theirs = pipe
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle, offset, nbytes = _filled_block(provider, 5)
    held: list[int] = []  # fds open in the sender at each message it sends
    send = mine.send

    def counting_send(header: dict[str, Any], fds: Any = (), timeout: float | None = None) -> None:
        held.append(_open_fds())
        send(header, fds, timeout)

    monkeypatch.setattr(mine, "send", counting_send)
    with start_child(_receive_with_few_fds, theirs, nbytes, 5) as child:
        gc.collect()  # no collected Fd may close a fd while the sender's are counted
        before = _open_fds()
        cuda.send_device_memory(mine, provider, address + offset, nbytes, timeout=30)
        assert [n - before for n in held] == [wire.MAX_FDS, wire.MAX_FDS, MANY - 2 * wire.MAX_FDS]
        reply, _ = mine.recv(timeout=60)
        assert child.join(30) == 0
    assert reply == {"ok": True}, reply
    provider.free(handle)
    provider.close()


def test_the_receiver_holds_one_batch_of_fds_at_a_time_and_maps_every_chunk(
        model: DriverModel, pipe: tuple[wire.Connection, wire.Connection], monkeypatch: pytest.MonkeyPatch) -> None:
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle, offset, nbytes = _filled_block(provider, 9)
    cuda.send_device_memory(pipe[0], provider, address + offset, nbytes, meta={"seed": 9})
    held: list[int] = []  # fds open in the receiver at each import
    real_import = DriverModel._cuMemImportFromShareableHandle

    def counting_import(self: DriverModel, fd: int, kind: Any) -> Any:
        held.append(_open_fds())
        return real_import(self, fd, kind)

    monkeypatch.setattr(DriverModel, "_cuMemImportFromShareableHandle", counting_import)
    gc.collect()
    before = _open_fds()  # every batch is in flight in the socket, none in this process yet
    imported = cuda.recv_device_memory(pipe[1], timeout=10)
    assert len(held) == MANY and max(held) - before == wire.MAX_FDS and _open_fds() == before
    assert imported.meta == {"seed": 9} and imported.nbytes == nbytes
    provider.free(handle)  # the sender lets go: the imported chunks keep the memory
    provider.close()
    assert len(model.mappings) == MANY and (_read(imported.address, nbytes) == pattern(9, nbytes, np.uint8)).all()
    imported.close()
    gc.collect()
    cuda.finish_releases()  # the finalizer only queued the release (Note [Deferred releases])
    assert model.live() == dict.fromkeys(model.live(), 0)


def test_a_sender_that_fails_part_way_says_so_and_the_receiver_keeps_nothing(
        model: DriverModel, pipe: tuple[wire.Connection, wire.Connection], monkeypatch: pytest.MonkeyPatch) -> None:
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle, offset, nbytes = _filled_block(provider, 2)
    real_export = DriverModel._cuMemExportToShareableHandle
    exports = []

    def failing_export(self: DriverModel, handle: Any, kind: Any, flags: int) -> Any:
        exports.append(handle)
        if len(exports) == wire.MAX_FDS + 3:  # in the second batch
            return self._err(2)  # CUDA_ERROR_OUT_OF_MEMORY
        return real_export(self, handle, kind, flags)

    monkeypatch.setattr(DriverModel, "_cuMemExportToShareableHandle", failing_export)
    sender_books = model.live()
    with pytest.raises(cuda.CudaOutOfMemory, match="cuMemExportToShareableHandle"):
        cuda.send_device_memory(pipe[0], provider, address + offset, nbytes)
    with pytest.raises(ProtocolError, match=f"gave up after {wire.MAX_FDS} of {MANY} chunks.*CudaOutOfMemory"):
        cuda.recv_device_memory(pipe[1], timeout=10)
    assert model.live() == sender_books  # the first batch was imported and mapped, then all let go
    provider.free(handle)
    provider.close()


def test_a_continuation_that_cannot_be_sent_is_an_abort_not_a_silence(
        model: DriverModel, pipe: tuple[wire.Connection, wire.Connection], monkeypatch: pytest.MonkeyPatch) -> None:
    # Fds in flight past the sender's RLIMIT_NOFILE fail a send with ETOOMANYREFS (FdLimitError):
    # the receiver, holding the first batch, must hear that rather than wait out its timeout.
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle, offset, nbytes = _filled_block(provider, 3)
    mine, theirs = pipe
    real_send, sends = mine.send, []

    def send(header: dict[str, Any], fds: Any = (), timeout: float | None = None) -> None:
        sends.append(header.get("kind"))
        if len(sends) == 2:
            raise FdLimitError(errno.ETOOMANYREFS, "too many fds are in flight on this socket")
        real_send(header, fds, timeout)

    monkeypatch.setattr(mine, "send", send)
    with pytest.raises(FdLimitError):
        cuda.send_device_memory(mine, provider, address + offset, nbytes)
    assert sends == [_ipc.KIND, _ipc.KIND_MORE, _ipc.KIND_ABORT]
    with pytest.raises(ProtocolError, match=f"gave up after {wire.MAX_FDS} of {MANY} chunks.*FdLimitError"):
        cuda.recv_device_memory(theirs, timeout=30)
    provider.free(handle)
    provider.close()


def _then(header: dict[str, Any] | None, fds: slice) -> Callable[[wire.Connection, list[Any]], None]:
    """Return a step that sends ``header`` with the chunk fds ``fds`` (None: closes the connection)."""
    def step(conn: wire.Connection, chunk_fds: list[Any]) -> None:
        if header is None:
            conn.close()
        else:
            conn.send(header, chunk_fds[fds])
    return step


MORE, ABORT = _ipc.KIND_MORE, _ipc.KIND_ABORT


@pytest.mark.parametrize("step, error, match", [
    (_then({"kind": MORE, "index": 2}, slice(1, 2)), ProtocolError, "index 1 and 1 fds"),
    (_then({"kind": MORE, "index": True}, slice(1, 2)), ProtocolError, "index 1"),
    (_then({"kind": MORE, "index": 1}, slice(1, 3)), ProtocolError, "with 2 fds"),  # more fds than the batch
    (_then({"kind": MORE, "index": 1}, slice(1, 1)), ProtocolError, "with 0 fds"),
    (_then({"kind": "shmshare.cuda.memory"}, slice(1, 2)), ProtocolError, "expected 'shmshare.cuda.memory.fds'"),
    (_then({"kind": ABORT, "index": 1, "error": "boom"}, slice(0, 0)), ProtocolError, "gave up after 1 of 3.*boom"),
    (_then(None, slice(0, 0)), PeerDied, "after 1 of 3 chunks"),
    (lambda conn, fds: None, ShmshareTimeout, "after 1 of 3 chunks"),  # a sender that stops talking
], ids=["wrong-index", "bool-index", "too-many-fds", "too-few-fds", "other-message", "abort", "closed", "silent"])
def test_a_sequence_that_is_not_the_announced_one_fails_and_keeps_nothing(
        model: DriverModel, pipe: tuple[wire.Connection, wire.Connection],
        step: Callable[[wire.Connection, list[Any]], None], error: type[Exception], match: str) -> None:
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle = provider.allocate(3 * CHUNK)
    _, raw = provider.range_of(address)[0].export(0, 3 * CHUNK)
    chunk_fds = [wire.Fd(fd) for fd in raw]
    header = {"kind": _ipc.KIND, "version": _ipc.VERSION, "device": 0, "device_uuid": provider.context.uuid(),
              "chunk_size": CHUNK, "nchunks": 3, "batch": 1, "offset": 0, "nbytes": 3 * CHUNK, "meta": {}}
    pipe[0].send(header, chunk_fds[:1])
    step(pipe[0], chunk_fds)
    for fd in chunk_fds:
        fd.close()
    sender_books = model.live()
    with pytest.raises(error, match=match):
        cuda.recv_device_memory(pipe[1], timeout=0.5)
    assert model.live() == sender_books  # the chunk imported from the header is unmapped and released
    provider.free(handle)
    provider.close()


def test_a_block_of_exactly_one_batch_is_one_message(model: DriverModel,
                                                     pipe: tuple[wire.Connection, wire.Connection]) -> None:
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle = provider.allocate(wire.MAX_FDS * CHUNK)
    cuda.send_device_memory(pipe[0], provider, address, wire.MAX_FDS * CHUNK)
    assert pipe[0].statistics().frames_sent == 1 and pipe[0].statistics().fds_sent == wire.MAX_FDS
    with cuda.recv_device_memory(pipe[1], timeout=10) as imported:
        assert imported.nbytes == wire.MAX_FDS * CHUNK
    gc.collect()
    cuda.finish_releases()  # the finalizer only queued the unmap (Note [Deferred releases])
    provider.free(handle)
    provider.close()
    assert not model.mappings and not model.reservations
