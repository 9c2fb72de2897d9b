"""Lazy access to the CUDA driver API through cuda-python, and the errors it raises.

Note [Lazy driver]
~~~~~~~~~~~~~~~~~~
CUDA is optional: importing shmshare must work on a machine with no
cuda-python, no driver library and no GPU. So ``cuda.bindings.driver`` (or
``cuda.cuda`` for cuda-python before 12.6) is imported on the first call
that needs it, then ``cuInit(0)`` and ``cuDeviceGetCount`` run once; the
outcome is cached. ``available()`` says whether that worked and
``why_unavailable()`` why not, naming the missing module or library, or the
``CUresult`` of the call that failed.

Every driver call goes through :func:`call`, which unpacks cuda-python's
``(CUresult, value...)`` tuples and turns a failure into a
:class:`CudaError` that names the call and the ``CUresult``
(``CUDA_ERROR_OUT_OF_MEMORY`` becomes :class:`CudaOutOfMemory`, which is
also the allocator's ``ProviderOutOfMemory``, so the pools' retry chains
see it).

A process that initialized CUDA and then forked cannot use CUDA in the
child; the child gets a :class:`CudaUnavailable` saying so rather than a
hang or a crash deep in the driver. Start such children with ``spawn``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .. import _fork
from .._errors import ShmshareError
from ..memory._provider import ProviderOutOfMemory

__all__ = [
    "CudaError",
    "CudaOutOfMemory",
    "CudaUnavailable",
    "available",
    "call",
    "driver",
    "query",
    "result_name",
    "why_unavailable",
]

SUCCESS = 0
NOT_READY = 600  # CUDA_ERROR_NOT_READY: an event or stream query that is not done yet
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class CudaError(ShmshareError):
    """Report a failed CUDA driver call, naming the call and its ``CUresult``.

    Attributes
    ----------
    call : str or None
        The driver function (``"cuMemAlloc"``), None when no call failed.
    result : int or None
        The ``CUresult`` value.
    result_name : str or None
        Its name (``"CUDA_ERROR_OUT_OF_MEMORY"``).
    """

    def __init__(self, message: str, *, call: str | None = None, result: int | None = None,
                 result_name: str | None = None) -> None:
        super().__init__(message)
        self.call = call
        self.result = result
        self.result_name = result_name


class CudaOutOfMemory(CudaError, ProviderOutOfMemory):
    """Report ``CUDA_ERROR_OUT_OF_MEMORY``; the pools treat it as a provider out of memory."""


class CudaUnavailable(CudaError):
    """Report that CUDA cannot be used in this process; the message says why."""


CudaUnavailable.__module__ = "shmshare.cuda"  # tracebacks name the public module


def available() -> bool:
    """Return whether the CUDA driver is usable here (cuda-python, libcuda and a device)."""
    return why_unavailable() is None


def why_unavailable() -> str | None:
    """Return why CUDA cannot be used here, or None when it can.

    The reason names what is missing: the cuda-python module, the driver
    library, the ``CUresult`` of a failing ``cuInit``, or the devices.
    """
    if _forked_after_init:
        return ("CUDA was initialized in the parent before fork(); a forked child cannot use it. "
                "Start the child with the 'spawn' method")
    return _probe()[1]


def driver() -> Any:
    """Return the initialized driver module, or raise :class:`CudaUnavailable` saying why."""
    reason = why_unavailable()
    if reason is not None:
        raise CudaUnavailable(f"CUDA is not available: {reason}")
    return _probe()[0]


def call(name: str, *args: Any) -> Any:
    """Call driver function ``name``; return its outputs (None, one value, or a tuple).

    Raises
    ------
    CudaError
        When the call returns anything but ``CUDA_SUCCESS``;
        :class:`CudaOutOfMemory` for ``CUDA_ERROR_OUT_OF_MEMORY``.
    """
    out = getattr(driver(), name)(*args)
    err = int(out[0])
    if err != SUCCESS:
        raise _error(name, out[0], args)
    if len(out) == 1:
        return None
    return out[1] if len(out) == 2 else tuple(out[1:])


def query(name: str, *args: Any) -> bool:
    """Call a query (``cuEventQuery``, ``cuStreamQuery``): True when done, False when not ready."""
    (err, *_) = getattr(driver(), name)(*args)
    if int(err) == SUCCESS:
        return True
    if int(err) == NOT_READY:
        return False
    raise _error(name, err, args)


def result_name(err: Any) -> str:
    """Return the name of a ``CUresult`` (``"CUDA_ERROR_INVALID_VALUE"``), or its number."""
    name = getattr(err, "name", None)
    if isinstance(name, str):
        return name
    try:
        return str(_probe()[0].CUresult(int(err)).name)
    except Exception:  # noqa: BLE001 - an unknown code, or no module to ask: the number says it
        return f"CUresult {int(err)}"


# --- private ---------------------------------------------------------------------------

_lock = threading.Lock()
_state: tuple[Any, str | None] | None = None  # (driver module or None, reason or None)
_forked_after_init = False


def _probe() -> tuple[Any, str | None]:
    global _state
    state = _state
    if state is None:
        with _lock:
            if _state is None:
                _state = _initialize()
            state = _state
    return state


def _initialize() -> tuple[Any, str | None]:
    try:
        module = _import_driver()
    except ImportError as exc:
        return None, f"cuda-python is not installed ({exc}); pip install 'shmshare[cuda]'"
    except Exception as exc:  # noqa: BLE001 - a broken install: say so rather than fail every import of shmshare
        return None, f"importing cuda-python failed: {type(exc).__name__}: {exc}"
    try:
        (err,) = module.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - cuda-python raises when it cannot load libcuda.so: say so
        return None, f"the NVIDIA driver library libcuda.so could not be loaded: {exc}"
    if int(err) != SUCCESS:
        return None, f"cuInit(0) failed with {_name_from(module, err)}"
    err, count = module.cuDeviceGetCount()
    if int(err) != SUCCESS:
        return None, f"cuDeviceGetCount() failed with {_name_from(module, err)}"
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return None, f"no CUDA device is visible{hint}"
    return module, None


def _import_driver() -> Any:
    from cuda.bindings import driver as module  # cuda-python >= 12.6 (pyproject pins it)

    return module


def _name_from(module: Any, err: Any) -> str:
    name = getattr(err, "name", None)
    if isinstance(name, str):
        return name
    try:
        return str(module.CUresult(int(err)).name)
    except Exception:  # noqa: BLE001 - a code this binding does not name: the number says it
        return f"CUresult {int(err)}"


def _error(name: str, err: Any, args: tuple[Any, ...]) -> CudaError:
    code, label = int(err), result_name(err)
    shown = ", ".join(_short(a) for a in args)
    message = f"{name}({shown}) failed with {label}"
    cls = CudaOutOfMemory if code == OUT_OF_MEMORY else CudaError
    return cls(message, call=name, result=code, result_name=label)


def _short(arg: Any) -> str:
    if isinstance(arg, int) and not isinstance(arg, bool):
        return hex(arg) if arg > 4096 else str(arg)
    text = repr(arg)
    return text if len(text) <= 40 else text[:37] + "..."


def _after_fork_in_child() -> None:
    global _forked_after_init
    if _state is not None and _state[0] is not None:
        _forked_after_init = True


_fork.on_fork_in_child(3, _after_fork_in_child)
