"""Resuming a loader inside an epoch: ``state_dict()`` / ``load_state_dict()`` in torchdata's layout.

Note [Resuming mid-epoch]
    A state says where the epoch is, in the layout of torchdata's
    ``StatefulDataLoader`` (0.11), key for key, so that a state saved by one
    loader is loaded by the other (docs/loader.md says where not). Resuming
    after k batches yields exactly the batches an uninterrupted run would
    have yielded from k on, and three things make that so:

    * **Indices.** The sampler's iterator is resumable where the sampler is
      known: torch's (or shmshare's) ``RandomSampler`` and ``BatchSampler``,
      of exactly those classes, are iterated by ``_RandomIter`` and
      ``_BatchIter`` here. They draw exactly as torch's do, lazily, and
      remember the generator's state from before the epoch's draws and how
      many indices they gave. On load, the generator is set back to that
      state and the indices given are skipped. So the generator also ends where
      the uninterrupted run's did, and later epochs match too. The loader's
      ``sampler`` and ``batch_sampler`` stay torch's objects: only the
      iteration is ours. A sampler (or its iterator) with ``state_dict`` and
      ``load_state_dict`` of its own is asked for them. Any other sampler is
      fast-forwarded by the number of batches drawn, as torchdata does.
    * **Workers.** Each batch a worker sends carries that worker's state
      after making it (``Capturer.snapshot``): the dataset's ``state_dict()`` (if it
      has one), its iterator's (iterable-style), and the worker's random
      state: ``random``, ``numpy.random`` and ``torch``. torchdata keeps no
      RNG state, so a dataset that augments at random resumes with other
      draws there. The RNG part travels as bytes, and only when it changed since
      that worker's last batch. The main process keeps, per worker, the
      state that came with the last batch it *yielded* (prefetched batches
      are done again after a resume) and which worker gave it. A resumed
      worker is seeded from the epoch's saved ``base_seed``, runs
      ``worker_init_fn``, loads its dataset's and iterator's states (or
      replays its batches, for an iterable dataset that cannot say where it
      is), then takes back its RNG state. The next task goes to the worker
      after the one that gave the last batch, as it would have.
    * **The epoch's seeds.** ``_base_seed`` is saved and reused. On
      load the base seed is drawn all the same and then replaced, so the
      loader's generator (or torch's global RNG) moves as the run's did.

    Snapshots are taken at every batch (torchdata's
    ``snapshot_every_n_steps=1``), so ``_steps_since_snapshot`` is always 0
    in our states. A torchdata state with more is replayed as torchdata
    replays it.
"""

from __future__ import annotations

import array
import base64
import binascii
import copy
import ctypes
import itertools
import pickle
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["stateful", "sampler_iter", "restore_sampler", "Capturer", "restore_rng",
           "SNAPSHOT", "MAIN_SNAPSHOT", "WORKER_SNAPSHOTS", "NUM_YIELDED"]

# torchdata's keys (torchdata/stateful_dataloader/stateful_dataloader.py, incremental_state.py)
INDEX_SAMPLER_STATE = "_index_sampler_state"
SAMPLER_ITER_STATE = "_sampler_iter_state"
SAMPLER_ITER_YIELDED = "_sampler_iter_yielded"
NUM_YIELDED = "_num_yielded"
LEN_CALLED = "_IterableDataset_len_called"
SHARED_SEED = "_shared_seed"
ITERATOR_FINISHED = "_iterator_finished"
NUM_WORKERS = "_num_workers"
SNAPSHOT = "_snapshot"
MAIN_SNAPSHOT = "_main_snapshot"
WORKER_SNAPSHOTS = "_worker_snapshots"
SNAPSHOT_STEP = "_snapshot_step"
STEPS_SINCE = "_steps_since_snapshot"
LAST_WORKER = "_last_yielded_worker_id"
BASE_SEED = "_base_seed"
WORKER_ID = "worker_id"
FETCHER_STATE = "fetcher_state"
DATASET_STATE = "dataset_state"
DATASET_ITER_STATE = "dataset_iter_state"
FETCHER_ENDED = "fetcher_ended"
# ours, beside them in a worker's snapshot (torchdata reads the keys it knows)
RNG = "_shmshare_rng"  # the worker's random/numpy/torch states after its last yielded batch
BATCHES = "_shmshare_batches"  # batches it made this epoch: replayed where a dataset cannot say where it is


def stateful(obj: Any) -> bool:
    """Whether `obj` has ``state_dict`` and ``load_state_dict`` (torchdata's ``Stateful``, duck-typed)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def state_of(obj: Any) -> Any:
    """``obj.state_dict()`` for a stateful object, else None (torchdata's ``try_to_serialize``)."""
    return obj.state_dict() if stateful(obj) else None


# -- the sampler's side ---------------------------------------------------------------------------


def _known(index_sampler: Any) -> str | None:
    """Which of the samplers we iterate ourselves `index_sampler` is exactly, if any."""
    from . import _samplers

    t = type(index_sampler)
    data = sys.modules.get("torch.utils.data")
    if t is _samplers.BatchSampler or (data is not None and t is data.BatchSampler):
        return "batch"
    if t is _samplers.RandomSampler:
        return "numpy-random"
    if data is not None and t is data.RandomSampler:
        return "torch-random"
    return None


def sampler_iter(index_sampler: Any) -> Iterator[Any]:
    """``iter(index_sampler)``: resumable where the sampler is one we know (Note [Resuming mid-epoch])."""
    kind = _known(index_sampler)
    if kind == "batch":
        return _BatchIter(index_sampler)
    if kind is not None:
        return _RandomIter(index_sampler, kind)
    return iter(index_sampler)


class _RandomIter(Iterator[int]):
    """A ``RandomSampler``'s epoch, drawn as torch's (or shmshare's) sampler draws it, that can resume.

    Its state is torchdata's ``RandomSampler`` iterator's: ``generator``, the
    generator's state before the epoch's draws (a ``torch.uint8`` tensor;
    numpy's ``bit_generator.state`` dict in numpy mode), and ``yielded``.
    """

    def __init__(self, sampler: Any, kind: str) -> None:
        self._sampler = sampler
        self._kind = kind
        self._it: Iterator[int] | None = None
        self._start: Any = None
        self.yielded = 0

    def __next__(self) -> int:
        if self._it is None:
            self._begin(None)
        assert self._it is not None
        value = next(self._it)
        self.yielded += 1
        return value

    def _begin(self, state: Any) -> None:
        """Choose the epoch's generator: as the sampler does (a draw from the global RNG where it has
        none), or, resuming, set to `state` (drawing nothing from the global RNG: the program restores
        that itself, as the uninterrupted run had it then)."""
        s = self._sampler
        if self._kind == "numpy-random":
            if state is None:
                rng = s._rng.for_iteration()  # (a draw from the global state or a torch generator)
            else:
                rng = s._rng._rng or np.random.Generator(_bit_generator(state))
                rng.bit_generator.state = state
            self._start = rng.bit_generator.state
            self._it = itertools.chain.from_iterable(s._chunks(rng))
            return
        import torch

        if s.generator is not None:
            generator = s.generator
        elif state is None:  # torch's RandomSampler: a fresh generator from a global draw
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        else:
            generator = torch.Generator()
        if state is not None:
            generator.set_state(state)
        self._start = generator.get_state()
        self._it = _torch_draws(s, generator)

    def state_dict(self) -> dict[str, Any]:
        if self._it is None:  # asked before the first draw (an epoch's start): the generator is chosen now
            self._begin(None)
        return {"generator": self._start, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._begin(state["generator"])
        self.yielded = 0
        for _ in itertools.islice(self, int(state["yielded"])):
            pass


def _bit_generator(state: Any) -> Any:
    name = state.get("bit_generator") if isinstance(state, dict) else None
    cls = getattr(np.random, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, np.random.BitGenerator)):
        raise ValueError(f"the state's sampler generator is not a numpy bit generator's state: {name!r}")
    return cls()


def _torch_draws(s: Any, generator: Any) -> Iterator[int]:
    """torch's ``RandomSampler.__iter__`` after its generator is chosen (torch 2.x)."""
    import torch

    n = len(s.data_source)
    if s.replacement:
        for _ in range(s.num_samples // 32):
            yield from torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator).tolist()
        yield from torch.randint(high=n, size=(s.num_samples % 32,), dtype=torch.int64,
                                 generator=generator).tolist()
    else:
        for _ in range(s.num_samples // n):
            yield from torch.randperm(n, generator=generator).tolist()
        yield from torch.randperm(n, generator=generator).tolist()[:s.num_samples % n]


class _BatchIter(Iterator[list[Any]]):
    """A ``BatchSampler``'s epoch, batched as torch's, with torchdata's ``_BatchSamplerIterator`` state:
    ``samples_yielded``, and the sampler's and its iterator's states where they have them."""

    def __init__(self, batch_sampler: Any) -> None:
        self._bs = batch_sampler
        self._inner = sampler_iter(batch_sampler.sampler)
        self._sampler_stateful = stateful(batch_sampler.sampler)
        self._inner_stateful = stateful(self._inner)
        self.samples_yielded = 0

    def __next__(self) -> list[Any]:
        size = self._bs.batch_size
        batch = list(itertools.islice(self._inner, size))
        if not batch or (self._bs.drop_last and len(batch) < size):
            raise StopIteration
        self.samples_yielded += len(batch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"samples_yielded": self.samples_yielded}
        if self._sampler_stateful:
            state["sampler_state"] = self._bs.sampler.state_dict()
        if self._inner_stateful:
            state["sampler_iter_state"] = self._inner.state_dict()  # type: ignore[attr-defined]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self._bs.sampler
        loaded = state.get("sampler_state") is not None and self._sampler_stateful
        if loaded:
            sampler.load_state_dict(state["sampler_state"])
        self._inner = sampler_iter(sampler)
        self.samples_yielded = int(state["samples_yielded"])
        if state.get("sampler_iter_state") is not None and stateful(self._inner):
            self._inner.load_state_dict(state["sampler_iter_state"])  # type: ignore[attr-defined]
        elif not loaded:  # a sampler that says where it is skips by itself (torchdata's rule)
            for _ in itertools.islice(self._inner, self.samples_yielded):
                pass


def restore_sampler(index_sampler: Any, main: dict[str, Any]) -> tuple[Iterator[Any], int]:
    """Return the sampler's iterator where `main` (a main snapshot, or the single-process state) left
    it, and the number of draws that makes."""
    loaded = main.get(INDEX_SAMPLER_STATE) is not None and stateful(index_sampler)
    if loaded:
        index_sampler.load_state_dict(main[INDEX_SAMPLER_STATE])
    it = sampler_iter(index_sampler)
    drawn = int(main.get(SAMPLER_ITER_YIELDED) or 0)
    if main.get(SAMPLER_ITER_STATE) is not None and stateful(it):
        it.load_state_dict(main[SAMPLER_ITER_STATE])  # type: ignore[attr-defined]
    elif not loaded:
        for _ in itertools.islice(it, drawn):  # torchdata's fast-forward for samplers that keep no state
            pass
    return it, drawn


# -- a worker's side ------------------------------------------------------------------------------


class Capturer:
    """A worker's snapshots after each batch (Note [Resuming mid-epoch]): cheap when nothing changed.

    The RNG part is read raw where it can be (numpy's MT19937 words through
    its ctypes address: 1 µs where ``get_state()`` takes 100) and sent only
    when it differs from what was sent last. A dataset's own state is pickled
    each batch; if taking it fails, the error travels instead and
    ``loader.state_dict()`` raises it.
    """

    def __init__(self, use_torch: bool) -> None:
        self._torch = sys.modules.get("torch") if use_torch else None
        self._py: Any = None
        self._np_raw: bytes | None = None
        self._np_gauss = False  # numpy's cached normal: used without moving the words
        self._torch_raw: bytes | None = None
        self._np_addr: int | None = None
        try:
            bg = np.random.mtrand._rand._bit_generator
            if type(bg).__name__ == "MT19937":
                self._np_addr = int(bg.ctypes.state_address)
        except AttributeError:
            pass

    def snapshot(self, dataset: Any, fetcher: Any, iterable: bool) -> list[Any]:
        """[rng bytes or None (unchanged since the last snapshot), user pickle or None]."""
        return [self._rng(), _user_state(dataset, fetcher, iterable)]

    def _rng(self) -> bytes | None:
        py = _py_state()
        np_raw = ctypes.string_at(self._np_addr, _MT_BYTES) if self._np_addr is not None else None
        torch_raw = self._torch.get_rng_state().numpy().tobytes() if self._torch is not None else b""
        if (py == self._py and torch_raw == self._torch_raw and np_raw is not None and np_raw == self._np_raw
                and not self._np_gauss):
            return None
        self._py, self._np_raw, self._torch_raw = py, np_raw, torch_raw
        st = np.random.get_state(legacy=False)
        self._np_gauss = bool(st["has_gauss"])
        version, words, gauss = random.getstate()
        return pickle.dumps(((version, gauss, st["state"]["pos"], st["has_gauss"], st["gauss"]),
                             array.array("I", words).tobytes(), st["state"]["key"].astype(np.uint32).tobytes(),
                             torch_raw), protocol=pickle.HIGHEST_PROTOCOL)


_MT_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos
_PY_OFFSET = 16  # CPython's RandomObject: PyObject_HEAD (16 bytes); int index; uint32_t state[624]
_PY_BYTES = 4 + 624 * 4


def _py_state() -> Any:
    """Something that changes exactly when ``random``'s state does: its words read raw (1 µs; building
    ``getstate()``'s tuple of 625 ints takes 20-30), checked once against ``getstate()``, which is used
    where the layout is not CPython's."""
    global _py_raw_ok
    inst: Any = random._inst
    if _py_raw_ok is None:
        _py_raw_ok = _raw_matches(inst)
    if not _py_raw_ok:
        return random.getstate()
    return ctypes.string_at(id(inst) + _PY_OFFSET, _PY_BYTES), inst.gauss_next


def _raw_matches(inst: Any) -> bool:
    try:
        raw = ctypes.string_at(id(inst) + _PY_OFFSET, _PY_BYTES)
        _, words, _ = inst.getstate()
        index = int.from_bytes(raw[:4], sys.byteorder, signed=True)
        return type(inst) is random.Random and sys.implementation.name == "cpython" and (
            [*array.array("I", raw[4:]), index] == list(words))
    except (AttributeError, ValueError, TypeError, OverflowError):
        return False


_py_raw_ok: bool | None = None


class StateError:
    """A worker's dataset state that could not be taken: what went wrong, raised by ``state_dict()``."""

    def __init__(self, why: str) -> None:
        self.why = why


def _user_state(dataset: Any, fetcher: Any, iterable: bool) -> bytes | None:
    it = getattr(fetcher, "it", None)
    try:
        dataset_state = None if iterable and it is dataset else _dataset_state(dataset)
        fetcher_state = None
        if iterable:
            fetcher_state = {DATASET_ITER_STATE: state_of(it), FETCHER_ENDED: bool(fetcher.ended)}
        if dataset_state is None and fetcher_state is None:
            return None
        return pickle.dumps((dataset_state, fetcher_state), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - the batch goes on; state_dict() says it
        return pickle.dumps(StateError(f"{type(exc).__name__}: {exc}"[:2000]))


def _dataset_state(dataset: Any) -> Any:
    """The dataset's own state, unless it is a torch ``nn.Module`` (whose state_dict is its weights)."""
    if not stateful(dataset):
        return None
    nn = sys.modules.get("torch.nn")
    if nn is not None and isinstance(dataset, nn.Module):
        return None
    return dataset.state_dict()


def worker_snapshot(worker_id: int, snap: Any, batches: int) -> dict[str, Any]:
    """The torchdata-layout snapshot of a worker from the last one it sent (None: none yet; a dict:
    the one it was resumed from, no batch since)."""
    if isinstance(snap, dict):
        return {**snap, WORKER_ID: worker_id, BATCHES: batches}
    out: dict[str, Any] = {WORKER_ID: worker_id, DATASET_STATE: None, FETCHER_STATE: None}
    if snap is not None:
        if snap[1] is not None:
            user = pickle.loads(snap[1])
            if isinstance(user, StateError):
                raise RuntimeError(f"DataLoader worker {worker_id} could not take its dataset's state after its "
                                   f"last batch: {user.why}. A dataset's (or its iterator's) state_dict() must "
                                   "return something picklable, and not raise")
            out[DATASET_STATE], out[FETCHER_STATE] = user
        if snap[0] is not None:
            out[RNG] = _rng_from_bytes(snap[0])
    out[BATCHES] = batches
    return out


def restore_worker(state: dict[str, Any], dataset: Any, make: Any, iterable: bool,
                   replay_index: Any) -> Any:
    """In a resumed worker, after seeding and ``worker_init_fn``: the fetcher where `state` left it, then
    the RNG state taken back."""
    fetcher = restore_fetcher(state, dataset, make, iterable, replay_index, int(state.get(BATCHES) or 0))
    if state.get(RNG) is not None:
        restore_rng(state[RNG])
    return fetcher


def restore_fetcher(state: dict[str, Any], dataset: Any, make: Any, iterable: bool, replay_index: Any,
                    batches: int) -> Any:
    """Load the dataset's state, make the fetcher (``make()``: ``iter(dataset)`` once), then load its
    iterator's state; an iterable dataset that has neither is brought where it was by fetching its
    `batches` again (torchdata's order: dataset, ``iter()``, iterator)."""
    loaded = state.get(DATASET_STATE) is not None and stateful(dataset)
    nn = sys.modules.get("torch.nn")
    if nn is not None and isinstance(dataset, nn.Module):
        loaded = False
    if loaded:
        dataset.load_state_dict(state[DATASET_STATE])
    fetcher = make()
    if not iterable:
        return fetcher
    fstate = state.get(FETCHER_STATE) or {}
    if fstate.get(DATASET_ITER_STATE) is not None and stateful(fetcher.it):
        fetcher.it.load_state_dict(fstate[DATASET_ITER_STATE])
    elif not loaded:
        for _ in range(batches):
            try:
                fetcher.fetch(replay_index)
            except StopIteration:
                break
    if FETCHER_ENDED in fstate:
        fetcher.ended = bool(fstate[FETCHER_ENDED])
    return fetcher


def stateless_iterable(state: dict[str, Any]) -> bool:
    """Whether a state with workers came from torchdata over an iterable dataset that keeps no state:
    it is resumed by replaying its batches from the start, as torchdata resumes it."""
    workers = state[SNAPSHOT][WORKER_SNAPSHOTS].values()
    return all(BATCHES not in w and w.get(DATASET_STATE) is None
               and (w.get(FETCHER_STATE) or {}).get(DATASET_ITER_STATE) is None for w in workers)


def single_state(progress: Any, index_sampler: Any, sampler_it: Any, fetcher: Any, dataset: Any,
                 iterable: bool) -> dict[str, Any]:
    """The state of an iterator with no workers (torchdata's flat layout), from the objects now."""
    it = getattr(fetcher, "it", None)
    return {INDEX_SAMPLER_STATE: state_of(index_sampler), SAMPLER_ITER_STATE: state_of(sampler_it),
            SAMPLER_ITER_YIELDED: progress.drawn, NUM_YIELDED: progress.num_yielded,
            LEN_CALLED: progress.len_called, SHARED_SEED: None,
            FETCHER_STATE: {DATASET_ITER_STATE: state_of(it), FETCHER_ENDED: bool(fetcher.ended)}
            if iterable else None,
            DATASET_STATE: None if iterable and it is dataset else state_of(dataset)}


def _rng_from_bytes(data: bytes) -> dict[str, Any]:
    """The RNG states as plain data: numbers, and the words as base64 text (JSON holds them, and
    ``torch.load(weights_only=True)``; a list of 5056 ints would be 10x the size and time)."""
    head, words, key, torch_state = pickle.loads(data)
    version, gauss, pos, has_gauss, np_gauss = head
    return {"format": 1, "random": [version, _b64(words), gauss],
            "numpy": {"key": _b64(key), "pos": pos, "has_gauss": has_gauss, "gauss": np_gauss},
            "torch": _b64(torch_state) if torch_state else None}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (TypeError, ValueError, binascii.Error) as exc:
        raise ValueError(f"the state's worker RNG ({what}) is not the base64 text state_dict() wrote") from exc


def check_rng(state: Any, where: str) -> None:
    """Refuse a worker RNG state that is not what state_dict() wrote (before any worker starts)."""
    try:
        version, words, _ = state["random"]
        ok = (int(version) == 3 and len(_unb64(words, "random")) == 625 * 4
              and len(_unb64(state["numpy"]["key"], "numpy")) == 624 * 4
              and 0 <= int(state["numpy"]["pos"]) <= 624
              and (state.get("torch") is None or len(_unb64(state["torch"], "torch")) > 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: the worker RNG state ({RNG!r}) is not one state_dict() wrote: {exc}") from None
    if not ok:
        raise ValueError(f"{where}: the worker RNG state ({RNG!r}) has the wrong sizes; it is not one "
                         "state_dict() wrote")


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's random, numpy and (if imported) torch RNGs to `state` (from a snapshot)."""
    version, words, gauss = state["random"]
    random.setstate((version, tuple(array.array("I", _unb64(words, "random"))), gauss))
    np_state = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937",
                         "state": {"key": np.frombuffer(_unb64(np_state["key"], "numpy"), np.uint32).copy(),
                                   "pos": np_state["pos"]},
                         "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]})
    torch = sys.modules.get("torch")
    if torch is not None and state.get("torch") is not None:
        raw = np.frombuffer(_unb64(state["torch"], "torch"), np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(raw))


def copied(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy: a state handed out is not changed by later batches, nor the loader's by its user."""
    out: dict[str, Any] = copy.deepcopy(state)
    return out
