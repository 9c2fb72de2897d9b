"""``shmshare stat``'s tables fitted to the terminal: every line within the width, every header
of the columns shown whole, the command line shown beyond the interpreter, and what was left
out named (Note [Fitting the table to the terminal] in ``shmshare/_termtable.py``)."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest

from shmshare import _stat

WAIT = 30.0
_PYTHON = "/home/someone/projects/venvs/training-env/bin/python3.11"
_SCRIPT = "/home/someone/projects/experiments/2026-run-17/holder.py"
_HEADS = {"PID", "MAPPED", "RESIDENT", "FDS", "SEGS", "SHARES WITH", "COMMAND"}


def _report() -> _stat.Report:
    by_kind = {"shm": {"pools": 2, "reserved_bytes": 4 << 20, "allocated_bytes": 300 << 10,
                       "peak_reserved_bytes": 4 << 20, "leases_out": 4, "oldest_lease_s": 1.5}}
    procs = [
        _stat.Process(123456, f"{_PYTHON} {_SCRIPT} --tag xyz", 4 << 20, 4 << 20, 1, {("0:1", 1)},
                      {7, 123457, 123458, 123459, 123460, 123461}),
        _stat.Process(7, f"{_PYTHON} -m trainer.serve", 1 << 20, 0, 0, {("0:1", 1)}, {123456},
                      {"totals": {"by_kind": by_kind}}),
    ]
    segs = [_stat.Segment("0:1", 1, "/memfd:shmshare_7_ab (deleted)", 4 << 20, {7}, {123456})]
    stores = [{"pid": 99, "path": "/tmp/shmshare-1000/store.sock",
               "stats": {"objects": 1, "held_bytes": 4096, "deleted_viewed": 0, "connected": 1},
               "objects": [{"size": 4096, "refs": 1, "holders": 1, "age": 2.0, "kind": "arena",
                            "sealed": True, "write_seal": "none", "name": "weights/layer1"}]}]
    return _stat.Report(procs, segs, 0, [], stores)


def _heads(line: str) -> set[str]:
    return {h for h in _HEADS if h in line}


@pytest.mark.parametrize("width", [200, 100, 80, 60, 40])
def test_every_line_fits_and_each_header_is_whole(width):
    lines = _stat.render(_report(), width).splitlines()
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    head = lines[0]
    assert head.split()[0] == "PID" and head.rstrip().endswith("COMMAND"), head
    pools_head = next(line for line in lines if line.split()[:2] == ["PID", "KIND"])
    assert "RESERVED" in pools_head
    assert any(line.strip().startswith("SIZE") and line.rstrip().endswith("NAME") for line in lines)
    gone = _HEADS - _heads(head)
    if gone:  # the columns left out are named, not silently lost (the note cut at 40)
        note = next(line for line in lines if line.startswith("(no room for"))
        assert width < 60 or all(h in note for h in gone), note


@pytest.mark.parametrize("width", [100, 60, 40])
def test_a_store_line_keeps_its_figures_first_and_a_cut_is_marked(width):
    report = _report()
    report.stores.append({"pid": 98, "path": "/tmp/shmshare-1000/other.sock", "error": "did not answer in 0.5 s"})
    lines = _stat.render(report, width).splitlines()
    line = next(ln for ln in lines if ln.startswith("store pid 99"))
    whole = "store pid 99: 1 objects, 4.0K held, 0 deleted but viewed, 1 clients, at /tmp/shmshare-1000/store.sock"
    assert line == (whole if len(whole) <= width else whole[:width - 3] + "..."), line
    assert width < 60 or "1 objects" in line  # the path goes first (a new user's review: "0 obje")
    error = next(ln for ln in lines if ln.startswith("store pid 98"))
    assert error.startswith("store pid 98: did not answer") or width < 30, error


@pytest.mark.parametrize("width", [100, 80, 60])
def test_the_command_column_shows_the_script_not_only_the_interpreter(width):
    rows = _stat.render(_report(), width).splitlines()[1:3]
    assert "holder.py" in rows[0] and "python3.11" in rows[0], rows
    assert "-m trainer" in rows[1], rows


def test_a_command_that_fits_is_shown_whole():
    text = _stat.render(_report(), 400)
    assert f"{_PYTHON} {_SCRIPT} --tag xyz" in text and "SHARES WITH" in text
    assert "no room" not in text


def test_many_pids_sharing_are_counted_not_spilled():
    row = _stat.render(_report(), 200).splitlines()[1]
    assert "7,123457,+4" in row, row


_HOLDER = """
import signal, sys
import numpy as np
from shmshare import Segment
seg = Segment.create(1 << 20)
seg.view(np.uint8, 1 << 20)[:] = 1
print("up", flush=True)
signal.pause()
"""


def test_shmshare_stat_fits_columns_env_and_shows_the_script(tmp_path):
    """The command, end to end: ``COLUMNS=60 shmshare stat`` of a process that runs a script from
    a long path (the header used to wrap and the row to end inside the interpreter's path)."""
    deep = tmp_path / "a-rather-long-directory-name" / "and-another-one"
    deep.mkdir(parents=True)
    script = deep / "holder.py"
    script.write_text(_HOLDER)
    with subprocess.Popen([sys.executable, str(script), "--tag", "xyz"], stdout=subprocess.PIPE,
                          text=True) as child:  # leaving it closes the pipe and reaps the child
        try:
            assert child.stdout is not None
            assert select.select([child.stdout], [], [], WAIT)[0], "the child said nothing"
            assert child.stdout.readline().strip() == "up"
            env = {k: v for k, v in os.environ.items() if k != "SHMSHARE_STATS"}
            env["COLUMNS"] = "60"
            out = subprocess.run([sys.executable, "-m", "shmshare", "stat", "--pid", str(child.pid)],
                                 capture_output=True, text=True, timeout=WAIT, env=env)
        finally:
            child.kill()
            child.wait(10)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert all(len(line) <= 60 for line in lines), out.stdout
    assert lines[0].split()[0] == "PID" and lines[0].rstrip().endswith("COMMAND"), out.stdout
    (row,) = [line for line in lines if line.split()[:1] == [str(child.pid)]]
    assert "holder.py" in row, out.stdout
