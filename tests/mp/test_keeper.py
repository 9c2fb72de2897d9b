"""A process that exits with handles not yet unpickled exits at once; a keeper serves them for
the linger (Note [A keeper after exit]). It made the process itself linger: "join the child,
then read its result" waited out the linger and then raised OwnerGone, and every script that
sent an array nobody received exited 10 s late."""

from __future__ import annotations

import gc
import glob
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import psutil

import shmshare.multiprocessing as smp
from shmshare.testing import kill, wait_until

from .helpers import WAIT


def _socket_dirs(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"shmshare-mp-{pid}-*"))


def _put_and_return(q, linger: float) -> None:
    smp.set_exit_linger(linger)
    q.put(np.full(1 << 16, 8.0))


def test_join_the_child_then_read_its_result():
    """The stdlib's pattern: join first, then get. The child exits at once; its keeper serves
    the handle, and the array arrives."""
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_put_and_return, args=(q, 20.0))
    p.start()
    try:
        p.join(WAIT)
        assert p.exitcode == 0
        got = q.get(timeout=WAIT)
        assert got.shape == (1 << 16,) and float(got.min()) == float(got.max()) == 8.0
        # all claimed: the keeper leaves at once, removing the socket (well before its 20 s)
        wait_until(lambda: not _socket_dirs(p.pid), "the keeper to leave", WAIT, between=gc.collect)
        assert float(got.sum()) == 8.0 * (1 << 16)  # the data outlives owner and keeper
    finally:
        kill(p)
        q.close()
        q.join_thread()


_SENDS_AND_EXITS = textwrap.dedent("""
    import os, sys
    import numpy as np
    from multiprocessing.reduction import ForkingPickler
    import shmshare.multiprocessing as mp
    mp.set_exit_linger(float(sys.argv[1]))
    raw = bytes(ForkingPickler.dumps(np.full(1 << 16, 9.0)))  # a handle nobody has unpickled
    print(os.getpid(), raw.hex(), flush=True)
""")


def test_a_script_whose_array_is_not_received_yet_exits_at_once():
    """With a linger of 60 s the script itself still ends at once: the run below is bounded by
    a timeout well inside that linger. Its keeper then serves the handle."""
    done = subprocess.run([sys.executable, "-c", _SENDS_AND_EXITS, "60"], capture_output=True,
                          text=True, timeout=30)  # a lingering script would outlast this
    assert done.returncode == 0, done.stderr[-2000:]
    pid, raw = done.stdout.split()
    got = ForkingPickler.loads(bytes.fromhex(raw))  # served by the keeper
    assert float(got.min()) == float(got.max()) == 9.0
    wait_until(lambda: not _socket_dirs(int(pid)), "the keeper to leave once all is claimed", WAIT,
               between=gc.collect)
    del got


# -- the keeper runs nothing of the program's ------------------------------------------------------

_READER = textwrap.dedent("""
    import sys, pickle
    import shmshare.multiprocessing as mp
    a = pickle.loads(open(sys.argv[1], "rb").read())
    print(float(a.sum()))
""")


def _kill_copies(script: str) -> None:
    """Kill every process (keepers included: their own session) running `script`, by pid."""
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if script in (p.info["cmdline"] or []) and p.pid != os.getpid():
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _run(tmp_path, body: str) -> tuple[str, list[str]]:
    script = str(tmp_path / "owner.py")
    marker, blob = tmp_path / "marker.txt", tmp_path / "h.bin"
    with open(script, "w") as f:
        f.write(textwrap.dedent("""
            import os, sys, gc
            import numpy as np
            import shmshare.multiprocessing as mp
            from multiprocessing.reduction import ForkingPickler
            MARK = sys.argv[1]
            def mark(what):
                with open(MARK, "a") as f:
                    f.write(f"{what} {os.getpid()}\\n")
            mark("owner")
            open(sys.argv[2], "wb").write(bytes(ForkingPickler.dumps(np.arange(1000.0))))
        """) + textwrap.dedent(body))
    # the keeper serves until the handle is claimed, and the reader's start (an interpreter, numpy and
    # shmshare: over 3 s with the machine loaded) stays well inside the linger
    env = dict(os.environ, SHMSHARE_MP_LINGER="30")
    try:
        subprocess.run([sys.executable, script, str(marker), str(blob)], env=env, timeout=30,
                       check=True)
        reader = tmp_path / "reader.py"
        reader.write_text(_READER)
        time.sleep(0.3)
        out = subprocess.run([sys.executable, str(reader), str(blob)], env=env, timeout=30,
                             capture_output=True, text=True, check=True).stdout
        (owner,) = _pids(marker.read_text().split("\n"), "owner")
        # the keeper leaves once the handle is claimed, removing its socket's directory as it goes
        wait_until(lambda: not _socket_dirs(int(owner)), "the keeper to leave once the handle was claimed", WAIT)
        return out, marker.read_text().split("\n")
    finally:
        _kill_copies(script)


def _pids(lines: list[str], what: str) -> set[str]:
    return {ln.split()[1] for ln in lines if ln.startswith(what + " ")}


def test_the_keeper_runs_no_fork_handler_of_the_programs(tmp_path):
    """os.register_at_fork(after_in_child=...) is the program's code: the keeper's os.fork()
    ran it in the keeper."""
    out, lines = _run(tmp_path, """
        os.register_at_fork(after_in_child=lambda: mark("user_fork_handler"))
    """)
    assert out.strip() == "499500.0"
    ran_in = _pids(lines, "user_fork_handler")
    assert not ran_in, f"a user's fork handler ran in the keeper (pid {ran_in}): {lines}"


def test_the_keeper_runs_no_finalizer_of_the_programs(tmp_path):
    """Cyclic garbage of the program's, left for the next collection: the exit finalized it, and
    the keeper's own collector (its serving loop allocates) ran its __del__ a second time."""
    out, lines = _run(tmp_path, """
        class D:
            def __del__(self):
                mark("del")
        gc.collect(); gc.set_threshold(50)
        d = D(); d.me = d; del d
    """)
    assert out.strip() == "499500.0"
    owner = _pids(lines, "owner")
    dels = _pids(lines, "del")
    assert dels <= owner, f"a user __del__ ran in the keeper (pids {dels - owner}): {lines}"
