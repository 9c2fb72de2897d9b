"""A user's script under ``mypy --strict`` sees the installed package (it said import-not-found:
the default editable install is an import hook mypy cannot follow), gets the DataLoader's type
from its dataset, as torch's DataLoader does, and gets what ``recv()``, ``Store.get()`` and
``mp.empty``/``mp.zeros`` return as precisely as from ``Queue[T].get()``, ``Shelf[V]`` and
``np.empty``/``torch.empty``: ``assert_type`` fails the run where a type falls back to Any."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_USER = textwrap.dedent("""
    from typing import Any, assert_type

    import numpy as np
    import numpy.typing as npt
    import shmshare
    import shmshare.multiprocessing as mp
    from shmshare import Receiver, Store

    F32 = npt.NDArray[np.float32]


    class Squares:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> npt.NDArray[np.float64]:
            return np.full(3, float(i))


    loader = shmshare.DataLoader(Squares(), batch_size=2)
    reveal_type(loader)
    for batch in loader:
        print(batch)

    assert_type(mp.empty(3), npt.NDArray[np.float64])
    assert_type(mp.zeros((2, 3), np.float32), F32)
    assert_type(mp.empty([2], dtype=np.dtype(np.int16)), npt.NDArray[np.int16])
    assert_type(mp.zeros(4, "uint8"), npt.NDArray[Any])
    assert_type(mp.statistics(), mp.OwnerStatistics)
    mp.empty(2.5)  # type: ignore[call-overload]


    def receive(rx: Receiver[dict[str, F32]]) -> None:
        assert_type(rx.recv(), dict[str, F32])
        assert_type(rx.recv_from(1.0), tuple[int, dict[str, F32]])
        for got in rx:
            assert_type(got, dict[str, F32])


    def receive_anything(rx: Receiver) -> None:  # unparameterized: no error under --strict
        assert_type(rx.recv(), Any)


    def store(s: Store[F32]) -> None:
        assert_type(s.get("x", timeout=1.0), F32)
        s.put("x", np.zeros(3, np.float32))
        s.put("y", [1, 2])  # type: ignore[arg-type]
        assert_type(s.create("z", (2, 3), np.uint8), npt.NDArray[np.uint8])
        with Store() as plain:
            assert_type(plain, Store[Any])


    tx, rx = shmshare.channel()
    assert_type(rx, Receiver[Any])
    typed: Store[F32] = Store()
""")

_USER_TORCH = textwrap.dedent("""
    import torch

    assert_type(mp.empty(3, torch.float32), torch.Tensor)
    assert_type(mp.zeros((2, 2), dtype=torch.bfloat16), torch.Tensor)


    def store_tensors(s: Store[torch.Tensor]) -> None:
        assert_type(s.get("t"), torch.Tensor)
        assert_type(s.create("u", 4, torch.float16), torch.Tensor)
""")


# mypy's own incremental cache, kept between runs beside the project's (.mypy_cache ignores itself in git):
# a fresh one made mypy read numpy's stubs and torch's sources again at every run (40-50 s of the suite;
# ~1 s warm). mypy re-checks what changed since (each module's mtime and hash, the options, its version),
# and finds the package anew at every run: a cache cannot hide an import-not-found.
CACHE = Path(__file__).resolve().parents[1] / ".mypy_cache" / "test_typing"


@pytest.mark.slow
@pytest.mark.timeout(900)  # mypy reads numpy's stubs, and torch's sources when torch is installed (cold cache)
def test_mypy_strict_on_a_user_script_sees_the_package_and_its_types(tmp_path):
    script = tmp_path / "user.py"
    has_torch = importlib.util.find_spec("torch") is not None
    script.write_text(_USER + (_USER_TORCH if has_torch else ""))
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(CACHE), str(script)],
                          capture_output=True, text=True, timeout=800, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DataLoader[numpy.ndarray[" in done.stdout and "float64" in done.stdout, done.stdout
