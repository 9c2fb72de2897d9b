"""Settings in the syntax of PYTORCH_CUDA_ALLOC_CONF: parsing, errors, env, precedence."""

from __future__ import annotations

import pytest

from shmshare.memory import (
    AllocatorConfig,
    CachingAllocator,
    SimulatedDevice,
    configure,
    get_config,
    parse_config,
)
from shmshare.memory._config import UNLIMITED, VALID_KEYS

MiB = 1 << 20


def test_defaults_are_pytorchs() -> None:
    config = parse_config("")
    assert config == AllocatorConfig()
    assert config.max_split_size == UNLIMITED
    assert config.max_non_split_rounding == 20 * MiB
    assert config.large_segment_size == 20 * MiB
    assert not config.expandable_segments and config.garbage_collection_threshold == 0.0


def test_every_key_parses() -> None:
    config = parse_config(
        " max_split_size_mb:512, max_non_split_rounding_mb:200,roundup_power2_divisions:[64:8,256:4,1024:4,>:1],"
        "garbage_collection_threshold:0.6,expandable_segments:True,large_segment_size_mb:40,"
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
        "pinned_use_background_threads:True,pinned_reserve_segment_size_mb:64"
    )
    assert config.max_split_size == 512 * MiB
    assert config.max_non_split_rounding == 200 * MiB
    assert config.roundup_power2_divisions == ((64 * MiB, 8), (256 * MiB, 4), (1024 * MiB, 4), (UNLIMITED, 1))
    assert config.garbage_collection_threshold == 0.6
    assert config.expandable_segments and config.large_segment_size == 40 * MiB
    assert config.pinned_use_cuda_host_register and config.pinned_use_background_threads
    assert config.pinned_num_register_threads == 8
    assert config.pinned_reserve_segment_size == 64 * MiB
    assert parse_config(config.to_string()) == config


def test_divisions_apply_per_range() -> None:
    config = parse_config("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]")
    assert config.divisions(10 * MiB) == 8
    assert config.divisions(64 * MiB - 1) == 8
    assert config.divisions(64 * MiB) == 4
    assert config.divisions(1000 * MiB) == 4
    assert config.divisions(4096 * MiB) == 1
    assert parse_config("roundup_power2_divisions:4").divisions(5 * MiB) == 4
    assert parse_config("roundup_power2_divisions:[64:8]").divisions(128 * MiB) == 0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("max_split_sz_mb:10", "unknown key 'max_split_sz_mb'"),
        ("expandable_segments:yes", "expects True or False, got 'yes'"),
        ("expandable_segments", "needs a value"),
        ("max_split_size_mb:-3", "expects a number >= 0"),
        ("max_split_size_mb:lots", "expects a whole number"),
        ("max_split_size_mb:20", "max_split_size_mb too small, must be > 20"),
        ("max_non_split_rounding_mb:10", "max_non_split_rounding_mb too small"),
        ("garbage_collection_threshold:1.5", "between 0.0 and 1.0"),
        ("garbage_collection_threshold:0", "between 0.0 and 1.0"),
        ("roundup_power2_divisions:3", "power of two"),
        ("roundup_power2_divisions:[64:8,32:4]", "must increase"),
        ("roundup_power2_divisions:[60:8]", "powers of two"),
        ("roundup_power2_divisions:[>:1,64:8]", "'>' must be the last"),
        ("roundup_power2_divisions:[64:3]", "power of two or 0"),
        ("roundup_power2_divisions:[64:8", "unbalanced '['"),
        ("large_segment_size_mb:7", "even number of MiB >= 10"),
        ("large_segment_size_mb:40,max_split_size_mb:30", "must be > 40"),
        ("pinned_num_register_threads:3", "power of two from 1 to 128"),
        ("pinned_num_register_threads:256", "power of two from 1 to 128"),
        ("pinned_reserve_segment_size_mb:0", "> 0"),
    ],
)
def test_bad_settings_name_the_fix(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_config(text)
    assert fragment in str(info.value)


def test_unknown_key_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        parse_config("nope:1")
    for key in VALID_KEYS:
        assert key in str(info.value)


def test_environment_sets_the_process_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMSHARE_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    config = get_config()
    assert config.expandable_segments and config.max_split_size == 64 * MiB
    assert CachingAllocator(SimulatedDevice(1 << 30)).config is config


def test_bad_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMSHARE_ALLOC_CONF", "bogus:1")
    with pytest.raises(ValueError, match="SHMSHARE_ALLOC_CONF"):
        get_config()


def test_configure_merges_onto_current_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMSHARE_ALLOC_CONF", "max_split_size_mb:64")
    configure("expandable_segments:True")
    configure("garbage_collection_threshold:0.5")
    config = get_config()
    assert config.max_split_size == 64 * MiB
    assert config.expandable_segments and config.garbage_collection_threshold == 0.5


def test_allocator_config_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMSHARE_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    device = SimulatedDevice(1 << 30)
    as_string = CachingAllocator(device, "expandable_segments:False").config
    assert not as_string.expandable_segments and as_string.max_split_size == 64 * MiB
    as_object = CachingAllocator(device, AllocatorConfig()).config
    assert as_object == AllocatorConfig()


def test_expandable_needs_an_expandable_provider() -> None:
    class Classic:
        def allocate(self, nbytes): ...
        def free(self, handle): ...
        def capacity(self): return None
        def free_bytes(self): return None
        def default_stream(self): return 0
        def record_event(self, stream): ...
        def event_done(self, event): return True
        def synchronize(self, stream=None): ...

    CachingAllocator(Classic(), "expandable_segments:False")
    with pytest.raises(ValueError, match="reserve/map/unmap/release"):
        CachingAllocator(Classic(), "expandable_segments:True")
