"""A memory cgroup's limit met by the store: an error that names it, never an OOM kill -- of a
putter whose objects are charged to its cgroup, or of a daemon whose pool is charged to its
own (Note [Shared memory and the memory cgroup] in store/_packing.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmshare.store import Daemon, Store, StoreFull
from shmshare.testing import wait_until

from .helpers import WAIT, memory_cgroup
from .hostile_helpers import _fresh_daemon

MiB = 1 << 20
CLIENT_LIMIT = 160 * MiB
OBJECT = 32 * MiB
DAEMON_LIMIT = 24 * MiB

# The child joins the cgroup before it imports anything, so that what it allocates from then on
# (numpy, shmshare, the array, the objects' memfds) is charged there.
CLIENT = textwrap.dedent("""
    import os, sys
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    import numpy as np
    from shmshare.store import Store
    arr = np.full(int(sys.argv[3]) // 8, 7, np.int64)
    n = 0
    with Store(sys.argv[2]) as s:
        try:
            while n < 64:
                s.put(f"cg{n}", arr, immutable=True)  # its own memfd: charged here
                n += 1
        except Exception as exc:
            print("REFUSED", n, type(exc).__name__, getattr(exc, "errno", None), exc, flush=True)
        else:
            print("NEVER REFUSED", n, flush=True)
        s.put("small after", np.arange(10))  # what the daemon's pool holds is not charged here
""")


def test_a_putter_in_a_full_memory_cgroup_gets_a_segment_error_not_an_oom_kill(
        store: Store, daemon: Daemon) -> None:
    """Puts of 32 MiB arrays from a client in a 160 MiB cgroup: one is refused with
    SegmentError(ENOMEM) naming the cgroup, its limit and the fix; the client lives on, and
    the daemon, another client and the objects put before are as they were."""
    with memory_cgroup(CLIENT_LIMIT) as (directory, procs):
        try:
            proc = subprocess.run([sys.executable, "-c", CLIENT, procs, daemon.path, str(OBJECT)],
                                  capture_output=True, text=True, timeout=120)
            out, err = proc.stdout, proc.stderr
            assert proc.returncode != -signal.SIGKILL, f"the putter was OOM-killed: {out}{err}"
            assert proc.returncode == 0, err
            assert out.startswith("REFUSED"), out
            _, count, kind, code, text = out.split(" ", 4)
            assert 1 <= int(count) < CLIENT_LIMIT // OBJECT and kind == "SegmentError", out
            assert int(code) == 12, out  # ENOMEM, as the segment layer says it
            assert "memory cgroup" in text and os.path.basename(directory) in text, text
            assert f"a limit of {CLIENT_LIMIT} bytes" in text and f"{OBJECT} bytes" in text, text
            assert "OOM-killed" in text and "stay charged to its cgroup" in text, text
            assert "memory.max" in text, text
            for i in range(int(count)):  # what went in before is intact
                got = store.get(f"cg{i}")
                assert got.shape == (OBJECT // 8,) and int(got[0]) == int(got[-1]) == 7
                del got
            store.put("other", np.arange(OBJECT // 8))  # another client is not refused
            assert int(store.get("other")[-1]) == OBJECT // 8 - 1
            assert [int(x) for x in store.get("small after")] == list(range(10))
        finally:
            for o in store.list():  # the child's pages leave its cgroup with the objects
                store.delete(o.name)
            wait_until(lambda: store.stats()["memfd_bytes"] == 0, "the objects' memfds are closed")


@pytest.mark.parametrize("limit", [None, 1 << 30], ids=["no-limit", "limit-above-cgroup"])
def test_a_daemon_in_a_full_memory_cgroup_refuses_small_puts_with_store_full(
        sockdir: str, limit: int | None) -> None:
    """A daemon moved into a 24 MiB cgroup: small puts (its pool, or memfds of its own under a
    --limit above the cgroup's) are refused with StoreFull naming the daemon's cgroup, not
    answered by dropping the client (an assertion in the daemon) nor by the daemon being
    OOM-killed; the daemon serves on, and deleting makes room again."""
    small = np.full(128 * 1024, 3, np.int32)  # 512 KiB: a block of the daemon's pool
    with memory_cgroup(DAEMON_LIMIT) as (directory, procs), \
            _fresh_daemon(sockdir, "cg", limit=limit) as d:
        with open(procs, "w") as f:
            f.write(str(d.pid))  # what it allocates from now on is charged there
        with Store(d.path, timeout=WAIT) as s:
            n = 0
            with pytest.raises(StoreFull) as info:
                while n < 200:
                    s.put(f"s{n}", small)
                    n += 1
            text = str(info.value)
            assert d.proc.poll() is None, "the daemon died"
            assert n >= 1, text
            assert "memory cgroup" in text and os.path.basename(directory) in text, text
            assert f"store daemon (pid {d.pid})" in text and "OOM-killed" in text, text
            assert f"a limit of {DAEMON_LIMIT} bytes" in text and "Delete objects" in text, text
            assert int(s.get("s0")[0]) == 3 and s.stats()["objects"] == n
            for i in range(n):
                s.delete(f"s{i}")
            s.put("after", small)  # room again
            assert int(s.get("after")[-1]) == 3
            # a large put finds no room in the daemon's cgroup for a pool segment: it falls
            # back to a memfd of its own, written (and charged) here (Note [Warm memory])
            big = np.full(OBJECT // 4, 5, np.int32)
            s.put("big", big)
            info = s.info("big")
            assert (info.kind, info.write_seal) == ("memfd", "full"), info
            assert int(s.get("big")[-1]) == 5 and d.proc.poll() is None
