"""The transport contract's own promise: a test a service cannot run is skipped with its reason, a
known bug is a strict xfail (it fails once the bug is gone), and a subclass that leaves out a hook
fails rather than passes. Run by pytester on subclasses of the channel's contract."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SAMPLE = """
from shmshare.testing import TransportContract
from tests.contract.test_contract_channel import TestChannel as Channel

class TestCannot(Channel):
    cannot = {"test_statistics_count_each_lease_out_and_back": "this service keeps no statistics"}

class TestKnownBugThatIsNotThere(Channel):
    known_bugs = {"test_statistics_count_each_lease_out_and_back": "a bug that is not there"}

class TestNoHooks(TransportContract):
    pass
"""


def test_skips_say_why_fixed_bugs_fail_and_missing_hooks_fail(pytester: pytest.Pytester) -> None:
    pytester.syspathinsert(Path(__file__).resolve().parents[2])  # the checkout: tests.contract
    pytester.makepyfile(test_sample=SAMPLE)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rsX", "-k", "statistics")
    result.assert_outcomes(skipped=1, failed=2)
    result.stdout.fnmatch_lines(["*SKIPPED*TestCannot: this service keeps no statistics*"])
    result.stdout.fnmatch_lines(["*XPASS(strict)*a bug that is not there*"])
    result.stdout.fnmatch_lines(["*NotImplementedError: a TransportContract subclass defines make_pair()*"])
