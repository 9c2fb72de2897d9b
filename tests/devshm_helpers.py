"""/dev/shm names by who made them, for the checks that a test left no name behind.

/dev/shm is one directory for every process of the user: another pytest-xdist worker, or another
run on the host, has names there while a test runs. So a check counts the names of the test's own
processes only. shmshare's names and torch's carry their maker's pid (``shmshare_<pid>_<hex>``,
``torch_<pid>_<n>``); a name whose maker is dead is counted as the test's (a child it killed), and
so is a name with no pid in it: only a name of a live process outside the test is passed over.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Collection

import psutil

from shmshare._procfs import shm_names
from shmshare.testing import pid_alive

__all__ = ["maker", "names_of", "foreign", "process_tree", "why_no_unshare"]

_PID_IN_NAME = re.compile(r"[A-Za-z]+_(\d+)_")


def maker(name: str) -> int | None:
    """Return the pid a /dev/shm name says made it, or None if it names none."""
    m = _PID_IN_NAME.match(name)
    return int(m.group(1)) if m else None


def names_of(pids: Collection[int], prefix: str = "shmshare_") -> set[str]:
    """Return the /dev/shm names starting with `prefix` that one of `pids` made."""
    return {n for n in shm_names(prefix) if maker(n) in pids}


def foreign(name: str, ours: Collection[int]) -> bool:
    """Whether a live process outside `ours` made `name` (then it is not the test's)."""
    pid = maker(name)
    return pid is not None and pid not in ours and pid_alive(pid)


def process_tree() -> set[int]:
    """Return this process's pid and its descendants' (psutil's children, recursively)."""
    try:
        kids = {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        kids = set()
    return {os.getpid(), *kids}


def why_no_unshare() -> str | None:
    """Why a test cannot mount a small tmpfs on /dev/shm in a mount namespace of its own, or None."""
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs in a private mount namespace"
    if shutil.which("unshare") is None:
        return "util-linux unshare is not installed"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        return f"unshare -m is not permitted here: {probe.stderr.decode().strip()}"
    return None
