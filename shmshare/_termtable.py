"""The CLI's tables: columns fitted to the terminal, and nothing a terminal would act on.

Note [Fitting the table to the terminal]
    ``shmshare stat`` prints its tables for a terminal of some width
    (``$COLUMNS``, else the terminal's, else 100). A line wider than that
    wraps, and the columns under a wrapped header no longer line up; a line
    cut at the width loses what is at its end, which is the command line,
    the one column that says which process a row is. So a table is laid
    out for the width: each column as wide as its widest cell (header
    included), the last column, when it is words (the command, an object's
    name), given what is left. While that leaves the last column fewer than
    ``LAST_ROOM`` characters, the column that matters least goes (each
    column says how long it stays: ``Col.keep``), and a line under the
    table names the columns left out (``--json`` has them all). A header is
    never cut or wrapped. A last cell longer than its room is shortened by
    the table's caller (a command loses directories before it is cut, see
    ``_stat._fit_command``) or cut with "...". Only a terminal too narrow
    for the columns that never go (a few characters) gets lines cut at its
    width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Col", "table", "fit", "printable", "LAST_ROOM"]

LAST_ROOM = 24  # characters a table's last, left-aligned column keeps before other columns go
_NEVER = 9  # Col.keep of a column that never goes


@dataclass(frozen=True)
class Col:
    """A column of a table: its header, how it aligns, and how long it stays on a narrow terminal."""

    head: str
    left: bool = False  # left-aligned (words); else right-aligned (figures)
    keep: int = _NEVER  # the lowest goes first when the table does not fit


def table(cols: list[Col], rows: list[list[str]], width: int, indent: str = "",
          fit_last: Callable[[str, int], str] | None = None) -> list[str]:
    """Return the header, the rows and a line naming the columns left out, each at most `width`
    characters (Note [Fitting the table to the terminal]).

    `fit_last(cell, room)` shortens a cell of the last column, when that one is left-aligned and
    so takes the room that is left; by default the cell is cut with "...".
    """
    rows = [[printable(c) for c in r] for r in rows]  # escaped first: escapes take room
    last = len(cols) - 1
    flex = cols[last].left
    wide = [max([len(c.head)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    least = min(wide[last], max(LAST_ROOM, len(cols[last].head))) if flex else wide[last]
    shown = list(range(len(cols)))

    def others(idx: list[int]) -> int:  # the widths of the columns but the last, and the gaps
        return sum(wide[i] for i in idx if i != last) + 2 * (len(idx) - 1)

    while others(shown) + least > width - len(indent) and any(cols[i].keep < _NEVER for i in shown):
        shown.remove(min((i for i in shown if cols[i].keep < _NEVER), key=lambda i: (cols[i].keep, -i)))
    if flex:
        wide[last] = max(len(cols[last].head), width - len(indent) - others(shown))

    def line(cells: list[str]) -> str:
        out = [(fit_last or fit)(cells[i], wide[i]) if i == last and flex
               else cells[i].ljust(wide[i]) if cols[i].left else cells[i].rjust(wide[i])
               for i in shown]
        # cut only where the columns that never go do not fit (a terminal a few characters wide)
        return (indent + "  ".join(out).rstrip())[:width]

    lines = [line([c.head for c in cols])] + [line(r) for r in rows]
    gone = [c.head for i, c in enumerate(cols) if i not in shown]
    if gone:
        lines.append(fit(f"{indent}(no room for {', '.join(gone)}: see --json)", width))
    return lines


def fit(text: str, room: int) -> str:
    """Return `text`, cut to `room` characters with "..." if it is longer."""
    return text if len(text) <= room else text[:max(0, room - 3)] + "..."[:room]


def printable(text: str) -> str:
    """Return `text` with what a terminal would act on (control and format characters) escaped,
    as ``repr`` does: a process names itself, a store daemon its objects, and both reach root's
    terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
