"""The ``shmshare`` command line: ``doctor`` (what this host allows), ``sweep``, ``stat``,
``serve`` (the store daemon) and ``demo``.

The subcommands live in their own modules: ``_doctor``, ``_stat``, ``store`` and ``_demo``.
"""

from __future__ import annotations

import argparse
import os
import sys

from ._demo import demo
from ._doctor import doctor
from ._sizes import parse_size
from ._stat import main_stat
from .segment import sweep

__all__ = ["main"]

_MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    """Run the ``shmshare`` command line and return its exit code."""
    parser = argparse.ArgumentParser(prog="shmshare", description="Zero-copy tensors between "
                                     "processes through shared memory: host checks, what each "
                                     "process holds, the store daemon, and demos.")
    parser.add_argument("--version", action="version", version=f"shmshare {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    doc = sub.add_parser("doctor", help="check what shmshare needs from this host, and what it means")
    doc.add_argument("--json", action="store_true", help="print a machine-readable report")
    swp = sub.add_parser("sweep", help="remove /dev/shm/shmshare_* names whose creator died")
    swp.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    st = sub.add_parser("stat", help="what every process holds of shmshare memory, from /proc; "
                        "pools and leases of those with a stats socket (SHMSHARE_STATS=1)")
    st.add_argument("--json", action="store_true", help="print a machine-readable report")
    st.add_argument("--watch", type=_parse_interval, default=None, metavar="SECONDS",
                    help="refresh every SECONDS until Ctrl-C")
    st.add_argument("--pid", type=int, action="append", default=None,
                    help="only this process (repeat for more)")
    srv = sub.add_parser("serve", help="run the named-tensor store daemon (Ctrl-C or SIGTERM stops it)")
    srv.add_argument("--socket", default=None, metavar="PATH",
                     help="the socket to listen on (default: $XDG_RUNTIME_DIR/shmshare/store.sock, "
                     "else /tmp/shmshare-<uid>/store.sock)")
    srv.add_argument("--limit", type=_parse_size, default=None, metavar="BYTES",
                     help="most bytes of objects held, e.g. 4G (default: no limit but the host's)")
    srv.add_argument("--evict", action="store_true",
                     help="past --limit, evict unreferenced objects, least recently used first")
    srv.add_argument("--spill", default=None, metavar="DIR",
                     help="past --limit, spill unreferenced objects to files in DIR, least "
                     "recently used first; a get reads them back")
    srv.add_argument("--log-level", default="warning",
                     choices=("debug", "info", "warning", "error", "critical"))
    srv.add_argument("--detach", action="store_true",
                     help="run in the background; print the socket path once it listens")
    dem = sub.add_parser("demo", help="watch a shared segment's fds and mappings live across two "
                         "processes, then the DataLoader beside torch's")
    dem.add_argument("--backend", choices=("memfd", "posix"), default="memfd")
    dem.add_argument("--size", type=_parse_size, default=64 * _MiB,
                     help="segment size, e.g. 8M, 64MiB, 1G (default 64M)")
    dem.add_argument("--loader-seconds", type=_parse_seconds, default=None,
                     help="how long each DataLoader runs after the walk-through (0: skip them)")
    args = parser.parse_args(argv)
    if args.command == "serve" and args.evict and args.limit is None:
        srv.error("--evict evicts past --limit, and no --limit was given: add one (e.g. --limit 4G), "
                  "or leave --evict out")
    if args.command == "serve":
        from .store._daemon import check_spill_args

        try:
            check_spill_args(args.limit, args.evict, args.spill)
        except ValueError as exc:
            srv.error(str(exc))
    try:
        if args.command == "doctor":
            return doctor(as_json=args.json)
        if args.command == "sweep":
            return _sweep(args.dry_run)
        if args.command == "stat":
            return main_stat(args.json, args.watch, args.pid)
        if args.command == "serve":
            from .store._launch import main_serve

            return main_serve(args.socket, args.limit, args.evict, args.log_level, args.detach,
                              args.spill)
        if args.command == "demo":
            return demo(backend=args.backend, size=args.size, loader_seconds=args.loader_seconds)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader (`| head`) left: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    parser.print_help()
    return 2




def _sweep(dry_run: bool) -> int:
    """Remove (or list) stale names, one a line; return 0."""
    paths = sweep(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for path in paths:
        print(f"{verb} {path}")
    print(f"shmshare sweep: {verb} {len(paths)} name(s) of dead processes")
    return 0


def _parse_seconds(text: str) -> float:
    """Parse a non-negative number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"seconds must be 0 or more, got {text!r}")
    return seconds


def _parse_interval(text: str) -> float:
    """Parse a positive number of seconds (a refresh interval)."""
    seconds = _parse_seconds(text)
    if not 0 < seconds <= _LONGEST_INTERVAL:
        raise argparse.ArgumentTypeError(f"the interval must be more than 0 seconds and at most "
                                         f"{_LONGEST_INTERVAL} (a day), got {text!r}")
    return seconds


_LONGEST_INTERVAL = 86400  # s: stat --watch's longest refresh (time.sleep overflows past ~2**63 ns)


def _parse_size(text: str) -> int:
    """Parse a size such as ``4096``, ``8M``, ``64MiB`` or ``1G`` (binary units) into bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shmshare")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"
