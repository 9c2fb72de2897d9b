"""Driver for the interpreter-exit parity test (``python -m tests.loader.parity_exit_driver torch|shmshare``).

It leaves two loaders mid-epoch, one persistent and one not, prints their worker pids as one JSON line and
returns from main without closing anything: the interpreter must exit, and the workers with it.
"""

from __future__ import annotations

import json
import sys


def main(which: str) -> None:
    import torch.utils.data

    from tests.loader.parity_datasets import PidDataset

    if which == "torch":
        cls = torch.utils.data.DataLoader
    else:
        import shmshare

        cls = shmshare.DataLoader
    pids = set()
    keep = []
    for persistent in (False, True):
        loader = cls(PidDataset(100, delay=0.01), batch_size=None, num_workers=2, persistent_workers=persistent)
        it = iter(loader)
        for _ in range(4):
            pids.add(next(it)[2])
        keep.append((loader, it))
    print(json.dumps({"pids": sorted(pids)}), flush=True)
    globals()["_keep"] = keep  # alive until interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
