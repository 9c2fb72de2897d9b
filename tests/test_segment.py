"""shmshare.Segment: the MapAllocator's open -> resize -> map -> finalize, and close."""

from __future__ import annotations

import fcntl
import gc
import os

import numpy as np
import pytest

from shmshare import Flags, Segment, SegmentError
from shmshare._procfs import shm_mappings, shm_names

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
        assert not shm_names("shmshare_")
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
