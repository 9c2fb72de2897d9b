"""What the parity tests share: the loader parameter, the fixtures, the helpers (see test_torch_parity.py)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the parity tests compare against torch.utils.data.DataLoader")
np = pytest.importorskip("numpy")


import shmshare  # noqa: E402

from . import parity_datasets as pd  # noqa: E402,F401

TorchDataLoader = torch.utils.data.DataLoader
REPO = Path(__file__).resolve().parents[2]

loader_cls_param = pytest.mark.parametrize(
    "loader_cls",
    [
        pytest.param(TorchDataLoader, id="torch"),
        pytest.param(
            getattr(shmshare, "DataLoader", None),
            id="shmshare",
            marks=pytest.mark.skipif(not hasattr(shmshare, "DataLoader"), reason="shmshare.DataLoader not built yet"),
        ),
    ],
)




# -- helpers ----------------------------------------------------------------------------------------------------


def run(loader_cls: type, dataset: Any, **kwargs: Any) -> list:
    """Iterate a fresh loader to exhaustion (which shuts its workers down) and return the batches."""
    loader = loader_cls(dataset, **kwargs)
    out = list(loader)
    del loader
    return out


def describe(obj: Any) -> Any:
    """A comparable picture of a batch: every container's type and every leaf's type, dtype, shape and value."""
    if isinstance(obj, torch.Tensor):
        return ("Tensor", type(obj).__name__, str(obj.dtype), tuple(obj.shape), obj.is_contiguous(), obj.tolist())
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, obj.tolist())
    if isinstance(obj, dict):
        return (type(obj).__name__, {k: describe(v) for k, v in obj.items()})
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, [describe(v) for v in obj])
    return (type(obj).__name__, obj)


def torch_base_seed(seed: int) -> int:
    """The base seed torch's loader draws first from `generator=torch.Generator().manual_seed(seed)`."""
    return torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(seed)).item()

def drain(loader: Any, limit: int) -> list:
    """Iterate `loader` once to the end, keeping going after exceptions (at most `limit` steps): each item,
    or ``(type, message)`` for each exception. Only strings are kept of an exception, not the object: torch's
    reraise leaves a reference cycle through its traceback, and an iterator held by it shuts down only at
    garbage collection (in torch's case with a 5 s join per worker)."""
    it = iter(loader)
    out: list = []
    for _ in range(limit):
        try:
            out.append(next(it))
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001 - the test compares what was raised
            out.append((type(e), str(e)))
    del it
    gc.collect()
    return out


def run_driver(module: str, *args: str, within: float) -> dict:
    """Run `python -m module args` in its own process group; kill the group if it passes `within` seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{module} {args} did not finish within {within} s (killed); stderr: {err[-2000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind (its workers share its group)
        except ProcessLookupError:
            pass
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}; stdout: {out[-2000:]}; stderr: {err[-2000:]}"
    return json.loads(lines[-1])
