"""shmshare.Segment: the MapAllocator's open -> resize -> map -> finalize, and close."""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import resource
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmshare import FdLimitError, Flags, Segment, SegmentError, _procfs
from shmshare._fd import Fd
from shmshare._procfs import shm_mappings, shm_names
from shmshare.segment import sweep

BACKENDS = ["memfd", "posix"]
DEFAULT = Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.KEEPFD | Flags.UNLINK


def test_flags_have_pytorch_values():
    assert [Flags.SHARED, Flags.SHAREDMEM, Flags.EXCLUSIVE, Flags.NOCREATE, Flags.KEEPFD,
            Flags.FROMFD, Flags.UNLINK] == [1, 2, 4, 8, 16, 32, 64]
    assert not (Flags.READONLY | Flags.SEAL | Flags.POPULATE) & 127


@pytest.mark.parametrize("backend", BACKENDS)
def test_create_default_keeps_fd_and_has_no_name(backend):
    with Segment.create(1 << 20, backend=backend) as seg:
        assert seg.size == 1 << 20 and seg.backend == backend and seg.flags == DEFAULT
        assert seg.fd is not None and os.fstat(seg.fd).st_size == 1 << 20
        assert os.fstat(seg.fd).st_nlink == 0  # UNLINK: no name left anywhere
        assert not shm_names(f"shmshare_{os.getpid()}_")  # (others' names: another test's, beside this one)
        assert len(shm_mappings(contains=seg.name.lstrip("/"))) == 1
        arr = seg.view(np.int64, (1 << 17,))
        arr[:] = np.arange(1 << 17)
        assert int(seg.view(np.int64, 4, offset=8 * 1000)[0]) == 1000
        del arr
    assert seg.closed and seg.fd is None
    assert not shm_mappings(contains=seg.name.lstrip("/"))


def test_memfd_is_sealed_against_shrink_and_grow():
    with Segment.create(4096) as seg:
        assert seg.seals & fcntl.F_SEAL_SHRINK and seg.seals & fcntl.F_SEAL_GROW
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 8192)
    with Segment.create(4096, growable=True) as seg:
        assert seg.seals & fcntl.F_SEAL_SHRINK and not seg.seals & fcntl.F_SEAL_GROW
        os.ftruncate(seg.fd, 8192)
    with Segment.create(4096, DEFAULT | Flags.SEAL) as seg:
        assert seg.seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)


def test_receiver_sees_writes_and_keeps_pages_after_creator_closes():
    seg = Segment.create(8192)
    rx = Segment.from_fd(seg.fd, flags=Flags.FROMFD)  # no KEEPFD: fd closed after mapping
    assert rx.fd is None and rx.backend == "memfd" and rx.size == 8192
    seg.view(np.uint8, 8192)[:] = 42
    seg.close()
    assert int(rx.view(np.uint8, 8192).sum()) == 42 * 8192
    rx.close()


def test_from_fd_dups_and_caller_keeps_its_fd():
    seg = Segment.create(4096)
    rx = Segment.from_fd(seg.fd)
    assert rx.fd not in (None, seg.fd)
    rx.close()
    os.fstat(seg.fd)  # still open
    seg.close()


def test_from_fd_refuses_mapping_past_the_end():
    with Segment.create(4096) as seg:
        with pytest.raises(SegmentError, match=r"4096 bytes, 8192 were asked.*SIGBUS"):
            Segment.from_fd(seg.fd, 8192)
        with pytest.raises(SegmentError, match="not a regular file"):
            r, w = os.pipe()
            try:
                Segment.from_fd(r)
            finally:
                os.close(r)
                os.close(w)
        with pytest.raises(ValueError, match="non-negative int"):
            Segment.from_fd(-1)


def test_readonly_receiver_cannot_write():
    with Segment.create(4096) as seg, Segment.from_fd(seg.fd, flags=Flags.FROMFD | Flags.READONLY) as ro:
        arr = ro.view(np.uint8, 16)
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 1
        assert ro.buffer.readonly
        del arr


def test_posix_without_unlink_keeps_name_until_close_and_open_finds_it():
    seg = Segment.create(4096, Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.KEEPFD, backend="posix")
    name = seg.name
    assert name.startswith(f"/shmshare_{os.getpid()}_") and name[1:] in shm_names()
    seg.buffer[:3] = b"abc"
    other = Segment.open(name)  # SHAREDMEM|NOCREATE
    assert bytes(other.buffer[:3]) == b"abc" and other.fd is None
    other.close()
    with pytest.raises(SegmentError, match="EXCLUSIVE") as err:
        Segment.open(name, 4096, Flags.SHAREDMEM | Flags.EXCLUSIVE)
    assert err.value.errno == 17
    seg.close()
    assert name[1:] not in shm_names()
    with pytest.raises(SegmentError, match="no such shm object"):
        Segment.open(name)


def test_unlink_is_explicit_and_idempotent():
    seg = Segment.create(4096, Flags.SHAREDMEM | Flags.KEEPFD, backend="posix")
    assert seg.name[1:] in shm_names()
    seg.unlink()
    seg.unlink()
    assert seg.name[1:] not in shm_names() and os.fstat(seg.fd).st_nlink == 0
    seg.close()


def test_posix_named_collision_retries_random_names(monkeypatch):
    import secrets

    taken = Segment.create(4096, Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.KEEPFD, backend="posix")
    token = taken.name.rsplit("_", 1)[1]
    draws = iter([token, token, "0123456789ab"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(draws))
    seg = Segment.create(4096, backend="posix")
    assert seg.name.endswith("_0123456789ab")
    seg.close()
    taken.close()


def test_file_shared_and_private_mappings(tmp_path):
    path = tmp_path / "data.bin"
    with Segment.open(path, 8192, Flags.SHARED) as seg:  # created and grown
        assert seg.backend == "file" and seg.size == 8192
        seg.buffer[:2] = b"hi"
    assert path.read_bytes()[:2] == b"hi"
    with Segment.open(path, flags=Flags.NOCREATE) as cow:  # MAP_PRIVATE
        cow.buffer[:2] = b"yo"
        assert bytes(cow.buffer[:2]) == b"yo"
    assert path.read_bytes()[:2] == b"hi"
    with pytest.raises(SegmentError, match="is 8192 bytes, 16384 were asked"):
        Segment.open(path, 16384, Flags.SHARED | Flags.NOCREATE)
    with Segment.open(path, flags=Flags.SHARED | Flags.UNLINK):
        assert not path.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_with_live_views_defers_unmap(backend):
    seg = Segment.create(1 << 16, backend=backend)
    tag = seg.name.lstrip("/")
    arr = seg.view(np.float32, (16,))
    mv = seg.buffer
    arr[:] = 1.5
    seg.close()
    seg.close()  # idempotent
    assert len(shm_mappings(contains=tag)) == 1  # the views keep the pages mapped
    assert float(arr.sum()) == 24.0
    del arr
    gc.collect()
    assert len(shm_mappings(contains=tag)) == 1
    mv.release()
    assert shm_mappings(contains=tag) == []
    with pytest.raises(ValueError, match="closed"):
        seg.view(np.uint8, 1)


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, "10", True])
def test_bad_sizes_are_refused(nbytes):
    with pytest.raises(ValueError, match="nbytes must be a positive int"):
        Segment.create(nbytes)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="sysv"), "backend must be one of"),
    (dict(flags=Flags.SHAREDMEM | Flags.NOCREATE), "Segment.open"),
    (dict(flags=Flags.SHAREDMEM | Flags.FROMFD), "Segment.from_fd"),
    (dict(flags=Flags.SHARED), "Flags.SHAREDMEM"),
    (dict(flags=DEFAULT | Flags.READONLY), "read-only segment cannot be created"),
    (dict(name="/x"), "memfd segments have no name"),
    (dict(backend="posix", growable=True), "growable=True needs backend='memfd'"),
])
def test_bad_create_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Segment.create(4096, **kwargs)


def test_views_check_bounds():
    with Segment.create(4096) as seg:
        with pytest.raises(ValueError, match="does not fit in a 4096-byte segment"):
            seg.view(np.float64, 513)
        with pytest.raises(ValueError, match="does not fit"):
            seg.view(np.uint8, 10, offset=4090)


def test_segment_is_not_picklable_and_constructor_is_private():
    import pickle

    with Segment.create(4096) as seg, pytest.raises(TypeError, match=r"Segment\.from_fd"):
        pickle.dumps(seg)
    with pytest.raises(TypeError, match=r"Segment\.create"):
        Segment()


def test_keepfd_absent_closes_fd_after_mapping():
    seg = Segment.create(4096, Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.UNLINK)
    assert seg.fd is None
    with pytest.raises(ValueError, match="KEEPFD"):
        seg.fileno()
    seg.buffer[0] = 1
    seg.close()


def test_populate_flag_prefaults():
    with Segment.create(1 << 20, DEFAULT | Flags.POPULATE) as seg:
        assert seg.view(np.uint8, 1 << 20).sum() == 0


def _drop_segment_in_child(seg):
    seg.close()  # the child's copy: must not remove the parent's name
    os._exit(0)


def test_a_forked_child_closing_its_copy_keeps_the_parents_name():
    from shmshare.testing import start_child

    seg = Segment.create(4096, Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.KEEPFD, backend="posix")
    with start_child(_drop_segment_in_child, seg) as child:
        assert child.join(30) == 0
    assert seg.name[1:] in shm_names()
    Segment.open(seg.name).close()
    seg.close()
    assert seg.name[1:] not in shm_names()


def test_opening_shared_memory_that_may_be_created_needs_a_size():
    with pytest.raises(ValueError, match="pass nbytes"):
        Segment.open("/shmshare_never_made", flags=Flags.SHAREDMEM)
    assert "shmshare_never_made" not in shm_names()


# -- ownership of received fds (issue 9, defect 5) ----------------------------


def _open_fds() -> set[int]:
    return set(_procfs.fds())


def test_from_fd_takes_an_Fd_without_a_dup_and_keeps_no_fd_without_keepfd():
    base = _open_fds()
    seg = Segment.create(8192)
    got = Fd(os.dup(seg.fd))  # what Connection.recv hands out
    number = got.fileno()
    before = _open_fds()
    rx = Segment.from_fd(got, flags=Flags.FROMFD)
    assert got.closed and rx.fd is None  # taken, then closed right after mmap
    assert _open_fds() == before - {number}  # no dup was ever left behind
    number2 = os.dup(seg.fd)
    kept = Segment.from_fd(Fd(number2))  # KEEPFD: the taken number is the segment's fd
    assert kept.fd == number2
    seg.view(np.uint8, 8192)[:] = 7
    assert int(rx.view(np.uint8, 8192)[-1]) == 7 and int(kept.view(np.uint8, 1)[0]) == 7
    for s in (rx, kept, seg):
        s.close()
    assert _open_fds() == base


def test_from_fd_closes_a_taken_fd_on_error():
    r, w = os.pipe()
    os.close(w)
    got = Fd(r)
    with pytest.raises(SegmentError, match="not a regular file"):
        Segment.from_fd(got)
    assert got.closed
    with pytest.raises(OSError):
        os.fstat(r)  # closed, not leaked
    with Segment.create(4096) as seg:
        big = Fd(os.dup(seg.fd))
        number = big.fileno()
        with pytest.raises(SegmentError, match="SIGBUS"):
            Segment.from_fd(big, 8192)
        assert big.closed and number not in _open_fds()
        with pytest.raises(ValueError, match="taken or closed"):
            Segment.from_fd(big)


def test_from_fd_with_an_int_still_dups():
    with Segment.create(4096) as seg:
        rx = Segment.from_fd(seg.fd, flags=Flags.FROMFD)
        rx.close()
        os.fstat(seg.fd)  # the caller's fd is untouched


@pytest.mark.parametrize("what", ["memfd", "posix", "dup", "open"])
def test_fd_exhaustion_is_an_FdLimitError_with_the_limit_and_the_fix(what, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    src = Segment.create(4096)
    filler: list[int] = []
    low = len(_open_fds()) + 4
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        with pytest.raises(OSError):
            while True:
                filler.append(os.dup(0))
        with pytest.raises(FdLimitError) as err:
            if what == "memfd":
                Segment.create(4096)
            elif what == "posix":
                Segment.create(4096, backend="posix")
            elif what == "dup":
                Segment.from_fd(src.fd)
            else:
                Segment.open(tmp_path / "f", 4096, Flags.SHARED)
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        src.close()
    text = str(err.value)
    assert err.value.errno == errno.EMFILE and isinstance(err.value, OSError)
    assert f"RLIMIT_NOFILE is {low} (hard {hard}) and all {low} of RLIMIT_NOFILE are in use" in text
    assert "-1 fds" not in text and "raise it" in text
    assert {"memfd": "memfd_create", "posix": "shm_open", "dup": "dup(", "open": "open("}[what] in text
    assert not shm_names(f"shmshare_{os.getpid()}_")


# -- a crash leaves no name (issue 9, defect 3) --------------------------------

CRASH = textwrap.dedent("""
    import os, signal, sys
    from shmshare import Flags, Segment
    flags = Flags.SHAREDMEM | Flags.EXCLUSIVE | Flags.KEEPFD
    if sys.argv[1] == "unlink":
        flags |= Flags.UNLINK
    # SIGKILL in the window between shm_open and fallocate (where a slow fallocate of a
    # large segment gives a crash the most time to land)
    os.posix_fallocate = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    Segment.create(1 << 20, flags, backend="posix")
""")


def _crash(mode: str) -> int:
    """Run CRASH in a child; return its pid once it died of SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-c", CRASH, mode], stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL, err
    return proc.pid


@pytest.mark.alone  # the dead child's name would be another worker's leak, and its sweep takes theirs
def test_sigkill_between_shm_open_and_fallocate_leaves_no_name():
    unlinked, named = _crash("unlink"), _crash("keep-name")
    try:
        assert not shm_names(f"shmshare_{unlinked}_")  # UNLINK: the name went right after shm_open
        (left,) = shm_names(f"shmshare_{named}_")  # without UNLINK a crash leaves the name ...
        assert f"/dev/shm/{left}" in sweep()  # ... and its creator is dead: sweep removes it
        assert not shm_names(f"shmshare_{named}_")
    finally:
        for pid in (unlinked, named):
            for name in shm_names(f"shmshare_{pid}_"):
                os.unlink(f"/dev/shm/{name}")
