"""The exception tree's own wording: fd exhaustion is said in one place, with the numbers."""

from __future__ import annotations

import errno
import os
import resource

import pytest

from shmshare import FdLimitError, ShmshareError


def test_exhausted_names_the_syscall_the_limits_the_count_and_the_fix():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    exc = FdLimitError.exhausted("memfd_create", OSError(errno.EMFILE, "Too many open files"),
                                 "each kept segment holds one fd")
    assert isinstance(exc, (FdLimitError, OSError, ShmshareError)) and exc.errno == errno.EMFILE
    text = str(exc)
    nopen = len(os.listdir("/proc/self/fd")) - 1
    assert text.startswith("[Errno 24] memfd_create failed: Too many open files.")
    assert f"RLIMIT_NOFILE is {soft} (hard {hard}) and " in text
    assert f" {nopen} fds are open: raise it" in text  # the listing's own fd is not counted
    assert "ulimit -n" in text or "ulimit -Hn" in text
    assert text.endswith("; each kept segment holds one fd")


def test_exhausted_never_says_minus_one_when_the_table_is_full():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    low = len(os.listdir("/proc/self/fd")) + 4
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        with pytest.raises(OSError) as full:
            while True:
                filler.append(os.dup(0))
        exc = FdLimitError.exhausted("dup(0)", full.value)
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert full.value.errno == errno.EMFILE
    assert "-1" not in str(exc)
    assert f"RLIMIT_NOFILE is {low} (hard {hard}) and all {low} of RLIMIT_NOFILE are in use: " \
        "raise it" in str(exc)  # /proc/self/fd could not be listed: the count is the limit


def test_exhausted_takes_a_bare_errno_and_explains_enfile():
    exc = FdLimitError.exhausted("recvmsg", errno.ENFILE)
    assert exc.errno == errno.ENFILE and "fs.file-max" in str(exc)
    assert "fds are open" in str(exc)


def test_every_public_exception_names_its_public_module_and_pickles():
    """Tracebacks showed ``shmshare.store._protocol._Missing`` and the like: private names."""
    import pickle

    import shmshare
    import shmshare.memory
    import shmshare.multiprocessing
    import shmshare.store

    for mod in (shmshare, shmshare.memory, shmshare.multiprocessing, shmshare.store):
        for name in mod.__all__:
            cls = getattr(mod, name)
            if isinstance(cls, type) and issubclass(cls, BaseException) and \
                    cls.__module__.startswith("shmshare"):
                assert "._" not in f".{cls.__module__}", f"{mod.__name__}.{name}: {cls.__module__}"
                assert getattr(__import__(cls.__module__, fromlist=["_"]), cls.__name__) is cls
                assert type(pickle.loads(pickle.dumps(cls("why")))) is cls
    assert "ObjectNotFound" in shmshare.store.__all__
