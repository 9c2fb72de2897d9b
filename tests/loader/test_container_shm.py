"""A container's /dev/shm (Docker's default is 64 MiB): 8 workers of 256 MiB batches (issue 24, item 5).

shmshare's workers collate into memfds, which /dev/shm's size does not bound; torch's put each batch in
/dev/shm, and a worker that touches past its end dies of SIGBUS. Run in a mount namespace of the test's own
(``unshare -m``) with a 64 MiB tmpfs on /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.devshm_helpers import why_no_unshare

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch.utils.data import DataLoader as TorchDataLoader, Dataset
    import shmshare

    MB = 1 << 20

    class Big(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.full((256 * MB,), i + 1, dtype=torch.uint8)

    def run(cls):
        dl = cls(Big(), batch_size=1, num_workers=8, prefetch_factor=1)
        try:
            got = [(int(b[0, 0]), int(b[0, -1]), b.numel()) for b in dl]
            return {"ok": got}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "cause": repr(exc.__cause__)}

    out = {"shm_size": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize}
    out["shmshare"] = run(shmshare.DataLoader)
    out["left_after_shmshare"] = sorted(os.listdir("/dev/shm"))
    out["torch"] = run(TorchDataLoader)
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.alone  # 2 GiB of batches at once: nothing else beside it
@pytest.mark.skipif(why_no_unshare() is not None, reason=str(why_no_unshare()))
def test_eight_workers_of_256_mib_batches_under_a_64_mib_dev_shm(tmp_path):
    script = tmp_path / "container.py"
    script.write_text(SCRIPT)
    cmd = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["shm_size"] == 64 << 20
    assert out["shmshare"] == {"ok": [[i + 1, i + 1, 256 << 20] for i in range(8)]}, out["shmshare"]
    assert out["left_after_shmshare"] == []  # nothing left behind (memfds have no name)
    # what torch's users see: a worker killed by SIGBUS, or no space left in /dev/shm
    err = out["torch"].get("error", "") + out["torch"].get("cause", "")
    assert "ok" not in out["torch"], out["torch"]
    assert "Bus error" in err or "shared memory" in err or "No space left" in err, out["torch"]
