"""What the bench_*.py scripts share: printing a table."""

from __future__ import annotations

import sys

__all__ = ["table"]


def table(head: list[str], rows: list[list[str]]) -> None:
    """Print `rows` under `head`, first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        print("    " + "  ".join(cells))
    sys.stdout.flush()
