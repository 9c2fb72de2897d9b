"""The contract suite that every service lending shared memory runs (issue 22), as PoolContract is for providers.

The channel (a ``Sender`` lends, its ``Receiver`` borrows), the multiprocessing
drop-in (a process's owner lends what it pickles, the process that unpickles
borrows) and the store (its daemon lends what was put, a getter borrows) make
the same promises. A service's whole test file is its hooks::

    import shmshare
    from shmshare.testing import TransportContract

    class TestChannel(TransportContract):
        fd_limit_ends_the_link = True  # MSG_CTRUNC loses the batch: the receiver drops that sender

        def make_pair(self, own=False):
            return shmshare.channel()

        def lend(self, lender, key, array):
            lender.send({"key": key, "x": array}, timeout=self.wait)

        def take(self, borrower, key, timeout):
            got = borrower.recv(timeout=timeout)
            assert got["key"] == key
            return got["x"]

        def lent(self, lender):
            return lender.statistics().leases_out
        ...

What every service's tests check, each bounded (every wait has `wait` s, every
child is killed by pid), none timing anything:

1. lifetime: an array taken stays intact after its lender closes (in this
   process) or exits (in a child); every lease comes back once the borrower drops
   its arrays; a borrower closed while it holds arrays keeps nothing once they die;
2. death: a lender SIGKILLed leaves the borrower's arrays readable, and this
   process leaks nothing (fds, shared mappings, /dev/shm names); a borrower
   SIGKILLed gives back all it held;
3. hostile peer: a borrower handed a regular file as a segment, a descriptor
   outside its segment or a garbage message raises the service's error (a
   ShmshareError), leaks nothing, and the service still serves after;
4. fd limits: a borrower whose fd table is full raises FdLimitError naming the
   limit, and takes again once fds are free;
5. statistics: what the lender lends rises by one per array lent (or taken, where
   the service lends on take) and falls by one per array whose last view dies.

A test a service cannot run is listed in ``cannot`` with the reason (a skip), a
test that finds a bug in ``known_bugs`` with the bug (a strict xfail): no test
passes in silence. Children are forks (``start_child(method="fork")``): the
ends made here are inherited, and ``child_end``/``parent_copy`` say what each
process does with its copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import resource
import select
import shutil
import tempfile
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest

from .. import _segcalls
from .._errors import FdLimitError, ShmshareError
from .leaks import ResourceSnapshot, assert_no_leaks, check_leaks
from .patterns import pattern
from .procs import Child, start_child
from .waits import wait_until

__all__ = ["TransportContract", "Forged", "OtherProcess", "no_free_fds", "regular_file", "sealed_memfd"]

@dataclass
class Forged:
    """Input forged for a borrower: taking it must raise `error` matching `match`; `close` frees it.

    ``take()`` makes the service's borrower take the forged message or fd (a
    ``recv``, a ``Queue.get``, a ``get`` from a fake peer); ``close()`` releases
    what the forgery and that borrower hold, so that nothing is left after.
    """

    take: Callable[[], object]
    error: type[BaseException] | tuple[type[BaseException], ...]
    match: str
    close: Callable[[], None]


@dataclass
class OtherProcess:
    """A lender in another process of the test's own, and the borrower this process holds of it.

    ``finish()`` asks it to close and exit and returns its exit code (bounded);
    ``kill()`` SIGKILLs it by pid and reaps it.
    """

    pid: int
    borrower: Any
    finish: Callable[[], int]
    kill: Callable[[], None]


class TransportContract:
    """Run the transport contract against the service whose lender and borrower the hooks make and use."""

    wait: float = 10.0  # s: the bound of every wait, on a child, a take or a statistic
    n: int = 1 << 14  # uint32 items of each array lent: 64 KiB
    big: int = 1 << 20  # uint32 items of the fd-limit test's arrays: 4 MiB, a segment or memfd of their own
    count: int = 3  # arrays lent in a test
    fd_limit_ends_the_link: bool = False  # a borrower out of fds drops its lender: "again" is a fresh pair
    lent_before_take: bool = True  # an array counts as lent once lent (False: once taken, as the store)
    cannot: ClassVar[dict[str, str]] = {}  # test name -> why this service cannot run it (skipped)
    known_bugs: ClassVar[dict[str, str]] = {}  # test name -> the bug it finds (xfail, strict)

    # -- hooks: what every service defines ----------------------------------------------------------

    def make_pair(self, own: bool = False) -> tuple[Any, Any]:
        """Return a lender and a borrower connected to it, both in this process.

        `own`: the test closes or kills this lender, so a service whose lender is shared
        (the store's daemon) starts one for the test.
        """
        raise NotImplementedError("a TransportContract subclass defines make_pair()")

    def lend(self, lender: Any, key: str, array: np.ndarray) -> None:
        """Lend `array` under `key` (a send, a ``Queue.put``, a store put); return once it is lent."""
        raise NotImplementedError("a TransportContract subclass defines lend()")

    def take(self, borrower: Any, key: str, timeout: float) -> np.ndarray:
        """Take the array lent under `key` (a recv, a ``Queue.get``, a get), waiting at most `timeout` s."""
        raise NotImplementedError("a TransportContract subclass defines take()")

    def lent(self, lender: Any) -> int:
        """How many arrays the lender lends now, from the service's public statistics."""
        raise NotImplementedError("a TransportContract subclass defines lent()")

    def close_lender(self, lender: Any) -> None:
        """Close the lender (idempotent); arrays taken from it stay valid."""
        raise NotImplementedError("a TransportContract subclass defines close_lender()")

    def close_borrower(self, borrower: Any) -> None:
        """Close the borrower (idempotent): what it holds goes once its arrays are gone."""
        raise NotImplementedError("a TransportContract subclass defines close_borrower()")

    def forge(self, case: str, where: str) -> Forged:
        """Return forged input for a borrower of this service; `case` is one of:

        - ``"regular_file"``: a regular file (truncatable: SIGBUS under a mapping) as a segment's fd;
        - ``"outside"``: a descriptor of an array that lies outside its segment;
        - ``"garbage"``: a message that is not what the service sends.

        `where` is a fresh short directory (regular files, sockets). A service that takes no
        such input lists the test in ``cannot`` instead.
        """
        raise NotImplementedError(f"a TransportContract subclass defines forge() (or lists the test of {case!r} "
                                  "in cannot, with the reason)")

    # -- hooks with defaults --------------------------------------------------------------------------

    def settle(self, lender: Any) -> None:
        """Help releases on their way arrive (called between the polls of a wait): collect garbage."""
        gc.collect()

    def child_end(self, end: Any) -> Any:
        """The end a forked child uses in place of the one it inherited (default: the same)."""
        return end

    def parent_copy(self, end: Any) -> None:
        """Do what this process does with its copy of an end a forked child took over (default: nothing)."""

    def after_lender_died(self, borrower: Any) -> None:
        """Let the borrower find out that its lender died (default: nothing to do)."""

    @contextlib.contextmanager
    def lender_elsewhere(self, items: dict[str, np.ndarray], own: bool) -> Iterator[OtherProcess]:
        """A lender in another process that has lent `items`, and a borrower here.

        The default forks a child that lends them through its end of ``make_pair(own=True)``
        and then waits to be told to finish, or to be killed. `own`: the test kills or stops
        the other process (else a service may use a shared one, the store's daemon).
        """
        lender, borrower = self.make_pair(own=True)
        try:
            with _Forked(self, "lend", lender, items) as child:
                self.parent_copy(lender)
                child.wait_done(self.wait)
                yield OtherProcess(child.pid, borrower, child.finish, child.kill)
        finally:
            self.close_lender(lender)

    # -- the tests ----------------------------------------------------------------------------------------

    @pytest.fixture(autouse=True)
    def _transport_marks(self, request: pytest.FixtureRequest) -> None:
        name = getattr(request.node, "originalname", request.node.name)
        if name in self.known_bugs:
            request.applymarker(pytest.mark.xfail(strict=True, reason=self.known_bugs[name]))
        if name in self.cannot:
            pytest.skip(f"{type(self).__name__}: {self.cannot[name]}")

    @pytest.fixture
    def forge_dir(self) -> Iterator[str]:
        """A fresh directory with a short path (a socket's path holds at most 107 bytes)."""
        path = tempfile.mkdtemp(prefix="ss-tc-", dir="/tmp")
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # Each test runs its scenario under the leak checker (_checked), and the scenario is a method
    # of its own: what it held (a Queue's semaphores, a closed end) is gone once it returns,
    # before the check looks.

    def test_taken_arrays_outlive_their_lender_closing(self) -> None:
        self._checked(self._outlive_closing)

    def test_taken_arrays_outlive_their_lender_exiting(self) -> None:
        self._checked(self._outlive_elsewhere, False)

    def test_every_lease_comes_back_when_the_borrower_drops_its_arrays(self) -> None:
        self._checked(self._all_back)

    def test_a_borrower_closed_holding_arrays_leaves_nothing_once_they_go(self) -> None:
        self._checked(self._borrower_closed)

    def test_the_borrower_keeps_its_arrays_when_the_lender_is_killed(self) -> None:
        self._checked(self._outlive_elsewhere, True)

    def test_the_lender_takes_back_what_a_killed_borrower_held(self) -> None:
        self._checked(self._borrower_killed)

    def test_a_regular_file_as_a_segment_is_refused(self, forge_dir: str) -> None:
        self._checked(self._refuses, "regular_file", forge_dir)

    def test_a_descriptor_outside_its_segment_is_refused(self, forge_dir: str) -> None:
        self._checked(self._refuses, "outside", forge_dir)

    def test_a_garbage_message_is_refused(self, forge_dir: str) -> None:
        self._checked(self._refuses, "garbage", forge_dir)

    def test_a_borrower_out_of_fds_says_so_and_takes_again_once_fds_are_free(self) -> None:
        self._checked(self._out_of_fds)

    def test_statistics_count_each_lease_out_and_back(self) -> None:
        self._checked(self._counts)

    # -- the scenarios ------------------------------------------------------------------------------------

    def _outlive_closing(self) -> None:
        items = self._items()
        lender, borrower = self.make_pair(own=True)
        try:
            self._lend_all(lender, items)
            got = self._take_all(borrower, items)
            self.close_lender(lender)
            gc.collect()
            _check_intact(got, items, "after the lender closed")
            del got
        finally:
            self.close_lender(lender)
            self.close_borrower(borrower)

    def _outlive_elsewhere(self, killed: bool) -> None:
        items = self._items()
        with self.lender_elsewhere(items, own=True) as other:
            try:
                got = self._take_all(other.borrower, items)
                if killed:
                    other.kill()
                    self.after_lender_died(other.borrower)
                else:
                    code = other.finish()
                    assert code == 0, f"the lender (pid {other.pid}) exited with {code}"
                gc.collect()
                _check_intact(got, items, f"after the lender (pid {other.pid}) {'was killed' if killed else 'exited'}")
                del got
            finally:
                self.close_borrower(other.borrower)

    def _all_back(self) -> None:
        items = self._items()
        lender, borrower = self.make_pair()
        try:
            self._lend_all(lender, items)
            got = self._take_all(borrower, items)
            assert self.lent(lender) == len(items), f"{self.lent(lender)} lent of {len(items)} taken"
            del got
            self._wait_lent(lender, 0, "every lease back once the borrower dropped its arrays")
        finally:
            self.close_lender(lender)
            self.close_borrower(borrower)

    def _borrower_closed(self) -> None:
        items = self._items()
        lender, borrower = self.make_pair()
        try:
            self._lend_all(lender, items)
            gc.collect()
            lending = ResourceSnapshot.take()  # what the lender holds, before the borrower takes
            got = self._take_all(borrower, items)
            self.close_borrower(borrower)
            gc.collect()
            _check_intact(got, items, "after the borrower closed")
            del got
            self._wait_lent(lender, 0, "every lease back once the arrays of the closed borrower died")
            assert_no_leaks(lending)  # the borrower kept nothing of what it took (its lender is still open)
        finally:
            self.close_lender(lender)
            self.close_borrower(borrower)

    def _borrower_killed(self) -> None:
        items = self._items()
        lender, borrower = self.make_pair()
        try:
            with _Forked(self, "take", borrower, items) as child:
                self.parent_copy(borrower)
                self._lend_all(lender, items)
                child.wait_done(self.wait)
                self._wait_lent(lender, len(items), "every array the child took counted as lent")
                child.kill()
                self._wait_lent(lender, 0, f"every lease of the killed borrower (pid {child.pid}) back")
        finally:
            self.close_lender(lender)
            self.close_borrower(borrower)

    def _refuses(self, case: str, where: str) -> None:
        forged = self.forge(case, where)
        try:
            kind, text = _raised(forged.take, forged.error, forged.match)
            assert issubclass(kind, ShmshareError), f"{kind.__name__} ({text}) is not a ShmshareError"
        finally:
            forged.close()
        self._round_trip()  # the service still serves

    def _out_of_fds(self) -> None:
        items = {"warm": pattern(1, self.n), "big": pattern(2, self.big), "again": pattern(3, self.big)}
        keys = {name: self._key(name) for name in items}
        with self.lender_elsewhere({keys[name]: arr for name, arr in items.items()}, own=False) as other:
            try:
                warm = self.take(other.borrower, keys["warm"], self.wait)  # connections, threads, imports: made
                with no_free_fds():  # "big" is in a segment (or memfd) of its own: one fd more
                    _kind, text = _raised(lambda: self.take(other.borrower, keys["big"], self.wait), FdLimitError)
                assert "RLIMIT_NOFILE" in text or "ulimit" in text, f"the error does not name the limit: {text}"
                if not self.fd_limit_ends_the_link:
                    again = self.take(other.borrower, keys["again"], self.wait)
                    _check_intact([again], {"again": items["again"]}, "taken once fds were free")
                    del again
                _check_intact([warm], {"warm": items["warm"]}, "after the borrower ran out of fds")
                del warm
            finally:
                self.close_borrower(other.borrower)
        self._round_trip()  # a fresh pair, fds free again

    def _counts(self) -> None:
        items = self._items()
        keys = list(items)
        lender, borrower = self.make_pair()
        try:
            assert self.lent(lender) == 0, f"a new lender lends {self.lent(lender)}"
            for i, key in enumerate(keys, 1):
                self.lend(lender, key, items[key])
                assert self.lent(lender) == (i if self.lent_before_take else 0), (
                    f"{self.lent(lender)} lent after {i} lent, none taken")
            got = []
            for i, key in enumerate(keys, 1):
                got.append(self.take(borrower, key, self.wait))
                assert self.lent(lender) == (len(keys) if self.lent_before_take else i), (
                    f"{self.lent(lender)} lent after {i} of {len(keys)} taken")
            view = got[0][1:]  # keeps the first array's lease after the array itself is gone
            del got[:2]
            # Releases come back in the order the arrays died: once the second's is in, the
            # first's would be too, had its view not kept it.
            self._wait_lent(lender, len(keys) - 1, "the lease of the second array dropped back")
            del view
            self._wait_lent(lender, len(keys) - 2, "the lease of the first array back with its last view")
            del got
            self._wait_lent(lender, 0, "every lease back")
        finally:
            self.close_lender(lender)
            self.close_borrower(borrower)

    # -- the steps they share -------------------------------------------------------------------------

    def _checked(self, scenario: Callable[..., None], *args: Any) -> None:
        """Run `scenario` under the leak checker. If it fails, what its frames held goes now, not
        with the report: else every failure would also be reported as the leak of those things."""
        try:
            with check_leaks():
                scenario(*args)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            raise

    def _key(self, name: str) -> str:
        return f"{name}-{uuid.uuid4().hex[:12]}"  # unique: a shared lender (the store) outlives a test

    def _items(self) -> dict[str, np.ndarray]:
        return {self._key(f"a{i}"): pattern(i, self.n) for i in range(self.count)}

    def _lend_all(self, lender: Any, items: dict[str, np.ndarray]) -> None:
        for key, array in items.items():
            self.lend(lender, key, array)

    def _take_all(self, borrower: Any, items: dict[str, np.ndarray]) -> list[np.ndarray]:
        got = [self.take(borrower, key, self.wait) for key in items]
        _check_intact(got, items, "as taken")
        return got

    def _wait_lent(self, lender: Any, n: int, what: str) -> None:
        wait_until(lambda: self.lent(lender) <= n, lambda: f"{what} ({self.lent(lender)} still lent, not {n})",
                   self.wait, between=lambda: self.settle(lender))
        assert self.lent(lender) == n, f"{what}: {self.lent(lender)} lent, not {n}"

    def _round_trip(self) -> None:
        """One array lent, taken, checked and given back, on a fresh pair: the service still serves."""
        items = {self._key("again"): pattern(7, self.n)}
        lender, borrower = self.make_pair()
        try:
            self._lend_all(lender, items)
            got = self._take_all(borrower, items)
            del got
            self._wait_lent(lender, 0, "the lease of a round trip back")
        finally:
            self.close_lender(lender)
            self.close_borrower(borrower)


class _Forked:
    """A forked child that lends or takes `items` through its copy of `end`, reports, and holds on.

    It writes ``ok`` (or its error) on a pipe once done, then keeps what it took until this
    process closes the other pipe (``finish()``: it closes its end and exits) or kills it.
    """

    def __init__(self, contract: TransportContract, role: str, end: Any, items: dict[str, np.ndarray]) -> None:
        self._wait = contract.wait
        self._report, report_w = os.pipe()
        hold_r, self._hold = os.pipe()
        try:
            self._child: Child | None = start_child(_child_main, contract, role, end, items,
                                                    (report_w, hold_r, self._report, self._hold), method="fork")
        except BaseException:
            for fd in (self._report, self._hold):
                os.close(fd)
            raise
        finally:
            os.close(report_w)
            os.close(hold_r)
        self.pid = self._child.pid

    def wait_done(self, timeout: float) -> None:
        """Wait for the child's report; fail with its error, or if it said nothing in `timeout` s."""
        if not select.select([self._report], [], [], timeout)[0]:
            raise AssertionError(f"the child (pid {self.pid}) did not lend or take within {timeout:g} s")
        said = os.read(self._report, 65536)
        if said != b"ok":
            raise AssertionError(f"the child (pid {self.pid}) failed: {said.decode(errors='replace') or 'died'}")

    def finish(self) -> int:
        """Tell the child to close its end and exit; return its exit code (killed past the bound)."""
        self._close_hold()
        assert self._child is not None
        return self._child.join(self._wait)

    def kill(self) -> None:
        """SIGKILL the child by pid and reap it."""
        if self._child is not None:
            self._child.kill()

    def _close_hold(self) -> None:
        if self._hold >= 0:
            fd, self._hold = self._hold, -1
            os.close(fd)

    def __enter__(self) -> _Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.stop()  # killed by pid if still there, reaped, its Process closed
        self._close_hold()
        if self._report >= 0:
            fd, self._report = self._report, -1
            os.close(fd)


def _child_main(contract: TransportContract, role: str, end: Any, items: dict[str, np.ndarray],
                fds: tuple[int, int, int, int]) -> None:
    """The forked child of :class:`_Forked`."""
    report, hold, theirs_report, theirs_hold = fds
    os.close(theirs_report)
    os.close(theirs_hold)
    held: list[np.ndarray] = []
    try:
        end = contract.child_end(end)
        if role == "lend":
            for key, array in items.items():
                contract.lend(end, key, array)
        else:
            held = [contract.take(end, key, contract.wait) for key in items]
            _check_intact(held, items, "in the child")
    except BaseException as exc:  # noqa: BLE001  (told to the parent, which fails the test with it)
        os.write(report, f"{type(exc).__name__}: {exc}".encode()[:60000])
        os._exit(1)
    os.write(report, b"ok")
    select.select([hold], [], [], 3 * contract.wait)  # until the parent closes its end, or kills us
    del held
    if role == "lend":
        contract.close_lender(end)
    else:
        contract.close_borrower(end)


def _raised(call: Callable[[], object], error: type[BaseException] | tuple[type[BaseException], ...],
            match: str | None = None) -> tuple[type[BaseException], str]:
    """Check that `call()` raises `error` (its text matching `match`); return its type and text.

    Not the exception: its traceback holds the frames that raised it, and what they held
    (a mapping, a fd) would be taken for a leak while it lives.
    """
    with pytest.raises(error, match=match) as err:
        call()
    return type(err.value), str(err.value)


def _check_intact(got: list[np.ndarray], items: dict[str, np.ndarray], when: str) -> None:
    for (key, want), have in zip(items.items(), got, strict=True):
        assert have.shape == want.shape and np.array_equal(have, want), f"array {key!r} changed {when}"


@contextlib.contextmanager
def no_free_fds() -> Iterator[None]:
    """Fill this process's fd table for the block: RLIMIT_NOFILE at the highest fd, the holes below filled.

    The limit and every fd are restored after, whatever happens.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(f) for f in os.listdir("/proc/self/fd")) + 1
    filler: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
    try:
        while True:
            try:
                filler.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                break
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def regular_file(where: str, size: int) -> int:
    """Return a fd of an unnamed regular file of `size` bytes in directory `where` (truncatable by whoever holds it)."""
    fd = os.open(where, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sealed_memfd(size: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, *,
                 fallocate: bool = True) -> int:
    """Return a fd of a memfd of `size` bytes, every page allocated (unless not `fallocate`: one
    with holes), sealed with `seals` (as a lender makes one)."""
    return _segcalls.sealed_memfd("shmshare_forged", size, seals, fallocate)
