"""The seed's fd-sharing walk-through, proven step by step with real processes.

At every step of the parent/child diagram in seed-notes ("FD共享流程") we read
/proc/<pid>/fd, /proc/<pid>/maps and /dev/shm of both processes and assert
who holds the object: create -> unlink -> send -> child maps -> parent closes
-> child closes -> gone. Then the failure cases: either side SIGKILLed, and
a message whose fds are never received.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from shmshare import Flags, PeerDied, Segment, wire
from shmshare._procfs import shm_mappings, shm_names
from shmshare.testing import pattern, start_child

from .devshm_helpers import names_of
from .reliability.helpers import shmem_bytes, wait_shmem_below

BACKENDS = ["memfd", "posix"]
MiB = 1 << 20


def refs(pid: int | str, dev_ino: tuple[int, int]) -> tuple[int, int]:
    """Return (fds, mappings) that process `pid` holds on the object `dev_ino`."""
    nfd = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        nfd += (st.st_dev, st.st_ino) == dev_ino
    nmap = sum(m.inode == dev_ino[1] for m in shm_mappings(pid))
    return nfd, nmap


def agent(conn: wire.Connection, other_end: wire.Connection) -> None:
    """The child: obey one command at a time, answer each, and never outlive its parent's wait."""
    other_end.close()
    held: list[wire.Fd] = []
    seg = None
    try:
        while True:
            cmd, fds = conn.recv(timeout=60)
            op, reply = cmd["op"], {"ok": True}
            if op == "take_fd":
                held.extend(fds)
            elif op == "map":
                seg = Segment.from_fd(held[0].fileno())  # an int is dup'ed, as in the seed
            elif op == "close_received":
                held.pop().close()
            elif op == "check":
                got = seg.view(np.uint64, seg.size // 8)
                reply["match"] = bool(np.array_equal(got, pattern(cmd["seed"], seg.size // 8, np.uint64)))
                del got
            elif op == "close":
                seg.close()
            elif op == "produce":
                seg = Segment.create(cmd["size"], backend=cmd["backend"])
                seg.view(np.uint64, cmd["size"] // 8)[:] = pattern(cmd["seed"], cmd["size"] // 8, np.uint64)
                conn.send({"ok": True}, fds=[seg])
                continue
            elif op == "hang":
                conn.send(reply)
                time.sleep(60)  # bounded: the test kills it long before
                continue
            elif op == "exit":
                conn.send(reply)
                break
            conn.send(reply)
    finally:
        conn.close()
        os._exit(0)


class Walk:
    """The parent side: a forked agent and the commands to drive it."""

    def __init__(self) -> None:
        self.conn, child_end = wire.pipe()
        self.child = start_child(agent, child_end, self.conn)  # forked before any segment exists
        child_end.close()

    def do(self, op: str, fds=(), **kw):
        self.conn.send({"op": op, **kw}, fds=fds)
        reply, got = self.conn.recv(timeout=30)
        assert reply["ok"], reply
        return reply, got

    def close(self) -> None:
        self.child.stop()
        self.conn.close()


@pytest.fixture
def walk():
    w = Walk()
    yield w
    w.close()


@pytest.mark.alone  # reads the host's Shmem before and after
@pytest.mark.parametrize("size", [4 * MiB, 256 * MiB], ids=["4MiB", "256MiB"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_walkthrough(walk, backend, size):
    me, kid = os.getpid(), walk.child.pid
    shmem0 = shmem_bytes()

    # create: shm_open(O_CREAT|O_EXCL) / memfd_create, ftruncate, mmap -> fd + mapping
    flags = Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.KEEPFD  # UNLINK done by hand below
    seg = Segment.create(size, flags, backend=backend)
    st = os.fstat(seg.fd)
    obj = (st.st_dev, st.st_ino)
    seg.view(np.uint64, size // 8)[:] = pattern(7, size // 8, np.uint64)
    assert refs(me, obj) == (1, 1) and refs(kid, obj) == (0, 0)
    if backend == "posix":
        assert seg.name[1:] in shm_names() and st.st_nlink == 1
    if size >= 256 * MiB:
        assert shmem_bytes() - shmem0 >= 0.9 * size  # posix_fallocate reserved the pages

    # unlink: the name is gone (nlink 0), the inode lives on through fd + mapping
    seg.unlink()
    assert os.fstat(seg.fd).st_nlink == 0 and not shm_names(seg.name.lstrip("/"))
    assert refs(me, obj) == (1, 1)

    # sendmsg(SCM_RIGHTS): the child now holds its own fd
    walk.do("take_fd", fds=[seg])
    assert refs(kid, obj) == (1, 0) and refs(me, obj) == (1, 1)

    # child dups and mmaps (the dup is KEEPFD's fd), then closes the received tmp fd
    walk.do("map")
    assert refs(kid, obj) == (2, 1)
    walk.do("close_received")
    assert refs(kid, obj) == (1, 1)

    # ~MapAllocator in the parent: munmap + close -> only the child holds it
    seg.close()
    assert refs(me, obj) == (0, 0) and refs(kid, obj) == (1, 1)
    assert walk.do("check", seed=7)[0]["match"]

    # ~MapAllocator in the child: nothing holds it -> the kernel frees inode and pages
    walk.do("close")
    assert refs(kid, obj) == (0, 0) and refs(me, obj) == (0, 0)
    assert not names_of({me, kid})
    if size >= 256 * MiB:
        assert wait_shmem_below(shmem0 + size // 10, timeout=5.0) <= shmem0 + size // 10
    walk.do("exit")
    assert walk.child.join(10) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_producer_sigkilled_after_sending(walk, backend):
    size = 8 * MiB
    _, fds = walk.do("produce", size=size, backend=backend, seed=3)
    with fds[0] as fd:
        rx = Segment.from_fd(fd)
    walk.child.kill()
    assert walk.child.exitcode == -9
    assert not names_of({os.getpid(), walk.child.pid})  # UNLINK at creation: nothing named survives a crash
    arr = rx.view(np.uint64, size // 8)
    assert np.array_equal(arr, pattern(3, size // 8, np.uint64))  # the mapping, not the producer, keeps the pages
    arr[:] = 0  # and it is still ours to write
    del arr
    with pytest.raises(PeerDied):
        walk.conn.recv(timeout=10)
    rx.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_consumer_sigkilled_leaves_producer_unaffected(walk, backend):
    size = 8 * MiB
    seg = Segment.create(size, backend=backend)
    obj = (os.fstat(seg.fd).st_dev, os.fstat(seg.fd).st_ino)
    seg.view(np.uint64, size // 8)[:] = pattern(5, size // 8, np.uint64)
    walk.do("take_fd", fds=[seg])
    walk.do("map")
    walk.child.kill()
    assert refs(os.getpid(), obj) == (1, 1)
    view = seg.view(np.uint64, size // 8)
    assert np.array_equal(view, pattern(5, size // 8, np.uint64))
    view[:] = 1
    del view
    with pytest.raises(PeerDied):
        walk.conn.send({"op": "exit"})
    with pytest.raises(PeerDied):
        walk.conn.recv(timeout=10)
    seg.close()


@pytest.mark.alone  # reads the host's Shmem before and after
@pytest.mark.parametrize("backend", BACKENDS)
def test_fds_never_received_die_with_the_socket(backend):
    size = 64 * MiB
    shmem0 = shmem_bytes()
    a, b = wire.pipe()
    seg = Segment.create(size, backend=backend)
    a.send({"never": "received"}, fds=[seg, seg])
    seg.close()
    # only the message in flight holds the object now
    assert shmem_bytes() - shmem0 >= 0.9 * size
    a.close()
    b.close()
    assert wait_shmem_below(shmem0 + size // 4, timeout=5.0) <= shmem0 + size // 4


@pytest.mark.alone  # reads the host's Shmem before and after
@pytest.mark.parametrize("backend", BACKENDS)
def test_fds_sent_to_a_child_that_dies_before_receiving(walk, backend):
    size = 64 * MiB
    shmem0 = shmem_bytes()
    seg = Segment.create(size, backend=backend)
    walk.do("hang")  # the agent stops receiving...
    walk.conn.send({"op": "take_fd"}, fds=[seg])  # ...so this message stays in flight...
    walk.child.kill()  # ...until its receiver dies
    seg.close()
    walk.conn.close()
    assert wait_shmem_below(shmem0 + size // 4, timeout=5.0) <= shmem0 + size // 4
