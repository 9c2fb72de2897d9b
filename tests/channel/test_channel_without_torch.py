"""A process that never imported torch receives a tensor's bytes as a numpy array, without
importing torch (Note [Tensors to a process without torch]). It imported torch on the spot: a
Store.get took 6.7 s, a channel receiver stalled its sender 8.3 s."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import shmshare

torch = pytest.importorskip("torch")

_CHANNEL_RECEIVER = textwrap.dedent("""
    import sys
    import shmshare
    rx = shmshare.listen(sys.argv[1])
    print("listening", flush=True)
    got = rx.recv(timeout=30)
    print(type(got["x"]).__module__, got["x"].dtype, got["x"].shape, float(got["x"][1, 2]),
          got["b"].dtype, "torch" in sys.modules, flush=True)
    del got
    rx.close()
""")


def test_a_channel_receiver_without_torch_gets_numpy_arrays(tmp_path):
    path = str(tmp_path / "rx.sock")
    p = subprocess.Popen([sys.executable, "-c", _CHANNEL_RECEIVER, path], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "listening", p.stderr.read()
        with shmshare.connect(path, timeout=30) as tx:
            x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
            tx.send({"x": x, "b": torch.ones(4, dtype=torch.bfloat16)})
            out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    assert p.returncode == 0, err[-2000:]
    assert out.split() == ["numpy", "float32", "(3,", "4)", "6.0", "int16", "False"], out
