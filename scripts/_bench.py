"""What the bench_*.py scripts share: printing a table, and sizes as "4K", "64M"."""

from __future__ import annotations

import sys

__all__ = ["table", "parse_size", "fmt_size"]

_KiB, _MiB = 1 << 10, 1 << 20


def parse_size(text: str) -> int:
    """Bytes of a size written as 4K, 64M, 1G, 4KiB, 512 ..."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": _KiB, "M": _MiB, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def fmt_size(n: int) -> str:
    """A size as parse_size reads it: 4K, 64M, or plain bytes."""
    for unit, scale in (("G", 1 << 30), ("M", _MiB), ("K", _KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def table(head: list[str], rows: list[list[str]]) -> None:
    """Print `rows` under `head`, first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        print("    " + "  ".join(cells))
    sys.stdout.flush()
