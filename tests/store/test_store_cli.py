"""``shmshare serve`` from the command line: detached, refused, and the default socket's
directory."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys

import pytest

from shmshare.store import Daemon, Store, StoreError
from shmshare.testing import pid_alive, wait_until

from .helpers import WAIT


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmshare", "serve", *args], capture_output=True,
                          text=True, timeout=WAIT, env=env, stdin=subprocess.DEVNULL)


def test_detach_prints_the_socket_and_runs_until_sigterm(sockdir: str) -> None:
    path = os.path.join(sockdir, "detached.sock")
    got = _serve("--detach", "--socket", path)
    assert got.returncode == 0, got.stderr
    m = re.fullmatch(r"shmshare store listening on (\S+) \(pid (\d+)\)\n", got.stdout)
    assert m and m.group(1) == path, got.stdout
    pid = int(m.group(2))
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        assert int(fields[3]) != os.getsid(0)  # a session of its own: no terminal of ours
        assert int(fields[1]) != os.getpid()  # not our child: detached
        with Store(path) as s:
            s.put("x", 1)
            assert s.get("x") == 1 and s.daemon_pid == pid
    finally:
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not pid_alive(pid), "the detached daemon exits on SIGTERM")
    assert not os.path.exists(path)


def test_a_second_daemon_on_a_live_socket_is_refused(sockdir: str) -> None:
    path = os.path.join(sockdir, "busy.sock")
    with Daemon.start(path):
        got = _serve("--socket", path)
        assert got.returncode == 1
        assert "already listens" in got.stderr and path in got.stderr
        with pytest.raises(StoreError, match=r"exited with status 1 before it listened"):
            Daemon.start(path, timeout=WAIT)


@pytest.mark.parametrize("bad", ["0", "-5", "lots"])
def test_a_bad_limit_is_refused_by_the_command_line(bad: str, sockdir: str) -> None:
    got = _serve("--socket", os.path.join(sockdir, "x.sock"), "--limit", bad)
    assert got.returncode != 0
    assert "limit" in got.stderr.lower() or "size" in got.stderr.lower(), got.stderr


def test_the_default_socket_is_made_private_and_a_loose_directory_refused(sockdir: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SHMSHARE_STORE"}
    env["XDG_RUNTIME_DIR"] = sockdir
    with Daemon.start(env=env) as d:
        assert d.path == os.path.join(sockdir, "shmshare", "store.sock")
        assert stat.S_IMODE(os.stat(os.path.dirname(d.path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o600
    assert not os.path.exists(os.path.join(sockdir, "shmshare"))  # the directory it made, gone
    os.mkdir(os.path.join(sockdir, "shmshare"), 0o755)
    os.chmod(os.path.join(sockdir, "shmshare"), 0o755)
    got = _serve(env=env)
    assert got.returncode == 1 and "chmod 700" in got.stderr, got.stderr
    # a path named on purpose is the user's choice, $SHMSHARE_STORE as --socket
    with Daemon.start(env={**env, "SHMSHARE_STORE": os.path.join(sockdir, "shmshare", "mine.sock")}) as d:
        assert d.path == os.path.join(sockdir, "shmshare", "mine.sock")
    # relative, it is taken from where it is given, as --socket: not from "/" after --detach's chdir
    got = subprocess.run([sys.executable, "-m", "shmshare", "serve", "--detach"], capture_output=True, text=True,
                         timeout=WAIT, env={**env, "SHMSHARE_STORE": "rel.sock"}, cwd=sockdir, stdin=subprocess.DEVNULL)
    assert got.returncode == 0, got.stderr
    with Store(os.path.join(sockdir, "rel.sock")) as s:
        pid = s.stats()["pid"]
        assert s.stats()["path"] == os.path.join(sockdir, "rel.sock")
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not os.path.exists(os.path.join(sockdir, "rel.sock")), "the detached daemon gone", WAIT)


def test_evict_without_a_limit_is_refused_where_it_is_given(sockdir: str) -> None:
    got = _serve("--evict", "--socket", os.path.join(sockdir, "e.sock"))
    assert got.returncode == 2 and "--evict evicts past --limit, and no --limit was given" in got.stderr
    with pytest.raises(ValueError, match=r"evict=True\) evicts past a limit, and no limit= was given"):
        Daemon.start(os.path.join(sockdir, "e.sock"), evict=True)


def test_daemon_start_takes_a_limit_as_the_command_line_does(sockdir: str) -> None:
    for bad in ["abc", "-5", 1.5, True, 100]:
        with pytest.raises(ValueError, match=r"Daemon.start\(limit=\.\.\.\) takes bytes or a size"):
            Daemon.start(os.path.join(sockdir, "never.sock"), limit=bad)  # type: ignore[arg-type]
    d = Daemon.start(os.path.join(sockdir, f"limit-{os.getpid()}.sock"), limit="8M")
    try:
        with Store(d.path) as s:
            assert s.stats()["limit"] == 8 << 20
    finally:
        assert d.stop() == 0
