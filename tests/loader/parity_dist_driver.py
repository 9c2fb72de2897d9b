"""One rank of the distributed parity test (``python -m tests.loader.parity_dist_driver torch|shmshare OUT``).

The test starts WORLD_SIZE of these with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT): 2 simulated nodes of 2 processes. Each rank joins a gloo group, runs a
loader with 2 workers over a map-style dataset with DistributedSampler for 2 epochs (set_epoch) and over an
IterableDataset sharded by rank x worker for 2 epochs; what each rank saw is gathered with all_gather_object
and rank 0 writes it to OUT as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

N = 24  # divisible by the world size: DistributedSampler pads nothing


def main(which: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    from tests.loader.parity_datasets import PidDataset, RankShardedIterable

    if which == "torch":
        cls = torch.utils.data.DataLoader
    else:
        import shmshare

        cls = shmshare.DataLoader
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["GROUP_RANK"])
    result: dict = {"map": [], "iterable": []}

    sampler = DistributedSampler(PidDataset(N), shuffle=True, seed=3)
    loader = cls(PidDataset(N), batch_size=2, sampler=sampler, num_workers=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = []
        for idx, wid, _pid in loader:
            seen += [[i, rank, node, w] for i, w in zip(idx.tolist(), wid.tolist(), strict=True)]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, seen)
        result["map"].append(gathered)
    del loader

    loader = cls(RankShardedIterable(N), batch_size=3, num_workers=2)
    for _epoch in range(2):
        seen = []
        for idx, r, wid in loader:
            seen += [[i, rr, node, w] for i, rr, w in zip(idx.tolist(), r.tolist(), wid.tolist(), strict=True)]
        gathered = [None] * world
        dist.all_gather_object(gathered, seen)
        result["iterable"].append(gathered)
    del loader

    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
