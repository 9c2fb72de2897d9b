"""Type variables with a default, for the generic public classes (``Receiver[T]``, ``Store[V]``).

A default lets an unparameterized ``Receiver`` mean ``Receiver[Any]`` under
``mypy --strict``, as ``Queue`` does. typing's ``TypeVar`` takes a default
from 3.13 only, and typing_extensions is no dependency of ours, so the
default is declared for the type checker alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["T", "V"]

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    T = TypeVar("T", default=Any)  # what a channel receiver receives
    V = TypeVar("V", default=Any)  # what a store holds
else:
    from typing import TypeVar

    T = TypeVar("T")
    V = TypeVar("V")
