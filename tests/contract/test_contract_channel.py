"""The transport contract, run against the channel: a Sender lends, its Receiver borrows."""

from __future__ import annotations

import os

import msgpack
import pytest

import shmshare
from shmshare import PeerDied, ProtocolError, wire
from shmshare.tensors import ArrayDesc
from shmshare.testing import Forged, TransportContract
from shmshare.testing.transport_contract import regular_file, sealed_memfd


class TestChannel(TransportContract):
    """A channel() pair. Out of fds, the receiver loses the batch whose fds the kernel dropped
    (MSG_CTRUNC) and drops that sender (docs/architecture.md, Fd exhaustion): it takes again
    from a new sender, not from the one it dropped."""

    fd_limit_ends_the_link = True

    def make_pair(self, own=False):
        return shmshare.channel()

    def lend(self, lender, key, array):
        lender.send({"key": key, "x": array}, timeout=self.wait)

    def take(self, borrower, key, timeout):
        got = borrower.recv(timeout=timeout)
        assert got["key"] == key, f"took {got['key']!r}, not {key!r}"
        return got["x"]

    def lent(self, lender):
        return lender.statistics().leases_out

    def settle(self, lender):
        super().settle(lender)
        lender.poll_releases()  # the releases, or the receiver's end, are read by the sender's calls

    def close_lender(self, lender):
        lender.close()

    close_borrower = close_lender
    parent_copy = close_lender  # the child's copy of an end is the one in use

    def after_lender_died(self, borrower):
        with pytest.raises(PeerDied, match="died"):
            borrower.recv(timeout=self.wait)

    def forge(self, case, where):
        # a raw sender on a socket pair (tests/channel/test_channel_hardening.py's way)
        a, b = wire.pipe()
        rx = shmshare.Receiver([b])
        fds = []
        if case == "garbage":
            a._sock.send(b"\xc1")  # never a msgpack value
            error, match = ProtocolError, "a malformed frame"
        else:
            size = 1 << 20
            fds.append(regular_file(where, size) if case == "regular_file" else sealed_memfd(size))
            offset = 0 if case == "regular_file" else size - 64  # 4096 bytes from 64 before the end
            tree = msgpack.packb(ArrayDesc(9, 1, offset, "<u1", (4096,), (1,)).pack())
            a.send({"k": "m", "s": [[9, size, False]], "b": tree}, fds=fds)
            error, match = ProtocolError, "a regular file" if case == "regular_file" else "lies outside"

        def close():
            for fd in fds:
                os.close(fd)
            a.close()
            rx.close()
        return Forged(lambda: rx.recv(timeout=self.wait), error, match, close)

