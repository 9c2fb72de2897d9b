"""The one place where "closing" becomes a context manager and a finalizer."""

from __future__ import annotations

from typing import Self

__all__ = ["Closeable"]


class Closeable:
    """Mixin for owners of OS resources: ``with`` and garbage collection both call ``close()``.

    ``close()`` must be idempotent and safe on a half-built object (the
    finalizer also runs when ``__init__`` raised).
    """

    __slots__ = ()

    def close(self) -> None:
        """Release what this object owns. Idempotent."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # a half-built object, or interpreter shutdown: nothing to report to
            pass
