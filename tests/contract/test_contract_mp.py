"""The transport contract, run against shmshare.multiprocessing: this process's owner lends
what a Queue pickles, the process that unpickles it borrows."""

from __future__ import annotations

import sys
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

from shmshare import ProtocolError
from shmshare.testing import Forged, TransportContract, wait_until
from shmshare.testing.transport_contract import regular_file

from .fakes import FakeOwner, Handle


class TestMultiprocessing(TransportContract):
    """A Queue of a fork context: a lender and a borrower are the one Queue, in one process or two."""

    @pytest.fixture(autouse=True)
    def reducers(self):
        """Ours only while a test runs, as tests/mp/conftest.py has them: importing the module
        registers them for the whole process (and this module is collected before tests/mp)."""
        reducers = ForkingPickler._extra_reducers
        before, meta = dict(reducers), list(sys.meta_path)
        import shmshare.multiprocessing as smp
        from shmshare.multiprocessing import _reduce

        _reduce.install()
        try:
            yield
        finally:
            smp.shutdown()
            ours = (_reduce.reduce_ndarray, _reduce.reduce_tensor, _reduce.reduce_storage)
            for key, fn in list(reducers.items()):
                if fn in ours:
                    if key in before:
                        reducers[key] = before[key]
                    else:
                        del reducers[key]
            sys.meta_path[:] = [f for f in sys.meta_path if f in meta]

    def make_pair(self, own=False):
        import shmshare.multiprocessing as smp

        q = smp.get_context("fork").Queue()
        return q, q

    def lend(self, lender, key, array):
        import shmshare.multiprocessing as smp

        before = smp.statistics().handles_pickled
        lender.put((key, array))  # pickled by the Queue's feeder thread: lent once that is done
        wait_until(lambda: smp.statistics().handles_pickled > before, f"{key!r} pickled as a handle", self.wait)

    def take(self, borrower, key, timeout):
        got_key, array = borrower.get(timeout=timeout)
        assert got_key == key, f"took {got_key!r}, not {key!r}"
        return array

    def lent(self, lender):
        import shmshare.multiprocessing as smp

        s = smp.statistics()
        return s.handles_unclaimed + s.handles_claimed

    def close_lender(self, lender):
        import shmshare.multiprocessing as smp

        lender.close()
        lender.join_thread()
        smp.shutdown()  # this process's owner and links (the pool is the process's, not the Queue's)

    close_borrower = close_lender

    def forge(self, case, where):
        import shmshare.multiprocessing as smp
        from shmshare.multiprocessing import _owner, _reduce

        q, _ = self.make_pair()
        if case == "regular_file":  # a fake owner serves a regular file as the handle's segment
            fake = FakeOwner(where, regular_file(where, 1 << 20), 1 << 20, self.wait)
            q.put(("forged", Handle(fake.handle(0, 4096))))
            error, match, stop = ProtocolError, "a regular file", fake.close
        else:  # tests/mp/test_claims.py's way: a handle of our owner, altered and signed again
            self.lend(q, "mapped", np.ones(1 << 12))
            held = [self.take(q, "mapped", self.wait)]  # its segment is mapped here now
            args = list(_reduce._handle(np.ones(1 << 12)))  # a block of the same segment
            if case == "outside":
                size = args[4]
                args[4], args[5] = size + (64 << 20), size + (32 << 20)  # past what is mapped
                args[-1] = _owner.current_owner().sign(tuple(args[3:11]), False)
                error, match = smp.HandleError, "a malformed handle"
            else:
                args[-1] = bytes(8)  # garbage for a signature
                error, match = smp.HandleError, "did not make"
            q.put(("forged", Handle(args)))
            stop = held.clear

        def close():
            stop()
            self.close_lender(q)
        return Forged(lambda: self.take(q, "forged", self.wait), error, match, close)
