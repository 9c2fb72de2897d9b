"""Worker seeding equal to torch's: the numpy seed hash, the base seed draw, the worker's RNGs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmshare.loader._seeding import draw_base_seed, generate_state, seed_worker

torch = pytest.importorskip("torch")
from torch.utils.data._utils.worker import _generate_state as torch_generate_state  # noqa: E402


@pytest.fixture(autouse=True)
def keep_global_rngs() -> Iterator[None]:
    """Give back the global RNG states the tests reseed."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


_EDGES = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 1, 9075336941355847447]


def test_generate_state_equals_torchs_at_the_edges() -> None:
    for base in _EDGES:
        for worker in (0, 1, 2, 7, 63, 2**31):
            assert generate_state(base, worker) == torch_generate_state(base, worker), (base, worker)


def test_generate_state_equals_torchs_for_random_seeds() -> None:
    rng = random.Random(20240601)
    for _ in range(3000):
        base, worker = rng.randrange(2**63), rng.randrange(256)
        got = generate_state(base, worker)
        assert got == torch_generate_state(base, worker), (base, worker)
        assert len(got) == 4 and all(0 <= w < 2**32 for w in got)


def test_generate_state_folds_other_ints_as_torch_does() -> None:
    for base in (-1, -(2**40), 2**64 + 5, 2**70):
        assert generate_state(base, 3) == torch_generate_state(base, 3)


def test_generate_state_is_numpys_seed_sequence() -> None:
    base, worker = 123456789012345, 4
    words = [worker, base & 0xFFFFFFFF, base >> 32, 0]
    ss = np.random.SeedSequence(words, pool_size=4)
    assert generate_state(base, worker) == ss.generate_state(4, dtype=np.uint32).tolist()


def _torch_base_seed(generator: Any) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def test_base_seed_equals_torchs_for_a_torch_generator() -> None:
    for seed in (0, 1, 7, 2**40, 2**63 - 1):
        mine, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(3):  # and it advances the generator as torch's draw does
            assert draw_base_seed(mine) == _torch_base_seed(theirs)


def test_base_seed_from_none_is_torchs_global_draw_where_torch_is_imported() -> None:
    torch.manual_seed(99)
    mine = [draw_base_seed(None) for _ in range(3)]
    torch.manual_seed(99)
    assert mine == [_torch_base_seed(None) for _ in range(3)]


def test_base_seed_from_numpy_is_63_bits_and_reproducible() -> None:
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    draws = [draw_base_seed(a) for _ in range(50)]
    assert draws == [draw_base_seed(b) for _ in range(50)]
    assert len(set(draws)) == 50 and all(0 <= d < 2**63 for d in draws)
    assert draw_base_seed(5) == draw_base_seed(5) == draw_base_seed(np.random.default_rng(5))


@pytest.mark.parametrize("bad", ["7", 1.0, True, object()])
def test_base_seed_refuses_other_generators(bad: Any) -> None:
    with pytest.raises(TypeError, match="generator should be None, an int seed"):
        draw_base_seed(bad)


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()).item())


def test_seed_worker_seeds_as_torchs_worker_loop() -> None:
    for base, worker in [(0, 0), (12345, 3), (2**63 - 8, 7)]:
        assert seed_worker(base, worker) == base + worker
        mine = _draws()
        random.seed(base + worker)  # torch's _worker_loop, step by step
        torch.manual_seed(base + worker)
        np.random.seed(torch_generate_state(base, worker))
        assert mine == _draws()


class _WhatAWorkerSees(torch.utils.data.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[int, int, tuple[float, float, float]]:
        info = torch.utils.data.get_worker_info()
        return info.id, info.seed, _draws()


def test_a_torch_dataloaders_workers_are_predicted() -> None:
    """The end to end check: torch's own workers see the seeds and streams computed here."""
    loader = torch.utils.data.DataLoader(_WhatAWorkerSees(), batch_size=None, num_workers=2,
                                         generator=torch.Generator().manual_seed(31), collate_fn=lambda x: x,
                                         multiprocessing_context="fork", timeout=60)
    seen: dict[int, tuple[int, tuple[float, float, float]]] = {}
    for worker, seed, draws in loader:
        seen.setdefault(worker, (seed, draws))  # the draws of each worker's first index
    assert set(seen) == {0, 1}
    base = draw_base_seed(torch.Generator().manual_seed(31))  # a sequential sampler draws nothing first
    for worker, (seed, draws) in seen.items():
        assert seed_worker(base, worker) == seed
        assert _draws() == draws
