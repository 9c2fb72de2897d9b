"""``shmshare doctor``: what this host allows, one fact a line, and what it means."""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import resource
from dataclasses import asdict, dataclass, field
from typing import Any

from . import __version__, _cgroup, _procfs, _shmdir, wire
from .segment import Segment, shm_free_bytes

__all__ = ["doctor"]

_GiB, _MiB = 1 << 30, 1 << 20

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass
class Check:
    """One line of ``shmshare doctor``: a status, the fact, and what it means for the user."""

    name: str
    status: str  # ok | warn | fail
    fact: str
    meaning: str
    data: dict[str, Any] = field(default_factory=dict)


def doctor(as_json: bool = False) -> int:
    """Check the host, print one line per fact, and return 0 unless shmshare cannot work here."""
    checks = [*_check_memfd(), _check_posix(), _check_dev_shm(), _check_stale_shm(),
              _check_memory_limit(),
              _check_nofile(), _check_thp(), _check_sysv(), _check_scm_rights(), _check_cuda()]
    by_name = {c.name: c for c in checks}
    memfd_ok = by_name["memfd"].status == OK and by_name["seals"].status == OK
    broken = (not memfd_ok and by_name["posix_shm"].status == FAIL) or by_name["scm_rights"].status == FAIL
    code = 1 if broken else 0
    if as_json:
        report = {"ok": not broken, "exit_code": code, "host": _host(),
                  "checks": [asdict(c) for c in checks]}
        print(json.dumps(report, indent=2))
        return code
    print(f"shmshare doctor: {_host()['summary']}")
    for c in checks:
        print(f"  {c.status:<5} {c.name:<12} {c.fact}")
        print(f"  {'':<5} {'':<12} -> {c.meaning}")
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL)}
    verdict = "shmshare cannot share memory here" if broken else "shmshare can run here"
    print(f"{counts[OK]} ok, {counts[WARN]} warn, {counts[FAIL]} fail: {verdict} (exit {code})")
    return code


def _host() -> dict[str, Any]:
    summary = (f"Linux {platform.release()}, Python {platform.python_version()}, "
               f"shmshare {__version__}, {os.cpu_count()} CPUs")
    return {"summary": summary, "kernel": platform.release(), "python": platform.python_version(),
            "shmshare": __version__, "cpus": os.cpu_count()}


def _check_memfd() -> list[Check]:
    try:
        fd = os.memfd_create("shmshare-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError) as exc:
        why = "memfd_create is not available here (Linux >= 3.17 needed)"
        return [Check("memfd", FAIL, f"memfd_create failed: {exc}", why + "; use backend='posix'"),
                Check("seals", FAIL, "not tested: no memfd", "memfd segments cannot be made")]
    try:
        mem = Check("memfd", OK, "memfd_create(MFD_CLOEXEC|MFD_ALLOW_SEALING) works",
                    "the default backend works: segments have no name that could leak, "
                    "and /dev/shm's size does not cap them")
        return [mem, _seal_probe(fd)]
    finally:
        os.close(fd)


def _seal_probe(fd: int) -> Check:
    try:
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        return Check("seals", FAIL, f"F_ADD_SEALS(F_SEAL_SHRINK) failed: {exc}",
                     "memfd segments cannot be sealed, so Segment.create(backend='memfd') fails; "
                     "use backend='posix'")
    try:
        os.ftruncate(fd, 0)
        shrank = True
    except PermissionError:
        shrank = False  # EPERM: the seal holds, which is what we want
    if not seals & fcntl.F_SEAL_SHRINK or shrank:
        return Check("seals", FAIL, f"F_SEAL_SHRINK was added but does not hold (seals=0x{seals:x})",
                     "a peer could truncate a segment under a reader (SIGBUS); use backend='posix'",
                     {"seals": seals})
    return Check("seals", OK, f"F_SEAL_SHRINK added and read back (seals=0x{seals:x}); "
                 "ftruncate to 0 now fails with EPERM",
                 "no peer can shrink a segment under a reader's mapping: no SIGBUS from truncation",
                 {"seals": seals})


def _check_posix() -> Check:
    try:
        seg = Segment.create(4096, backend="posix")
        name = seg.name
        seg.close()
    except (OSError, ValueError) as exc:
        return Check("posix_shm", FAIL, f"shm_open under /dev/shm failed: {exc}",
                     "backend='posix' is unusable; the default memfd backend does not need it")
    if os.path.exists(f"/dev/shm{name}"):
        return Check("posix_shm", WARN, f"/dev/shm{name} is still there after close",
                     "something re-created or kept the name; backend='posix' may leak names here")
    return Check("posix_shm", OK, f"shm_open(O_CREAT|O_EXCL) + shm_unlink under /dev/shm works ({name})",
                 "backend='posix' works; a name is removed right after shm_open (before the "
                 "pages are reserved), so crashed processes do not fill /dev/shm")


def _check_dev_shm() -> Check:
    try:
        free, total = shm_free_bytes()
    except OSError as exc:
        return Check("dev_shm", WARN, f"/dev/shm cannot be read: {exc}",
                     "backend='posix' cannot work; memfd (the default) does not need /dev/shm")
    fact = f"/dev/shm is {_fmt(total)}, {_fmt(free)} free"
    data = {"total_bytes": total, "free_bytes": free}
    if total < _GiB:
        return Check("dev_shm", WARN, fact + " (Docker's default is 64 MB)",
                     "posix segments, stdlib SharedMemory and PyTorch's file_system sharing fail "
                     "beyond it: start the container with --shm-size=8g; memfd segments (the "
                     "default) are not capped by /dev/shm", data)
    if free < _GiB:
        return Check("dev_shm", WARN, fact, "posix segments are short of room (stale files in "
                     "/dev/shm?); memfd segments (the default) are not capped by /dev/shm", data)
    return Check("dev_shm", OK, fact, f"posix segments can use up to {_fmt(free)}; memfd "
                 "segments (the default) are not capped by /dev/shm", data)


def _check_stale_shm() -> Check:
    stale = _shmdir.stale_names()
    if not stale:
        return Check("stale_shm", OK, "no shmshare names of dead processes in /dev/shm",
                     "no crashed process left /dev/shm space behind", {"names": [], "bytes": 0})
    total = sum(nbytes for _, nbytes in stale)
    shown = ", ".join(os.path.basename(p) for p, _ in stale[:3]) + (", ..." if len(stale) > 3 else "")
    return Check("stale_shm", WARN, f"{len(stale)} shmshare name(s) of dead processes in /dev/shm "
                 f"hold {_fmt(total)}: {shown}",
                 "their creators died before removing them; the space stays taken until they go: "
                 "run `shmshare sweep` (`--dry-run` lists them first)",
                 {"names": [p for p, _ in stale], "bytes": total})


def _check_memory_limit() -> Check:
    lim = _cgroup.memory_limit()
    meaning = ("shared memory (memfd and /dev/shm) is charged to this limit; a segment that does "
               "not fit is refused at create with ENOMEM, before the kernel would OOM-kill")
    if lim is None:
        return Check("memory_limit", OK, "no memory cgroup limit", "shared memory is bounded by "
                     "the host's RAM; a segment that does not fit fails at create, never with SIGBUS")
    data = {"limit_bytes": lim.limit, "used_bytes": lim.usage, "cgroup": lim.path,
            "version": lim.version}
    status = WARN if lim.room < _GiB else OK
    return Check("memory_limit", status, f"memory cgroup {lim.path} (v{lim.version}) limit "
                 f"{_fmt(lim.limit)}, {_fmt(lim.usage)} used", meaning, data)


def _check_nofile() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nopen = len(_procfs.fds("self"))
    room = soft - nopen
    raise_hint = f"; `ulimit -n {hard}` raises it" if soft < hard else ""
    return Check("nofile", OK if room >= 256 else WARN,
                 f"RLIMIT_NOFILE soft {soft}, hard {hard}; {nopen} fds open now",
                 f"shmshare holds one fd per pool segment and per peer, not per tensor: about "
                 f"{room} more segments fit{raise_hint}",
                 {"soft": soft, "hard": hard, "open": nopen})


def _check_thp() -> Check:
    raw = _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    chosen = re.search(r"\[(\w+)\]", raw or "")  # the kernel brackets the mode in force
    mode = chosen.group(1) if chosen else None
    mounts = _read("/proc/mounts") or ""
    opt = re.search(r"^\S+ /dev/shm tmpfs \S*huge=(\w+)", mounts, re.M)
    fact = f"shmem THP: shmem_enabled={mode or 'unknown'}, /dev/shm huge={opt.group(1) if opt else 'never'}"
    data = {"shmem_enabled": mode, "dev_shm_huge": opt.group(1) if opt else "never"}
    if mode in ("advise", "always", "within_size", "force"):
        what = ("shmshare asks for 2 MiB pages (MADV_HUGEPAGE) on memfd segments of 2 MiB and more: "
                "fewer page faults and TLB misses on large tensors")
    else:
        what = ("memfd segments use 4 KiB pages: correct, but large tensors take more page faults "
                "to touch; an admin can set shmem_enabled to 'advise'")
    return Check("thp_shmem", OK, fact, what, data)


def _check_sysv() -> Check:
    shmmax, shmall = _read("/proc/sys/kernel/shmmax"), _read("/proc/sys/kernel/shmall")
    shown = ["unlimited" if v and v.isdigit() and int(v) >= 1 << 60 else str(v) for v in (shmmax, shmall)]
    return Check("sysv_limits", OK, f"kernel.shmmax={shown[0]}, kernel.shmall={shown[1]}",
                 "System V shm limits: they do not apply to memfd or POSIX shm, so shmshare "
                 "is not bound by them", {"shmmax": shmmax, "shmall": shmall})


def _check_scm_rights() -> Check:
    r, w = os.pipe()
    try:
        a, b = wire.pipe(role="doctor")
        with a, b:
            a.send({"probe": 1}, [r])
            _, fds = b.recv(timeout=2.0)
            with fds[0] as got:
                os.write(w, b"shm")
                same = os.read(got.fileno(), 3) == b"shm"  # the pipe we sent, seen through the copy
                fact = f"fd {r} sent over AF_UNIX SOCK_SEQPACKET arrived as fd {got.fileno()}"
    except Exception as exc:  # noqa: BLE001 - any failure here means fds cannot cross processes
        return Check("scm_rights", FAIL, f"passing a fd with SCM_RIGHTS failed: {exc}",
                     "no segment can reach another process; a sandbox (seccomp, gVisor) may block it")
    finally:
        os.close(r)
        os.close(w)
    if not same:
        return Check("scm_rights", FAIL, fact + ", but not to the same object",
                     "fd passing is broken here; no segment can reach another process")
    return Check("scm_rights", OK, fact + ", same object",
                 "segments can be handed to other processes; each crosses once per peer")


def _check_cuda() -> Check:
    # CUDA is optional: a missing module is fine (CPU only); a module whose
    # driver or device is missing is a warning, since someone meant to use it.
    from . import cuda

    reason = cuda.why_unavailable()
    if reason is not None:
        if reason.startswith("cuda-python is not installed"):
            return _no_cuda(OK, reason, "CPU only, which is all shmshare needs; "
                            "pip install 'shmshare[cuda]' for GPU pools")
        meaning = ("no NVIDIA driver (libcuda.so.1) here; GPU features are off, CPU paths work"
                   if "libcuda" in reason else "GPU features are off; CPU paths work")
        return _no_cuda(WARN, reason, meaning)
    _, count = cuda._driver.driver().cuDeviceGetCount()
    return Check("cuda", OK, f"CUDA available: {count} device(s)",
                 "GPU pools and pinned copies can be used", {"available": True, "devices": count})


def _no_cuda(status: str, reason: str, meaning: str = "GPU features are off; CPU paths work") -> Check:
    return Check("cuda", status, f"CUDA not available: {reason}", meaning,
                 {"available": False, "reason": reason})


def _fmt(nbytes: int) -> str:
    for unit, scale in (("GiB", _GiB), ("MiB", _MiB), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None
