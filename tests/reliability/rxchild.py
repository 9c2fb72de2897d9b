"""A ``listen()`` receiver in a forked child, driven and watched by the test.

The child reports every batch (after reading each of its bytes) and every
exception ``recv()`` raises over its control connection, and at the end how
many ``recv()`` calls it made and raised. A batch ``{"case": i, "x":
pattern(i, n)}`` from the test's own good sender is a marker: it proves the
receiver still serves after case i. The test asserts on the child's exit
status, so a SIGBUS or SIGSEGV in the receiver is seen as a signal.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import shmshare
from shmshare import ShmshareTimeout
from shmshare.testing import pattern

from .helpers import (
    CHILD_DEADLINE,
    Kid,
    error_report,
    exit_status,
    fd_count,
    remove_private_dir,
    set_nofile,
    touch_all,
)

MAX_ERROR_REPORTS = 300  # past this, errors are only counted (a spinning recv() must not flood us)


def receiver_main(ctl: Any, opts: dict[str, Any]) -> None:
    """The child: listen, report ready, then recv and report until told to stop."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stack dump of a hang
    kw = dict(opts.get("listen_kw", {}))
    rx = shmshare.listen(None, **kw)
    if opts.get("nofile_spare") is not None:  # fds this process may open beyond what it has
        set_nofile(fd_count() + opts["nofile_spare"])
    ctl.send({"ev": "ready", "path": rx.path, "pid": os.getpid()})
    held: list[Any] = []
    calls = raised = reports = 0
    kinds: dict[str, int] = {}
    deadline = time.monotonic() + opts.get("deadline", CHILD_DEADLINE)
    try:
        while time.monotonic() < deadline:
            if ctl.poll(0):
                cmd, _ = ctl.recv(timeout=5)
                if cmd.get("cmd") == "stop":
                    break
                if cmd.get("cmd") == "drop":
                    held.clear()
                    ctl.send({"ev": "dropped"})
                continue
            calls += 1
            try:
                batch = rx.recv(timeout=0.2)
            except ShmshareTimeout:
                continue
            except Exception as exc:  # noqa: BLE001 - every kind is reported: the test judges them
                raised += 1
                kinds[type(exc).__name__] = kinds.get(type(exc).__name__, 0) + 1
                if reports < opts.get("max_reports", MAX_ERROR_REPORTS):
                    reports += 1
                    ctl.send(error_report(exc), timeout=10)
                continue
            ctl.send(_batch_report(batch), timeout=10)
            if opts.get("hold"):
                held.append(batch)
            del batch
    finally:
        ctl.send({"ev": "bye", "calls": calls, "raised": raised, "kinds": kinds}, timeout=10)
        held.clear()
        rx.close()


def _batch_report(batch: Any) -> dict[str, Any]:
    total = touch_all(batch)
    if isinstance(batch, dict) and "case" in batch and isinstance(batch.get("x"), np.ndarray):
        x = batch["x"]
        ok = bool(np.array_equal(x, pattern(batch["case"], x.size)))
        return {"ev": "batch", "case": batch["case"], "ok": ok, "sum": total}
    return {"ev": "batch", "case": None, "ok": None, "sum": total}


class ReceiverChild:
    """The test's side: the child's path, pid, reports, and a good sender of markers."""

    def __init__(self, **opts: Any) -> None:
        self.kid = Kid(receiver_main, opts)
        self.path: str | None = None
        self.good: shmshare.Sender | None = None
        self.errors: list[dict[str, Any]] = []  # every error report, in order
        self.foreign: list[dict[str, Any]] = []  # batches that were not markers
        self.bye: dict[str, Any] | None = None
        ready = self.kid.expect("ready")
        self.path, self.pid = ready["path"], ready["pid"]

    def connect_good(self, n: int = 256) -> None:
        """Connect the test's own sender and prove it is served (marker case -1)."""
        self.good = shmshare.connect(self.path, timeout=10, limit=8 << 20)
        self.marker(-1, n)

    def marker(self, case: int, n: int = 256, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Send marker `case` from the good sender; return the error reports seen before it."""
        assert self.good is not None
        self.good.send({"case": case, "x": pattern(case, n)}, timeout=timeout)
        return self.until_marker(case, timeout)

    def until_marker(self, case: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            assert left > 0, f"marker {case} was not delivered within {timeout} s; {_summary(seen)}"
            try:
                ev = self.kid.event(left)
            except AssertionError as exc:
                raise AssertionError(f"marker {case} was not delivered: {exc}; {_summary(seen)}") \
                    from None
            if ev["ev"] == "error":
                self.errors.append(ev)
                seen.append(ev)
            elif ev["ev"] == "batch" and ev["case"] == case:
                assert ev["ok"], f"marker {case} arrived with the wrong contents"
                return seen
            elif ev["ev"] == "batch":
                self.foreign.append(ev)
            else:  # the receiver loop ended early: its crash report (if any) says why
                self.kid.event(5)
                raise AssertionError(f"the receiver stopped early: {ev}")

    def next_foreign(self, timeout: float = 20.0) -> dict[str, Any]:
        """Return the next batch that was not a marker (errors seen meanwhile are kept)."""
        if self.foreign:
            return self.foreign.pop(0)
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            ev = self.kid.event(left)
            if ev["ev"] == "batch" and ev["case"] is None:
                return ev
            assert ev["ev"] == "error", f"unexpected report {ev}"
            self.errors.append(ev)
        raise AssertionError(f"no batch from the forged peer within {timeout} s; errors: "
                             f"{self.errors}")

    def finish(self, timeout: float = 20.0) -> dict[str, Any]:
        """Stop the receiver; return its final counts; fail if it did not exit 0."""
        if self.good is not None:
            self.good.close()
            self.good = None
        self.kid.tell(cmd="stop")
        while True:
            ev = self.kid.event(timeout)
            if ev["ev"] == "bye":
                self.bye = ev
                break
            if ev["ev"] == "error":
                self.errors.append(ev)
        code = self.kid.join(timeout)
        assert code == 0, f"receiver pid {self.pid}: {exit_status(code)}"
        return self.bye

    def close(self) -> None:
        if self.good is not None:
            with contextlib.suppress(Exception):
                self.good.close()
            self.good = None
        self.kid.stop()
        remove_private_dir(self.path)


def _summary(errors: list[dict[str, Any]]) -> str:
    kinds: dict[str, int] = {}
    for e in errors:
        kinds[e["type"]] = kinds.get(e["type"], 0) + 1
    first = f"; the first: {errors[0]['type']}: {errors[0]['msg'][:300]}" if errors else ""
    return f"recv() raised meanwhile: {kinds or 'nothing'}{first}"


@contextlib.contextmanager
def receiver_child(**opts: Any) -> Iterator[ReceiverChild]:
    """Start a receiver child; kill it by pid and clean its directory afterwards."""
    rc = ReceiverChild(**opts)
    try:
        yield rc
    finally:
        rc.close()
