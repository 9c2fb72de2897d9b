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
    (``requires_grad``), tensor subclasses, sparse, nested, quantized, or not on the CPU.

    A non-contiguous tensor goes as torch's pickling sends it: its whole
    storage, with its shape, strides and offset, rebuilt by ``as_strided``.
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

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t is np.ndarray:
            if obj.dtype.hasobject:
                return None
        elif t is not self.tensor or not _plain_tensor(obj, self.strided):
            return None
        elif not obj.is_contiguous():
            # torch shares a view's whole storage and keeps its strides: so do we
            size = obj.untyped_storage().nbytes()
            if size % obj.element_size() == 0:
                base = obj.new_empty(0).set_(obj.untyped_storage(), 0, (size // obj.element_size(),))
                self.arrays.append(base)
                return (len(self.arrays) - 1, tuple(obj.shape), obj.stride(), obj.storage_offset())
        self.arrays.append(obj)
        return len(self.arrays) - 1


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, arrays: list[Any]) -> None:
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is tuple and len(pid) == 4:  # a strided view of a tensor's whole storage
            i, shape, stride, offset = pid
            base = self._array(i)
            return base.as_strided(shape, stride, offset)  # torch checks it lies in the storage
        return self._array(pid)

    def _array(self, i: Any) -> Any:
        if type(i) is not int or not 0 <= i < len(self.arrays):
            raise pickle.UnpicklingError(f"a batch refers to array {i!r} of {len(self.arrays)}")
        return self.arrays[i]


def _plain_tensor(t: Any, strided: Any) -> bool:
    return bool(t.layout is strided and t.device.type == "cpu" and not t.requires_grad
                and not t.is_nested and not t.is_quantized and not t.is_conj() and not t.is_neg())


def pack(batch: Any) -> tuple[bytes, list[Any]]:
    """Return (the pickle of `batch` with its arrays taken out, the arrays)."""
    arrays: list[Any] = []
    buf = io.BytesIO()
    _Pickler(buf, arrays).dump(batch)
    return buf.getvalue(), arrays


def unpack(data: bytes, arrays: list[Any]) -> Any:
    """Return the batch `pack` made, with `arrays` (as received) put back in place."""
    batch = _Unpickler(io.BytesIO(data), arrays).load()
    torch = sys.modules.get("torch")
    if torch is not None and torch._utils._sparse_tensors_to_validate:
        # torch rebuilds a pickled sparse tensor unchecked and keeps it for torch.load to check
        # (and forget): without this call every sparse batch would stay alive, pinning its blocks
        torch._utils._validate_loaded_sparse_tensors()
    return batch
