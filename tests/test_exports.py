"""Every public name is real, documented in its docstring and in the docs, and typed (as trio's test_exports).

The public API is ``__all__`` of the packages users import (below). ``wire``, ``tensors``
and ``segment`` are layers the services are built on; what users need of them is
re-exported at the top. shmshare.multiprocessing re-exports the stdlib's and torch's
names, documented there: only the names it adds are checked here.
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import pathlib
import re
from typing import Any

import pytest

PUBLIC = ["shmshare", "shmshare.channel", "shmshare.memory", "shmshare.store", "shmshare.loader",
          "shmshare.testing", "shmshare.cuda", "shmshare.multiprocessing"]
ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))) + (ROOT / "README.md").read_text()
# torch.multiprocessing's own names (not the stdlib's), which shmshare.multiprocessing offers as torch does
TORCH_MP = {"get_sharing_strategy", "set_sharing_strategy", "get_all_sharing_strategies", "spawn",
            "start_processes", "ProcessContext", "ProcessRaisedException", "ProcessExitedException",
            "SpawnContext", "init_reductions"}


def _own_names(modname: str) -> list[str]:
    mod = importlib.import_module(modname)
    names = list(mod.__all__)
    if modname == "shmshare.multiprocessing":
        stdlib = set(multiprocessing.__all__) | {"reducer"}
        names = [n for n in names if n not in stdlib and n not in TORCH_MP]
    return names


CASES = [(m, n) for m in PUBLIC for n in _own_names(m)]


@pytest.mark.parametrize(("modname", "name"), CASES, ids=[f"{m}.{n}" for m, n in CASES])
def test_public_name_is_real_documented_and_typed(modname: str, name: str) -> None:
    mod = importlib.import_module(modname)
    obj = getattr(mod, name)  # AttributeError: __all__ names something that is not there
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
        assert inspect.getdoc(obj), f"{modname}.{name} has no docstring"
        assert (getattr(obj, "__module__", None) or obj.__name__).startswith("shmshare"), (
            f"{modname}.{name} is {obj!r}, not shmshare's own")
    assert re.search(rf"(?<![\w.]){re.escape(name)}\b", DOCS) or re.search(
        rf"\b{re.escape(modname.rsplit('.', 1)[-1])}\.{re.escape(name)}\b", DOCS), (
        f"{modname}.{name} is public but neither README.md nor docs/*.md mention it")
    for fn in _callables(obj):
        sig = inspect.signature(fn)
        missing = [p.name for p in sig.parameters.values()
                   if p.annotation is inspect.Parameter.empty and p.name not in ("self", "cls")]
        assert not missing, f"{modname}.{name}: {fn.__qualname__} has untyped parameters {missing}"


def _callables(obj: Any) -> list[Any]:
    """The function itself, or a class's public methods defined in shmshare (and __init__)."""
    if inspect.isfunction(obj):
        return [obj]
    if not inspect.isclass(obj):
        return []
    out = []
    for attr, value in vars(obj).items():
        if ((not attr.startswith("_") or attr == "__init__") and inspect.isfunction(value)
                and value.__module__.startswith("shmshare")):  # not typing's Protocol __init__
            out.append(value)
    return out


def test_every_public_package_has_all() -> None:
    for modname in PUBLIC:
        mod = importlib.import_module(modname)
        assert isinstance(getattr(mod, "__all__", None), list), f"{modname} has no __all__ list"
        assert len(set(mod.__all__)) == len(mod.__all__), f"{modname}.__all__ repeats a name"
