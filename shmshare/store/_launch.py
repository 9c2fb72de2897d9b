"""Starting the daemon: ``shmshare serve`` in the foreground or detached, and ``Daemon``."""

from __future__ import annotations

import logging
import numbers
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

from .._sizes import parse_size
from ._daemon import MAX_CLIENTS, Server, check_spill_args, serve
from ._protocol import StoreError
from ._spill import check_spill_dir

__all__ = ["Daemon", "main_serve"]

_READY = "shmshare store listening on "
_PARENT = "SHMSHARE_SERVE_PARENT"  # set by Daemon.start: the pid the daemon dies with
_MAX_CLIENTS_ENV = "SHMSHARE_STORE_MAX_CLIENTS"  # clients connected at once (default 4096)


class Daemon:
    """A store daemon run as a child process (``python -m shmshare serve``).

    ``Daemon.start()`` returns once it listens; ``stop()`` ends it with
    SIGTERM (every object freed, the socket removed) and ``kill()`` with
    SIGKILL. A context manager stops it on exit.
    """

    def __init__(self, proc: subprocess.Popen[str], path: str) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.path = path

    @classmethod
    def start(cls, path: str | os.PathLike[str] | None = None, limit: int | str | None = None,
              evict: bool = False, timeout: float = 10.0, log_level: str = "warning",
              env: dict[str, str] | None = None, die_with_parent: bool = True,
              max_clients: int | None = None,
              spill: str | os.PathLike[str] | None = None) -> Daemon:
        """Run a daemon and wait (at most `timeout` s) until it listens.

        `limit` is bytes, or a size as ``serve --limit`` takes it ("8M", "64MiB", "1G").
        `max_clients` caps the clients connected at once (``SHMSHARE_STORE_MAX_CLIENTS``
        in its environment; 4096 by default). `spill` is ``serve --spill``'s directory.

        With `die_with_parent` the daemon gets SIGTERM when the thread that
        started it ends (``PR_SET_PDEATHSIG``: the kernel's rule is the
        thread's, not the process's), so a killed test or script leaves no
        daemon behind.
        """
        if evict and limit is None:
            raise ValueError("Daemon.start(evict=True) evicts past a limit, and no limit= was given: "
                             "pass one (e.g. limit='4G'), or leave evict out")
        check_spill_args(None if limit is None else 0, evict, None if spill is None else os.fspath(spill))
        if spill is not None:
            check_spill_dir(os.fspath(spill))  # its error here, not on the daemon's stderr
        cmd = [sys.executable, "-m", "shmshare", "serve", "--log-level", log_level]
        if path is not None:
            cmd += ["--socket", os.fspath(path)]
        if limit is not None:
            cmd += ["--limit", str(_limit_bytes(limit))]
        if evict:
            cmd.append("--evict")
        if spill is not None:
            cmd += ["--spill", os.path.abspath(spill)]
        child_env = dict(os.environ if env is None else env)
        child_env.pop(_PARENT, None)
        if max_clients is not None:
            child_env[_MAX_CLIENTS_ENV] = str(int(max_clients))
        if die_with_parent:
            child_env[_PARENT] = str(os.getpid())
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                env=child_env)
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                    raise StoreError(f"the store daemon (pid {proc.pid}) did not start listening "
                                     f"within {timeout} s")
                line = proc.stdout.readline()
                if not line:
                    rc = proc.wait(timeout=5)
                    raise StoreError(f"the store daemon exited with status {rc} before it "
                                     "listened (its error is on stderr above)")
                if line.startswith(_READY):
                    where = line[len(_READY):].rsplit(" (pid", 1)[0]
                    return cls(proc, where)
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            proc.stdout.close()
            raise

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, and wait for the exit status (SIGKILL after `timeout` s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._close_pipe()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (the socket file stays; the next daemon on the path removes it)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<Daemon pid {self.pid} at {self.path!r}>"


def main_serve(socket_path: str | None, limit: int | None, evict: bool, log_level: str,
               detach: bool, spill: str | None = None) -> int:
    """``shmshare serve``: run the store in the foreground, or detached (printing its socket)."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s shmshare-store[%(process)d] %(levelname)s %(message)s")
    if socket_path is not None:
        socket_path = os.path.abspath(socket_path)  # --detach changes to / before it binds
    elif os.environ.get("SHMSHARE_STORE"):  # so does the path named there: it is taken from here
        os.environ["SHMSHARE_STORE"] = os.path.abspath(os.environ["SHMSHARE_STORE"])
    if spill is not None:
        spill = os.path.abspath(spill)  # as the socket: --detach changes to /
    max_clients = _max_clients()
    if max_clients is None:
        return 1
    if detach:
        return _detach(socket_path, limit, evict, max_clients, spill)
    parent = os.environ.pop(_PARENT, None)
    if parent is not None and not _die_with(parent):
        return 1

    def ready(server: Server) -> None:
        print(f"{_READY}{server.path} (pid {os.getpid()})", flush=True)

    try:
        return serve(socket_path, limit, evict, ready, max_clients, spill)
    except (StoreError, OSError, ValueError) as exc:  # OSError: the socket (a path too long, no permission, ...)
        print(f"shmshare serve: {exc}", file=sys.stderr)
        return 1


def _die_with(parent: str) -> bool:
    """SIGTERM when our parent goes (PR_SET_PDEATHSIG); False if it is gone already."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        logging.getLogger("shmshare.store").warning("prctl(PR_SET_PDEATHSIG) failed: errno %d",
                                                    ctypes.get_errno())
    return str(os.getppid()) == parent  # it may have gone before the prctl


def _max_clients() -> int | None:
    """The client cap from the environment (the default when unset); None, told, if malformed."""
    raw = os.environ.get(_MAX_CLIENTS_ENV)
    if raw is None:
        return MAX_CLIENTS
    if not raw.strip().isdigit() or int(raw) < 1:
        print(f"shmshare serve: {_MAX_CLIENTS_ENV}={raw!r} must be a whole number of clients, at "
              f"least 1 (unset, it is {MAX_CLIENTS})", file=sys.stderr)
        return None
    return int(raw)


def _detach(socket_path: str | None, limit: int | None, evict: bool, max_clients: int,
            spill: str | None) -> int:
    """Fork twice (a new session, no terminal), serve there; print the socket once it listens."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        with os.fdopen(r) as f:
            got = f.read()
        os.waitpid(pid, 0)
        if not got.startswith(_READY):
            print(f"shmshare serve --detach: {got.strip() or 'the daemon did not start'}",
                  file=sys.stderr)
            return 1
        print(got.strip())
        return 0
    os.close(r)
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        os.chdir("/")  # no directory of the caller's kept busy
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        os.closerange(3, w)  # and no fd of the caller's kept open: only the pipe to the parent
        os.closerange(w + 1, os.sysconf("SC_OPEN_MAX"))

        def ready(server: Server) -> None:
            os.write(w, f"{_READY}{server.path} (pid {os.getpid()})\n".encode())
            os.close(w)

        serve(socket_path, limit, evict, ready, max_clients, spill)
    except BaseException as exc:  # noqa: BLE001 - told to the parent, then this process ends
        try:
            os.write(w, f"{exc}\n".encode())
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _limit_bytes(limit: Any) -> int:
    """Daemon.start's `limit`: bytes (an int) or a size string, as the command line takes it."""
    try:
        if isinstance(limit, str):
            return parse_size(limit)
        if isinstance(limit, bool) or not isinstance(limit, numbers.Integral):
            raise ValueError(f"not a size: {limit!r}")
        return parse_size(str(int(limit)))
    except ValueError as exc:
        raise ValueError(f"Daemon.start(limit=...) takes bytes or a size such as '8M', '64MiB' "
                         f"or '1G': {exc}") from None
