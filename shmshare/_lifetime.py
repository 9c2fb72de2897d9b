"""The one place where "closing" becomes a context manager and a finalizer."""

from __future__ import annotations

from typing import Self

__all__ = ["Closeable"]


class Closeable:
    """Mixin for owners of OS resources: ``with`` calls ``close()``, garbage collection ``_finalize()``.

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
            self._finalize()
        except Exception:  # noqa: BLE001, S110 - a half-built object, or interpreter shutdown: nothing to report to
            pass

    def _finalize(self) -> None:
        """What the garbage collector does with an object nobody closed: ``close()``.

        Owners whose ``close()`` converses with a peer or waits (a goodbye, a
        join) override this to release without waiting and warn instead
        (STYLE.md: finalizers release, they do not converse).
        """
        self.close()
