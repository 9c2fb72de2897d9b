"""Worker seeds the way ``torch.utils.data.DataLoader`` makes them, with or without torch.

What: three functions the loader calls around its workers.

* :func:`draw_base_seed` draws the iteration's ``base_seed`` in the parent, once per epoch.
* :func:`seed_worker` seeds a worker's RNGs from ``base_seed`` and its id, first thing in the worker.
* :func:`generate_state` is the hash that turns ``(base_seed, worker_id)`` into numpy's seed.

Why: a drop-in for torch's DataLoader has to give each worker the same seeds torch's would, so
that a program seeded with ``torch.manual_seed`` sees the same ``random``, ``numpy.random`` and
``torch`` streams in its workers (and ``get_worker_info().seed``) whichever loader it runs. Torch
seeds a worker with ``base_seed + worker_id`` for ``random`` and ``torch``, and numpy from a
SeedSequence-style hash of both, so that numpy's and Python's Mersenne Twisters, seeded alike,
do not produce the same stream.

Torch is never imported here: it is used only when the program has imported it already (it is
in ``sys.modules``). A program that has not imported torch has not seeded it either, and torch
(2.x) seeds its default generator non-deterministically at import, so importing it only to
draw from it would cost seconds and reproduce nothing.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Protocol

import numpy as np

__all__ = ["draw_base_seed", "seed_worker", "generate_state"]


class TorchGeneratorLike(Protocol):
    """What a ``torch.Generator`` offers that the loader relies on (checked for real with isinstance)."""

    def initial_seed(self) -> int: ...


#: What a sampler or the loader accepts as ``generator``.
GeneratorLike = int | np.random.Generator | TorchGeneratorLike | None


def draw_base_seed(generator: GeneratorLike) -> int:
    """Draw the non-negative 63-bit ``base_seed`` of one DataLoader iteration.

    Parameters
    ----------
    generator
        ``None``, a ``torch.Generator``, a ``numpy.random.Generator`` or an ``int`` seed.

    Returns
    -------
    int
        In ``[0, 2**63)``. Where torch is in use it is exactly what torch's
        ``_BaseDataLoaderIter.__init__`` draws, ``torch.empty((), dtype=torch.int64)
        .random_(generator=generator).item()``: for a ``torch.Generator``, and for ``None`` when
        torch is already imported (torch's global RNG, so ``torch.manual_seed`` reproduces it).
        Otherwise it comes from numpy: from the ``numpy.random.Generator`` (advancing it), from
        ``numpy.random.default_rng(seed)`` for an ``int`` (stateless: the same seed every call,
        so pass a Generator to vary it by epoch), or for ``None`` from numpy's global state
        (``np.random.seed`` reproduces it).

    Raises
    ------
    TypeError
        If `generator` is none of those.
    """
    torch = imported_torch()
    if generator is None:
        if torch is not None:
            return torch_draw(torch, None)
        return global_numpy_draw()
    if isinstance(generator, np.random.Generator):
        return numpy_draw(generator)
    if isinstance(generator, int) and not isinstance(generator, bool):
        return numpy_draw(np.random.default_rng(generator))
    if torch is not None and isinstance(generator, torch.Generator):
        return torch_draw(torch, generator)
    raise TypeError(
        "generator should be None, an int seed, a numpy.random.Generator or a torch.Generator, "
        f"but got generator={generator!r}"
    )


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed this worker's RNGs as torch's ``_worker_loop`` does, and return the worker's seed.

    ``random`` and (where torch is already imported) ``torch`` get ``base_seed + worker_id``;
    numpy's global state gets ``generate_state(base_seed, worker_id)``, in that order.

    Parameters
    ----------
    base_seed
        The iteration's seed from :func:`draw_base_seed`, drawn in the parent.
    worker_id
        The worker's index, ``0 .. num_workers - 1``.

    Returns
    -------
    int
        ``base_seed + worker_id``, what ``get_worker_info().seed`` reports.

    Notes
    -----
    Call it after the dataset is unpickled in the worker: a spawned worker imports torch only
    then, if the dataset needs it, and torch's RNG is seeded only when torch is there to seed.
    Torch's worker loop also calls ``torch.set_num_threads(1)``; that is not seeding, so it is
    left to the loader.
    """
    seed = base_seed + worker_id
    random.seed(seed)
    torch = imported_torch()
    if torch is not None:
        torch.manual_seed(seed)
    np.random.seed(generate_state(base_seed, worker_id))
    return seed


# -- the hash: numpy's SeedSequence with a 4-word pool, entropy (worker_id, seed lo, seed hi, 0) --

_MASK32 = 0xFFFFFFFF
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875  # the hash constants the pool is mixed with
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED  # ... and those the output words are drawn with
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_XSHIFT = 16  # half a 32-bit word


def generate_state(base_seed: int, worker_id: int) -> list[int]:
    """Return the four 32-bit words torch seeds a worker's ``numpy.random`` with.

    Equal to torch's ``torch.utils.data._utils.worker._generate_state(base_seed, worker_id)``:
    numpy's ``SeedSequence`` algorithm (O'Neill's seed_seq hashing) over the entropy words
    ``[worker_id, base_seed mod 2**32, base_seed >> 32, 0]`` with a pool of four words.

    Parameters
    ----------
    base_seed
        The iteration's seed (63 bits from :func:`draw_base_seed`; other ints are folded
        modulo ``2**32`` word by word, as torch's are).
    worker_id
        The worker's index.

    Returns
    -------
    list[int]
        Four ints in ``[0, 2**32)``, for ``np.random.seed``.
    """
    entropy = (worker_id, base_seed & _MASK32, base_seed >> 32, 0)
    mult = _INIT_A
    pool = []
    for word in entropy:  # each entropy word hashed into its own pool word
        hashed, mult = _hash(word, mult, _MULT_A)
        pool.append(hashed)
    for src in range(4):  # every pool word stirred into every other, so late words reach early ones
        for dst in range(4):
            if src != dst:
                hashed, mult = _hash(pool[src], mult, _MULT_A)
                pool[dst] = _mix(pool[dst], hashed)
    state = []
    mult = _INIT_B
    for word in pool:  # the output: each pool word through the second hash
        hashed, mult = _hash(word, mult, _MULT_B)
        state.append(hashed)
    return state


def _hash(value: int, mult: int, step: int) -> tuple[int, int]:
    """Hash one word with the running multiplier; return (the hash, the multiplier times `step`)."""
    value = (value ^ mult) & _MASK32
    mult = (mult * step) & _MASK32
    value = (value * mult) & _MASK32
    return value ^ (value >> _XSHIFT), mult


def _mix(x: int, y: int) -> int:
    """Combine two words, as SeedSequence's ``mix``."""
    result = ((_MIX_MULT_L * x) - (_MIX_MULT_R * y)) & _MASK32
    return result ^ (result >> _XSHIFT)


# -- the draws --


def numpy_draw(rng: np.random.Generator) -> int:
    """Draw a non-negative 63-bit int from `rng` (the width of torch's int64 ``random_()``)."""
    return int(rng.integers(0, 2**63, dtype=np.int64))


def global_numpy_draw() -> int:
    """Draw a non-negative 63-bit int from numpy's global state (which ``np.random.seed`` sets)."""
    return int(np.random.randint(0, 2**63, dtype=np.int64))


def torch_draw(torch: Any, generator: Any) -> int:
    """Draw as torch's DataLoader draws its base seed (from the global RNG when `generator` is None)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def imported_torch() -> Any:
    """Return the torch module if the program has imported it, else None (never imports it)."""
    return sys.modules.get("torch")
