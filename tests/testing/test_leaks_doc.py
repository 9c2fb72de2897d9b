"""docs/leaks.md's worked example, run: the toy pool's test fails on the leak, and passes once fixed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

DOC = Path(__file__).parents[2] / "docs" / "leaks.md"
# -rN: no short summary, whose lines repeat a leak's message as far as the terminal's width lets them
# no:hypothesispytest: that plugin costs 0.6 s of imports per run, for samples that do not use it
PLUGIN = ("-p", "no:shmshare", "-p", "shmshare.testing.pytest_plugin", "--leaks-settle=0.2",
          "-p", "no:hypothesispytest", "-rN")
TIMEOUT = 60  # s: one run of the example


def blocks() -> dict[str, str]:
    """Return the page's fenced blocks by their info string ("python pool.py", "diff", ...)."""
    return {m[1]: m[2] for m in re.finditer(r"^```([^\n]+)\n(.*?)^```$", DOC.read_text(), re.M | re.S)}


def fixed(pool: str, diff: str) -> str:
    lines = diff.splitlines()
    old = "\n".join(x[1:] for x in lines if x.startswith("-"))
    new = "\n".join(x[1:] for x in lines if x.startswith("+"))
    assert pool.count(old) == 1, "the page's diff no longer applies to its pool.py"
    return pool.replace(old, new)


def run(pytester: pytest.Pytester, pool: str) -> pytest.RunResult:
    pytester.makepyfile(pool=pool, test_pool=blocks()["python test_pool.py"])
    return pytester.runpytest_subprocess(*PLUGIN, timeout=TIMEOUT)


def test_the_pool_as_written_leaks_one_socket_per_worker(pytester: pytest.Pytester) -> None:
    result = run(pytester, blocks()["python pool.py"])
    result.assert_outcomes(passed=2, errors=2)
    out = result.stdout.str()
    assert out.count("LeakError: 2 resource(s) left behind") == 2
    assert len(re.findall(r"^  \d+ +socket fd +socket:\[\d+\]", out, re.M)) == 4
    result.stdout.fnmatch_lines(['    File "*pool.py", line *, in __init__',
                                 "      ours, theirs = socket.socketpair()"])


def test_the_fixed_pool_passes(pytester: pytest.Pytester) -> None:
    doc = blocks()
    result = run(pytester, fixed(doc["python pool.py"], doc["diff"]))
    result.assert_outcomes(passed=2)
