"""The fd server against other users and hostile peers; handles against exhausted hosts."""

from __future__ import annotations

import gc
import os
import resource
import socket
import stat
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import shmshare.multiprocessing as smp
from shmshare import wire
from shmshare.multiprocessing import _client, _owner, _table
from shmshare.testing import kill

WAIT = 30.0


def _server_path() -> str:
    ForkingPickler.dumps(np.ones(1 << 12))  # starts the server
    ow = _owner.current_owner()
    assert ow is not None and ow.server is not None
    return ow.path


def test_the_socket_is_0600_in_a_0700_directory_removed_at_shutdown():
    path = _server_path()
    st, dst = os.stat(path), os.stat(os.path.dirname(path))
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(dst.st_mode) == 0o700 and dst.st_uid == os.getuid()
    smp.shutdown()
    assert not os.path.exists(os.path.dirname(path))


def _connect_as(uid: int, path: str, out) -> None:
    os.setgid(uid)
    os.setuid(uid)
    try:
        conn = wire.connect(path, timeout=5, allow_uids=[0])  # we would take root's answer
    except OSError as exc:
        out.put(("connect", exc.errno))
        return
    try:
        conn.send({"k": "t"})
        conn.recv(timeout=5)
        out.put(("served", None))
    except Exception as exc:  # noqa: BLE001
        out.put(("refused", type(exc).__name__))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child as another uid")
def test_another_uid_cannot_reach_the_socket_nor_be_served(tmp_path):
    import errno

    path = _server_path()
    ctx = smp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_connect_as, args=(65534, path, out))
    p.start()
    try:
        assert out.get(timeout=WAIT) == ("connect", errno.EACCES)  # the 0700 directory
        p.join(WAIT)
        # open the way on purpose: the server still checks the peer's uid
        d = os.path.dirname(path)
        os.chmod(d, 0o711)
        os.chmod(path, 0o666)
        p = ctx.Process(target=_connect_as, args=(65534, path, out))
        p.start()
        kind, _ = out.get(timeout=WAIT)
        assert kind == "refused"
        os.chmod(d, 0o700)
        os.chmod(path, 0o600)
        got = ForkingPickler.loads(ForkingPickler.dumps(np.full(1 << 12, 2.0)))  # still serving
        assert float(got[0]) == 2.0
    finally:
        p.join(WAIT)
        kill(p)


@pytest.mark.parametrize("frame", [b"\xc1garbage", b"\x80\x04\x95" + b"cos\nsystem\n", b""])
def test_a_peer_sending_garbage_or_pickles_is_dropped_and_the_rest_are_served(frame):
    path = _server_path()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        raw.settimeout(5)
        raw.connect(path)
        raw.send(frame or b"\x00" * 70000)  # msgpack garbage, a pickle, an oversize frame
        _wait_gone(raw)  # its HELLO at most, then the end
    finally:
        raw.close()
    got = ForkingPickler.loads(ForkingPickler.dumps(np.full(1 << 12, 3.0)))
    assert float(got[-1]) == 3.0


def _wait_gone(raw: socket.socket) -> None:
    deadline = time.monotonic() + WAIT
    raw.settimeout(1)
    while time.monotonic() < deadline:
        try:
            if raw.recv(65536) == b"":
                return
        except TimeoutError:
            continue
        except OSError:
            return
    pytest.fail("the server kept a peer that sent garbage")


def _forge_release(path: str, slot: int, gen: int, out) -> None:
    conn = wire.connect(path, timeout=5)
    conn.send({"k": "r", "l": [slot, gen]})
    time.sleep(0.2)
    conn.close()
    out.put("sent")


def test_a_release_from_another_process_than_the_claimer_is_ignored():
    path = _server_path()
    got = ForkingPickler.loads(ForkingPickler.dumps(np.ones(1 << 14)))
    ow = _owner.current_owner()
    slot = next(iter(ow._slots))
    gen = ow.table.state(slot)[0]
    ctx = smp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_forge_release, args=(path, slot, gen, out))
    p.start()
    try:
        assert out.get(timeout=WAIT) == "sent"
        p.join(WAIT)
        time.sleep(0.1)
        assert smp.statistics().handles_claimed == 1 and float(got[0]) == 1.0
    finally:
        kill(p)
    del got


@pytest.mark.parametrize("field,value,match", [
    ("start", 1 << 40, "malformed handle"),
    ("span", -8, "malformed handle"),
    ("lo", 8, "malformed handle"),
    ("slot", 1 << 40, "malformed handle"),
    ("seg_id", 12345, "no segment"),
    ("shape", (1 << 13,), "malformed handle"),  # more than the span: numpy refuses the view
    ("strides", (16,), "malformed handle"),
])
def test_a_malformed_handle_is_a_clear_error(field, value, match):
    ForkingPickler.dumps(np.ones(1 << 12))  # a server to talk to
    ow = _owner.current_owner()
    seg_id, size, start, span, lo, strides, slot, gen = ow.place(np.ones(1 << 12))
    args = dict(pid=ow.pid, token=ow.token, path=ow.path, seg_id=seg_id, size=size, start=start,
                span=span, lo=lo, strides=strides, slot=slot, gen=gen, dtype="<f8",
                shape=(1 << 12,))
    args[field] = value
    # signed as the owner signs (a peer holding its key): the checks behind the signature hold
    args["mac"] = _table.sign(ow.secret, args["seg_id"], args["size"], args["start"], args["span"],
                              args["lo"], args["slot"], args["gen"], False)
    with pytest.raises(smp.HandleError, match=match):
        _client.rebuild_array(**args)


def test_a_handle_of_an_owner_that_never_was_names_its_pid(tmp_path):
    with pytest.raises(smp.OwnerGone, match="pid 999999999"):
        _client.rebuild_array(999999999, 1, str(tmp_path / "nothing"), 1, 4096, 0, 64, 0, (8,),
                              0, 1, "<f8", (8,))


def _pickle_with_few_fds(q) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nopen = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nopen + 1, hard))
    q.put(np.full(1 << 16, 6.0))  # no fd for a segment: by value, not lost
    q.close()
    q.join_thread()


def test_an_owner_out_of_fds_sends_by_value_and_loses_nothing():
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_pickle_with_few_fds, args=(q,))
    p.start()
    try:
        got = q.get(timeout=WAIT)
        assert got.shape == (1 << 16,) and float(got.sum()) == 6.0 * (1 << 16)
        p.join(WAIT)
        assert p.exitcode == 0
    finally:
        kill(p)


def _unpickle_with_few_fds(q, out) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nopen = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nopen, hard))
    try:
        q.get(timeout=WAIT)
        out.put(("ok", ""))
    except Exception as exc:  # noqa: BLE001
        out.put((type(exc).__name__, str(exc)))


def test_a_receiver_out_of_fds_gets_a_clear_error():
    ctx = smp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_unpickle_with_few_fds, args=(q, out))
    p.start()
    try:
        q.put(np.full(1 << 16, 6.0))
        kind, msg = out.get(timeout=WAIT)
        assert kind == "FdLimitError" and "fd" in msg, (kind, msg)
        p.join(WAIT)
    finally:
        kill(p)
    gc.collect()
