"""A batch on its way from a worker: pickled, with its arrays beside the pickle as pool leases.

Note [Batches as pickles with arrays beside]
    torch's loader pickles whatever a worker's ``collate_fn`` returns, so a
    batch may hold anything: namedtuples, dataclasses, OrderedDicts, PIL
    images, strings. The channel carries only arrays in dicts, lists and
    tuples. So a batch is pickled (the C pickler: every type comes back as it
    was) with each numpy array and CPU tensor taken out by ``persistent_id``
    and sent beside the pickle, as the channel sends any array: a lease on
    the worker's pool block, no copy when the array is already in the pool
    (``default_collate`` stacks straight into it), one copy otherwise. What
    the pickle keeps in-band: arrays of objects, tensors that need autograd
    (``requires_grad``), tensor subclasses, sparse, quantized, or not on the CPU.

    Two views of one array that is not in the pool arrive as two copies:
    their aliasing is lost (torch's pickling keeps it, sharing the storage).
    An array or tensor in the pool keeps it: both views lease the same block.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

import numpy as np

__all__ = ["pack", "unpack"]


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, arrays: list[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays = arrays
        torch = sys.modules.get("torch")
        self.tensor = torch.Tensor if torch is not None else None
        self.strided = torch.strided if torch is not None else None

    def persistent_id(self, obj: Any) -> int | None:
        t = type(obj)
        if t is np.ndarray:
            if obj.dtype.hasobject:
                return None
        elif t is not self.tensor or not _plain_tensor(obj, self.strided):
            return None
        self.arrays.append(obj)
        return len(self.arrays) - 1


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, arrays: list[Any]) -> None:
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not int or not 0 <= pid < len(self.arrays):
            raise pickle.UnpicklingError(f"a batch refers to array {pid!r} of {len(self.arrays)}")
        return self.arrays[pid]


def _plain_tensor(t: Any, strided: Any) -> bool:
    return bool(t.layout is strided and t.device.type == "cpu" and not t.requires_grad
                and not t.is_quantized and not t.is_conj() and not t.is_neg())


def pack(batch: Any) -> tuple[bytes, list[Any]]:
    """Return (the pickle of `batch` with its arrays taken out, the arrays)."""
    arrays: list[Any] = []
    buf = io.BytesIO()
    _Pickler(buf, arrays).dump(batch)
    return buf.getvalue(), arrays


def unpack(data: bytes, arrays: list[Any]) -> Any:
    """Return the batch `pack` made, with `arrays` (as received) put back in place."""
    return _Unpickler(io.BytesIO(data), arrays).load()
