"""A user's script under ``mypy --strict`` sees the installed package (it said import-not-found:
the default editable install is an import hook mypy cannot follow) and gets the DataLoader's
type from its dataset, as torch's DataLoader does."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_USER = textwrap.dedent("""
    import numpy as np
    import numpy.typing as npt
    import shmshare


    class Squares:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> npt.NDArray[np.float64]:
            return np.full(3, float(i))


    loader = shmshare.DataLoader(Squares(), batch_size=2)
    reveal_type(loader)
    for batch in loader:
        print(batch)
""")


def test_mypy_strict_on_a_user_script_sees_the_package_and_the_loaders_type(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(_USER)
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir",
                           str(tmp_path / "cache"), str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DataLoader[numpy.ndarray[" in done.stdout and "float64" in done.stdout, done.stdout
