"""``pytest --leaks`` over code that uses shmshare.multiprocessing, and beside other processes:
the library's process-wide pool, server and links are not blamed on the test (they were: 11
items in every test), what the test itself keeps still is, and a /dev/shm name another process
made meanwhile (a concurrent run, pytest-xdist's other workers) is not the test's."""

from __future__ import annotations

import pytest

from .test_pytest_plugin import run

pytest_plugins = ["pytester"]

_USES_MP = """
import numpy as np
import shmshare.multiprocessing as smp

def test_queue_of_arrays():
    q = smp.Queue()
    for i in range(3):
        q.put(np.full(1 << 14, float(i)))
    got = [q.get(timeout=30) for _ in range(3)]
    assert [float(a[0]) for a in got] == [0.0, 1.0, 2.0]
    q.close()
    q.join_thread()
"""

_KEEPS_AN_ARRAY = """
import numpy as np
import shmshare.multiprocessing as smp
from multiprocessing.reduction import ForkingPickler

def test_keeps_a_received_array():
    keep.append(ForkingPickler.loads(ForkingPickler.dumps(np.ones(1 << 14))))
"""

_ANOTHER_PROCESS_MAKES_A_NAME = """
import subprocess, sys, time
import pytest

MAKER = '''
import os, sys, time
if os.fork():
    os._exit(0)  # the grandchild is nobody's child of ours: an unrelated process
path = f"/dev/shm/torch_{os.getpid()}_4242"
open(path, "w").close()
open(sys.argv[1], "w").write(path)
os.close(1); os.close(2)
time.sleep(5)
os.unlink(path)
'''

def test_another_process_makes_a_name_meanwhile(tmp_path):
    note = tmp_path / "made"
    subprocess.run([sys.executable, "-c", MAKER, str(note)], timeout=30, check=True)
    for _ in range(3000):  # the grandchild writes it at once; bounded all the same
        if note.exists() and note.read_text():
            break
        time.sleep(0.01)
    else:
        pytest.fail("the other process never made its name")
"""


def test_a_test_using_multiprocessing_leaks_nothing_of_the_librarys(pytester: pytest.Pytester) -> None:
    result = run(pytester, _USES_MP, "--leaks")
    result.assert_outcomes(passed=1)


def test_an_array_a_test_keeps_is_still_reported(pytester: pytest.Pytester) -> None:
    result = run(pytester, _KEEPS_AN_ARRAY, "--leaks")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*LeakError*", "*shared mapping rw-s*memfd:shmshare_*"])


def test_a_name_another_process_made_is_not_the_tests(pytester: pytest.Pytester) -> None:
    result = run(pytester, _ANOTHER_PROCESS_MAKES_A_NAME, "--leaks")
    result.assert_outcomes(passed=1)
