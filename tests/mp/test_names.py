"""Every name ``torch.multiprocessing`` has is reachable through ``shmshare.multiprocessing``: a
drop-in forwards what it does not replace (``_set_thread_name``, ``reductions``, ``pool``,
``ENV_VAR_PARALLEL_START``, ...), and multiprocessing's submodules too."""

from __future__ import annotations

import multiprocessing.reduction

import pytest

import shmshare.multiprocessing as smp

torch_mp = pytest.importorskip("torch.multiprocessing")

_OURS = {"init_reductions"}  # the one torch name we replace: it registers our reducers


def test_every_name_of_torch_multiprocessing_is_reachable_and_is_torchs_unless_ours():
    names = [n for n in dir(torch_mp) if not n.startswith("__")]
    missing = [n for n in names if not hasattr(smp, n)]
    assert not missing, f"not reachable through shmshare.multiprocessing: {missing}"
    for n in names:
        if n not in _OURS:
            assert getattr(smp, n) is getattr(torch_mp, n), n
    assert set(names) <= set(dir(smp))


@pytest.mark.parametrize("name", ["pool", "queue", "reductions"])
def test_torchs_submodules_are_reachable_as_attributes(name):
    assert getattr(smp, name).__name__ == f"torch.multiprocessing.{name}"


def test_multiprocessings_submodules_are_reachable_as_attributes():
    assert smp.reduction is multiprocessing.reduction
    assert smp.reduction.ForkingPickler is multiprocessing.reduction.ForkingPickler
    assert smp.connection.Connection is multiprocessing.connection.Connection


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no_such_thing"):
        smp.no_such_thing  # noqa: B018


def test_a_tools_probe_of_a_private_name_imports_no_torch():
    """pytest asks every module-level name of a test module for ``_mock_name``: a test file that
    imports this module must not import torch (3-5 s) for that."""
    import subprocess
    import sys

    code = ("import sys, shmshare.multiprocessing as mp\n"
            "assert getattr(mp, '_mock_name', None) is None\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
