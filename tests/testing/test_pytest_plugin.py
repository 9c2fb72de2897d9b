"""The pytest plugin, run by pytester on sample test files that leak and that do not.

Each sample runs in its own pytest subprocess: what it leaks on purpose dies
with it (a child it leaves is killed at that process's exit), and the
project's own leak check of this process stays clean.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# The entry point may or may not be installed here: block it and load the module by name, either way.
# -rN: no short summary, whose lines repeat a leak's message as far as the terminal's width lets them
# no:hypothesispytest: that plugin costs 0.6 s of imports per run, for samples that do not use it
PLUGIN = ("-p", "no:shmshare", "-p", "shmshare.testing.pytest_plugin", "--leaks-settle=0.2",
          "-p", "no:hypothesispytest", "-rN")
TIMEOUT = 60  # s: one sample run

LEAKY = {
    "file": ("keep.append(open(tmp_path / 'f', 'w'))", "file fd", True),
    "socket": ("keep.append(socket.socket())", "socket fd", True),
    "mapping": ("keep.append(mmap.mmap(-1, 5000))", "shared mapping rw-s", True),
    "shm_name": ("os.close(os.open(SHM, os.O_CREAT | os.O_RDWR, 0o600))", "/dev/shm name", True),
    "child": ("keep.append(subprocess.Popen(['sleep', '30'])); atexit.register(keep[-1].kill)",
              "child process", False),
    "thread": ("ev = threading.Event(); atexit.register(ev.set); "
               "threading.Thread(target=ev.wait, daemon=True).start()", "thread", False),
}

HEADER = """
import atexit, mmap, os, socket, subprocess, threading
import pytest
SHM = f"/dev/shm/leakplugin_test_{os.getpid()}"
atexit.register(lambda: os.path.exists(SHM) and os.unlink(SHM))
keep = []
"""


def run(pytester: pytest.Pytester, body: str, *args: str, conftest: str = "") -> pytest.RunResult:
    pytester.makepyfile(test_sample=HEADER + body)
    if conftest:
        pytester.makeconftest(conftest)
    return pytester.runpytest_subprocess(*PLUGIN, *args, timeout=TIMEOUT)


def leak_test(what: str, name: str = "test_leaks", fixtures: str = "tmp_path", marker: str = "") -> str:
    return f"\n{marker}\ndef {name}({fixtures}):\n    {LEAKY[what][0]}\n"


@pytest.fixture(scope="module")
def every_kind_leaked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One pytest run of a sample with a test per kind of leak (six runs cost ~2.5 s each): each test's
    teardown report, by kind. Each test is checked against what it held before it, so the leaks of the
    tests before it are not its own: one row each, as in a run of its own."""
    where = tmp_path_factory.mktemp("every_kind")
    (where / "test_sample.py").write_text(HEADER + "".join(leak_test(w, f"test_leaks_{w}") for w in sorted(LEAKY)))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, "-m", "pytest", f"--basetemp={where / 'tmp'}", "-p", "no:cacheprovider",
                           *PLUGIN, "--leaks", "test_sample.py"], cwd=where, env={**env, "PY_COLORS": "0"},
                          capture_output=True, text=True, timeout=TIMEOUT)
    out = done.stdout
    assert re.search(rf"\b{len(LEAKY)} passed, {len(LEAKY)} errors\b", out), out  # a failing teardown is an error
    sections = re.split(r"^_+ ERROR at teardown of (test_leaks_\w+) _+$", out, flags=re.M)
    return {name.removeprefix("test_leaks_"): text for name, text in zip(sections[1::2], sections[2::2], strict=True)}


@pytest.mark.parametrize("what", sorted(LEAKY))
def test_each_kind_of_leak_fails_the_test_with_a_table_row(every_kind_leaked: dict[str, str], what: str) -> None:
    out = every_kind_leaked[what]
    assert f"LeakError: 1 resource(s) left behind by test_sample.py::test_leaks_{what} " in out, out
    kind, made_in_python = LEAKY[what][1], LEAKY[what][2]
    assert re.search(rf"^  \S+ +{re.escape(kind)} ", out, re.M), out
    if made_in_python:  # the creating stack ends at the test's own line, and hides pytest's frames
        pytest.LineMatcher(out.splitlines()).fnmatch_lines([
            "* was made at (most recent call last):", f'    File "*test_sample.py", line *, in test_leaks_{what}',
            f"      {LEAKY[what][0].split(';')[0]}"])
        assert "_pytest" not in out.split("was made at")[1], out


def test_the_row_says_number_target_and_size(pytester: pytest.Pytester) -> None:
    result = run(pytester, "\ndef test_leaks(tmp_path):\n    f = open(tmp_path / 'f', 'w')\n    f.write('x' * 10)\n"
                           "    f.flush()\n    keep.append(f)\n", "--leaks")
    result.stdout.fnmatch_lines(["  number  kind     target * size",
                                 "  [0-9]*  file fd  */test_leaks0/f * 10"])


def test_clean_tests_pass_and_what_existed_before_is_not_theirs(pytester: pytest.Pytester) -> None:
    body = """
ev = threading.Event(); atexit.register(ev.set)
threading.Thread(target=ev.wait, daemon=True).start()  # before any test: not a test's leak
early = socket.socket()  # a module's own fd, made at import

@pytest.fixture(scope="module")
def server():
    s = socket.socket(); yield s; s.close()  # set up inside the first test, but not the test's

def test_closes_everything(tmp_path, server):
    with open(tmp_path / "f", "w"), socket.socket(), mmap.mmap(-1, 4096):
        pass
    os.close(os.open(SHM, os.O_CREAT | os.O_RDWR, 0o600)); os.unlink(SHM)
    p = subprocess.Popen(["true"]); p.wait(timeout=10)
    t = threading.Thread(target=lambda: None); t.start(); t.join(10)

def test_a_release_in_flight_is_waited_for():
    r, w = os.pipe()
    threading.Timer(0.05, lambda: (os.close(r), os.close(w))).start()
"""
    result = run(pytester, body, "--leaks", "--leaks-settle=5")
    result.assert_outcomes(passed=2)


def test_inert_unless_asked(pytester: pytest.Pytester) -> None:
    result = run(pytester, "".join(leak_test(w, f"test_{w}") for w in LEAKY))
    result.assert_outcomes(passed=len(LEAKY))
    assert "left behind" not in result.stdout.str()


def test_the_marker_checks_only_the_marked_tests(pytester: pytest.Pytester) -> None:
    body = leak_test("socket", "test_marked", marker="@pytest.mark.leakcheck") + leak_test("socket", "test_unmarked")
    result = run(pytester, body, "--strict-markers")
    result.assert_outcomes(passed=2, errors=1)
    assert "left behind by test_sample.py::test_marked" in result.stdout.str()


def test_the_fixture_checks_its_test_and_the_tests_other_fixtures(pytester: pytest.Pytester) -> None:
    body = """
@pytest.fixture
def leaky_fixture():
    keep.append(socket.socket())  # set up before no_leaks is named, still inside the check
    yield

def test_fixture_leaks(leaky_fixture, no_leaks):
    pass

def test_clean(no_leaks):
    pass
""" + leak_test("socket", "test_not_asking", fixtures="")
    result = run(pytester, body)
    result.assert_outcomes(passed=3, errors=1)
    assert "left behind by test_sample.py::test_fixture_leaks" in result.stdout.str()


def test_asked_three_ways_at_once_checks_once(pytester: pytest.Pytester) -> None:
    result = run(pytester, leak_test("socket", fixtures="no_leaks", marker="@pytest.mark.leakcheck"), "--leaks")
    result.assert_outcomes(passed=1, errors=1)
    assert result.stdout.str().count("left behind by") == 1


def test_a_conftest_no_leaks_of_its_own_shadows_the_plugins(pytester: pytest.Pytester) -> None:
    # As in this project's tests/conftest.py: its autouse no_leaks is its own check, and the plugin stays out.
    conftest = "import pytest\n@pytest.fixture(autouse=True)\ndef no_leaks():\n    yield\n"
    result = run(pytester, leak_test("socket"), conftest=conftest)
    result.assert_outcomes(passed=1)


def test_the_entry_point_names_the_plugin_module() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["pytest11"] == {"shmshare": "shmshare.testing.pytest_plugin"}


NO_HYPOTHESIS = ("-p", "no:hypothesispytest")  # another plugin: 0.6 s of imports per run


def test_pytest_loads_the_plugin_by_its_entry_point(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # What `pip install shmshare` leaves: a dist-info whose entry_points.txt names the module (here a stand-in
    # on PYTHONPATH, so the test does not depend on how this checkout is installed); no -p for shmshare anywhere.
    site = pytester.mkdir("site")
    info = site / "shmshare_entry_point_check-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shmshare-entry-point-check\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nshmshare = shmshare.testing.pytest_plugin\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(test_sample=HEADER + leak_test("socket"))
    quiet = pytester.runpytest_subprocess(*NO_HYPOTHESIS, timeout=TIMEOUT)
    quiet.assert_outcomes(passed=1)
    checked = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "--leaks", "--leaks-settle=0.2", timeout=TIMEOUT)
    checked.assert_outcomes(passed=1, errors=1)
    assert "socket fd" in checked.stdout.str()
