"""A memory cgroup limit is a SegmentError at allocation time, never an OOM kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

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


def _make_cgroup() -> tuple[str, str] | str:
    """Return (directory, procs file) of a fresh cgroup limited to LIMIT, or why none can be made."""
    if os.geteuid() != 0:
        return "needs root to create a memory cgroup"
    name = f"shmshare_test_{os.getpid()}"
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    v1 = next((ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":")[1].split(",")), None)
    tried = []
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # v2 mounted at /sys/fs/cgroup
        d = f"/sys/fs/cgroup/{name}"  # under the root: a v2 inner cgroup may not hold processes
        try:
            with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
                f.write("+memory")
            os.mkdir(d)
            with open(f"{d}/memory.max", "w") as f:
                f.write(str(LIMIT))
            with open(f"{d}/memory.swap.max", "w") as f:
                f.write("0")
            return d, f"{d}/cgroup.procs"
        except OSError as exc:
            tried.append(f"v2: {exc}")
            _remove(d)
    if v1 is not None and os.path.isdir("/sys/fs/cgroup/memory"):
        d = os.path.join("/sys/fs/cgroup/memory", v1.lstrip("/"), name)
        try:
            os.mkdir(d)
            with open(f"{d}/memory.limit_in_bytes", "w") as f:
                f.write(str(LIMIT))
            return d, f"{d}/cgroup.procs"
        except OSError as exc:
            tried.append(f"v1: {exc}")
            _remove(d)
    return "no memory cgroup can be made here: " + ("; ".join(tried) or "neither v2 nor v1 memory")


def _remove(d: str) -> None:
    deadline = time.monotonic() + 10
    while os.path.isdir(d):
        try:
            os.rmdir(d)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the dead child's charges are still being uncharged


def test_filling_a_memory_cgroup_is_a_segment_error_not_an_oom_kill():
    made = _make_cgroup()
    if isinstance(made, str):
        pytest.skip(made)
    directory, procs = made
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
        _remove(directory)
