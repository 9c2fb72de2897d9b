"""Fetchers: from one task's indices to one collated batch, as torch's ``_utils/fetch.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["MapFetcher", "IterableFetcher", "make_fetcher"]


class MapFetcher:
    """A map-style dataset: ``dataset[i]`` per index, or ``__getitems__`` for the whole batch."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 drop_last: bool) -> None:
        self.dataset, self.auto_collation, self.collate_fn = dataset, auto_collation, collate_fn
        getitems = getattr(dataset, "__getitems__", None)
        self.getitems = getitems if getitems else None

    def fetch(self, index: Any) -> Any:
        if self.auto_collation:
            data = self.getitems(index) if self.getitems is not None else [self.dataset[i] for i in index]
        else:
            data = self.dataset[index]
        return self.collate_fn(data)


class IterableFetcher:
    """An iterable-style dataset: the next ``batch_size`` items of this process's iterator."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 drop_last: bool) -> None:
        self.auto_collation, self.collate_fn, self.drop_last = auto_collation, collate_fn, drop_last
        self.it: Iterator[Any] = iter(dataset)
        self.ended = False

    def fetch(self, index: Any) -> Any:
        if self.ended:
            raise StopIteration
        if self.auto_collation:
            data = []
            for _ in index:
                try:
                    data.append(next(self.it))
                except StopIteration:
                    self.ended = True
                    break
            if not data or (self.drop_last and len(data) < len(index)):
                raise StopIteration
        else:
            data = next(self.it)
        return self.collate_fn(data)


def make_fetcher(iterable: bool, dataset: Any, auto_collation: bool,
                 collate_fn: Callable[[Any], Any], drop_last: bool) -> MapFetcher | IterableFetcher:
    cls = IterableFetcher if iterable else MapFetcher
    return cls(dataset, auto_collation, collate_fn, drop_last)
