"""An exception raised in a worker, re-raised in the main process with its type and traceback.

torch's ``ExceptionWrapper`` is the spec: the main process raises an
exception of the worker's exception type whose message is ``Caught <Type>
in DataLoader worker process <id>.`` followed by ``Original Traceback (most
recent call last):`` and the worker's traceback; a KeyError's message keeps
its newlines; a type that cannot be built from one message string becomes
a RuntimeError with the same text.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from typing import Any, NoReturn

__all__ = ["WorkerError", "KeyErrorMessage", "capture"]


class KeyErrorMessage(str):
    """A KeyError's message shown as is (a KeyError's str() is the repr of its argument)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return self


class WorkerError:
    """The exception being handled, as `where` saw it, in a form that pickles."""

    def __init__(self, exc_info: Any = None, where: str = "in background") -> None:
        if exc_info is None:
            exc_info = sys.exc_info()
        self.exc_type: type[BaseException] = exc_info[0]
        self.exc_msg = "".join(traceback.format_exception(*exc_info))
        self.where = where

    def message(self) -> str:
        return (f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}")

    def reraise(self) -> NoReturn:
        msg = self.message()
        if self.exc_type is KeyError:
            msg = KeyErrorMessage(msg)
        elif getattr(self.exc_type, "message", None):
            raise self.exc_type(message=msg)  # type: ignore[call-arg]
        try:
            exc = self.exc_type(msg)
        except Exception:  # noqa: BLE001 - a type that takes other arguments: its text stays
            raise RuntimeError(msg) from None
        raise exc

    def dumps(self) -> bytes:
        """Pickle it; an exception type that does not pickle (a local class) goes as RuntimeError."""
        try:
            return pickle.dumps(self)
        except Exception:  # noqa: BLE001 - any failure to pickle the type: keep the text
            plain = WorkerError.__new__(WorkerError)
            plain.exc_type, plain.exc_msg, plain.where = RuntimeError, self.exc_msg, self.where
            return pickle.dumps(plain)


def capture(where: str) -> bytes:
    """Return the pickled WorkerError of the exception being handled."""
    return WorkerError(where=where).dumps()
