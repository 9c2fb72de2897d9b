"""``shmshare.DataLoader`` as a ``torch.utils.data.DataLoader``: the class of a loader made while torch is imported.

Note [A torch DataLoader when torch is imported]
    Frameworks ask ``isinstance(loader, torch.utils.data.DataLoader)`` before
    they treat an object as a loader: Lightning, to add a distributed sampler,
    seed workers, set the sampler's epoch and re-create the loader for
    ``predict`` or DDP as ``type(loader)(**arguments)``; Accelerate, to
    prepare it at all. shmshare's class cannot derive from torch's, since it
    imports and works without torch, and a numpy program should not import
    torch to make a loader. So ``DataLoader.__new__`` makes a loader that is
    made while torch is imported (the test that picks torch's mode) an
    instance of a subclass of both, made here:

    - shmshare's class comes first in the MRO and overrides every method
      torch's class defines (``__init__``, ``__iter__``, ``_get_iterator``,
      ``__len__``, ``__setattr__``, ``multiprocessing_context``,
      ``_auto_collation``, ``_index_sampler``,
      ``check_worker_number_rationality``), so nothing of torch's loader runs;
      torch's class is there for ``isinstance`` and for its class attributes.
    - ``type(loader)`` is that subclass and calling it makes the same kind of
      loader, as Lightning's re-creation does. ``__init__`` is repeated in the
      subclass's own ``__dict__``: Lightning records the constructor's
      arguments (to re-create a loader exactly) only for subclasses of torch's
      class that define ``__init__`` themselves.
    - A user's subclass of ``shmshare.DataLoader`` gets a subclass of its own,
      made once (``as_torch``), with the same name.
    - A loader made before ``import torch`` stays shmshare's class alone: it is
      in numpy mode and no framework that checks the type runs before torch is
      imported.

    What frameworks do with a torch loader beyond reading it can still replace
    it with torch's own: Accelerate builds a new ``torch.utils.data.DataLoader``
    from the one it is given (Note [Accelerate rebuilds loaders] in
    ``_accelerate.py``, imported here with this module).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar, cast

import torch.utils.data

from . import _accelerate, _dataloader

__all__ = ["DataLoader", "as_torch"]

T_co = TypeVar("T_co", covariant=True)


# The two bases disagree on the types of what shmshare overrides (torch's __iter__ returns its own iterator class,
# its _IterableDataset_len_called is a class attribute); shmshare's, first in the MRO, are the ones that run.
class DataLoader(_dataloader.DataLoader[T_co], torch.utils.data.DataLoader[T_co]):  # type: ignore[misc]
    """``shmshare.DataLoader``, made while torch is imported: a ``torch.utils.data.DataLoader`` as well."""

    if not TYPE_CHECKING:  # (to mypy, a function assigned in a class body makes the class Any)
        __init__ = _dataloader.DataLoader.__init__  # in this class's own dict: Lightning records the arguments


def as_torch(cls: type[Any]) -> type[Any]:
    """Return the class a loader of `cls` has when torch is imported: `cls` and ``torch.utils.data.DataLoader``."""
    if issubclass(cls, torch.utils.data.DataLoader):
        return cls  # this module's class, one made below, or a user's class that derives from both itself
    if cls is _dataloader.DataLoader:
        return DataLoader
    with _lock:
        made = _subclasses.get(cls)
        if made is None:
            made = cast(type[Any], type(cls.__name__, (cls, DataLoader), {
                "__init__": cls.__init__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__, "__reduce_ex__": _pickled_as(cls)}))
            _subclasses[cls] = made
    return made


def _pickled_as(cls: type[Any]) -> Callable[[Any, SupportsIndex], Any]:
    """A made subclass's ``__reduce_ex__``: pickled as `cls` (its name finds `cls`, not the subclass), whose
    ``__new__`` makes the subclass again when the unpickling process has torch imported."""

    def reduce_ex(self: Any, protocol: SupportsIndex) -> Any:
        reduced = cast(tuple[Any, ...], object.__reduce_ex__(self, 2))  # (copyreg.__newobj__, (made,), state, ...)
        return (cls.__new__, (cls,), *reduced[2:])

    return reduce_ex


_lock = threading.Lock()  # one subclass per user class, even when two threads make the first loaders at once
_subclasses: dict[type[Any], type[Any]] = {}  # a user's subclass of shmshare.DataLoader -> its torch subclass

_accelerate.keep_in_accelerate()
