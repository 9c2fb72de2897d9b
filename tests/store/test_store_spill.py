"""Spilling (Note [Spilling] in store/_spill.py): past --limit, unreferenced objects go to files
in --spill DIR, least recently used first, and come back on get; a full directory refuses the put
and loses nothing; a daemon killed after (or in the middle of) a spill is restarted on the
directory and serves what was spilled."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from shmshare.store import Daemon, Store, StoreError, StoreFull
from shmshare.testing import pattern, procs, wait_until

from .helpers import WAIT

MiB = 1 << 20
OBJ = 3 << 18  # int32 items: 3 MiB, a memfd of its own under an 8 MiB limit


@contextlib.contextmanager
def _daemon(sockdir: str, spill: str, limit: str = "8M") -> Iterator[Daemon]:
    d = Daemon.start(os.path.join(sockdir, f"spill-{os.getpid()}.sock"), limit=limit, spill=spill)
    try:
        yield d
    finally:
        d.kill()
        d.proc.wait(WAIT)


def _kinds(s: Store) -> dict[str, str]:
    return {o.name: o.kind for o in s.list()}


def _files(spill: str) -> list[str]:
    return sorted(f for f in os.listdir(spill) if not f.startswith("."))  # not its .lock


def test_past_the_limit_the_least_recently_used_object_is_spilled_and_read_back(
        sockdir: str, tmp_path) -> None:
    spill = str(tmp_path / "spill")
    with _daemon(sockdir, spill) as d, Store(d.path) as s:
        s.put("a", pattern(1, OBJ))
        s.put("b", pattern(2, OBJ))
        s.get("a")  # now "b" is the least recently used
        s.put("c", pattern(3, OBJ))
        assert _kinds(s) == {"a": "memfd", "b": "spilled", "c": "memfd"}
        assert len(_files(spill)) == 1 and _files(spill)[0].endswith(".spill")
        st = s.stats()
        assert (st["spilled"], st["spilled_bytes"], st["spills"]) == (1, OBJ * 4, 1)
        assert st["held_bytes"] <= 8 * MiB and "b" in s
        shown = subprocess.run([sys.executable, "-m", "shmshare", "stat", "--pid", str(d.pid)],
                               capture_output=True, text=True, timeout=WAIT,
                               env={**os.environ, "COLUMNS": "300"})
        assert f"1 spilled (3.0M in {spill})" in shown.stdout, shown.stdout
        got = s.get("b")  # read back: "a" goes out to make room
        np.testing.assert_array_equal(got, pattern(2, OBJ))
        assert not got.flags.writeable
        assert _kinds(s)["b"] == "memfd" and _kinds(s)["a"] == "spilled"
        assert s.info("b").write_seal == "full" and s.stats()["restores"] == 1
        del got
        s.delete("a")  # a spilled object deleted: its file goes
        wait_until(lambda: _files(spill) == [], "the spill file removed")
        assert s.stats()["spilled_bytes"] == 0


def test_objects_with_views_are_never_spilled(sockdir: str, tmp_path) -> None:
    spill = str(tmp_path / "spill")
    with _daemon(sockdir, spill) as d, Store(d.path) as s:
        s.put("a", pattern(1, OBJ))
        s.put("b", pattern(2, OBJ))
        va, vb = s.get("a"), s.get("b")
        with pytest.raises(StoreFull, match="--spill, but nothing unreferenced is left"):
            s.put("c", pattern(3, OBJ))
        assert _files(spill) == [] and _kinds(s) == {"a": "memfd", "b": "memfd"}
        del vb
        wait_until(lambda: s.info("b").refs == 0, "b's reference given back")
        s.put("c", pattern(3, OBJ))
        assert _kinds(s) == {"a": "memfd", "b": "spilled", "c": "memfd"}
        np.testing.assert_array_equal(va, pattern(1, OBJ))
        with pytest.raises(StoreFull):  # no room to read "b" back: both others are viewed
            vc = s.get("c")  # noqa: F841 - held
            s.get("b")
        assert _kinds(s)["b"] == "spilled"


def _limit_files(pid: int, nbytes: int) -> None:
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))  # soft only


def test_a_full_spill_directory_refuses_the_put_and_loses_nothing(sockdir: str, tmp_path) -> None:
    """The daemon may write files of at most 1 MiB (RLIMIT_FSIZE: EFBIG, as ENOSPC would be): the
    spill of a 3 MiB object fails, the put that needed the room is refused naming the
    directory, and the object stays in memory, whole; no partial file is left."""
    spill = str(tmp_path / "spill")
    with _daemon(sockdir, spill) as d, Store(d.path) as s:
        s.put("a", pattern(1, OBJ))
        s.put("b", pattern(2, OBJ))
        _limit_files(d.pid, MiB)
        with pytest.raises(StoreFull, match=r"spill directory .* is full") as info:
            s.put("c", pattern(3, OBJ))
        assert "stays in memory" in str(info.value) and spill in str(info.value)
        assert _files(spill) == [] and _kinds(s) == {"a": "memfd", "b": "memfd"}
        np.testing.assert_array_equal(s.get("a"), pattern(1, OBJ))
        _limit_files(d.pid, resource.RLIM_INFINITY)
        s.put("c", pattern(3, OBJ))  # room again
        assert sorted(_kinds(s).values()) == ["memfd", "memfd", "spilled"]


def test_a_killed_daemons_spilled_objects_come_back_with_the_next_one(sockdir: str,
                                                                       tmp_path) -> None:
    spill = str(tmp_path / "spill")
    value = {"w": pattern(4, OBJ), "step": 7, "t": ("x", 2.5)}
    with _daemon(sockdir, spill) as d, Store(d.path) as s:
        s.put("kept", value)
        s.put("b", pattern(5, OBJ))
        s.put("c", pattern(6, OBJ))  # "kept" is spilled
        assert _kinds(s)["kept"] == "spilled"
    # killed (SIGKILL): the objects in memory are gone with it, the spilled one is on disk; a
    # spill the kill cut short left a .tmp file
    cut = os.path.join(spill, ".99-1-1.tmp")
    with open(cut, "wb") as f:
        f.write(b"SHMSPILL partial")
    with open(os.path.join(spill, "junk.spill"), "wb") as f:
        f.write(b"not a spill file")
    with _daemon(sockdir, spill) as d, Store(d.path) as s:
        assert _kinds(s) == {"kept": "spilled"}
        got = s.get("kept")
        np.testing.assert_array_equal(got["w"], pattern(4, OBJ))
        assert got["step"] == 7 and got["t"] == ("x", 2.5)
        assert not os.path.exists(cut)  # the cut-short spill removed
        assert _files(spill) == ["junk.spill"]  # what it cannot read is left, and reported
        del got
        d.stop()
    assert _files(spill) == ["junk.spill"]  # a stop frees every object, spilled ones too


def test_spill_needs_a_limit_no_evict_and_a_private_directory(tmp_path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shmshare", "serve",
                               "--socket", str(tmp_path / "x.sock"), *args],
                              capture_output=True, text=True, timeout=WAIT)

    got = serve("--spill", str(tmp_path / "s"))
    assert got.returncode == 2 and "no --limit was given" in got.stderr
    got = serve("--spill", str(tmp_path / "s"), "--limit", "8M", "--evict")
    assert got.returncode == 2 and "not both" in got.stderr
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    got = serve("--spill", str(open_dir), "--limit", "8M")
    assert got.returncode == 1 and "not writable by others (chmod 700)" in got.stderr
    with pytest.raises(ValueError, match="no --limit was given"):
        Daemon.start(tmp_path / "y.sock", spill=tmp_path / "s")
    got = serve("--spill", "", "--limit", "8M")  # an unset variable: never the current directory
    assert got.returncode == 2 and "empty path" in got.stderr
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(StoreError, match="name a directory"):  # its reason, not "see stderr"
        Daemon.start(tmp_path / "z.sock", limit="8M", spill=a_file)


def test_a_spill_file_changed_outside_the_store_is_an_error_not_a_drop_nor_its_bytes(
        sockdir: str, tmp_path) -> None:
    """Cut short, replaced by another object's file, or by a symlink or a FIFO: the get raises a
    StoreError naming the file, and the client keeps its connection and its other views."""
    spill = str(tmp_path / "spill")
    outside = tmp_path / "outside"
    outside.write_bytes(b"A" * (OBJ * 4 + 8192))
    with _daemon(sockdir, spill) as d, Store(d.path) as s:
        s.put("held", pattern(9, 100))
        held = s.get("held")
        for k, tamper in enumerate(("truncate", "swap", "symlink", "fifo")):
            a, b, c = f"a{k}", f"b{k}", f"c{k}"
            s.put(a, pattern(1, OBJ))
            s.put(b, pattern(2, OBJ))
            s.put(c, pattern(3, OBJ))  # a is spilled
            s.put(f"d{k}", pattern(4, OBJ))  # and b
            files = {s2: os.path.join(spill, f) for f in _files(spill)
                     for s2 in (a, b) if _owner(os.path.join(spill, f)) == s2}
            path = files[a]
            if tamper == "truncate":
                os.truncate(path, 5000)
            elif tamper == "swap":
                os.replace(files[b], path)
            elif tamper == "symlink":
                os.unlink(path)
                os.symlink(outside, path)
            else:
                os.unlink(path)
                os.mkfifo(path)
            with pytest.raises(StoreError, match="spill"):
                s.get(a)
            np.testing.assert_array_equal(held, pattern(9, 100))
            assert s.info("held").refs == 1  # still connected, its reference kept
            for name in (a, b, c, f"d{k}"):
                with contextlib.suppress(KeyError):
                    s.delete(name)
            for f in os.listdir(spill):
                if not f.startswith("."):
                    os.unlink(os.path.join(spill, f))
        del held


def _owner(path: str) -> str | None:
    """The object name a spill file holds, read as the daemon does."""
    from shmshare.store._spill import _read_header

    try:
        return _read_header(path).name
    except Exception:  # noqa: BLE001 - not a spill file
        return None


def test_a_second_daemon_on_a_spill_directory_in_use_is_refused(sockdir: str, tmp_path) -> None:
    spill = str(tmp_path / "spill")
    with _daemon(sockdir, spill):
        got = subprocess.run([sys.executable, "-m", "shmshare", "serve", "--socket",
                              str(tmp_path / "second.sock"), "--limit", "8M", "--spill", spill],
                             capture_output=True, text=True, timeout=WAIT)
        assert got.returncode == 1 and "in use by another store daemon" in got.stderr


def _put_then_get(path: str, name: str, value_seed: int, n: int, other: str) -> None:
    """A client whose put makes the daemon spill, then whose get makes it read back."""
    with Store(path, timeout=WAIT) as s:
        s.put(name, pattern(value_seed, n))
        s.get(other)  # read back: the daemon may be killed in the middle
    os._exit(0)


@pytest.mark.parametrize("when", [0.0, 0.05, 0.15, 0.3])
def test_a_daemon_killed_while_it_spills_or_reads_back_loses_nothing_sealed_to_disk(
        sockdir: str, tmp_path, when: float) -> None:
    """kill -9 at some moment of a 64 MiB spill and read-back: the daemon started next on the
    directory serves every spilled object it finds whole, with its bytes, and nothing else
    (what was in memory went with the killed daemon)."""
    import time

    spill = str(tmp_path / "spill")
    n = 16 << 20  # int32 items: 64 MiB
    with _daemon(sockdir, spill, limit="150M") as d, Store(d.path) as s:
        s.put("a", pattern(1, n))
        s.put("b", pattern(2, n))
        with procs.start_child(_put_then_get, d.path, "c", 3, n, "a") as child:
            time.sleep(when)  # some moment of the spill of "a" and its read-back (not asserted)
            d.kill()
            child.join(WAIT)
    with _daemon(sockdir, spill, limit="150M") as d, Store(d.path) as s:
        want = {"a": 1, "b": 2, "c": 3}
        for info in s.list():
            assert info.kind == "spilled", info
            np.testing.assert_array_equal(s.get(info.name), pattern(want[info.name], n))
        assert not [f for f in os.listdir(spill) if f.endswith(".tmp")]
