"""A sender inside a memory cgroup (memory.max ~160 MiB) asking for more than it allows.

It gets SegmentError or PoolExhausted naming the cgroup, and is never
OOM-killed: the child's exit status tells. cgroup v2 if /sys/fs/cgroup (or
its ``unified`` mount) has the memory controller, else v1's memory
hierarchy; skipped with the reason if neither can be made.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

import shmshare

from .helpers import Kid, MiB, exit_status, shmem_bytes, wait_shmem_below

pytestmark = pytest.mark.alone  # each trial reads the host's Shmem before and after

LIMIT = 160 * MiB


def _cgroup_root() -> tuple[str, str] | str:
    """Return (version, directory to make a child cgroup in), or why none can be made."""
    if os.geteuid() != 0:
        return "making a cgroup needs root"
    for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        try:
            with open(f"{base}/cgroup.controllers") as f:
                if "memory" in f.read().split():
                    return "v2", base
        except OSError:
            pass
    if os.path.exists("/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        return "v1", "/sys/fs/cgroup/memory"
    return "neither a cgroup v2 memory controller nor a v1 memory hierarchy is mounted"


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[tuple[str, str]]:
    root = _cgroup_root()
    if isinstance(root, str):
        pytest.skip(root)
    version, base = root
    path = f"{base}/shmshare_rel_{os.getpid()}_{time.monotonic_ns()}"
    try:
        os.mkdir(path)
        limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
        with open(f"{path}/{limit_file}", "w") as f:
            f.write(str(limit))
        if version == "v2" and os.path.exists(f"{path}/memory.swap.max"):
            with open(f"{path}/memory.swap.max", "w") as f:
                f.write("0")
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        pytest.skip(f"cannot make a {version} memory cgroup under {base}: {exc}")
    try:
        yield version, path
    finally:
        for _ in range(100):  # the killed or exited child leaves it a moment later
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.05)


def _ask_too_much(ctl, backend: str, seed: int) -> None:
    ctl.recv(timeout=30)  # wait until the parent moved us into the cgroup
    rng = random.Random(seed)
    tx, rx = shmshare.channel(backend=backend, limit=1 << 30)
    small = tx.empty(MiB // 4, np.uint32)  # what fits: a positive control
    small[:] = seed
    tx.send({"x": small}, timeout=10)
    got = rx.recv(timeout=10)
    ok = int(got["x"][0]) == seed
    del got, small
    size = rng.choice([256, 384, 512]) * MiB
    try:
        big = tx.empty(size, np.uint8, timeout=2)
        big[:] = 1
        tx.send({"x": big}, timeout=10)
        ctl.send({"ev": "result", "ok": ok, "raised": None, "size": size})
    except (shmshare.SegmentError, shmshare.PoolExhausted) as exc:
        ctl.send({"ev": "result", "ok": ok, "raised": type(exc).__name__, "msg": str(exc),
                  "size": size})
    tx.close()
    rx.close()


def trial(backend: str, seed: int) -> None:
    where = f"backend={backend} seed={seed}"
    base = shmem_bytes()
    with memory_cgroup(LIMIT) as (version, path):
        with Kid(_ask_too_much, backend, seed) as kid:
            with open(f"{path}/cgroup.procs", "w") as f:
                f.write(str(kid.pid))
            kid.tell(go=True)
            try:
                res = kid.expect("result", timeout=60)
            except AssertionError as exc:
                raise AssertionError(f"{where} ({version}): {exc}") from None
            code = kid.join(30)
        assert code == 0, f"{where} ({version}): the sender ended with {exit_status(code)}"
        assert code != -signal.SIGKILL
        assert res["ok"], f"{where}: the 1 MiB control did not arrive intact"
        assert res["raised"] in ("SegmentError", "PoolExhausted"), (
            f"{where}: asking for {res['size'] // MiB} MiB in a {LIMIT // MiB} MiB cgroup "
            f"raised nothing")
        assert "cgroup" in res["msg"], f"{where}: the error does not name the cgroup: {res['msg']}"
    assert wait_shmem_below(base + 48 * MiB) <= base + 48 * MiB, f"{where}: Shmem stays up"


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_cgroup_short(backend: str) -> None:
    trial(backend, 1)


@pytest.mark.stress
@pytest.mark.parametrize("seed", range(2, 6))
@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_cgroup_stress(backend: str, seed: int) -> None:
    trial(backend, seed)
