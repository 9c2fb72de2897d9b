"""The store attacked: hostile same-uid peers speaking raw frames, a daemon stopped or starved
of fds, a client interrupted, and the limit and the command line taken at their word.

Each test's docstring says what goes wrong and what a fix must do. Raw peers are
``wire.connect`` connections sending crafted headers and fds; every wait is bounded and
every process a test starts is stopped by its pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import mmap
import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmshare import wire
from shmshare._errors import PeerDied, ShmshareTimeout
from shmshare.store import Daemon, Store, StoreError, StoreFull, StoreGone, _launch
from shmshare.store._packing import SEALS
from shmshare.testing import wait_until

from .helpers import WAIT
from .hostile_helpers import (
    _FALLOC_FL_KEEP_SIZE,
    _FALLOC_FL_PUNCH_HOLE,
    MiB,
    _ask,
    _daemon_fd,
    _first_hole,
    _memfd,
    _meta,
    _nfds,
    _raw,
    _start_with_nofile,
    _stopped,
)

# -- what a hostile peer's fds can do to getters ---------------------------------------------


def test_a_created_memfd_sealed_against_sealing_is_never_published_writable(
        store: Store, daemon: Daemon) -> None:
    """A create whose memfd carries F_SEAL_SEAL makes the seal's F_ADD_SEALS fail after the
    object is already marked sealed: the creator is dropped and the object stays in the store,
    sealed, got by others, with write_seal "none", and the creator keeps changing its bytes.
    A fix must refuse such a memfd at create (or refuse the seal and abort the object) with an
    error reply, so a >= 1 MiB object is never published without the write seal."""
    fd = _memfd(MiB, SEALS | fcntl.F_SEAL_SEAL)
    m = mmap.mmap(fd, MiB)  # the creator's writable mapping
    try:
        with _raw(daemon.path) as c:
            created = _ask(c, {"k": "create", "n": "unsealable", "m": _meta(MiB), "s": MiB,
                               "t": False}, [fd])
            sealed: dict[Any, Any] | None = None
            if created["k"] == "ok":
                try:
                    sealed = _ask(c, {"k": "seal", "n": "unsealable"})
                except PeerDied:
                    sealed = None  # dropped instead of answered
        if "unsealable" in store:
            info = store.info("unsealable")
            view = store.get("unsealable")
            m[0] = 42  # the creator writes after the seal
            changed = int(view[0])
            del view
            assert info.write_seal != "none" and changed != 42, (
                f"published with write_seal={info.write_seal!r} and the creator's write after "
                f"seal shows in a getter's view ({changed}); the seal's reply was {sealed}")
    finally:
        m.close()
        os.close(fd)


def test_holes_punched_between_create_and_seal_are_refused_at_seal(store: Store,
                                                                   daemon: Daemon) -> None:
    """A creator can punch every page out of its memfd after create and then seal: the daemon
    checks the pages only at create, so it publishes an object that is all holes, and each
    getter's reads allocate pages charged to the getter (Note [Trust no fd]). A fix must
    check again at seal (st_blocks / SEEK_HOLE over the object) and refuse the seal."""
    fd = _memfd(MiB, name="hostile-punched")
    try:
        with _raw(daemon.path) as c:
            assert _ask(c, {"k": "create", "n": "punched", "m": _meta(MiB), "s": MiB,
                            "t": False}, [fd])["k"] == "ok"
            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE,
                                ctypes.c_long(0), ctypes.c_long(MiB))
            assert rc == 0 and os.fstat(fd).st_blocks == 0
            sealed = _ask(c, {"k": "seal", "n": "punched"})
            if sealed["k"] == "ok":
                theirs = _daemon_fd(daemon.pid, "hostile-punched")
                try:
                    blocks = os.fstat(theirs).st_blocks * 512
                finally:
                    os.close(theirs)
                assert blocks >= MiB, (f"the seal was accepted and the published object has "
                                       f"{blocks} of its {MiB} bytes backed by pages")
    finally:
        os.close(fd)


def test_a_put_memfd_larger_than_announced_cannot_hide_a_hole_in_the_object(
        store: Store, daemon: Daemon) -> None:
    """A put's memfd may be larger than the size it announces, and the page check compares
    totals (st_blocks >= size): a 2 MiB memfd whose second MiB is allocated passes as a 1 MiB
    object whose every byte is a hole. A fix must require the memfd's size to be the object's
    (page-rounded) and check the pages of [0, size) itself (SEEK_HOLE)."""
    fd = _memfd(2 * MiB, seals=0, fill=False, name="hostile-oversized")
    try:
        os.posix_fallocate(fd, MiB, MiB)  # pages only past what is announced
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_WRITE)
        with _raw(daemon.path) as c:
            h = _ask(c, {"k": "put", "n": "holed", "m": _meta(MiB), "s": MiB, "t": False,
                         "r": False}, [fd])
        if h["k"] == "ok":
            theirs = _daemon_fd(daemon.pid, "hostile-oversized")
            try:
                hole = _first_hole(theirs)
            finally:
                os.close(theirs)
            assert hole >= MiB, f"the store took a 1 MiB object whose bytes {hole}.. are a hole"
    finally:
        os.close(fd)


@pytest.mark.daemon_args(limit=8 * MiB)
def test_a_put_memfd_larger_than_announced_is_not_a_way_around_the_limit(
        own_daemon: Daemon) -> None:
    """A put announcing 1 MiB with a fully allocated 64 MiB memfd is accepted and charged
    1 MiB: the daemon holds 64 MiB under an 8 MiB --limit and stats() says 1 MiB. A fix must
    refuse a memfd larger than the object (page-rounded), or charge what it really holds."""
    fd = _memfd(64 * MiB, SEALS | fcntl.F_SEAL_WRITE)
    try:
        with _raw(own_daemon.path) as c:
            h = _ask(c, {"k": "put", "n": "fat", "m": _meta(MiB), "s": MiB, "t": False,
                         "r": False}, [fd])
    finally:
        os.close(fd)
    with Store(own_daemon.path) as s:
        st = s.stats()
        assert h["k"] == "err" or st["memfd_bytes"] >= 64 * MiB, (
            f"a 64 MiB memfd was taken as a 1 MiB object under an 8 MiB limit: the store "
            f"counts memfd_bytes={st['memfd_bytes']}")


# -- the daemon against unread replies, full fd tables, and its own bookkeeping ---------------


def test_an_expiring_wait_whose_reply_blocks_does_not_crash_the_daemon(sockdir: str) -> None:
    """The daemon died with KeyError in _expire_waits: a wait expired whose reply could not be
    sent, so its client was dropped; dropping it aborted an object it was creating, which woke
    (and popped) another name's waiters from the dict that _expire_waits was walking by a
    snapshot of its keys. A fix must skip popped names (or apply the drops after the walk).

    Run on a Server in this process: since drop frames are capped per client, a peer can no
    longer fill its own socket with them, so the reply that fails is made to fail here."""
    from shmshare.store._daemon import Server, _Client

    server = Server(os.path.join(sockdir, f"expire-{os.getpid()}.sock"))
    ends = [wire.pipe() for _ in range(2)]
    try:
        x, y = _Client(1, ends[0][0]), _Client(2, ends[1][0])
        server._answer(x, {"k": "create", "n": "n2", "m": _meta(4), "s": 4, "t": False}, [])
        assert ends[0][1].recv(timeout=5)[0]["k"] == "ok"
        server._answer(x, {"k": "wait", "n": "n1", "t": 0}, [])  # expires at once
        server._answer(y, {"k": "wait", "n": "n2", "t": 30}, [])  # woken when n2 is aborted
        real = server._reply

        def full_for_x(client: Any, header: Any, fds: Any = None) -> None:
            if client is x:
                raise ShmshareTimeout("x's socket is full")
            real(client, header, fds)

        server._reply = full_for_x  # type: ignore[method-assign]
        time.sleep(0.01)
        server._expire_waits()  # raised KeyError before the fix
        h, _ = ends[1][1].recv(timeout=5)
        assert h.get("e") == "aborted", h
        assert "n2" not in server.table.names and x.conn.closed
    finally:
        server.close()
        for a, b in ends:
            a.close()
            b.close()

def test_a_full_fd_table_does_not_drop_existing_clients(sockdir: str) -> None:
    """With its fd table filled by idle connections, the daemon drops an existing client whose
    put brings a memfd (the kernel truncates the fds: FdLimitError), releasing every reference
    it holds under its live views, and the client is told StoreGone although the daemon runs.
    A fix must keep room for a request's fds before accepting more clients (check_fd_room, as
    the channels do) and answer a request that lost its fds with an error reply, not a drop."""
    path = os.path.join(sockdir, f"nofile-{os.getpid()}.sock")
    d = _start_with_nofile(path, 64)
    conns: list[wire.Connection] = []
    try:
        with Store(path, timeout=5) as s:
            s.put("held", np.arange(1000))
            view = s.get("held")
            for _ in range(80):
                conns.append(wire.connect(path, timeout=5))
            # it stops accepting with a request's worth of fds still free (check_fd_room)
            wait_until(lambda: _nfds(d.pid) >= 48, "the daemon's fd table fills", timeout=10)
            dropped = None
            try:
                s.put("big", np.zeros(MiB, np.uint8))
            except StoreGone as exc:
                dropped = str(exc)
            except StoreError:
                pass  # a clear refusal is fine
            refs = None if dropped else s.info("held").refs
            del view  # before any assertion: a failing test must not keep the mapping
            assert dropped is None, (f"an existing client was dropped when the daemon ran out "
                                     f"of fds (its views' references went with it): {dropped}")
            assert refs == 1
    finally:
        for c in conns:
            c.close()
        gc.collect()
        d.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_list_of_many_long_names_does_not_drop_the_client(store: Store) -> None:
    """list() of 200 objects with 700-byte names makes a reply frame over wire.MAX_FRAME
    (256 entries per page whatever their size); the daemon drops the client and list() raises
    StoreGone. A fix must size each list page by its bytes, not by a count of entries."""
    names = [f"{i:04d}" + "x" * 700 for i in range(200)]
    try:
        for i, n in enumerate(names):
            store.put(n, i)
        got = store.list()
        assert sorted(o.name for o in got) == names
    finally:
        with Store(store.path) as other:
            for n in names:
                with contextlib.suppress(KeyError):
                    other.delete(n)


# The daemon, with every wait of its own on a client's socket (a poll of wire's with a timeout)
# written down, a line each, in the file argv[1]; argv[2] is its socket. Note [One thread]: it
# never waits on one, whatever the client does.
_NOTING_WAITS = textwrap.dedent("""
    import select, sys, types
    from shmshare import wire
    from shmshare.store import _launch

    noted = open(sys.argv[1], "a", buffering=1)

    def poll():
        real = select.poll()

        class Poller:
            register, unregister, modify = real.register, real.unregister, real.modify

            def poll(self, ms=None):
                if ms is None or ms > 0:
                    noted.write(f"{ms}\\n")
                return real.poll(ms)

        return Poller()

    wire.select = types.SimpleNamespace(poll=poll, **{k: getattr(select, k) for k in dir(select)
                                                      if k.startswith("POLL")})
    sys.exit(_launch.main_serve(sys.argv[2], None, False, "critical", False))
""")


def _start_noting_waits(path: str, noted: str) -> Daemon:
    """A daemon (_NOTING_WAITS) at `path` that writes its waits on clients' sockets to `noted`."""
    proc = subprocess.Popen([sys.executable, "-c", _NOTING_WAITS, noted, path],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env={**os.environ, _launch._PARENT: str(os.getpid())})
    assert proc.stdout is not None
    try:
        if not select.select([proc.stdout], [], [], WAIT)[0]:
            raise AssertionError(f"the daemon did not start within {WAIT} s")
        line = proc.stdout.readline()
        assert line.startswith(_launch._READY), line
    except BaseException:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        raise
    return Daemon(proc, path)


def _hung_up(conn: wire.Connection) -> bool:
    """Whether the other end of `conn` closed (its replies left unread)."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLHUP | select.POLLRDHUP)
    return bool(poller.poll(0))


def test_peers_that_do_not_read_their_replies_do_not_stall_other_clients(
        sockdir: str, tmp_path: Path) -> None:
    """Every reply waits up to 0.5 s for room on its client's socket, on the daemon's only
    thread: four peers that send list requests and never read the replies stall every other
    client for 4 x 0.5 s, and a peer can repeat it at will. A fix must queue replies per client
    without blocking the loop (drop a client whose queue passes a cap), so one client's
    request is never held up by another's unread replies: here the daemon writes down each wait
    on a client's socket, and after the four peers are dropped and another client's stats()
    is answered, it must have written none."""
    noted = tmp_path / "waits"
    noted.touch()
    daemon = _start_noting_waits(os.path.join(sockdir, f"noting-{os.getpid()}.sock"), str(noted))
    try:
        with Store(daemon.path, timeout=20) as s:
            for i in range(256):
                s.put(f"{i:04d}" + "x" * 150, i)
            floods = [wire.connect(daemon.path, timeout=5) for _ in range(4)]
            try:
                for f in floods:
                    _ask(f, {"k": "stats"})
                with Store(daemon.path, timeout=20) as other:  # polled after the peers
                    other.stats()
                    with _stopped(daemon.pid):
                        for f in floods:
                            for _ in range(100):
                                f.send({"k": "list"}, timeout=5)
                    other.stats()
                    wait_until(lambda: all(_hung_up(f) for f in floods),
                               "the daemon drops the peers whose sockets its replies filled")
                    other.stats()
            finally:
                for f in floods:
                    f.close()
        waits = noted.read_text().split()
        assert not waits, (f"the daemon waited {len(waits)} times on a client's socket (polls of "
                           f"{', '.join(waits[:8])} ms), every other client held up meanwhile")
    finally:
        rc = daemon.stop()
    assert rc == 0, f"the daemon exited with {rc}"
    assert not os.path.exists(daemon.path), "the daemon left its socket behind"


@pytest.mark.daemon_args(limit=4 * MiB)
def test_a_replacing_put_under_the_limit_counts_the_old_object_as_room(
        own_daemon: Daemon) -> None:
    """put(name, value, replace=True) of a 3 MiB object over an unreferenced 3 MiB one fails
    StoreFull under a 4 MiB --limit: the new object is charged before the old one goes, so
    replacing an object in place needs twice its size. A fix must count the old object's
    bytes as room when no getter holds it (while still leaving it in place on failure)."""
    with Store(own_daemon.path) as s:
        s.put("w", np.zeros(3 * MiB, np.uint8))
        try:
            s.put("w", np.ones(3 * MiB, np.uint8), replace=True)
        except StoreFull as exc:
            raise AssertionError(f"replacing an unreferenced object of the same size failed: "
                                 f"{exc}") from exc
        assert s.get("w")[0] == 1


def test_a_small_put_within_the_limit_is_not_refused_for_the_pools_segment_size(
        sockdir: str) -> None:
    """Under --limit 1 MiB a put of 1000 bytes into an empty store fails StoreFull, saying it
    "needs 1000 bytes ... holds 0 bytes": the pool reserves a 2 MiB segment, which no limit
    below 2 MiB allows, and the message's figures do not add up. A fix must fit small objects
    within any limit the daemon accepts (or refuse such a limit at start, saying why)."""
    try:
        d = Daemon.start(os.path.join(sockdir, f"tiny-{os.getpid()}.sock"), limit=MiB,
                         log_level="critical")
    except StoreError:
        return  # refused at start, saying why: fine
    try:
        with Store(d.path) as s:
            try:
                s.put("small", np.zeros(1000, np.uint8))
            except StoreFull as exc:
                raise AssertionError(f"1000 bytes did not fit in an empty store under a 1 MiB "
                                     f"limit: {exc}") from exc
    finally:
        d.stop()


def test_serve_on_an_existing_regular_file_does_not_delete_it(sockdir: str) -> None:
    """`shmshare serve --socket FILE` where FILE is a regular file unlinks it (connect says
    ECONNREFUSED, which _remove_stale takes for a dead daemon's socket) and listens there:
    a typo costs the user a file. A fix must remove only a socket (S_ISSOCK), and refuse
    anything else with an error naming the path."""
    victim = os.path.join(sockdir, f"precious-{os.getpid()}.txt")
    with open(victim, "w") as f:
        f.write("the user's data\n")
    try:
        try:
            d = Daemon.start(victim, log_level="critical")
        except StoreError:
            d = None  # refused: what a fix does
        if d is not None:
            d.stop()
        assert os.path.isfile(victim), "the daemon deleted the regular file at its --socket path"
        with open(victim) as f:
            assert f.read() == "the user's data\n"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(victim)


