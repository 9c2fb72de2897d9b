"""kill, wait_exit and pid_alive over each kind of process a test starts: a pid of os.fork, a
multiprocessing Process, a subprocess.Popen, and a pid that is not this process's child."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from shmshare.testing import kill, pid_alive, wait_exit, wait_gone, wait_until


def _fork(code: int | None) -> int:
    """A forked child that exits with `code` at once, or sleeps (None) until killed."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        if code is None:
            time.sleep(60)
        os._exit(code or 0)
    return pid


def _reaped(pid: int) -> bool:
    """Whether our child `pid` has been reaped (asked with WNOWAIT: a zombie stays one)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def test_a_zombie_is_not_alive_and_a_live_child_is() -> None:
    pid = _fork(None)
    try:
        assert pid_alive(pid)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), f"the killed child {pid} to be a zombie")
        assert not _reaped(pid)  # a zombie still, not reaped: pid_alive reads its state
    finally:
        kill(pid)
    assert not pid_alive(pid)


def test_pid_1_is_alive_though_not_ours() -> None:
    assert pid_alive(1)


def test_kill_reaps_a_forked_child() -> None:
    pid = _fork(None)
    kill(pid)
    assert _reaped(pid)


def test_kill_without_reap_leaves_the_zombie_to_its_owner() -> None:
    pid = _fork(None)
    try:
        kill(pid, reap=False)
        assert not pid_alive(pid) and not _reaped(pid)
    finally:
        assert wait_exit(pid) == -signal.SIGKILL


def test_kill_joins_a_process_and_waits_for_a_popen() -> None:
    proc = mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    kill(None, proc, popen)
    assert (proc.exitcode, popen.returncode) == (-signal.SIGKILL, -signal.SIGKILL)
    proc.close()
    kill(popen)  # ended already: passed over


def test_kill_of_a_pid_reaped_already_returns() -> None:
    pid = _fork(0)
    assert wait_exit(pid) == 0
    kill(pid)


def test_wait_exit_returns_the_exit_code_of_each_kind() -> None:
    assert wait_exit(_fork(7)) == 7
    proc = mp.get_context("fork").Process(target=sys.exit, args=(5,), daemon=True)
    proc.start()
    assert wait_exit(proc) == 5
    proc.close()
    assert wait_exit(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])) == 3


def test_wait_exit_kills_what_does_not_exit_and_says_so() -> None:
    pid = _fork(None)
    with pytest.raises(AssertionError, match=rf"pid {pid} did not exit within 0.1 s \(killed it\)"):
        wait_exit(pid, 0.1)
    assert _reaped(pid)
    proc = mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    with pytest.raises(AssertionError, match=rf"pid {proc.pid} did not exit"):
        wait_exit(proc, 0.1)
    assert proc.exitcode == -signal.SIGKILL
    proc.close()


def test_wait_exit_of_a_pid_not_ours_is_an_error() -> None:
    with pytest.raises(ChildProcessError):
        wait_exit(1)


def test_wait_gone_waits_for_processes_it_does_not_reap() -> None:
    pids = [_fork(0), _fork(0)]
    wait_gone(pids, "two children that exit at once")  # zombies: exited, not reaped here
    assert not any(_reaped(p) for p in pids)
    for p in pids:
        assert wait_exit(p) == 0


def test_wait_gone_kills_what_is_still_running_and_names_it() -> None:
    done, sleeping = _fork(0), _fork(None)
    with pytest.raises(AssertionError, match=rf"the workers \(pids \[{sleeping}\] still running: killed them\)"):
        wait_gone([done, sleeping], "the workers", 0.1)
    assert not pid_alive(sleeping) and not _reaped(sleeping)
    assert (wait_exit(done), wait_exit(sleeping)) == (0, -signal.SIGKILL)


@pytest.mark.parametrize("pid", [0, -1, -12345, True])
def test_a_pid_that_is_not_a_positive_int_is_refused_never_signalled(pid):
    with pytest.raises(ValueError, match="a pid must be a positive int"):
        kill(pid)
    with pytest.raises(ValueError, match="a pid must be a positive int"):
        wait_exit(pid, timeout=0.1)
    with pytest.raises(ValueError, match="a pid must be a positive int"):
        wait_gone([pid], "nothing", timeout=0.1)
    assert not pid_alive(pid)  # no process has it


def test_wait_gone_names_a_lone_pid_passed_without_a_list():
    with pytest.raises(TypeError, match=r"pass \[12345\]"):
        wait_gone(12345, "nothing", timeout=0.1)  # type: ignore[arg-type]
