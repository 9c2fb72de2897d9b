"""Helpers for testing code that shares memory between processes.

``shmshare.testing`` may import anything in shmshare; nothing in shmshare
imports it. It holds the leak checker (fds, shared-memory mappings and
``/dev/shm`` names of a process, before and after), bounded child-process
helpers, and the contract suites that every pool provider runs.
"""

from .leaks import LeakError, Leaks, ResourceSnapshot, assert_no_leaks, check_leaks
from .procs import Child, start_child

__all__ = [
    "ResourceSnapshot",
    "Leaks",
    "LeakError",
    "assert_no_leaks",
    "check_leaks",
    "Child",
    "start_child",
]
