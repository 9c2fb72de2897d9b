"""Size policy: rounding, size classes and segment sizes, as PyTorch's."""

from __future__ import annotations

import pytest

from shmshare.memory import format_size, parse_config, round_size
from shmshare.memory._policy import allocation_size

MiB = 1 << 20
DEFAULT = parse_config("")


@pytest.mark.parametrize(
    ("size", "rounded"), [(0, 512), (1, 512), (512, 512), (513, 1024), (1000, 1024), (MiB + 1, MiB + 512)]
)
def test_sizes_round_to_512(size: int, rounded: int) -> None:
    assert round_size(size, DEFAULT) == rounded


def test_power2_divisions_round_within_the_interval() -> None:
    config = parse_config("roundup_power2_divisions:4")
    # 1 MiB..2 MiB in four steps of 256 KiB
    assert round_size(MiB + 1, config) == MiB + 256 * 1024
    assert round_size(MiB + 300 * 1024, config) == MiB + 512 * 1024
    assert round_size(2 * MiB, config) == 2 * MiB  # a power of two stays
    assert round_size(1500, config) == 1536  # too small for 4 divisions: plain 512 rounding


def test_power2_divisions_per_range() -> None:
    config = parse_config("roundup_power2_divisions:[64:8,256:4,>:1]")
    assert round_size(33 * MiB, config) == 36 * MiB  # 32..64 MiB in steps of 4 MiB
    assert round_size(129 * MiB, config) == 160 * MiB  # 128..256 MiB in steps of 32 MiB
    assert round_size(300 * MiB + 1, config) == 300 * MiB + 512  # one division: no power-2 rounding


@pytest.mark.parametrize(
    ("size", "segment"),
    [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),
     (10 * MiB, 10 * MiB), (11 * MiB, 12 * MiB), (33 * MiB, 34 * MiB)],
)
def test_allocation_sizes(size: int, segment: int) -> None:
    assert allocation_size(size, DEFAULT) == segment


def test_large_segment_size_is_configurable() -> None:
    assert allocation_size(3 * MiB, parse_config("large_segment_size_mb:32")) == 32 * MiB


def test_format_size_reads_like_pytorch() -> None:
    assert format_size(100) == "100 bytes"
    assert format_size(4096) == "4.00 KiB"
    assert format_size(20 * MiB) == "20.00 MiB"
    assert format_size(3 << 30) == "3.00 GiB"
