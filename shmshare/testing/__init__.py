"""Helpers for testing code that shares memory between processes.

``shmshare.testing`` may import anything in shmshare; nothing in shmshare
imports it. It holds the leak checker (fds, shared-memory mappings and
``/dev/shm`` names of a process, before and after), bounded child-process
helpers, ``refs()`` (who holds one shared object, in which processes), the
contract suites that every pool provider runs, and the pytest plugin
(``pytest --leaks``, in ``pytest_plugin``; pytest loads it, nothing imports it).
"""

from .leaks import LeakError, Leaks, ResourceSnapshot, assert_no_leaks, check_leaks
from .procs import Child, start_child
from .refs import Refs, refs

__all__ = [
    "ResourceSnapshot",
    "Leaks",
    "LeakError",
    "assert_no_leaks",
    "check_leaks",
    "Child",
    "start_child",
    "refs",
    "Refs",
]
