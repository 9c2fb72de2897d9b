#!/usr/bin/env python3
"""The whole GPU check in one command: environment, build, ``pytest -m cuda``, GPU benchmarks, end-to-end.

Run from a checkout on a GPU machine with the python that has torch and
cuda-python, installing nothing (``scripts/gpu_check`` is this, with
``python3``)::

    scripts/gpu_check [--logs DIR] [--budget SECONDS] [--model]

Steps, each a subprocess in its own process group with a timeout (killed,
group and all, when it expires), each step's stdout and stderr in its own
file of ONE log folder (``--logs``; default ``$OUT/gpu_check`` when ``$OUT``
is set, else ``./gpu_check_logs/<UTC timestamp>``):

1. ``env``: python and package versions (torch, its CUDA, cuda-bindings,
   numpy, msgpack, psutil, pytest, pytest-timeout, hypothesis, setuptools).
2. ``nvidia-smi``: the GPU and driver, when the tool exists (optional).
3. ``build``: the C extension in place (``setup.py build_ext --inplace``);
   if that fails (no setuptools, an old one, a compiler warning under
   ``-Werror``), ``build-gcc`` compiles it with gcc directly.
4. ``cuda``: ``shmshare.cuda.why_unavailable()`` and the device; fails
   when CUDA cannot be used (the later steps still run, and skip).
5. ``pytest``: ``pytest -m cuda tests/cuda`` (the GPU tests, the loader's
   GPU tests among them), junit xml in the log folder. Works without
   pytest-timeout (the ini's ``timeout`` then only warns; pytest's
   ``faulthandler_timeout`` dumps a hung test's stacks) and without
   hypothesis (nothing under tests/cuda imports it).
6. ``bench_cuda``: ``scripts/bench_cuda.py --quick``; its RATIO and FIGURE
   lines (the issue's three targets) are copied into the summary.
7. ``gpu_e2e``: ``scripts/gpu_e2e.py``, PASS/FAIL per check.

scripts/bench_loader.py has no pin_memory or device option, so the
loader's GPU paths are checked for correctness by tests/cuda/test_gpu_loader.py
in step 5, not benchmarked. Every step's timeout is also cut to what is left
of ``--budget`` (default 400 s), so the whole run stays under 7 minutes. At
the end: a table (step, rc, seconds, log, key figures) printed and written to
``summary.txt`` (with ``summary.json``); exit status 1 when any step failed.
``--model`` runs steps 5 to 7 over the driver model (tests/cuda/driver_model.py):
a smoke run of this script on a machine without a GPU, NOT a GPU result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 400.0  # the whole run: under 7 minutes with the start-up and the summary
KILL_GRACE_S = 5.0  # between SIGTERM and SIGKILL of a step's process group

ENV_SNIPPET = r"""
import importlib, importlib.metadata as md, platform, sys
print("python", sys.version.replace("\n", " "), "at", sys.executable)
print("platform", platform.platform())
for dist in ("numpy", "msgpack", "psutil", "pytest", "pytest-timeout", "hypothesis", "setuptools",
             "torch", "cuda-python", "cuda-bindings", "cupy"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "MISSING")
try:
    import torch
    print("torch.version.cuda", torch.version.cuda)
    print("torch.cuda.is_available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("torch.cuda.device_count", torch.cuda.device_count())
        print("torch.cuda.get_device_name", torch.cuda.get_device_name(0))
except Exception as exc:
    print("torch import failed:", repr(exc))
try:
    from cuda.bindings import driver
    err, version = driver.cuDriverGetVersion()
    print("cuDriverGetVersion", err, version)
except Exception as exc:
    print("cuda.bindings.driver:", repr(exc))
"""

CUDA_SNIPPET = r"""
import sys
from shmshare import cuda
reason = cuda.why_unavailable()
print("why_unavailable", reason)
if reason is None:
    ctx = cuda.Context.primary(0)
    print("device", ctx.name(), f"{ctx.total_memory() / 2**30:.1f} GiB")
    for attr in ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
                 "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING"):
        try:
            print(attr, ctx.attribute(attr))
        except Exception as exc:
            print(attr, "unknown:", repr(exc))
sys.exit(0 if reason is None else 1)
"""

MODEL_SNIPPET = r"""
import runpy, sys
from shmshare.cuda import _driver
from tests.cuda.driver_model import DriverModel
try:
    real = _driver._import_driver()
except ImportError:
    real = None
_driver._state = (DriverModel(real), None)
print("DRIVER MODEL -- NOT A GPU")
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


@dataclass
class Step:
    """One step: what it runs, for how long at most, and what its log says."""

    name: str
    argv: list[str]
    timeout: float  # s, before the budget cuts it
    optional: bool = False  # a failure is reported, not counted
    summarize: Callable[[str, Path], tuple[str, list[str]]] | None = None  # (key figures, summary lines)


@dataclass
class Result:
    """What one step did."""

    name: str
    rc: int | None  # None: not run
    seconds: float
    log: str
    timed_out: bool = False
    optional: bool = False
    key: str = ""  # a few figures for the table
    lines: list[str] = field(default_factory=list)  # figures copied into the summary

    @property
    def failed(self) -> bool:
        return not self.optional and (self.rc != 0 or self.timed_out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logs", type=Path, help="the log folder (default $OUT/gpu_check or ./gpu_check_logs/<ts>)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all steps together")
    parser.add_argument("--model", action="store_true", help="steps 5-7 over the driver model: NOT a GPU")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, split on spaces")
    args = parser.parse_args()
    logs = args.logs or default_logs()
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    py = sys.executable
    print(f"gpu_check: {ROOT} with {py}; logs in {logs}; budget {args.budget:.0f} s"
          + (" -- DRIVER MODEL, NOT A GPU" if args.model else ""), flush=True)
    results: list[Result] = []

    def run(step: Step, index: int) -> Result:
        result = run_step(step, logs / f"{index:02d}-{step.name}.log", deadline)
        results.append(result)
        return result

    run(Step("env", [py, "-c", ENV_SNIPPET], 60, summarize=summarize_env), 1)
    if shutil.which("nvidia-smi"):
        run(Step("nvidia-smi", ["nvidia-smi"], 30, optional=True, summarize=summarize_smi), 2)
    else:
        results.append(Result("nvidia-smi", None, 0.0, "-", optional=True, key="not installed"))
    build = run(Step("build", [py, "setup.py", "build_ext", "--inplace"], 180, summarize=summarize_build), 3)
    if build.failed:
        fallback = run(Step("build-gcc", gcc_argv(), 180, summarize=summarize_build), 4)
        if not fallback.failed:
            build.optional = True  # the fallback built it: report setup.py's failure, do not count it
            build.key = "FAILED, built by build-gcc instead"
    cuda = run(Step("cuda", [py, "-c", CUDA_SNIPPET], 60, summarize=summarize_cuda), 5)
    if args.model:
        cuda.optional = True  # the model makes CUDA "available" in the next steps only
    plugin = ["-p", "tests.cuda.model_plugin"] if args.model else []
    junit = logs / "pytest-junit.xml"
    run(Step("pytest", [py, "-m", "pytest", *plugin, "-m", "cuda", "tests/cuda", "-p", "no:cacheprovider",
                        "-o", "faulthandler_timeout=100", "-q", "-ra", f"--junitxml={junit}",
                        *args.pytest_args.split()],
             240, summarize=summarize_pytest), 6)
    via_model = [py, "-c", MODEL_SNIPPET] if args.model else [py]
    run(Step("bench_cuda", [*via_model, "scripts/bench_cuda.py", "--quick"], 150, summarize=summarize_bench), 7)
    run(Step("gpu_e2e", [py, "scripts/gpu_e2e.py", *(["--model"] if args.model else [])], 200,
             summarize=summarize_e2e), 8)
    results.append(Result("bench_loader GPU", None, 0.0, "-", optional=True,
                          key="not run: bench_loader.py has no pin_memory/device option (test_gpu_loader.py)"))
    return write_summary(results, logs, args.model)


def default_logs() -> Path:
    out = os.environ.get("OUT")
    if out:
        return Path(out) / "gpu_check"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path("gpu_check_logs") / stamp


def gcc_argv() -> list[str]:
    """The compile of setup.py's Extension, by hand: for a python without (a recent enough) setuptools.

    The same flags but ``-Werror``: a newer gcc's new warning must not stop the GPU check.
    """
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    include = sysconfig.get_paths()["include"]
    return [os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-O2", "-std=c11", "-Wall", "-Wextra",
            "-Wno-missing-field-initializers", "-D_GNU_SOURCE", "-Inative", f"-I{include}",
            "native/shmshare_native.c", "native/lease.c", "-o", f"shmshare/_native{suffix}", "-pthread"]


def run_step(step: Step, log: Path, deadline: float) -> Result:
    """Run one step with its output in ``log``; kill its process group when its time is up."""
    timeout = min(step.timeout, deadline - time.monotonic())
    if timeout <= 1:
        log.write_text(f"not run: the budget was spent before {step.name}\n")
        print(f"--- {step.name}: not run (budget spent)", flush=True)
        return Result(step.name, None, 0.0, str(log), optional=step.optional, key="not run: budget spent")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    print(f"--- {step.name} (timeout {timeout:.0f} s): {' '.join(short(a) for a in step.argv)}", flush=True)
    start = time.monotonic()
    timed_out = False
    with log.open("w") as out:
        out.write(f"# {step.name}: {step.argv!r}\n# cwd {ROOT}, timeout {timeout:.0f} s\n")
        out.flush()
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                kill_group(proc.pid, signal.SIGKILL)
                rc = proc.wait(KILL_GRACE_S)
        kill_group(proc.pid, signal.SIGKILL)  # what the step left running (a stray child) goes with it
        seconds = time.monotonic() - start
        out.write(f"\n# rc={rc} seconds={seconds:.1f}{' TIMED OUT (process group killed)' if timed_out else ''}\n")
    result = Result(step.name, rc, seconds, str(log), timed_out, step.optional)
    if step.summarize is not None:
        try:
            result.key, result.lines = step.summarize(log.read_text(errors="replace"), log)
        except Exception as exc:  # noqa: BLE001 - a log we cannot read is shown as such, the run goes on
            result.key = f"(summary failed: {exc!r})"
    if rc != 0 or timed_out:
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip() and
                not line.startswith("# ")][-1:]
        if not last:
            result.key += " | no output"
        elif last[0].split(" ", 1)[-1][:40] not in result.key:  # not what the summary shows already
            result.key += f" | last line: {last[0].strip()[:160]}"
    state = "TIMED OUT" if timed_out else f"rc={rc}"
    print(f"    {state} in {seconds:.1f} s  {result.key}", flush=True)
    return result


def kill_group(pgid: int, sig: int) -> None:
    """Signal the step's process group (its leader's pid: start_new_session made it)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def short(arg: str) -> str:
    return "<snippet>" if "\n" in arg else arg


# --- what each log says ---------------------------------------------------------------------------


def _grep(text: str, *names: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if head in names:
            found[head] = rest.strip()
    return found


def summarize_env(text: str, log: Path) -> tuple[str, list[str]]:
    v = _grep(text, "python", "torch", "torch.version.cuda", "torch.cuda.is_available", "cuda-bindings",
              "cuda-python", "pytest-timeout", "hypothesis", "setuptools")
    python = v.get("python", "?").split(" ")[0]
    key = (f"python {python}, torch {v.get('torch', '?')} (CUDA {v.get('torch.version.cuda', '?')}, "
           f"available {v.get('torch.cuda.is_available', '?')}), cuda-bindings {v.get('cuda-bindings', '?')}, "
           f"setuptools {v.get('setuptools', '?')}, pytest-timeout {v.get('pytest-timeout', '?')}, "
           f"hypothesis {v.get('hypothesis', '?')}")
    return key, [f"env: {key}"]


def summarize_smi(text: str, log: Path) -> tuple[str, list[str]]:
    driver = re.search(r"Driver Version:\s*(\S+)", text)
    cuda = re.search(r"CUDA Version:\s*(\S+)", text)
    gpu = re.search(r"\|\s+\d+\s+(NVIDIA[^|]*?)\s{2,}", text)
    key = (f"{gpu.group(1).strip() if gpu else '?'}, driver {driver.group(1) if driver else '?'}, "
           f"CUDA {cuda.group(1) if cuda else '?'}")
    return key, [f"nvidia-smi: {key}"]


def summarize_build(text: str, log: Path) -> tuple[str, list[str]]:
    built = list(ROOT.glob("shmshare/_native*.so"))
    errors = [line.strip()[:120] for line in text.splitlines() if re.search(r"\berror\b", line, re.I)
              and "-Werror" not in line][:2]
    if errors:
        return "; ".join(errors), []
    return (f"built {built[0].name}" if built else "no shmshare/_native*.so"), []


def summarize_cuda(text: str, log: Path) -> tuple[str, list[str]]:
    v = _grep(text, "why_unavailable", "device", "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED")
    if v.get("why_unavailable") not in (None, "None"):
        key = f"CUDA NOT AVAILABLE: {v['why_unavailable'][:160]}"
    else:
        key = (f"{v.get('device', '?')}; read-only host register "
               f"{v.get('CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED', '?')}")
    return key, [f"cuda: {key}"]


def summarize_pytest(text: str, log: Path) -> tuple[str, list[str]]:
    junit = log.parent / "pytest-junit.xml"
    lines = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))][:20]
    if not junit.exists():
        tail = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
        return f"no junit xml; last line: {tail[0][:150]}", lines
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    key = (f"{passed} passed, {count['failures']} failed, {count['errors']} errors, "
           f"{count['skipped']} skipped")
    return key, [f"pytest: {key}", *(f"  {line}" for line in lines)]


def summarize_bench(text: str, log: Path) -> tuple[str, list[str]]:
    figures = [line for line in text.splitlines() if line.startswith(("RATIO ", "FIGURE "))]
    ratios = [line.split() for line in figures if line.startswith("RATIO ")]
    if "skipped, CUDA is not available" in text:
        return "skipped: CUDA not available", []
    misses = [r[1] for r in ratios if len(r) > 4 and r[4] == "MISS"]
    key = f"{len(ratios)} ratios, {len(misses)} missed target" + (f" ({', '.join(misses[:3])})" if misses else "")
    return key, figures


def summarize_e2e(text: str, log: Path) -> tuple[str, list[str]]:
    if "skipped, CUDA is not available" in text:
        return "skipped: CUDA not available", []
    checks = [line for line in text.splitlines() if line.startswith(("PASS ", "FAIL ", "SKIP "))]
    figures = [line for line in text.splitlines() if line.startswith("FIGURE ")]
    total = re.search(r"gpu_e2e: (\d+) passed, (\d+) failed", text)
    key = f"{total.group(1)} passed, {total.group(2)} failed" if total else "no final count (crashed or killed)"
    return key, [*checks, *figures]


# --- the summary ----------------------------------------------------------------------------------


def write_summary(results: list[Result], logs: Path, model: bool) -> int:
    head = ["step", "rc", "seconds", "log", "key figures"]
    rows = [[r.name, "TIMEOUT" if r.timed_out else ("-" if r.rc is None else str(r.rc))
             + ("" if not r.optional or r.rc in (0, None) else " (not counted)"),
             f"{r.seconds:.1f}", os.path.basename(r.log) if r.log != "-" else "-", r.key] for r in results]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head) - 1)]
    table = []
    for row in [head, ["-" * w for w in widths] + ["-" * 11], *rows]:
        table.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    failed = [r.name for r in results if r.failed]
    verdict = f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'}"
    text = [f"gpu_check summary ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M:%S} UTC), logs in {logs}",
            *(["DRIVER MODEL -- NOT A GPU: these results say nothing about what a GPU does"] if model else []),
            "", *table, "", "Figures for the note:"]
    for r in results:
        text.extend(f"  {line}" for line in r.lines)
    text += ["", verdict]
    (logs / "summary.txt").write_text("\n".join(text) + "\n")
    (logs / "summary.json").write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    print("\n".join(text), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
