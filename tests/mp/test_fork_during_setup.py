"""A fork while another thread makes this process's pool (a Queue's feeder thread on its first
put, while ``Pool()`` forks its workers): the children must not start with a lock held by a
thread they do not have. It was an import's module lock and tempfile's: a worker hung forever
at its own first handle, and ``pool.map`` never returned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from .helpers import WAIT

_POOL_WHILE_THE_FIRST_PUT_SETS_UP = textwrap.dedent("""
    import numpy as np
    import shmshare.multiprocessing as mp

    def f(x):
        return np.full(1024, float(x))  # a handle: the worker's own first pickle

    if __name__ == "__main__":
        q = mp.Queue()
        q.put(np.ones(1024))  # the feeder thread makes the pool now ...
        with mp.Pool(2) as pool:  # ... while this forks
            print(sum(float(a[0]) for a in pool.map(f, range(8))))
        print(q.get(timeout=10).sum())
""")


def _run(code: str, timeout: float) -> tuple[int | None, str]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the script, and the Pool's workers with it
        out, _ = p.communicate(timeout=WAIT)
        return None, out
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(WAIT)


def test_the_pickling_path_imports_and_sets_up_nothing_lazily():
    """What a fork could interrupt on another thread: nothing of it is left to the first put."""
    rc, out = _run(textwrap.dedent("""
        import sys, tempfile
        import shmshare.multiprocessing
        print("server" if "shmshare.multiprocessing._server" in sys.modules else "lazy server")
        print("tempdir" if tempfile.tempdir is not None else "lazy tempdir")
    """), WAIT)
    assert rc == 0 and out.split() == ["server", "tempdir"], out


@pytest.mark.parametrize("run", range(6))
def test_a_pool_forked_during_the_first_puts_setup_finishes(run):
    rc, out = _run(_POOL_WHILE_THE_FIRST_PUT_SETS_UP, 60.0)
    assert rc is not None, f"pool.map hung (killed after 60 s); it said: {out[-500:]!r}"
    assert rc == 0 and out.split() == ["28.0", "1024.0"], out[-2000:]
