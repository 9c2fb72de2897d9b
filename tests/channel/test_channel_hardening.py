"""The receiver against hostile senders, and the errors that must point the right way (issue 9)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import multiprocessing as mp
import os
import resource
import signal
import socket
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

import shmshare
from shmshare import FdLimitError, PeerDied, PoolExhausted, ProtocolError, Receiver, wire
from shmshare._procfs import shm_mappings
from shmshare.tensors import ArrayDesc
from shmshare.testing.transport_contract import sealed_memfd


@contextlib.contextmanager
def _full_fd_table(free: int = 0) -> Iterator[None]:
    """Fill every fd slot (holes below the limit included) but `free`; undo it after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
        try:
            while True:
                filler.append(os.dup(0))
        except OSError:
            pass
        for _ in range(free):
            os.close(filler.pop())
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _raw_sender(**rx_kw):
    a, b = wire.pipe()
    return a, Receiver([b], **rx_kw)


def _batch_on(seg_id: int, size: int, n: int = 4) -> dict:
    tree = msgpack.packb(ArrayDesc(seg_id, 1, 0, "<u1", (n,), (1,)).pack())
    return {"k": "m", "s": [[seg_id, size, False]], "b": tree}


def test_a_truncatable_regular_file_is_refused_naming_what_it_is(tmp_path):
    # Defect 1: a regular file passed F_GET_SEALS's failure as "trusted POSIX shm"; its sender
    # truncated it and the receiver's next read was SIGBUS.
    fd = os.open(tmp_path, os.O_TMPFILE | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 20)
    a, rx = _raw_sender(trust_unsealed=True)  # even a trusting receiver maps only shared memory
    a.send(_batch_on(9, 1 << 20), fds=[fd])
    with pytest.raises(ProtocolError, match=r"a regular file on .* truncated"):
        rx.recv(timeout=5)
    os.close(fd)
    a.close()
    rx.close()


@pytest.mark.parametrize("kind", ["pipe", "socket", "directory", "character device",
                                  "anonymous inode"])
def test_fds_that_are_not_files_are_refused_by_name(kind, tmp_path):
    made = []
    if kind == "pipe":
        r, w = os.pipe()
        made, fd = [r, w], r
    elif kind == "socket":
        s1, s2 = socket.socketpair()
        made, fd = [s1.detach(), s2.detach()], None
        fd = made[0]
    elif kind == "directory":
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        made = [fd]
    elif kind == "character device":
        fd = os.open("/dev/zero", os.O_RDWR)
        made = [fd]
    else:
        fd = os.eventfd(0)
        made = [fd]
    a, rx = _raw_sender()
    a.send(_batch_on(9, 4096), fds=[fd])
    with pytest.raises(ProtocolError, match=f"sent an? {kind}"):
        rx.recv(timeout=5)
    for f in made:
        os.close(f)
    a.close()
    rx.close()


@pytest.mark.parametrize("how", ["channel", "listen"])
def test_the_posix_backend_delivers_to_a_trusting_receiver(how, tmp_path):
    # Defect 2: F_GET_SEALS succeeds on tmpfs (F_SEAL_SEAL), so every POSIX segment was refused.
    if how == "channel":
        tx, rx = shmshare.channel(backend="posix")
    else:
        rx = shmshare.listen(tmp_path / "sock", trust_unsealed=True)
        tx = shmshare.connect(rx.path, backend="posix")
    x = np.arange(1 << 16, dtype=np.float32)
    tx.send({"x": x})
    got = rx.recv(timeout=5)
    assert np.array_equal(got["x"], x)
    assert any("/dev/shm/shmshare_" in m.path for m in shm_mappings(contains="shmshare_"))
    del got
    tx.close()
    rx.close()


def test_a_receiver_that_does_not_trust_refuses_posix_senders(tmp_path):
    rx = shmshare.listen(tmp_path / "sock")
    tx = shmshare.connect(rx.path, backend="posix")
    tx.send(np.ones(64))
    with pytest.raises(ProtocolError, match="trust_unsealed=True"):
        rx.recv(timeout=5)
    with pytest.raises(ProtocolError, match=r"refused a batch .*trust_unsealed"):
        for _ in range(50):  # the sender is told why
            tx.send(np.ones(64), timeout=5)
    tx.close()
    rx.close()


def _maps_of(address: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.split()[1]
    raise AssertionError(f"address {address:#x} is not mapped")


@pytest.mark.parametrize("writable", [False, True])
def test_the_receiver_maps_read_only_unless_asked(writable):
    # Defect 7: the mapping was rw-s whatever `writable` said; a receiver wrote into the
    # sender's live empty() array.
    tx, rx = shmshare.channel(writable=writable)
    arr = tx.empty(4096, np.uint8)
    arr[:] = 7
    tx.send(arr)
    got = rx.recv(timeout=5)
    perms = _maps_of(got.__array_interface__["data"][0])
    assert perms == ("rw-s" if writable else "r--s")
    if writable:
        got[0] = 1
        assert arr[0] == 1  # shared memory: the sender sees it (documented)
    else:
        with pytest.raises(ValueError, match="read-only"):
            got[0] = 1
        assert arr[0] == 7
    del got, arr
    tx.close()
    rx.close()


def test_torch_tensors_from_a_read_only_receiver_are_private_copies():
    torch = pytest.importorskip("torch")
    tx, rx = shmshare.channel()
    t = tx.empty(16, torch.float32)
    t.fill_(3)
    tx.send(t)
    got = rx.recv(timeout=5)
    got.add_(1)  # no SIGSEGV: the copy is ours
    assert t[0].item() == 3 and got[0].item() == 4
    del got, t
    tx.close()
    rx.close()


def test_caps_per_peer_refuse_and_tell_the_sender(tmp_path):
    # Defect 8: one connection reserved ~128 TiB of address space and 65,216 mappings.
    rx = shmshare.listen(tmp_path / "sock", max_peer_segments=3)
    other = shmshare.connect(rx.path)
    other.send(np.ones(4))
    assert rx.recv(timeout=5)[0] == 1  # a well-behaved sender, served before and after
    a = wire.connect(rx.path)
    segs = [shmshare.Segment.create(4096) for _ in range(4)]
    for i, seg in enumerate(segs, start=1):
        a.send(_batch_on(100 + i, 4096), fds=[seg])
    for _ in range(3):
        assert rx.recv(timeout=5).shape == (4,)
    with pytest.raises(ProtocolError, match="max_peer_segments=3"):
        rx.recv(timeout=5)
    got, _ = a.recv(timeout=5)
    while got["k"] == "r":  # releases of the arrays it got may come first
        got, _ = a.recv(timeout=5)
    assert got["k"] == "e" and "max_peer_segments=3" in got["w"]
    other.send(np.full(4, 2.0))
    assert rx.recv(timeout=5)[0] == 2
    for seg in segs:
        seg.close()
    a.close()
    other.close()
    rx.close()


def test_address_space_cap_refuses_a_huge_expandable_announcement():
    a, rx = _raw_sender(max_peer_bytes=1 << 30)
    seg = shmshare.Segment.create(4096, growable=True)
    tree = msgpack.packb(ArrayDesc(0, 0, 0, "<u1", (0,), (1,)).pack())
    a.send({"k": "m", "s": [[5, 1 << 40, True]], "b": tree}, fds=[seg])
    with pytest.raises(ProtocolError, match="max_peer_bytes=1073741824"):
        rx.recv(timeout=5)
    seg.close()
    a.close()
    rx.close()


def _fork_child_sends_then_dies(tx):
    tx.send(np.ones(4))
    os.kill(os.getpid(), signal.SIGKILL)


def test_peer_died_names_the_sender_not_the_receiver_after_fork():
    # Defect 9: after channel() + fork, PeerDied named the receiver's own pid.
    tx, rx = shmshare.channel()
    p = mp.get_context("fork").Process(target=_fork_child_sends_then_dies, args=(tx,))
    p.start()
    try:
        tx.close()
        rx.recv(timeout=10)
        with pytest.raises(PeerDied) as err:
            rx.recv(timeout=10)
        assert f"pid {p.pid}" in str(err.value) and f"pid {os.getpid()}" not in str(err.value)
    finally:
        p.join(10)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    rx.close()


def test_a_local_mapping_failure_is_a_segment_error_not_the_peers_fault():
    # Defect 9: ENOMEM under RLIMIT_AS in the receiver's own mmap was labelled ProtocolError.
    tx, rx = shmshare.channel()
    tx.send(np.ones(64 << 20, dtype=np.uint8))  # the sender's 64 MiB segment is mapped here...
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    try:
        resource.setrlimit(resource.RLIMIT_AS, (vm + (8 << 20), hard))
        with pytest.raises(shmshare.SegmentError, match="local limit, not the sender"):
            rx.recv(timeout=5)  # ...but the receiver (this process) cannot map it again
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    tx.close()
    rx.close()


def test_a_closed_sender_gives_back_a_segment_when_its_last_view_dies():
    # Defect 10: an empty() array that died after close() kept a fd and a mapping until the
    # Sender object was collected.
    tx, rx = shmshare.channel()
    arr = tx.empty(1 << 20, np.uint8)
    tx.close()
    before = len(shm_mappings(contains=f"shmshare_{os.getpid()}_"))
    assert before >= 1
    del arr
    assert len(shm_mappings(contains=f"shmshare_{os.getpid()}_")) == before - 1
    assert tx is not None  # the sender object is still alive
    rx.close()


def test_a_sender_collected_in_a_cycle_says_goodbye():
    # Finalizers never lie: the Connection's finalizer used to close the socket first, so the
    # receiver reported a clean exit as "the sender died".
    tx, rx = shmshare.channel()
    tx.send(np.ones(3))
    cycle = [tx]
    cycle.append(cycle)
    del tx, cycle
    with pytest.warns(ResourceWarning, match="unclosed"):
        gc.collect()
    assert rx.recv(timeout=5)[0] == 1
    with pytest.raises(PeerDied, match="closed the channel"):
        rx.recv(timeout=5)
    rx.close()


def test_a_full_pool_host_says_dev_shm_not_raise_limit(monkeypatch):
    # Defect 9: a full /dev/shm read "pool of 1073741824 bytes ... raise limit=".
    from shmshare.memory import _shm

    def full(*a, **k):
        raise shmshare.SegmentError(28, "cannot reserve 2097152 bytes for a posix segment: "
                                        "posix_fallocate: No space left on device. /dev/shm has 0 "
                                        "of 4194304 bytes free")

    tx, rx = shmshare.channel(backend="posix")
    monkeypatch.setattr(_shm.Segment, "create", full)
    with pytest.raises(PoolExhausted, match="/dev/shm has 0") as err:
        tx.send(np.ones(64), timeout=1)
    assert "raise limit" not in str(err.value)
    tx.close()
    rx.close()


def test_accept_under_a_full_fd_table_serves_connected_senders(tmp_path):
    # Defect 4: EMFILE escaped accept(); recv(timeout=1) raised it 429,095 times in 3 s.
    rx = shmshare.listen(tmp_path / "sock")
    tx = shmshare.connect(rx.path)
    tx.send(np.ones(2))
    assert rx.recv(timeout=5)[0] == 1
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    for s in idle:
        s.connect(rx.path)
    raised = delivered = 0
    with _full_fd_table():
        for i in range(20):  # connected senders are served: what they send comes first
            tx.send(np.full(2, float(i)))
            try:
                got = rx.recv(timeout=1)
            except FdLimitError:
                got = rx.recv(timeout=1)
            assert got[0] == i
            delivered += 1
        for _ in range(10):  # nothing to deliver: each wait says why at most once, no spinning
            try:
                rx.recv(timeout=0.2)
            except FdLimitError as exc:
                raised += 1
                assert "RLIMIT_NOFILE" in str(exc) and "-1 fds" not in str(exc)
            except shmshare.ShmshareTimeout:
                pass
        tx.send(np.full(2, 99.0))
        try:
            got = rx.recv(timeout=1)
        except FdLimitError:
            got = rx.recv(timeout=1)
        assert got[0] == 99
    assert delivered == 20 and 1 <= raised <= 10, raised
    for s in idle:
        s.close()
    tx.close()
    rx.close()


def test_fcntl_seals_of_what_a_sender_sends():
    tx, rx = shmshare.channel()
    seg = tx.allocator.provider  # the pool's provider: every segment it sends is sealed
    tx.send(np.ones(4))
    rx.recv(timeout=5)
    for rec in seg.segments.values():
        assert fcntl.fcntl(rec.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    tx.close()
    rx.close()


def test_a_receiver_spends_no_fd_of_its_own_on_a_classic_segment():
    # Defect 5: Segment.from_fd dup'ed every received fd, so a batch of K new segments needed
    # K + 1 free slots; under a low RLIMIT_NOFILE that was "SegmentError: dup() failed".
    tx, rx = shmshare.channel()
    k = 3
    tx.send([np.full(12 << 20, i, dtype=np.uint8) for i in range(k)])  # a segment each
    with _full_fd_table(free=k):  # room for exactly the k fds the kernel installs, not one more
        got = rx.recv(timeout=5)
    assert [int(a[0]) for a in got] == list(range(k))
    from shmshare._procfs import fds

    senders = {r.fd for r in tx.allocator.provider.segments.values()}
    assert not [n for n, t in fds().items() if "memfd:shmshare" in t and n not in senders]
    del got
    tx.close()
    rx.close()


def test_releases_wait_for_room_on_a_full_socket_and_are_never_dropped():
    # Found by review: a release frame that met a full socket was dropped (ShmshareTimeout is an
    # OSError, and the OSError clause came first), so the sender counted those arrays as lent
    # for good and ended in PoolExhausted while the receiver held nothing.
    tx, rx = shmshare.channel(limit=64 << 20)
    n = 1500
    kept = []
    for _ in range(n):
        tx.send(np.ones(4096, np.uint8), timeout=5)
        kept.append(rx.recv(timeout=5))
    while kept:  # the sender reads nothing meanwhile; one release frame each
        kept.pop()
        rx._flush()
    for _ in range(200):  # bounded: the sender reads, the receiver sends the rest
        tx.poll_releases()
        rx._flush()
        if not tx.statistics().leases_out:
            break
    assert tx.statistics().leases_out == 0
    tx.close()
    rx.close()


def _sealed_memfd(size: int, *, fallocate: bool = True, seals: int = fcntl.F_SEAL_SHRINK) -> int:
    return sealed_memfd(size, seals, fallocate=fallocate)


def test_a_segment_with_holes_is_refused():
    # Found by review: a sealed but sparse memfd passed every check; reading its holes
    # allocated pages charged to the receiver (OOM-killed in a 64 MiB cgroup), and a sparse
    # POSIX file on a full tmpfs was SIGBUS for a trusting receiver.
    fd = _sealed_memfd(1 << 20, fallocate=False)
    a, rx = _raw_sender()
    a.send(_batch_on(9, 1 << 20), fds=[fd])
    with pytest.raises(ProtocolError, match="with holes: 0 of the 1048576 bytes"):
        rx.recv(timeout=5)
    os.close(fd)
    a.close()
    rx.close()


def test_a_write_sealed_memfd_is_refused_by_a_writable_receiver():
    fd = _sealed_memfd(4096, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    a, rx = _raw_sender(writable=True)
    a.send(_batch_on(9, 4096), fds=[fd])
    with pytest.raises(ProtocolError, match="sealed against writes"):
        rx.recv(timeout=5)
    os.close(fd)
    a.close()
    rx.close()


def test_a_dropped_segment_counts_against_the_caps_while_its_arrays_live():
    # Found by review: DROP took a segment's charge off at once, so a peer that pinned each
    # segment with one small array and dropped it mapped without bound.
    a, rx = _raw_sender(max_peer_segments=3)
    kept, fds = [], []
    for i in range(1, 4):
        fds.append(_sealed_memfd(4096))
        a.send(_batch_on(100 + i, 4096), fds=[fds[-1]])
        kept.append(rx.recv(timeout=5))
        a.send({"k": "m", "d": [100 + i], "b": msgpack.packb(None)})  # dropped, array kept
        assert rx.recv(timeout=5) is None
    fds.append(_sealed_memfd(4096))
    a.send(_batch_on(104, 4096), fds=[fds[-1]])
    with pytest.raises(ProtocolError, match="max_peer_segments=3"):
        rx.recv(timeout=5)
    assert len(rx._caps.uncharged) == 0
    del kept
    gc.collect()
    assert len(rx._caps.uncharged) == 3  # the mappings went with the arrays: their charges come off
    a.close()
    for fd in fds:
        os.close(fd)
    rx.close()


def test_a_receiver_keeps_at_most_max_peers_and_takes_the_next_when_one_leaves(tmp_path):
    rx = shmshare.listen(tmp_path / "sock", max_peers=1)
    first = shmshare.connect(rx.path)
    first.send(np.full(2, 1.0))
    assert rx.recv(timeout=5)[0] == 1
    second = shmshare.connect(rx.path)  # queued in the backlog
    second.send(np.full(2, 2.0))
    with pytest.raises(shmshare.ShmshareTimeout):
        rx.recv(timeout=0.5)
    first.close()
    assert rx.recv(timeout=5)[0] == 2
    second.close()
    rx.close()


def test_a_sender_that_closes_without_sending_has_not_died():
    # Found by review: the goodbye went only from a process that had sent, so a producer with
    # nothing to produce made its consumer's loop raise PeerDied.
    tx, rx = shmshare.channel()
    tx.close()
    assert list(rx) == []
    rx.close()


def test_a_parent_that_forked_its_sender_away_says_no_goodbye():
    tx, rx = shmshare.channel()
    p = mp.get_context("fork").Process(target=_fork_child_sends_then_dies, args=(tx,))
    p.start()
    try:
        tx.close()  # the child uses it: no goodbye from here
        assert rx.recv(timeout=10)[0] == 1
        with pytest.raises(PeerDied, match="died"):
            rx.recv(timeout=10)
    finally:
        p.join(10)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    rx.close()


@pytest.mark.parametrize("frame", [{"k": "r", "l": 5}, {"k": "r", "l": [[1]]}, b"\xc1", b""],
                         ids=["leases-not-a-list", "unhashable-lease", "garbage", "empty"])
def test_a_receiver_that_breaks_the_protocol_ends_the_connection_once(frame):
    # Found by review: a hostile receiver's malformed release made the next send() raise a
    # bare TypeError (or a ProtocolError about a frame it never asked for), and carried on.
    a, b = wire.pipe()
    tx = shmshare.Sender(a)
    tx.send(np.arange(64.0))
    b.recv(timeout=5)
    if isinstance(frame, dict):
        b.send(frame)
    else:
        b._sock.send(frame)
    for _ in range(3):
        with pytest.raises(ProtocolError, match="receiver broke the protocol"):
            tx.poll_releases()
            tx.send(np.arange(64.0), timeout=1)
    tx.close()
    b.close()


@pytest.mark.parametrize("make", ["channel", "listen"])
def test_making_ends_under_a_full_fd_table_is_fd_limit_error_and_leaves_nothing(make, tmp_path):
    # Found by review: the receiver's wake pipe raised a bare OSError, and channel() left the
    # sender it had made unclosed.
    seen = set()
    for free in range(6):
        with _full_fd_table(free):
            try:
                ends = shmshare.channel() if make == "channel" else (
                    shmshare.listen(tmp_path / "d" / "sock"),)
            except FdLimitError as exc:
                seen.add("FdLimitError")
                assert "RLIMIT_NOFILE" in str(exc)
            else:
                seen.add("ok")
                for end in ends:
                    end.close()
        assert not os.path.exists(tmp_path / "d"), free
    assert seen == {"FdLimitError", "ok"}
