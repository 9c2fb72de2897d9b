"""A process that never imported torch receives a tensor's bytes as a numpy array, without
importing torch (Note [Tensors to a process without torch]). It imported torch on the spot: a
Store.get took 6.7 s, a channel receiver stalled its sender 8.3 s."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shmshare.store import Daemon, Store

torch = pytest.importorskip("torch")

_STORE_GETTER = textwrap.dedent("""
    import sys
    from shmshare.store import Store
    with Store(sys.argv[1]) as st:
        for name in ("small", "large"):
            a = st.get(name)
            print(name, type(a).__module__, a.dtype, float(a[-1]), a.flags.writeable, flush=True)
            del a
    print("torch" in sys.modules, flush=True)
""")


def test_a_store_getter_without_torch_gets_numpy_arrays(own_daemon: Daemon):
    with Store(own_daemon.path) as st:
        st.put("small", torch.full((1000,), 3.0))
        st.put("large", torch.full((1 << 19,), 4.0, dtype=torch.float64))  # 4 MiB: its own memfd
        try:
            done = subprocess.run([sys.executable, "-c", _STORE_GETTER, own_daemon.path],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr[-2000:]
            assert done.stdout.split() == ["small", "numpy", "float32", "3.0", "False",
                                           "large", "numpy", "float64", "4.0", "False",
                                           "False"], done.stdout
            again = st.get("small")  # this process has torch: a tensor, as before
            assert isinstance(again, torch.Tensor) and float(again[0]) == 3.0
            del again
        finally:
            st.delete("small")
            st.delete("large")
