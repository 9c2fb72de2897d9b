"""Sizes as people write them: ``4096``, ``8M``, ``64MiB``, ``1G`` (binary units), for the command
line's ``--limit`` and ``--size`` and for ``Daemon.start(limit=...)``."""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``4096``, ``8M``, ``64MiB`` or ``1G``; ValueError saying what is
    wrong otherwise (not a size, or under one 4 KiB page)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 4096, 8M, 64MiB, 1G)")
    nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if nbytes < 4096:
        raise ValueError(f"size must be at least 4 KiB (one page), got {text!r}")
    return nbytes
