"""A loader made before ``import torch`` whose samples are torch tensors: the data decides the
collate, not import order (it raised numpy_collate's TypeError). Each case runs in a fresh
interpreter, where torch is not imported yet when the loader is made."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

_SCRIPT = textwrap.dedent("""
    import sys
    import shmshare

    class Tensors:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            import torch  # the dataset brings torch; the loader was made before
            return {"x": torch.full((3,), float(i)), "y": i}

    if __name__ == "__main__":
        assert "torch" not in sys.modules
        loader = shmshare.DataLoader(Tensors(), batch_size=2, num_workers=int(sys.argv[1]))
        import torch
        batches = list(loader)
        assert len(batches) == 2, batches
        assert isinstance(batches[0]["x"], torch.Tensor) and batches[0]["x"].shape == (2, 3)
        assert batches[1]["x"][1, 0].item() == 3.0 and batches[1]["y"].tolist() == [2, 3]
        print("ok", type(batches[0]["y"]).__module__)
""")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_made_before_import_torch_collates_torch_samples(tmp_path, workers):
    script = tmp_path / "early.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(workers)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "torch"]


def test_numpy_collate_given_a_tensor_says_what_to_do():
    import torch

    from shmshare.loader import numpy_collate

    with pytest.raises(TypeError, match="Leave collate_fn unset"):
        numpy_collate([torch.ones(2), torch.ones(2)])
