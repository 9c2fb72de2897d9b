"""Driver for the killed-worker parity test, run as its own process (``python -m tests.loader.parity_kill_driver
torch|shmshare``) so a loader that hangs fails the test (the test kills this process group) instead of the suite.

It takes one sample, SIGKILLs the worker that made it, keeps iterating and prints one JSON line: what was raised
(type and message, or None if iteration just ended) and how long after the kill.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main(which: str) -> None:
    import torch.utils.data

    from tests.loader.parity_datasets import PidDataset

    if which == "torch":
        cls = torch.utils.data.DataLoader
    else:
        import shmshare

        cls = shmshare.DataLoader
    loader = cls(PidDataset(200, delay=0.05), batch_size=None, num_workers=2)
    it = iter(loader)
    _, _, victim = next(it)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    result: dict = {"victim": victim, "type": None, "message": None, "after_s": None, "count": 0}
    try:
        for _ in it:
            result["count"] += 1
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
        chain = []
        cur: BaseException | None = e
        while cur is not None and len(chain) < 5:
            chain.append({"type": type(cur).__name__, "message": str(cur)})
            cur = cur.__cause__ or cur.__context__
        result.update(type=type(e).__name__, message=str(e), chain=chain)
    result["after_s"] = time.monotonic() - killed_at
    print(json.dumps(result), flush=True)
    del it, loader


if __name__ == "__main__":
    main(sys.argv[1])
