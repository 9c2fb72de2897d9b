"""Sharding across nodes rides on torch.distributed: 2 simulated nodes x 2 processes (4 gloo ranks on
127.0.0.1), each with a 2-worker loader, on torch's DataLoader and on shmshare's.

One launch per loader runs every scenario (tests/loader/parity_dist_driver.py); its result is shared by the
tests of that loader. Every process is started in its own session and killed by its group id at the end or
when the launch passes its time limit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the distributed tests compare against torch.utils.data.DataLoader")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import shmshare  # noqa: E402

from .parity_dist_driver import N  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
LAUNCH_LIMIT_S = 90

pytestmark = pytest.mark.parametrize(
    "which",
    [
        pytest.param("torch", id="torch"),
        pytest.param(
            "shmshare",
            id="shmshare",
            marks=pytest.mark.skipif(not hasattr(shmshare, "DataLoader"), reason="shmshare.DataLoader not built yet"),
        ),
    ],
)

_results: dict[str, dict] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(which: str, out: Path) -> dict:
    """Start the 4 ranks, wait (bounded) for all, kill every process group they made; return rank 0's JSON."""
    port = _free_port()
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
                LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_WORLD_SIZE=str(NODES), OMP_NUM_THREADS="1")
    procs = []
    logs = []
    try:
        for rank in range(WORLD):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank % PER_NODE), GROUP_RANK=str(rank // PER_NODE))
            log = open(out.with_name(f"rank{rank}.log"), "w+")  # noqa: SIM115 - closed in finally
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.loader.parity_dist_driver", which, str(out)],
                                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + LAUNCH_LIMIT_S
        codes = [p.poll() for p in procs]
        # until all are done, one fails (the others would wait for it in a collective), or time is up
        while None in codes and not any(codes) and time.monotonic() < deadline:
            time.sleep(0.05)
            codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and its workers (same group)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
        text = []
        for rank, log in enumerate(logs):
            log.seek(0)
            text.append(f"--- rank {rank} ---\n{log.read()[-1500:]}")
            log.close()
    if codes != [0] * WORLD or not out.exists():
        pytest.fail(f"ranks exited {codes} (None: still running when a rank failed or after {LAUNCH_LIMIT_S} s; "
                    "killed)\n" + "\n".join(text))
    return json.loads(out.read_text())


@pytest.fixture
def results(which, tmp_path_factory):
    if which not in _results:
        _results[which] = _launch(which, tmp_path_factory.mktemp(f"dist-{which}") / "result.json")
    return _results[which]


def _check_epoch(gathered: list, kind: str) -> None:
    """Every sample seen exactly once over all ranks, each rank by both its workers, on the right node."""
    assert len(gathered) == WORLD
    ids = Counter(i for per_rank in gathered for i, *_ in per_rank)
    assert sorted(ids) == list(range(N)), f"{kind}: samples missing: {sorted(set(range(N)) - set(ids))}"
    assert set(ids.values()) == {1}, f"{kind}: samples seen more than once: {[i for i, c in ids.items() if c > 1]}"
    for rank, per_rank in enumerate(gathered):
        assert len(per_rank) == N // WORLD, (kind, rank)
        assert {r for _, r, _, _ in per_rank} == {rank}
        assert {node for _, _, node, _ in per_rank} == {rank // PER_NODE}
        assert {w for *_, w in per_rank} == {0, 1}, f"{kind}: rank {rank} did not use both workers"


def test_distributed_sampler_each_sample_once_per_epoch(which, results):
    epochs = results["map"]
    assert len(epochs) == 2
    for gathered in epochs:
        _check_epoch(gathered, "DistributedSampler")
    orders = [[[i for i, *_ in per_rank] for per_rank in gathered] for gathered in epochs]
    assert orders[0] != orders[1], "set_epoch did not reshuffle"


def test_distributed_sampler_same_split_as_torch(which, results):
    """DistributedSampler decides the split, so each rank's samples, in order, are the same for both loaders."""
    if which == "torch":
        pytest.skip("the reference itself")
    if "torch" not in _results:
        pytest.skip("the torch run did not happen in this session")
    ours = [[[i for i, *_ in r] for r in g] for g in results["map"]]
    ref = [[[i for i, *_ in r] for r in g] for g in _results["torch"]["map"]]
    assert ours == ref


def test_iterable_sharded_by_rank_and_worker_each_sample_once(which, results):
    epochs = results["iterable"]
    assert len(epochs) == 2
    for gathered in epochs:
        _check_epoch(gathered, "IterableDataset")
