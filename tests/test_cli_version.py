"""``shmshare --version`` prints the installed version."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version


def test_version_prints_the_installed_version():
    done = subprocess.run([sys.executable, "-m", "shmshare", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"shmshare {version('shmshare')}"
