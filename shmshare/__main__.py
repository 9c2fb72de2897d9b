"""Run the ``shmshare`` command line as ``python -m shmshare``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
