"""A 4 MiB /dev/shm (a Docker default-like size) in a private mount namespace (``unshare -m``).

A POSIX-backed channel sends what fits end to end, refuses what does not
with an exception (never SIGBUS), and leaves nothing in /dev/shm. The script
runs as its own process; a signal shows in its return code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.devshm_helpers import why_no_unshare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import os, random, sys
    import numpy as np
    import shmshare
    from shmshare import PoolExhausted, SegmentError
    seed, trials = int(sys.argv[1]), int(sys.argv[2])
    rng = random.Random(seed)
    tx, rx = shmshare.channel(backend="posix", limit=64 << 20)
    for t in range(trials):
        n = rng.choice([1 << 10, 256 << 10, 1 << 20, 3 << 20, 6 << 20, 32 << 20])
        src = (np.arange(n // 4, dtype=np.uint32) * 2654435761 + t)
        try:
            tx.send({"t": t, "x": src}, timeout=2)
        except (SegmentError, PoolExhausted) as exc:
            print("REFUSED", t, n, type(exc).__name__, str(exc).replace(chr(10), " ")[:200])
            continue
        got = rx.recv(timeout=10)
        ok = got["t"] == t and np.array_equal(got["x"], src)
        print("SENT", t, n, "OK" if ok else "CORRUPT")
        del got
    tx.close(); rx.close()
    print("LEFT", sorted(os.listdir("/dev/shm")))
""")


def run(seed: int, trials: int) -> list[str]:
    cmd = (f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} -c '{SCRIPT}' "
           f"{seed} {trials}")
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True,
                         timeout=90, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    where = f"seed={seed}: rc={out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    assert out.returncode == 0, where  # negative: a signal (SIGBUS)
    lines = out.stdout.splitlines()
    assert lines and lines[-1] == "LEFT []", where
    assert not [ln for ln in lines if "CORRUPT" in ln], where
    assert any(ln.startswith("SENT") for ln in lines), f"nothing fitted: {where}"
    for ln in lines:  # what does not fit is said at allocation time, naming /dev/shm
        if ln.startswith("REFUSED"):
            assert "/dev/shm" in ln, f"a refusal that does not say where: {ln}"
    return lines


@pytest.mark.skipif(why_no_unshare() is not None, reason=str(why_no_unshare()))
def test_small_dev_shm_short() -> None:
    lines = run(1, 12)
    assert any(ln.startswith("REFUSED") for ln in lines), "\n".join(lines)


@pytest.mark.stress
@pytest.mark.skipif(why_no_unshare() is not None, reason=str(why_no_unshare()))
@pytest.mark.parametrize("seed", range(2, 8))
def test_small_dev_shm_stress(seed: int) -> None:
    run(seed, 60)
