"""Root's ``shmshare stat`` in other users' stats directories: it connects only to a socket
whose real owner is its directory's owner, and through no link (Note [Only the directory
owner's sockets] in ``_statask.py``).

Run as root (they chown): user A (uid 65534) owns a stats directory and plants in it what
would lead root elsewhere -- a symlink to a root-owned or another user's socket, a socket of
another user, a stats directory that is itself a link. The target is a listening socket that
never accepts: a connect stat made shows as a connection queued in its backlog.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from shmshare import _statask, _statsd, wire

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown")

A, B = 65534, 65533  # two unprivileged uids (A: nobody)
WAIT = 20.0  # s: the bound of every wait that should end much sooner
NAME = "4000000001.sock"  # a stats socket's name (<pid>.sock)


def _dir(path: Path, owner: int) -> Path:
    path.mkdir(mode=0o700, parents=True)
    os.chown(path, owner, owner)
    return path


def _listening(path: Path, owner: int) -> socket.socket:
    """A socket listening at `path`, its file chown'ed to `owner`, that never accepts."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK
                      | socket.SOCK_CLOEXEC)
    s.bind(str(path))
    s.listen(8)
    os.chown(path, owner, owner)
    return s


def _was_connected(s: socket.socket) -> bool:
    """Whether a connect is queued on the listening `s` (taken and closed)."""
    try:
        conn, _ = s.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@pytest.mark.parametrize("plant", ["link to root's socket", "link to B's socket",
                                   "B's socket in A's directory", "A's directory a link",
                                   "a link above A's directory"])
def test_root_connects_to_nothing_planted_in_a_users_stats_dir(tmp_path, plant):
    a = _dir(tmp_path / "a" / "stats", A)
    if plant == "link to root's socket":
        target = _listening(_dir(tmp_path / "root", 0) / "1.sock", 0)
        path = a / NAME
        os.symlink(tmp_path / "root" / "1.sock", path)
    elif plant == "link to B's socket":
        target = _listening(_dir(tmp_path / "b" / "stats", B) / "1.sock", B)
        path = a / NAME
        os.symlink(tmp_path / "b" / "stats" / "1.sock", path)
    elif plant == "B's socket in A's directory":  # B may write there, or A hard-linked it
        path = a / NAME
        target = _listening(path, B)
    else:  # A's "stats", or the directory above it (/tmp/shmshare-A), is a link to root's
        link = a if plant == "A's directory a link" else a.parent
        os.rmdir(a)
        os.rmdir(a.parent)
        if link == a:
            _dir(a.parent, A)
        target = _listening(_dir(tmp_path / "root" / "stats", 0) / NAME, 0)
        os.symlink(tmp_path / "root" / ("stats" if link == a else ""), link)
        os.lchown(link, A, A)
        path = a / NAME
    if os.path.islink(path):
        os.lchown(path, A, A)
    try:
        got = _statask.ask_all([str(path)], timeout=0.3)
        connected = _was_connected(target)
    finally:
        target.close()
    assert not connected, f"stat connected through {plant}"
    pid, reply, why = got[str(path)]
    assert pid == 0 and reply is None and why is not None and why.startswith("not asked:"), got


def test_root_asks_a_socket_owned_by_its_directorys_owner(tmp_path):
    """The socket a process of A's made in A's stats directory is asked, and answers."""
    path = _dir(tmp_path / "a" / "stats", A) / NAME
    listener = wire.Listener(path)
    os.chown(path, A, A)  # as if A's process had bound it (its peer is still root: accepted)

    def answer_once() -> None:
        try:
            conn = listener.accept(timeout=WAIT)
            conn.recv(timeout=WAIT)
            conn.send({"k": _statsd.REPLY, "v": _statsd.VERSION, "pid": 12})
            conn.close()
        except Exception:  # noqa: BLE001, S110 -- stat gone: the assertion below says why
            pass

    t = threading.Thread(target=answer_once)
    t.start()
    try:
        got = _statask.ask_all([str(path)], timeout=WAIT)
    finally:
        t.join(WAIT + 1)
        listener.close()
    assert got[str(path)] == (os.getpid(), {"pid": 12}, None)


def test_a_socket_swapped_for_a_link_after_its_check_is_not_followed(tmp_path, monkeypatch):
    """A swaps its checked socket for a link to root's between stat's check and its connect:
    the connect still goes to the socket checked (its inode, through /proc/self/fd)."""
    real = _statask._open_checked
    path = _dir(tmp_path / "a" / "stats", A) / NAME

    def check_then_swap(p: str) -> tuple[int, int]:
        got = real(p)
        os.rename(path, tmp_path / "a" / "stats" / "moved")
        os.symlink(tmp_path / "root" / "1.sock", path)
        os.lchown(path, A, A)
        return got

    monkeypatch.setattr(_statask, "_open_checked", check_then_swap)
    checked = _listening(path, A)
    target = _listening(_dir(tmp_path / "root", 0) / "1.sock", 0)
    try:
        _statask.ask_all([str(path)], timeout=0.3)
        to_target, to_checked = _was_connected(target), _was_connected(checked)
    finally:
        target.close()
        checked.close()
    assert not to_target and to_checked
