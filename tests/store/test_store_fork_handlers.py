"""The store's fork handler among the others (Note [Views across fork], Note [At fork]): a copy
that fails under warnings-as-errors does not skip the other layers' handlers, and a lock another
thread held at fork does not hang the child."""

from __future__ import annotations

import os
import threading
import warnings

import shmshare.multiprocessing  # noqa: F401 - its fork handlers are registered after the store's
from shmshare import _cgroup
from shmshare.multiprocessing import _client as mp_client
from shmshare.store import Daemon, Store
from shmshare.testing import kill, pattern, wait_exit

from .helpers import WAIT, memory_cgroup

_LIMIT = 5 << 20 | 512 << 10  # bytes: room for the child itself, not for a 2 MiB copy + slack


def _own_cgroup_procs() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _hier, ctl, path = line.rstrip("\n").split(":", 2)
            if "memory" in ctl.split(","):
                return os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"), "cgroup.procs")
    return "/sys/fs/cgroup/cgroup.procs"


def _fork_into_a_full_cgroup(procs_file: str) -> int:
    """fork() from inside a memory cgroup with no room for the child's 2 MiB copies; the parent
    goes back to its own cgroup at once (the child stays)."""
    home = _own_cgroup_procs()
    with open(procs_file, "w") as f:
        f.write(str(os.getpid()))
    try:
        pid = os.fork()
    finally:
        if pid != 0:
            with open(home, "w") as f:
                f.write(str(os.getpid()))
    return pid


def test_a_failed_copy_under_warnings_as_errors_does_not_skip_the_other_layers_handlers(
        own_daemon: Daemon) -> None:
    """warnings as errors (pytest -W error, filterwarnings=error): the store's fork handler's
    RuntimeWarning is raised out of _fork._run, so every handler after it -- the
    multiprocessing client's and owner's, registered later in layer 6 -- never runs in the
    child (it keeps the parent's client, its pid and its locks)."""
    with Store(own_daemon.path) as s, memory_cgroup(_LIMIT) as (_, procs_file):
        s.put("small", pattern(1, 1000))
        view = s.get("small")
        r, w = os.pipe()
        pid = -1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                pid = _fork_into_a_full_cgroup(procs_file)
                if pid == 0:
                    ok = mp_client._pid == os.getpid()
                    os.write(w, b"1" if ok else b"0")
                    os._exit(0)
            os.close(w)
            w = -1
            got = os.read(r, 1)
            assert wait_exit(pid) == 0
            pid = -1
            assert got == b"1", ("the multiprocessing client's fork handler did not run in the "
                                 "child: the store's handler raised its warning first")
        finally:
            del view  # not held by the traceback (the leak check)
            if pid > 0:
                kill(pid)
            for fd in (r, w):
                if fd >= 0:
                    os.close(fd)
        s.delete("small")


def test_fork_while_another_thread_holds_the_cgroup_cache_lock(own_daemon: Daemon) -> None:
    """The fork handler calls _cgroup.memory_limit, which takes _cgroup._lock to cache a new
    chain; that lock is not renewed at fork, so a child forked while another thread holds it
    (resolving its first chain, or in _cgroup.reset()) hangs in the fork handler forever.
    A getter-only parent has no chain cached, so its child always resolves one."""
    with Store(own_daemon.path) as s:
        with Store(own_daemon.path) as putter:
            putter.put("small", pattern(1, 1000))
        _cgroup.reset()
        view = s.get("small")
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with _cgroup._lock:  # as _chain() or reset() holds it, for a moment
                held.set()
                release.wait(WAIT)

        t = threading.Thread(target=hold, daemon=True)
        t.start()
        held.wait(WAIT)
        pid = -1
        try:
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            release.set()
            rc = wait_exit(pid, 10.0)
            assert rc == 0, "the forked child hangs in the store's fork handler (_cgroup._lock)"
            pid = -1
        finally:
            del view
            release.set()
            if pid > 0:
                kill(pid)
            t.join(WAIT)
        s.delete("small")
