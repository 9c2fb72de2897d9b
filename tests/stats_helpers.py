"""What the stats socket's tests share: a private stats directory per test (the `home`
fixture lives in tests/conftest.py), made on demand."""

from __future__ import annotations

import os

from shmshare import _statsd


def stats_dir() -> str:
    """The first stats directory for this user, made (0700) if missing."""
    d = _statsd.stats_dirs()[0]
    for part in (os.path.dirname(d), d):
        if not os.path.isdir(part):
            os.mkdir(part, 0o700)
    return d
