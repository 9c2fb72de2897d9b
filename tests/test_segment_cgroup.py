"""A memory cgroup limit is a SegmentError at allocation time, never an OOM kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from .cgroup_helpers import memory_cgroup

MiB = 1 << 20
LIMIT = 160 * MiB
SEGMENT = 32 * MiB

# The child joins the cgroup before it imports anything, so what it allocates from then on
# (numpy, shmshare, the segments) is charged there.
CHILD = textwrap.dedent("""
    import os, sys
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    from shmshare import Segment, SegmentError
    kept = []
    try:
        while len(kept) < 64:
            kept.append(Segment.create(int(sys.argv[2])))
    except SegmentError as exc:
        print("REFUSED", len(kept), exc.errno, exc, flush=True)
    else:
        print("NEVER REFUSED", len(kept), flush=True)
""")


def test_filling_a_memory_cgroup_is_a_segment_error_not_an_oom_kill():
    with memory_cgroup(LIMIT) as (directory, procs):
        _fill_in_a_child(directory, procs)


def _fill_in_a_child(directory: str, procs: str) -> None:
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, procs, str(SEGMENT)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode != -signal.SIGKILL, f"the child was OOM-killed: {out}{err}"
        assert proc.returncode == 0, err
        assert out.startswith("REFUSED"), out
        _, count, code, text = out.split(" ", 3)
        assert 1 <= int(count) < LIMIT // SEGMENT and int(code) == 12  # ENOMEM
        assert "memory cgroup" in text and os.path.basename(directory) in text
        assert f"a limit of {LIMIT} bytes" in text and f"cannot reserve {SEGMENT} bytes" in text
        assert "OOM-killed" in text and "docker run --memory" in text
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
