"""Allocator settings in the syntax of ``PYTORCH_CUDA_ALLOC_CONF``.

A settings string is a comma-separated list of ``key:value`` pairs, for
example ``"max_split_size_mb:512,expandable_segments:True"``. The
process-wide settings come from the environment variable
``SHMSHARE_ALLOC_CONF`` (read on first use) and can be changed with
:func:`configure`; an allocator built with ``config=`` uses its own.

Note [Settings]
~~~~~~~~~~~~~~~
Keys and their meaning follow PyTorch's caching allocator:

- ``max_split_size_mb``: blocks this large or larger are never split, and a
  smaller request never takes one. Must be greater than
  ``large_segment_size_mb``. Default: unlimited.
- ``max_non_split_rounding_mb``: a request of at least ``max_split_size``
  takes a cached oversize block only if the block is less than this much
  larger. Must be greater than ``large_segment_size_mb``. Default: 20.
- ``roundup_power2_divisions``: round request sizes up to one of N equal
  divisions of their power-of-two interval. Either one power of two for
  every size (``4``), or per range (``[64:8,256:4,1024:4,>:1]``): each
  ``K:N`` applies N divisions to sizes below K MiB and at or above the
  previous key; ``>:N`` to every size at or above the last key. Keys are
  increasing powers of two; N is a power of two, or 0 for "no rounding".
  This is the meaning PyTorch documents (and the seed notes read).
- ``garbage_collection_threshold``: a fraction in (0, 1). Before asking the
  provider for memory, release the oldest unsplit cached large blocks while
  reserved memory is above this fraction of the provider's capacity.
- ``expandable_segments``: ``True`` or ``False``; see
  Note [Expandable segments] in ``_expandable.py``.
- ``large_segment_size_mb``: shmshare's own key. The segment size for
  requests of 1-10 MiB and the page size of large expandable segments
  (PyTorch's fixed ``kLargeBuffer``). An even number, at least 10. Default 20.
- ``pinned_use_cuda_host_register``, ``pinned_num_register_threads``,
  ``pinned_use_background_threads``, ``pinned_reserve_segment_size_mb``:
  settings of the pinned-host pool, validated here and used there.

An unknown key or a bad value raises ``ValueError`` naming the valid keys or
the accepted values.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

__all__ = [
    "AllocatorConfig",
    "ENV_VAR",
    "UNLIMITED",
    "VALID_KEYS",
    "configure",
    "get_config",
    "parse_config",
]

ENV_VAR = "SHMSHARE_ALLOC_CONF"
MiB = 1 << 20
UNLIMITED = (1 << 64) - 1  # SIZE_MAX: "no limit" for max_split_size, as in PyTorch

_DEFAULT_LARGE_SEGMENT_MB = 20  # PyTorch's kLargeBuffer
_MIN_LARGE_SEGMENT_MB = 10  # requests of 1-10 MiB must fit one large segment
_MAX_REGISTER_THREADS = 128


@dataclass(frozen=True)
class AllocatorConfig:
    """Hold one allocator's settings, in bytes where the key says ``_mb``.

    Build it with :func:`parse_config` (which validates); the defaults are
    PyTorch's.
    """

    max_split_size: int = UNLIMITED  # blocks >= this are never split
    max_non_split_rounding: int = _DEFAULT_LARGE_SEGMENT_MB * MiB  # waste bound for oversize reuse
    roundup_power2_divisions: tuple[tuple[int, int], ...] = ()  # (exclusive upper bound, divisions)
    garbage_collection_threshold: float = 0.0  # 0.0 means off
    expandable_segments: bool = False  # reserve address space, map pages on demand
    large_segment_size: int = _DEFAULT_LARGE_SEGMENT_MB * MiB  # 1-10 MiB segment, large page
    pinned_use_cuda_host_register: bool = False  # host pool: register instead of cudaHostAlloc
    pinned_num_register_threads: int = 1  # host pool: threads that prefault pages
    pinned_use_background_threads: bool = False  # host pool: reap events on a thread
    pinned_reserve_segment_size: int = 0  # host pool: bytes reserved up front

    def divisions(self, size: int) -> int:
        """Return the ``roundup_power2_divisions`` that apply to ``size`` bytes (0: none)."""
        table = self.roundup_power2_divisions
        i = bisect.bisect_right(table, (size, UNLIMITED + 1))
        return table[i][1] if i < len(table) else 0

    def to_string(self) -> str:
        """Return the settings as a string that :func:`parse_config` reads back."""
        parts = []
        if self.max_split_size != UNLIMITED:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MiB}")
        if self.roundup_power2_divisions:
            parts.append(f"roundup_power2_divisions:{_format_divisions(self.roundup_power2_divisions)}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        parts.append(f"expandable_segments:{self.expandable_segments}")
        parts.append(f"large_segment_size_mb:{self.large_segment_size // MiB}")
        parts.append(f"pinned_use_cuda_host_register:{self.pinned_use_cuda_host_register}")
        parts.append(f"pinned_num_register_threads:{self.pinned_num_register_threads}")
        parts.append(f"pinned_use_background_threads:{self.pinned_use_background_threads}")
        if self.pinned_reserve_segment_size:
            parts.append(f"pinned_reserve_segment_size_mb:{self.pinned_reserve_segment_size // MiB}")
        return ",".join(parts)


def parse_config(
    text: str, base: AllocatorConfig | None = None, *, source: str = "allocator settings"
) -> AllocatorConfig:
    """Parse a settings string onto ``base`` (the defaults when None).

    Keys not named in ``text`` keep their value from ``base``.

    Raises
    ------
    ValueError
        For an unknown key, a malformed pair or a bad value; the message
        names ``source`` and lists the valid keys or values.
    """
    values: dict[str, object] = {}
    for item in _split_items(text, source):
        key, sep, raw = item.partition(":")
        key, raw = key.strip(), raw.strip()
        if key not in _PARSERS:
            raise ValueError(
                f"{source}: unknown key {key!r} in {text!r}; valid keys are: {', '.join(VALID_KEYS)}"
            )
        if not sep or not raw:
            raise ValueError(f"{source}: {key} needs a value, as in '{key}:<value>'")
        field_name, parse = _PARSERS[key]
        values[field_name] = parse(raw, f"{source}: {key}")
    config = replace(base or AllocatorConfig(), **values)  # type: ignore[arg-type]
    _check_relations(config, source, rounding_given="max_non_split_rounding" in values)
    return config


def get_config() -> AllocatorConfig:
    """Return the process-wide settings (from ``SHMSHARE_ALLOC_CONF`` on first use)."""
    global _current
    with _lock:
        if _current is None:
            _current = parse_config(os.environ.get(ENV_VAR, ""), source=ENV_VAR)
        return _current


def configure(text: str) -> AllocatorConfig:
    """Change the process-wide settings for allocators created from now on.

    Keys named in ``text`` replace the current values; the others stay (as
    PyTorch's ``torch.cuda.memory._set_allocator_settings`` does). Returns the
    new settings.
    """
    global _current
    new = parse_config(text, get_config(), source="shmshare.memory.configure")
    with _lock:
        _current = new
    return new


# --- private helpers -------------------------------------------------------------

_lock = threading.Lock()
_current: AllocatorConfig | None = None


def _split_items(text: str, source: str) -> list[str]:
    """Split at commas that are not inside ``[...]``."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{source}: unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"{source}: unbalanced '[' in {text!r}")
    items.append(text[start:])
    return [item for item in items if item.strip()]


def _parse_bool(raw: str, where: str) -> bool:
    if raw in ("True", "true", "1"):
        return True
    if raw in ("False", "false", "0"):
        return False
    raise ValueError(f"{where} expects True or False, got {raw!r}")


def _parse_int(raw: str, where: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{where} expects a whole number, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{where} expects a number >= 0, got {raw!r}")
    return value


def _parse_mb(raw: str, where: str) -> int:
    return _parse_int(raw, where) * MiB


def _parse_max_split(raw: str, where: str) -> int:
    return min(_parse_mb(raw, where), UNLIMITED)  # "huge" means unlimited, as PyTorch clamps


def _parse_positive_mb(raw: str, where: str) -> int:
    value = _parse_int(raw, where)
    if value <= 0:
        raise ValueError(f"{where} expects a size in MiB > 0, got {raw!r}")
    return value * MiB


def _parse_large_segment(raw: str, where: str) -> int:
    value = _parse_int(raw, where)
    if value < _MIN_LARGE_SEGMENT_MB or value % 2:
        raise ValueError(
            f"{where} expects an even number of MiB >= {_MIN_LARGE_SEGMENT_MB}, got {raw!r}"
        )
    return value * MiB


def _parse_fraction(raw: str, where: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{where} expects a fraction between 0.0 and 1.0, got {raw!r}") from None
    if not 0.0 < value < 1.0:
        raise ValueError(f"{where} expects a fraction between 0.0 and 1.0 (exclusive), got {raw!r}")
    return value


def _parse_threads(raw: str, where: str) -> int:
    value = _parse_int(raw, where)
    if not _is_power_of_two(value) or value > _MAX_REGISTER_THREADS:
        raise ValueError(f"{where} expects a power of two from 1 to {_MAX_REGISTER_THREADS}, got {raw!r}")
    return value


def _parse_divisions(raw: str, where: str) -> tuple[tuple[int, int], ...]:
    if not raw.startswith("["):
        value = _parse_int(raw, where)
        if not _is_power_of_two(value):
            raise ValueError(f"{where} expects a power of two, or a list like [64:8,256:4,>:1], got {raw!r}")
        return ((UNLIMITED, value),)
    if not raw.endswith("]"):
        raise ValueError(f"{where}: a list must end with ']', got {raw!r}")
    table: list[tuple[int, int]] = []
    entries = [e.strip() for e in raw[1:-1].split(",") if e.strip()]
    for n, entry in enumerate(entries):
        bound, sep, div = (part.strip() for part in entry.partition(":"))
        divisions = _parse_int(div, where) if sep else -1
        if divisions != 0 and not _is_power_of_two(divisions):
            raise ValueError(f"{where}: divisions must be a power of two or 0, got {entry!r}")
        table.append((_parse_bound(bound, n == len(entries) - 1, where), divisions))
        if len(table) > 1 and table[-1][0] <= table[-2][0]:
            raise ValueError(f"{where}: range keys must increase, got {raw!r}")
    if not table:
        raise ValueError(f"{where}: empty list {raw!r}")
    return tuple(table)


def _parse_bound(bound: str, is_last: bool, where: str) -> int:
    if bound == ">":
        if not is_last:
            raise ValueError(f"{where}: '>' must be the last range")
        return UNLIMITED
    mb = _parse_int(bound, where)
    if not _is_power_of_two(mb):
        raise ValueError(f"{where}: range keys are powers of two (MiB), got {bound!r}")
    return mb * MiB


def _format_divisions(table: tuple[tuple[int, int], ...]) -> str:
    if len(table) == 1 and table[0][0] == UNLIMITED:
        return str(table[0][1])
    items = [(">" if bound == UNLIMITED else str(bound // MiB)) + f":{div}" for bound, div in table]
    return "[" + ",".join(items) + "]"


def _check_relations(config: AllocatorConfig, source: str, *, rounding_given: bool) -> None:
    """Check rules that tie two keys together (PyTorch: both must exceed kLargeBuffer).

    The rounding rule applies only to a value given explicitly: its default
    equals the default large segment size, as PyTorch's does.
    """
    large_mb = config.large_segment_size // MiB
    if config.max_split_size != UNLIMITED and config.max_split_size <= config.large_segment_size:
        raise ValueError(
            f"{source}: max_split_size_mb too small, must be > {large_mb} (large_segment_size_mb)"
        )
    if rounding_given and config.max_non_split_rounding <= config.large_segment_size:
        raise ValueError(
            f"{source}: max_non_split_rounding_mb too small, must be > {large_mb} (large_segment_size_mb)"
        )


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


_Parser = Callable[[str, str], object]
_PARSERS: dict[str, tuple[str, _Parser]] = {
    "max_split_size_mb": ("max_split_size", _parse_max_split),
    "max_non_split_rounding_mb": ("max_non_split_rounding", _parse_mb),
    "roundup_power2_divisions": ("roundup_power2_divisions", _parse_divisions),
    "garbage_collection_threshold": ("garbage_collection_threshold", _parse_fraction),
    "expandable_segments": ("expandable_segments", _parse_bool),
    "large_segment_size_mb": ("large_segment_size", _parse_large_segment),
    "pinned_use_cuda_host_register": ("pinned_use_cuda_host_register", _parse_bool),
    "pinned_num_register_threads": ("pinned_num_register_threads", _parse_threads),
    "pinned_use_background_threads": ("pinned_use_background_threads", _parse_bool),
    "pinned_reserve_segment_size_mb": ("pinned_reserve_segment_size", _parse_positive_mb),
}
VALID_KEYS: tuple[str, ...] = tuple(_PARSERS)
assert {name for name, _ in _PARSERS.values()} == {f.name for f in fields(AllocatorConfig)}
