"""A process that exits with handles not yet unpickled exits at once; a keeper serves them for
the linger (Note [A keeper after exit]). It made the process itself linger: "join the child,
then read its result" waited out the linger and then raised OwnerGone, and every script that
sent an array nobody received exited 10 s late."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import textwrap
from multiprocessing.reduction import ForkingPickler

import numpy as np

import shmshare.multiprocessing as smp

from .helpers import WAIT
from .test_mp_hostile import _kill, _wait_for


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
        _wait_for(lambda: not _socket_dirs(p.pid), WAIT, "the keeper to leave")
        assert float(got.sum()) == 8.0 * (1 << 16)  # the data outlives owner and keeper
    finally:
        _kill(p)
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
    _wait_for(lambda: not _socket_dirs(int(pid)), WAIT, "the keeper to leave once all is claimed")
    del got
