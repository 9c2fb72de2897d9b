"""A seeded frame fuzzer against a ``listen()`` receiver that runs in a child.

Each case is one hostile connection: random bytes, valid msgpack of the
wrong shape, hostile array descriptors, hostile fds of every kind,
oversized frames, too many fds. After each case the test's own good sender
sends a marker batch, which must arrive intact: the receiver keeps serving.
The receiver reads every byte of every array it is given, so an fd it
should have refused and that shrinks under it is a SIGBUS, seen as the
child's exit status. Failures name the seed and case (replay with
``-k "<category> and <seed>"``).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from shmshare import wire
from shmshare.testing import wait_until

from . import forge
from .helpers import fd_count
from .rxchild import ReceiverChild, receiver_child

SHORT_SEEDS = [1]
STRESS_SEEDS = list(range(100, 110))
SHORT_CASES, STRESS_CASES = 200, 2000
SEG = (12345 << 32) | 1  # the segment id our forged peers announce
SEG_SIZE = 1 << 16
ALLOWED = {"ProtocolError", "FdLimitError", "PeerDied", "PeerRefused"}  # what recv() may raise for junk


def _random_bytes(rng: random.Random, path: str) -> tuple[forge.Peer, bool, str]:
    peer = forge.Peer(path)
    if rng.random() < 0.5:
        peer.hello()
    data = rng.randbytes(rng.randint(1, 4000))
    peer.raw(data)
    return peer, True, f"{len(data)} bytes {data[:16]!r}..."



def _wrong_shape(rng: random.Random, path: str) -> tuple[forge.Peer, bool, str]:
    junk = b"\xc1" + rng.randbytes(rng.randint(0, 64))  # 0xc1 is never valid msgpack
    good_tree = forge.tree({"a": 1})
    shapes: list[tuple[Any, bool]] = [
        (rng.randint(-2**63, 2**64 - 1), True), ("a string", True), ({"k": "m"}, True),
        ([1, rng.random()], True), ([1, [1, 2, 3]], True), ([7, {}], True), ([1], True),
        ([1, {"k": rng.choice(["r", "q", "", 5, None])}], True),
        ([1, {"k": "m"}], True), ([1, {"k": "m", "b": rng.choice([5, "s", [], {}, None])}], True),
        ([1, {"k": "m", "b": junk}], True),
        ([1, forge.batch(new=rng.choice(["x", 5, [[1]], [[1, 2, 3, 4]], [["a", 1, False]]]),
                         tree_bytes=good_tree)], True),
        ([1, forge.batch(new=[[SEG, SEG_SIZE, False]], tree_bytes=good_tree)], True),  # no fd
        ([1, forge.batch(tree_bytes=good_tree, g=rng.choice([5, [[SEG, 0, 4096]], [["x"]]]))], True),
        ([1, forge.batch(tree_bytes=forge.tree(msgpack.ExtType(99, b"")))], True),
        ([0, {"version": "two"}], True), ([0, [1, 2]], True),
        ([1, forge.batch(tree_bytes=b"\x91" * 5000 + b"\xc0")], False),  # deep: refused or served
        ([1, forge.batch(tree_bytes=good_tree, d=[SEG])], False),  # dropping the unknown is harmless
    ]
    body, must_fail = rng.choice(shapes)
    peer = forge.Peer(path).hello()
    peer.raw(msgpack.packb(body, use_bin_type=True))
    return peer, must_fail, repr(body)[:200]


def _descriptors(rng: random.Random, path: str) -> tuple[forge.Peer, bool, str]:
    peer = forge.Peer(path).hello()
    fd = forge.sealed_memfd(SEG_SIZE, fill=3)
    try:
        peer.msg(forge.batch(new=[[SEG, SEG_SIZE, False]]), [fd])
    finally:
        os.close(fd)
    dtypes = [b"|u1", b"<f8", b">c16", b"|O", b"O", b"|V0", b"<U0", b"|S0", b"<M8[ns]", b"",
              b"garbage", b"D[('a', '|O')]", b"D[('a', '<f8', (1099511627776,))]",
              b"D" + b"[" * 3000, b"D[('', '|V0')]", rng.randbytes(8)]
    dims = [0, 1, 2, 7, SEG_SIZE, 2**31, 2**62, -1, -2**63]
    strides = [1, 8, 0, -1, -8, SEG_SIZE, 2**62, -2**62]
    ndim = rng.choice([0, 1, 2, 3, 4, 64, 65, 255])
    shape = [rng.choice(dims) for _ in range(min(ndim, 8))] + [1] * max(0, ndim - 8)
    st = [rng.choice(strides) for _ in range(len(shape))]
    seg = rng.choice([SEG, SEG, 0, SEG + 1, rng.getrandbits(64)])
    off = rng.choice([0, 1, SEG_SIZE - 1, SEG_SIZE, -1, -2**63, 2**62, rng.randint(0, SEG_SIZE)])
    ext = forge.raw_desc(seg, rng.getrandbits(64), off, rng.choice(dtypes), shape, st)
    if rng.random() < 0.2:  # a payload cut short or with bytes to spare
        data = ext.data[:rng.randint(0, len(ext.data))] if rng.random() < 0.5 else ext.data + b"\0"
        ext = msgpack.ExtType(ext.code, data)
    peer.msg(forge.batch(tree_bytes=forge.tree({"x": ext, "y": [ext, (1, ext)]})))
    return peer, False, f"desc {ext!r:.200}"  # some of these describe a valid array: refused or served, never a crash


def _growth(rng: random.Random, path: str) -> tuple[forge.Peer, bool, str]:
    """An expandable segment over a sealed memfd, then hostile growth ranges and arrays in them."""
    peer = forge.Peer(path).hello()
    size = rng.choice([SEG_SIZE, 2 * SEG_SIZE, 1 << 30, 1 << 40, 0, 4095])
    fd = forge.sealed_memfd(SEG_SIZE, fill=4)
    try:
        peer.msg(forge.batch(new=[[SEG, size, True]]), [fd])
    finally:
        os.close(fd)
    offs = [0, 1, 4096, SEG_SIZE - 4096, SEG_SIZE, -4096, 1 << 39]
    lens = [4096, SEG_SIZE, 2 * SEG_SIZE, 0, -1, 4095, 1 << 40]
    grow = [[rng.choice([SEG, SEG + 1]), rng.choice(offs), rng.choice(lens)]
            for _ in range(rng.randint(1, 3))]
    off, n = rng.choice(offs[:5]), rng.choice(lens[:4])
    peer.msg(forge.batch(tree_bytes=forge.tree({"x": forge.desc(SEG, max(n, 0), max(off, 0))}),
                         g=grow))
    return peer, False, f"expandable of {size} bytes, growth {grow}, array [{off}, +{n})"


def _oversized(rng: random.Random, path: str) -> tuple[forge.Peer, bool, str]:
    peer = forge.Peer(path).hello()
    size = rng.randint(wire.MAX_FRAME + 1, 4 * wire.MAX_FRAME)
    frame = msgpack.packb([1, forge.batch(pad=b"\0" * size)], use_bin_type=True)
    fds = [forge.sealed_memfd(4096)] if rng.random() < 0.5 else []
    try:
        peer.raw(frame, fds)
    finally:
        for fd in fds:
            os.close(fd)
    return peer, True, f"frame of {len(frame)} bytes with {len(fds)} fds"


def _too_many_fds(rng: random.Random, path: str) -> tuple[forge.Peer, bool, str]:
    peer = forge.Peer(path).hello()
    n = rng.choice([wire.MAX_FDS + 1, 100, 253])
    fd = forge.sealed_memfd(4096)
    try:
        new = [[SEG + i, 4096, False] for i in range(n)]
        peer.msg(forge.batch(new=new), [fd] * n)
    finally:
        os.close(fd)
    return peer, True, f"{n} fds"


CATEGORIES: dict[str, Callable[[random.Random, str], tuple[forge.Peer, bool, str]]] = {
    "random_bytes": _random_bytes, "wrong_shape": _wrong_shape, "descriptors": _descriptors,
    "growth": _growth,
    "oversized": _oversized, "too_many_fds": _too_many_fds,
}


def run_fuzz(category: str, seed: int, cases: int) -> None:
    make = CATEGORIES[category]
    rng = random.Random(seed)
    where = f"category={category} seed={seed}"
    with receiver_child(max_reports=10 * cases) as rc:
        rc.connect_good()
        base_fds = fd_count(rc.pid)
        for case in range(cases):
            at = f"{where} case={case}"
            try:
                peer, must_fail, what = make(rng, rc.path)
                at += f" ({what})"
                try:
                    if must_fail:
                        assert peer.dropped(10), f"{at}: the receiver kept a hostile connection"
                    errors = rc.marker(case)
                finally:
                    peer.close()
                if must_fail:
                    assert errors, f"{at}: recv() raised nothing for a hostile frame"
                _check_kinds(errors, at)
            except AssertionError as exc:
                raise AssertionError(str(exc) if at in str(exc) else f"{at}: {exc}") from None
        rc.marker(cases)
        wait_until(lambda: fd_count(rc.pid) <= base_fds, lambda: (
            f"{where}: the receiver holds {fd_count(rc.pid) - base_fds} fds more than before "
            f"the hostile peers (fds of refused frames leaked)"), 10)
        bye = rc.finish()
        _check_kinds(rc.errors, where)
        assert bye["raised"] >= 1 or category == "descriptors", f"{where}: nothing was refused"


def _check_kinds(errors: list[dict[str, Any]], at: str) -> None:
    for e in errors:
        assert e["type"] in ALLOWED, f"{at}: recv() raised {e['type']}: {e['msg']}"
        assert "-1 fds" not in e["msg"], f"{at}: {e['msg']}"


@pytest.mark.parametrize("seed", SHORT_SEEDS)
@pytest.mark.parametrize("category", list(CATEGORIES))
def test_fuzz_short(category: str, seed: int) -> None:
    run_fuzz(category, seed, SHORT_CASES)


@pytest.mark.stress
@pytest.mark.parametrize("seed", STRESS_SEEDS)
@pytest.mark.parametrize("category", list(CATEGORIES))
def test_fuzz_stress(category: str, seed: int) -> None:
    run_fuzz(category, seed, STRESS_CASES)


# -- hostile fds: each kind refused by name, the connection dropped, never a SIGBUS ---------

def _announce_then_read(rc: ReceiverChild, kind: str, expandable: bool = False) -> forge.Peer:
    """Announce a segment over a hostile fd with an array in it; if the receiver takes it,
    shrink the file and send another array over it (a receiver that mapped it: SIGBUS)."""
    fd, owned = forge.hostile_fd(kind, SEG_SIZE)
    peer = forge.Peer(rc.path).hello()
    try:
        peer.msg(forge.batch(new=[[SEG, SEG_SIZE, expandable]],
                             tree_bytes=forge.tree({"x": forge.desc(SEG, SEG_SIZE)})), [fd])
        ev = rc.kid.event(20)
        if ev["ev"] == "error":
            rc.errors.append(ev)
        else:  # taken in: now make it bite
            rc.foreign.append(ev)
            if kind in forge.SHRINKABLE:
                os.ftruncate(fd, 0)
            peer.msg(forge.batch(tree_bytes=forge.tree({"x": forge.desc(SEG, SEG_SIZE)})))
    except OSError:
        pass  # the receiver dropped us already
    except BaseException:
        peer.close()
        raise
    finally:
        for f in owned:
            os.close(f)
    return peer


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
@pytest.mark.parametrize("kind", list(forge.HOSTILE_FDS))
def test_hostile_fd_is_refused_by_name(kind: str, expandable: bool) -> None:
    with receiver_child() as rc:
        rc.connect_good()
        peer = _announce_then_read(rc, kind, expandable)
        try:
            assert peer.dropped(10), f"{kind}: the connection of the peer that sent it was kept"
            rc.marker(0)
            errors = list(rc.errors)  # all of this test's (marker() files them there too)
        finally:
            peer.close()
        assert [e["type"] for e in errors] == ["ProtocolError"], f"{kind}: {errors}"
        assert re.search(forge.HOSTILE_FDS[kind], errors[0]["msg"]), (
            f"{kind}: the refusal does not say what the fd is: {errors[0]['msg']}")
        assert not rc.foreign, f"{kind}: an array over it was delivered"
        rc.finish()


@pytest.mark.parametrize("trust", [False, True], ids=["sealed_memfd", "posix_trusted"])
def test_what_cannot_shrink_is_served(trust: bool) -> None:
    """The controls: a sealed memfd always, and an unsealed POSIX file under trust_unsealed."""
    kind = "posix_unsealed" if trust else "memfd_sealed"
    opts = {"listen_kw": {"trust_unsealed": True}} if trust else {}
    with receiver_child(**opts) as rc:
        rc.connect_good()
        fd, owned = forge.hostile_fd(kind, SEG_SIZE)
        os.pwrite(fd, b"\2" * SEG_SIZE, 0)
        peer = forge.Peer(rc.path).hello()
        try:
            peer.msg(forge.batch(new=[[SEG, SEG_SIZE, False]],
                                 tree_bytes=forge.tree({"x": forge.desc(SEG, SEG_SIZE)})), [fd])
            got = rc.next_foreign()
            errors = rc.marker(0)
        finally:
            for f in owned:
                os.close(f)
            peer.close()
        assert not errors and not rc.errors, rc.errors
        assert got["sum"] == 2 * SEG_SIZE, got
        rc.finish()


@pytest.mark.parametrize("first", [True, False], ids=["first_hello", "later_hello"])
def test_a_hello_of_another_version_drops_the_peer(first: bool) -> None:
    """Found by the fuzzer: PeerRefused escaped recv() and the peer stayed connected."""
    with receiver_child() as rc:
        rc.connect_good()
        peer = forge.Peer(rc.path)
        try:
            if not first:
                peer.hello().msg({"k": "x"})
            peer.raw(msgpack.packb([0, {"version": 999, "pid": 1}], use_bin_type=True))
            assert peer.dropped(5), "the receiver kept a peer of another protocol version"
            rc.marker(0)
            errors = list(rc.errors)  # all of this test's (marker() files them there too)
        finally:
            peer.close()
        assert len(errors) == 1 and errors[0]["type"] in ("PeerRefused", "ProtocolError"), errors
        assert "version 999" in errors[0]["msg"], errors
        rc.finish()


@pytest.mark.parametrize("dtype", [b"|S0", b"<U0", b"|V0"])
def test_an_empty_descriptor_gets_no_memory(dtype: bytes) -> None:
    """Found by the fuzzer: segment 0 with a zero-size flexible dtype and shape (2**31,) made
    the receiver allocate 2 GiB, because np.empty turns S0 into S1 (numpy 2.x)."""
    import shmshare

    rx = shmshare.listen()
    peer = forge.Peer(rx.path).hello()
    try:
        peer.msg(forge.batch(tree_bytes=forge.tree({"x": forge.raw_desc(0, 1, 0, dtype,
                                                                        [1 << 20], [0])})))
        try:
            got = rx.recv(timeout=10)
        except shmshare.ProtocolError:
            return  # refused: also fine
        x = got["x"]
        assert x.nbytes == 0, f"{dtype!r}: the receiver allocated {x.nbytes} bytes ({x.dtype})"
    finally:
        peer.close()
        rx.close()
