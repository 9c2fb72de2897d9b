"""Helpers for testing code that shares memory between processes.

``shmshare.testing`` may import anything in shmshare; nothing in shmshare
imports it. It holds the leak checker (fds, shared-memory mappings and
``/dev/shm`` names of a process, before and after), bounded child-process
helpers (start, wait for an exit, kill by pid and reap, is a pid alive), a bounded
``wait_until``, ``pattern()`` (contents derived from an id, to check on the
other side), ``refs()`` (who holds one shared object, in which processes),
the contract suites that every pool provider and every service that lends
shared memory runs (``TransportContract``, imported with pytest on first use:
``import shmshare.testing`` itself needs no pytest), and the pytest plugin
(``pytest --leaks``, in ``pytest_plugin``; pytest loads it, nothing imports it).
"""

from typing import TYPE_CHECKING, Any

from .leaks import LeakError, Leaks, ResourceSnapshot, assert_no_leaks, check_leaks
from .patterns import pattern
from .procs import Child, kill, pid_alive, start_child, wait_exit, wait_gone
from .refs import Refs, refs
from .waits import wait_until

if TYPE_CHECKING:
    from .transport_contract import Forged, OtherProcess, TransportContract

__all__ = [
    "ResourceSnapshot",
    "Leaks",
    "LeakError",
    "assert_no_leaks",
    "check_leaks",
    "Child",
    "start_child",
    "kill",
    "wait_exit",
    "wait_gone",
    "pid_alive",
    "wait_until",
    "pattern",
    "refs",
    "Refs",
    "TransportContract",
    "Forged",
    "OtherProcess",
]

_CONTRACT = ("TransportContract", "Forged", "OtherProcess")  # in transport_contract.py, which imports pytest


def __getattr__(name: str) -> Any:
    if name in _CONTRACT:
        from . import transport_contract

        return getattr(transport_contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
