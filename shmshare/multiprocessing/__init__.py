"""``import shmshare.multiprocessing as mp``: multiprocessing, with arrays and tensors pooled.

A drop-in for ``torch.multiprocessing`` and ``multiprocessing``: everything
they export is here (torch's extras, such as ``set_sharing_strategy`` and
``spawn``, when torch is installed). Importing it registers reducers on
multiprocessing's ``ForkingPickler`` (``_reduce.py``), so that whatever
multiprocessing pickles -- ``Queue.put``, ``Pipe.send``, ``Pool.map``
arguments and results, ``Process`` arguments under spawn,
``concurrent.futures.ProcessPoolExecutor(mp_context=mp.get_context(...))``
-- carries numpy arrays and CPU torch tensors as small handles to this
process's shared pool instead of copies or fresh segments. See
docs/multiprocessing.md for the lifetimes a user can rely on, and where
this differs from torch.
"""

from __future__ import annotations

import importlib as _importlib
import multiprocessing as _mp
import multiprocessing.util as _util
import numbers as _numbers
import sys as _sys
from collections.abc import Iterable as _Iterable
from multiprocessing import *  # noqa: F403  (the drop-in: everything multiprocessing exports)
from typing import TYPE_CHECKING, Any
from typing import SupportsIndex as _SupportsIndex
from typing import TypeVar as _TypeVar
from typing import overload as _overload

import numpy as _np

from .. import _empty_args, _fork
from .._errors import PoolExhausted as PoolExhausted
from ._client import close_client as _close_client
from ._common import HandleError as HandleError
from ._common import OwnerGone as OwnerGone
from ._owner import close_owner as _close_owner
from ._owner import current_owner as _current_owner
from ._owner import exit_linger as exit_linger
from ._owner import owner as _get_owner
from ._owner import set_exit_linger as set_exit_linger
from ._reduce import BY_VALUE_BELOW as BY_VALUE_BELOW
from ._reduce import init_reductions as init_reductions
from ._reduce import install as _install
from ._statistics import OwnerStatistics as OwnerStatistics
from ._storages import Unshareable as Unshareable

if TYPE_CHECKING:
    import numpy.typing as _npt
    import torch as _torch

_ScalarT = _TypeVar("_ScalarT", bound=_np.generic)
_Shape = int | _Iterable[_SupportsIndex]  # what empty and zeros take, as their code reads it

_OURS = ["init_reductions", "empty", "zeros", "statistics", "shutdown", "exit_linger",
         "set_exit_linger", "OwnerGone", "HandleError", "Unshareable", "PoolExhausted", "OwnerStatistics",
         "BY_VALUE_BELOW"]
# torch.multiprocessing's own names (set_sharing_strategy, spawn, reductions, pool,
# _set_thread_name, ENV_VAR_PARALLEL_START, ...) are served from it when torch is installed, and
# multiprocessing's submodules (reduction, pool, connection, ...) otherwise: __getattr__ below
__all__ = list(_mp.__all__) + _OURS  # torch's names are not in it: `import *` must not need torch

# multiprocessing's submodules a user reaches as attributes (mp.reduction.ForkingPickler, ...)
_SUBMODULES = frozenset({
    "connection", "context", "dummy", "forkserver", "heap", "managers", "pool", "popen_fork",
    "popen_forkserver", "popen_spawn_posix", "process", "queues", "reduction",
    "resource_sharer", "resource_tracker", "shared_memory", "sharedctypes", "spawn",
    "synchronize", "util"})


# the private names of torch.multiprocessing's that its users reach (imported for them on demand)
_TORCH_PRIVATE = frozenset({"_set_thread_name", "_get_thread_name", "_prctl_pr_set_pdeathsig"})


def __getattr__(name: str) -> Any:
    """What torch.multiprocessing has and we do not override, then multiprocessing's submodules:
    a drop-in forwards what it does not replace."""
    if name.startswith("__") or (name.startswith("_") and name not in _TORCH_PRIVATE
                                 and "torch.multiprocessing" not in _sys.modules):
        # a tool's probe (pytest asks every module-level name for _mock_name) imports no torch
        raise AttributeError(f"module 'shmshare.multiprocessing' has no attribute {name!r}")
    tmp: Any
    try:
        import torch.multiprocessing as tmp
    except ImportError:
        tmp = None
    if tmp is not None:
        if hasattr(tmp, name):
            return getattr(tmp, name)
        try:  # its submodules not imported yet (pool, queue, spawn, reductions)
            return _importlib.import_module(f"torch.multiprocessing.{name}")
        except ImportError:
            pass
    if name in _SUBMODULES:
        return _importlib.import_module(f"multiprocessing.{name}")
    hint = " (it may be torch.multiprocessing's: torch is not installed)" if tmp is None else ""
    raise AttributeError(f"module 'shmshare.multiprocessing' has no attribute {name!r}{hint}")


def __dir__() -> list[str]:
    names = set(globals()) | _SUBMODULES
    tmp = _sys.modules.get("torch.multiprocessing")  # only if imported already: no torch for dir()
    if tmp is not None:
        names |= set(dir(tmp))
    return sorted(names)


@_overload
def empty(shape: _Shape) -> _npt.NDArray[_np.float64]: ...
@_overload
def empty(shape: _Shape, dtype: type[_ScalarT] | _np.dtype[_ScalarT]) -> _npt.NDArray[_ScalarT]: ...
@_overload
def empty(shape: _Shape, dtype: _npt.DTypeLike | None) -> _npt.NDArray[Any]: ...
@_overload
def empty(shape: _Shape, dtype: _torch.dtype) -> _torch.Tensor: ...  # last: Any without torch


def empty(shape: Any, dtype: Any = _np.float64) -> Any:
    """An uninitialized array in this process's pool (a torch tensor for a torch dtype).

    Put on a Queue (or pickled by multiprocessing any other way), it goes
    with no copy at all: fill it in place, then send it.
    """
    np_dtype, torch_dtype = _empty_args.alloc_dtypes(dtype)
    shp, _ = _empty_args.alloc_shape(shape, np_dtype.itemsize)
    return _empty_args.allocated(_get_owner().empty(shp, np_dtype), torch_dtype)


@_overload
def zeros(shape: _Shape) -> _npt.NDArray[_np.float64]: ...
@_overload
def zeros(shape: _Shape, dtype: type[_ScalarT] | _np.dtype[_ScalarT]) -> _npt.NDArray[_ScalarT]: ...
@_overload
def zeros(shape: _Shape, dtype: _npt.DTypeLike | None) -> _npt.NDArray[Any]: ...
@_overload
def zeros(shape: _Shape, dtype: _torch.dtype) -> _torch.Tensor: ...  # last: Any without torch


def zeros(shape: Any, dtype: Any = _np.float64) -> Any:
    """A zero-filled array in this process's pool (see :func:`empty`)."""
    out = empty(shape, dtype)
    out.fill(0) if isinstance(out, _np.ndarray) else out.zero_()
    return out


def statistics() -> OwnerStatistics:
    """What this process's pool holds for the handles it pickled (all zero before the first)."""
    ow = _current_owner()
    if ow is None or ow.closed:
        return OwnerStatistics(**{k: 0 for k in OwnerStatistics.__dataclass_fields__})
    return ow.statistics()


def shutdown(linger: float = 0.0) -> None:
    """Stop this process's fd server and links now, after serving unclaimed handles for up to
    `linger` s; give its pool back. Arrays received stay valid. Done at exit on its own
    (with :func:`exit_linger`); a later pickle starts a fresh pool."""
    if isinstance(linger, bool) or not isinstance(linger, _numbers.Real) or not linger >= 0:
        raise ValueError(f"shutdown(linger=...) takes seconds >= 0, got {linger!r}")
    _close_client()
    _close_owner(linger)


def _at_exit() -> None:
    _close_client()
    _close_owner(exit_linger(), exiting=True)


def _register_exit() -> None:
    # after the Queues' feeder threads are joined (their exitpriority is -5): Note [Exit linger]
    _util.Finalize(None, _at_exit, exitpriority=-20)


_register_exit()
_fork.on_fork_in_child(6, _register_exit)  # a plain os.fork() keeps the registry, with our pid
_util.register_after_fork(_register_exit, lambda _: _register_exit())  # multiprocessing clears it
_install()

del annotations
