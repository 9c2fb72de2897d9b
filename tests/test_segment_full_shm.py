"""A full /dev/shm is an error at allocation time, never a SIGBUS at first touch."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.devshm_helpers import why_no_unshare

SCRIPT = textwrap.dedent("""
    import numpy as np
    from shmshare import Segment, SegmentError
    try:
        Segment.create(8 << 20, backend="posix")
    except SegmentError as exc:
        print("ERROR", exc.errno, exc)
    else:
        print("NO ERROR")
    seg = Segment.create(8 << 20, backend="memfd")   # memfd is not capped by /dev/shm
    seg.view(np.uint8, 8 << 20)[:] = 1
    print("MEMFD OK", int(seg.view(np.uint8, 8 << 20).sum()))
    seg.close()
""")


@pytest.mark.skipif(why_no_unshare() is not None, reason=str(why_no_unshare()))
def test_posix_on_a_4mb_dev_shm_raises_enospc_with_the_fix():
    # A Docker-like /dev/shm: 4 MB, in this test's own mount namespace.
    cmd = f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} -c '{SCRIPT}'"
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERROR 28" in out.stdout, out.stdout  # ENOSPC, raised by posix_fallocate
    assert "cannot reserve 8388608 bytes for a posix segment" in out.stdout
    assert "/dev/shm has" in out.stdout and "--shm-size" in out.stdout
    # the size, the free space and the other way out, all on the SegmentError itself
    assert "free of 4.0 MiB (4194304 bytes) (a tmpfs) and 8.0 MiB (8388608 bytes) were asked" \
        in out.stdout
    assert "backend='memfd'" in out.stdout
    assert f"MEMFD OK {8 << 20}" in out.stdout


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.ENOMEM])
def test_memfd_out_of_memory_names_host_memory_and_the_cgroup(monkeypatch, err):
    from shmshare import Segment, SegmentError

    def full(fd: int, offset: int, nbytes: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SegmentError) as got:
        Segment.create(4 << 20)
    text = str(got.value)
    assert got.value.errno == err
    assert "cannot reserve 4194304 bytes for a memfd segment: posix_fallocate" in text
    assert re.search(r"the host has [\d.]+ [KMG]iB \(\d+ bytes\) available", text)
    assert "memory cgroup" in text and "4.0 MiB (4194304 bytes) were asked" in text
    assert "docker run --memory" in text


def test_a_segment_larger_than_the_host_is_refused_before_any_page_is_reserved():
    """Note [Checking memory before reserving]: a memfd has no size cap, and fallocate past the
    host's memory sets off the global OOM killer (it killed other programs' processes) rather
    than failing; so the request is refused first, naming the numbers."""
    from shmshare import Segment, SegmentError, _segcalls

    avail = _segcalls._host_available()
    if avail is None:
        pytest.skip("no /proc/meminfo to read the host's available memory from")
    too_big = avail + (1 << 30)
    with pytest.raises(SegmentError, match="OOM killer") as got:
        Segment.create(too_big)
    assert got.value.errno == errno.ENOMEM and str(too_big) in str(got.value)
