"""Tests of the ``shmshare`` command line: ``doctor`` (text and JSON) and the live ``demo``.

Every command runs in a subprocess with a timeout, the way a user runs it;
the demo's own child is reaped (or killed) by the demo itself, and the
tests check that nothing it made is left in /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shmshare import _demo, _procfs, cli

TIMEOUT = 60  # s, per command; the demo takes well under a second here
CHECKS = {"memfd", "seals", "posix_shm", "dev_shm", "stale_shm", "memory_limit", "nofile", "thp_shmem",
          "sysv_limits", "scm_rights", "cuda"}

# The seed's i_count at every step, as the demo counts it from /proc.
REFS = {
    "memfd": ["2", "2+1 in flight", "3", "5", "4", "4", "2", "2", "0"],
    "posix": ["2", "2", "2+1 in flight", "3", "5", "4", "4", "2", "2", "0"],
}


def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, int, str]:
    """Run ``python -m shmshare ARGS``; return (pid, exit code, stdout+stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "shmshare", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, 9)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"shmshare {' '.join(args)} did not finish in {TIMEOUT} s:\n{out}")
    return proc.pid, proc.returncode, out


# -- doctor -------------------------------------------------------------------


def test_doctor_json_reports_every_check_and_the_needed_ones_pass() -> None:
    _, code, out = run_cli("doctor", "--json")
    report = json.loads(out)
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == CHECKS
    for c in checks.values():
        assert c["status"] in ("ok", "warn", "fail"), c
        assert c["fact"] and c["meaning"], c
    for name in ("memfd", "seals", "posix_shm", "scm_rights"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["seals"]["data"]["seals"] & 0x2  # F_SEAL_SHRINK
    assert checks["nofile"]["data"]["soft"] > 0
    assert report["ok"] is True and report["exit_code"] == 0 and code == 0


def test_doctor_text_prints_status_fact_and_meaning_per_check() -> None:
    _, code, out = run_cli("doctor")
    lines = out.splitlines()
    for name in CHECKS:
        i = next(i for i, line in enumerate(lines) if re.match(rf"\s+(ok|warn|fail)\s+{name}\s", line))
        assert lines[i + 1].strip().startswith("-> "), lines[i + 1]
    assert re.search(r"^\d+ ok, \d+ warn, 0 fail: shmshare can run here \(exit 0\)$", out, re.M)
    assert code == 0


STUB_DRIVER = {
    "no_device": ("return (CUresult.CUDA_ERROR_NO_DEVICE,)", "warn",
                  "cuInit(0) failed with CUDA_ERROR_NO_DEVICE"),
    "no_driver": ("raise RuntimeError('Function \"cuInit\" not found')", "warn",
                  "driver library libcuda.so could not be loaded"),
    "two_devices": ("return (CUresult.CUDA_SUCCESS,)", "ok", "CUDA available: 2 device(s)"),
}


@pytest.mark.parametrize("case", sorted(STUB_DRIVER))
def test_doctor_says_why_cuda_is_missing_without_failing(case: str, tmp_path: Path) -> None:
    body, status, fact = STUB_DRIVER[case]
    pkg = tmp_path / "cuda" / "bindings"
    pkg.mkdir(parents=True)
    (tmp_path / "cuda" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "driver.py").write_text(textwrap.dedent(f"""\
        import enum
        class CUresult(enum.IntEnum):
            CUDA_SUCCESS = 0
            CUDA_ERROR_NO_DEVICE = 100
        def cuInit(flags):
            {body}
        def cuDeviceGetCount():
            return (CUresult.CUDA_SUCCESS, 2)
        """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    _, code, out = run_cli("doctor", "--json", env=env)
    cuda = next(c for c in json.loads(out)["checks"] if c["name"] == "cuda")
    assert cuda["status"] == status and fact in cuda["fact"], cuda
    assert code == 0  # CUDA is never needed


def test_console_script_runs_doctor() -> None:
    exe = shutil.which("shmshare", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("the shmshare console script is not installed next to this Python")
    out = subprocess.run([exe, "doctor", "--json"], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"] is True


# -- demo ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_demo_walks_the_seed_and_the_object_is_gone(backend: str) -> None:
    pid, code, out = run_cli("demo", "--backend", backend, "--size", "8M", "--loader-seconds", "0")
    assert code == 0, out
    assert re.findall(r"\| refs (\d+(?:\+1 in flight)?) \|", out) == REFS[backend], out
    assert "object gone: yes" in out and "child read the pattern: yes" in out, out
    assert not _procfs.shm_names(f"shmshare_{pid}_"), "the demo left a /dev/shm entry"
    if backend == "posix":
        assert re.search(rf"\| /dev/shm/shmshare_{pid}_\w+", out)  # shown before shm_unlink
        assert out.count("/dev/shm: gone") == len(REFS["posix"]) - 1


def test_demo_shows_host_shmem_only_when_the_segment_is_large_enough() -> None:
    _, code, out = run_cli("demo", "--loader-seconds", "0")  # the default size, 64 MiB
    assert code == 0 and "object gone: yes" in out, out
    assert out.count("| Shmem ") == len(REFS["memfd"])
    _, code, out = run_cli("demo", "--size", "1M", "--loader-seconds", "0")
    assert code == 0 and "Shmem" not in out, out


def test_demo_runs_the_loader_after_the_walk_through_and_leaves_no_fd() -> None:
    _, code, out = run_cli("demo", "--size", "1M", "--loader-seconds", "0.3")
    assert code == 0, out
    line = next(ln for ln in out.splitlines() if "shmshare (numpy batches)" in ln)
    assert re.search(r"[\d,]+ batches/s", line) and "after close: fds +0" in line, line


def test_demo_reports_a_failing_child_step_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken(state: dict[str, object], data: object) -> dict[str, object]:
        raise RuntimeError("injected")

    monkeypatch.setitem(_demo._CHILD_STEPS, "verify", broken)  # the forked child inherits it
    assert _demo.demo("posix", 1 << 20) == 1
    out = capsys.readouterr().out
    assert "failed at step 'verify': RuntimeError: injected" in out, out
    assert "object gone" not in out
    assert not _procfs.shm_names(f"shmshare_{os.getpid()}_")
    assert not _procfs.shm_mappings("self", "shmshare_")


def test_reap_kills_a_child_that_does_not_finish() -> None:
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(30)
        finally:
            os._exit(0)
    assert _demo._reap(pid, timeout=0.2) == -signal.SIGKILL


# -- arguments ----------------------------------------------------------------


@pytest.mark.parametrize("text, nbytes", [("4096", 4096), ("8M", 8 << 20), ("64MiB", 64 << 20),
                                          ("1G", 1 << 30), ("16k", 16 << 10), ("1.5M", 3 << 19)])
def test_sizes_parse_in_binary_units(text: str, nbytes: int) -> None:
    assert cli._parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "M", "12Q", "-1M", "1k"])
def test_bad_sizes_are_refused_with_the_reason(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        cli._parse_size(text)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "doctor" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--backend", "sysv"])
    assert exc.value.code == 2
    for interval in ["0", "inf", "1e400"]:  # 0 would print once, where the help says it refreshes; inf overflows
        with pytest.raises(SystemExit) as exc:
            cli.main(["stat", "--watch", interval])
        assert exc.value.code == 2 and "the interval must be more than 0 seconds" in capsys.readouterr().err


# -- stale names: doctor reports them, sweep removes them ---------------------


@pytest.mark.alone  # the stale name it plants would be another worker's leak, and its sweep takes theirs
def test_doctor_reports_a_stale_name_and_sweep_removes_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(TIMEOUT)  # its pid is dead from now on
    path = f"/dev/shm/shmshare_{child.pid}_5a1e"
    Path(path).write_bytes(b"x" * 8192)
    try:
        _, code, out = run_cli("doctor", "--json")
        stale = {c["name"]: c for c in json.loads(out)["checks"]}["stale_shm"]
        assert code == 0 and stale["status"] == "warn" and path in stale["data"]["names"]
        assert "shmshare sweep" in stale["meaning"]
        _, code, out = run_cli("sweep", "--dry-run")
        assert code == 0 and f"would remove {path}" in out and os.path.exists(path)
        _, code, out = run_cli("sweep")
        assert code == 0 and f"removed {path}" in out and not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
