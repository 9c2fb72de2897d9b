"""The transport contract, run against the store: its daemon lends what a client put, a getter borrows."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid

import numpy as np
import pytest

from shmshare import ProtocolError
from shmshare.store import Daemon, Store, StoreGone
from shmshare.store._packing import one_array_meta
from shmshare.testing import Forged, OtherProcess, TransportContract
from shmshare.testing.transport_contract import regular_file, sealed_memfd

from .fakes import FakeDaemon


class _Lender:
    """A daemon (the one of the module, or one of the test's own) and the client that puts into it."""

    def __init__(self, daemon, own, wait):
        self.daemon, self.own, self.keys, self.closed = daemon, own, [], False
        self.store = Store(daemon.path, timeout=wait)


class TestStore(TransportContract):
    """The daemon lends: what it lends is its getters' references (one per get), so an array counts
    as lent once taken, not once put. A test that stops or kills the lender starts a daemon of its own."""

    lent_before_take = False

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def daemon(cls):
        cls.where = tempfile.mkdtemp(prefix="ss-", dir="/tmp")  # short: a socket path is at most 107 bytes
        try:
            cls.shared = Daemon.start(os.path.join(cls.where, "store.sock"))
            yield cls.shared
            assert cls.shared.stop() == 0, "the module's daemon did not exit cleanly"
        finally:
            shutil.rmtree(cls.where, ignore_errors=True)

    def make_pair(self, own=False):
        daemon = Daemon.start(os.path.join(self.where, f"{uuid.uuid4().hex[:8]}.sock")) if own else self.shared
        try:
            return _Lender(daemon, own, self.wait), Store(daemon.path, timeout=self.wait)
        except BaseException:
            if own:
                daemon.kill()
            raise

    def lend(self, lender, key, array):
        lender.store.put(key, array)
        lender.keys.append(key)

    def take(self, borrower, key, timeout):
        return borrower.get(key, timeout=timeout)

    def lent(self, lender):
        return sum(lender.store.info(key).refs for key in lender.keys)

    def close_lender(self, lender):
        if lender.closed:
            return
        lender.closed = True
        if lender.own:
            lender.store.close()
            lender.daemon.stop()
            return
        for key in lender.keys:
            with contextlib.suppress(KeyError):
                lender.store.delete(key)
        lender.store.close()

    def close_borrower(self, borrower):
        borrower.close()

    def child_end(self, end):
        return Store(end.path, timeout=self.wait) if isinstance(end, Store) else end  # not the parent's

    def after_lender_died(self, borrower):
        with pytest.raises(StoreGone):
            borrower.stats()

    @contextlib.contextmanager
    def lender_elsewhere(self, items, own):
        lender, borrower = self.make_pair(own=own)  # the daemon is the other process
        try:
            for key, array in items.items():
                self.lend(lender, key, array)
            yield OtherProcess(lender.daemon.pid, borrower, lender.daemon.stop, lender.daemon.kill)
        finally:
            self.close_lender(lender)

    def forge(self, case, where):
        # a fake daemon answering a get (tests/store/test_store_hostile.py's raw peers, the other way)
        size = 1 << 20 if case == "regular_file" else 4096
        fds = [regular_file(where, size)] if case == "regular_file" else [sealed_memfd(size)]
        reply = {"k": "obj", "o": 1, "i": 7, "off": 0 if case == "regular_file" else size - 64, "s": size,
                 "m": one_array_meta((size,), np.dtype(np.uint8), None, True), "n": size}
        fake = FakeDaemon(os.path.join(where, "fake.sock"), b"\xc1" if case == "garbage" else reply, fds, self.wait)
        store = Store(fake.path, timeout=self.wait)
        match = {"regular_file": "a regular file", "outside": "placed", "garbage": "a malformed frame"}[case]

        def close():
            store.close()
            fake.close()
        return Forged(lambda: store.get("forged"), ProtocolError, match, close)
