"""shmshare._cgroup: which memory cgroup limit applies, read from a fake /proc and /sys tree."""

from __future__ import annotations

import pathlib
import shutil

import pytest

from shmshare import _cgroup

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh_cache():
    _cgroup.reset()
    yield
    _cgroup.reset()


def _tree(root: pathlib.Path, cgroup: str, files: dict[str, str]) -> str:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = root / "sys/fs/cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return str(root)


def test_v2_walks_up_and_the_level_with_least_room_wins(tmp_path):
    root = _tree(tmp_path, "0::/a/b\n", {
        "cgroup.controllers": "cpuset cpu io memory pids",
        "a/memory.max": str(500 * MiB), "a/memory.current": str(400 * MiB),  # 100 MiB room
        "a/b/memory.max": str(300 * MiB), "a/b/memory.current": str(100 * MiB),  # 200 MiB room
        "a/b/c/memory.max": "1",  # a child of ours: never ours to obey
    })
    got = _cgroup.memory_limit(root)
    assert got is not None
    assert (got.path, got.version, got.limit, got.usage) == ("/a", 2, 500 * MiB, 400 * MiB)
    assert got.directory == f"{root}/sys/fs/cgroup/a" and got.room == 100 * MiB
    assert got.fits(90 * MiB) and not got.fits(99 * MiB)  # a slack of max(4 MiB, limit/64) is kept


def test_v2_without_a_limit_anywhere_is_none(tmp_path):
    root = _tree(tmp_path, "0::/a\n", {"cgroup.controllers": "memory",
                                       "a/memory.max": "max", "a/memory.current": "123"})
    assert _cgroup.memory_limit(root) is None


def test_hybrid_host_uses_the_v1_memory_controller(tmp_path):
    # cgroup v2 mounted at unified/ without the memory controller, v1 memory beside it.
    huge = str((1 << 63) - 4096)  # v1's "no limit"
    root = _tree(tmp_path, "5:cpu,cpuacct:/\n4:memory:/job/7\n0::/\n", {
        "unified/cgroup.controllers": "",
        "memory/memory.limit_in_bytes": huge, "memory/memory.usage_in_bytes": "1",
        "memory/job/memory.limit_in_bytes": huge, "memory/job/memory.usage_in_bytes": "1",
        "memory/job/7/memory.limit_in_bytes": str(160 * MiB),
        "memory/job/7/memory.usage_in_bytes": str(40 * MiB),
    })
    got = _cgroup.memory_limit(root)
    assert got is not None and (got.path, got.version, got.limit) == ("/job/7", 1, 160 * MiB)


def test_page_cache_counts_as_room_only_when_the_quick_read_says_no(tmp_path):
    root = _tree(tmp_path, "0::/a\n", {
        "cgroup.controllers": "memory",
        "a/memory.max": str(100 * MiB), "a/memory.current": str(90 * MiB),
        "a/memory.stat": f"anon {10 * MiB}\nfile {80 * MiB}\nactive_file {30 * MiB}\n"
                         f"inactive_file {40 * MiB}\nshmem {10 * MiB}",
    })
    quick = _cgroup.memory_limit(root)
    assert quick is not None and quick.reclaimable == 0  # no request: memory.stat is not read
    got = _cgroup.memory_limit(root, nbytes=50 * MiB)
    assert got is not None and got.reclaimable == 70 * MiB and got.fits(50 * MiB)
    assert not got.fits(77 * MiB)


def test_the_chain_is_cached_and_usage_is_read_every_time(tmp_path):
    root = _tree(tmp_path, "0::/a\n", {"cgroup.controllers": "memory",
                                       "a/memory.max": str(64 * MiB), "a/memory.current": "0",
                                       "b/memory.max": str(32 * MiB), "b/memory.current": "0"})
    assert _cgroup.memory_limit(root).usage == 0
    assert len(_cgroup._chains) == 1
    (tmp_path / "sys/fs/cgroup/a/memory.current").write_text(str(MiB))
    assert _cgroup.memory_limit(root).usage == MiB
    assert len(_cgroup._chains) == 1  # the same cgroup: the chain was not resolved again
    # Moved to another cgroup (a forked child its parent put in one): seen at once. A chain
    # cached in the parent before the fork once hid the child's limit, and it was OOM-killed.
    (tmp_path / "proc/self/cgroup").write_text("0::/b\n")
    got = _cgroup.memory_limit(root)
    assert got.path == "/b" and got.limit == 32 * MiB
    shutil.rmtree(tmp_path / "sys/fs/cgroup/b")  # our cgroup disappears: no limit, resolved afresh
    assert _cgroup.memory_limit(root) is None
    assert not [k for k in _cgroup._chains if k[0] == root]


def test_no_proc_means_no_limit(tmp_path):
    assert _cgroup.memory_limit(str(tmp_path)) is None
