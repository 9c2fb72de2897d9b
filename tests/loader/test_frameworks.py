"""Frameworks that wrap loaders: a loader made with torch imported is a ``torch.utils.data.DataLoader``, Lightning
re-creates it as ours, and Accelerate's ``prepare`` keeps it ours. Each framework run is compared with the same run
over torch's loader: the same batches in the same order, the same losses."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import shmshare  # noqa: E402
from shmshare.loader import _accelerate  # noqa: E402

TorchLoader = torch.utils.data.DataLoader
POOL = 1 << 23  # a pool_limit that is not the default: it must survive every re-creation


class Samples(torch.utils.data.Dataset):
    """Sample i: four inputs and a target drawn from seed i, and i (the order the batches came in)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, object]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g), "i": i}


class Noisy(Samples):
    """Samples with noise drawn in the worker from torch's global generator: seeded by the worker's seeding."""

    def __getitem__(self, i: int) -> dict[str, object]:
        sample = super().__getitem__(i)
        sample["x"] = sample["x"] + 0.1 * torch.randn(4)
        return sample


def _shuffled(cls, dataset=None, **kwargs):
    return cls(dataset or Samples(), batch_size=8, shuffle=True, num_workers=2,
               generator=torch.Generator().manual_seed(1), **kwargs)


def _mine(**kwargs):
    return {"pool_limit": POOL, **kwargs}


# -- the class -------------------------------------------------------------------------------------------------------


def test_a_loader_made_with_torch_imported_is_a_torch_dataloader_and_recreated_as_ours():
    loader = shmshare.DataLoader(Samples(), batch_size=8, num_workers=2, pool_limit=POOL)
    assert isinstance(loader, TorchLoader) and isinstance(loader, shmshare.DataLoader)
    # Lightning's re-creation without recorded arguments: type(loader)(the attributes named like __init__'s
    # parameters that differ from their defaults, the sampler given, no batch_sampler)
    params = inspect.signature(type(loader).__init__).parameters
    kwargs = {k: v for k, v in vars(loader).items() if k in params and params[k].default is not v}
    again = type(loader)(**{**kwargs, "sampler": loader.sampler, "batch_sampler": None})
    assert type(again) is type(loader) and again.pool_limit == POOL and again._pool_limit == POOL
    assert [b["i"].tolist() for b in again] == [b["i"].tolist() for b in loader] == [
        list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert pickle.loads(pickle.dumps(loader)).pool_limit == POOL
    assert inspect.signature(shmshare.DataLoader) == inspect.signature(type(loader))  # __init__'s, not __new__'s


class Scaled(shmshare.DataLoader):
    """A user's subclass, with an argument of its own."""

    def __init__(self, dataset, scale: int = 1, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.scale = scale


def test_a_subclass_of_ours_is_a_torch_dataloader_of_its_own_name_and_pickles():
    loader = Scaled(Samples(), scale=3, batch_size=16)
    assert isinstance(loader, Scaled) and isinstance(loader, TorchLoader)
    assert type(loader).__name__ == "Scaled" and type(Scaled(Samples())) is type(loader)  # made once
    back = pickle.loads(pickle.dumps(loader))
    assert type(back) is type(loader) and back.scale == 3
    assert [b["i"].tolist() for b in back] == [list(range(16)), list(range(16, 32))]


def test_lightning_keeps_a_subclass_argument_when_the_first_loader_is_made_inside_its_hook():
    """Lightning records constructor arguments only for the torch DataLoader subclasses that exist when
    its recording starts: a user's subclass of ours is one from its class statement on."""
    fabric_data = pytest.importorskip("lightning_fabric.utilities.data")

    class Scaled(shmshare.DataLoader):
        def __init__(self, dataset, scale=1, **kwargs):
            super().__init__(dataset, **kwargs)
            self.factor = scale  # kept under another name, as users do: only the record has it

    with fabric_data._replace_dunder_methods(TorchLoader, "dataset"):
        loader = Scaled(Samples(), scale=3, batch_size=4)  # its first instance, inside the hook
    again = fabric_data._update_dataloader(loader, torch.utils.data.SequentialSampler(loader.dataset))
    assert type(again) is type(loader) and again.factor == 3


def test_a_loader_made_without_torch_stays_ours_alone_and_does_not_import_torch(tmp_path):
    script = tmp_path / "numpy_only.py"
    script.write_text(textwrap.dedent("""
        import sys
        import shmshare
        loader = shmshare.DataLoader(list(range(4)), batch_size=2)
        assert type(loader) is shmshare.DataLoader, type(loader)
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
        assert "torch" not in sys.modules and "shmshare.loader._torch_loader" not in sys.modules
        print("ok")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stdout + done.stderr[-3000:]


# -- Lightning -------------------------------------------------------------------------------------------------------


def _lightning():
    return pytest.importorskip("pytorch_lightning", reason="Lightning is not installed (the test extra has it)")


def _trainer(pl, root, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, **kwargs)


def _tiny_module(pl, loader_cls=None):
    class Tiny(pl.LightningModule):
        """A linear model that records every batch's sample ids and loss; its loaders made in its hooks."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)
            self.seen: list[list[int]] = []
            self.losses: list[float] = []
            self.made: list[object] = []

        def training_step(self, batch, _):
            loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
            self.seen.append(batch["i"].tolist())
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, _):
            self.seen.append(batch["i"].tolist())
            self.losses.append(torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"]).item())

        def predict_step(self, batch, _):
            return batch["i"].tolist(), self.net(batch["x"]).flatten().tolist()

        def predict_dataloader(self):
            self.made.append(loader_cls(Samples(), batch_size=8, num_workers=2, pool_limit=POOL))
            return self.made[-1]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def test_lightning_fit_over_our_loaders_sees_what_it_sees_over_torchs(tmp_path, monkeypatch):
    pl = _lightning()
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything sets them; put back after the test
        monkeypatch.setenv(name, "")
    runs = {}
    for name, cls in (("ours", shmshare.DataLoader), ("torch", TorchLoader)):
        # workers=True: Lightning gives every torch DataLoader its worker_init_fn, which re-seeds the noise
        pl.seed_everything(0, workers=True, verbose=False)
        model, trainer = _tiny_module(pl), _trainer(pl, tmp_path, max_epochs=2, num_sanity_val_steps=0)
        extra = _mine() if cls is shmshare.DataLoader else {}
        trainer.fit(model, _shuffled(cls, Noisy(), **extra), cls(Noisy(), batch_size=16, num_workers=2, **extra))
        assert type(trainer.train_dataloader) is type(trainer.val_dataloaders) is type(_shuffled(cls))
        assert trainer.train_dataloader.worker_init_fn is not None
        runs[name] = model.seen, model.losses
    (seen, losses), (torch_seen, torch_losses) = runs["ours"], runs["torch"]
    assert len(seen) == 2 * (4 + 2)  # two epochs of 4 training and 2 validation batches
    assert seen == torch_seen
    assert losses == pytest.approx(torch_losses, rel=1e-6)


def test_lightning_predict_recreates_our_loader_as_ours(tmp_path):
    pl = _lightning()
    # predict re-creates every loader (an index-tracking batch sampler); given to predict() (from its attributes),
    # and made in the module's hook (from the arguments Lightning records)
    trainer = _trainer(pl, tmp_path)
    given = shmshare.DataLoader(Samples(), batch_size=8, num_workers=2, pool_limit=POOL)
    from_attributes = trainer.predict(_tiny_module(pl), given)
    recreated = trainer.predict_dataloaders
    assert recreated is not given and type(recreated) is type(given) and recreated.pool_limit == POOL

    trainer, model = _trainer(pl, tmp_path), _tiny_module(pl, shmshare.DataLoader)
    from_arguments = trainer.predict(model)
    assert hasattr(model.made[0], "__pl_saved_args")  # Lightning recorded our __init__'s arguments
    assert type(trainer.predict_dataloaders) is type(given) and trainer.predict_dataloaders.pool_limit == POOL

    torchs = _trainer(pl, tmp_path).predict(_tiny_module(pl), TorchLoader(Samples(), batch_size=8, num_workers=2))
    assert from_attributes == from_arguments == torchs
    assert [ids for ids, _ in torchs] == [list(range(i, i + 8)) for i in range(0, 32, 8)]


# -- Accelerate ------------------------------------------------------------------------------------------------------


@pytest.fixture
def accelerate():
    accelerate = pytest.importorskip("accelerate", reason="Accelerate is not installed (the test extra has it)")
    yield accelerate
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerate_run(accelerate, cls, **extra):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, _shuffled(cls, **extra))
    seen, losses = [], []
    for _ in range(2):
        for batch in prepared:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            # the wrapper's own bookkeeping: the last batch of each epoch is the end of the data
            seen.append((batch["i"].tolist(), accelerator.gradient_state.end_of_dataloader))
            losses.append(loss.item())
    return accelerator, prepared, seen, losses


def test_accelerate_prepare_keeps_our_loader_and_sees_what_it_sees_over_torchs(accelerate):
    accelerator, prepared, seen, losses = _accelerate_run(accelerate, shmshare.DataLoader, **_mine())
    base = prepared.base_dataloader  # inside Accelerate's DataLoaderShard: ours, not a torch loader built from ours
    assert isinstance(base, shmshare.DataLoader) and base.pool_limit == POOL and base.num_workers == 2
    skipped = accelerator.skip_first_batches(prepared, 3)  # resuming mid-epoch re-creates the loader too
    assert isinstance(skipped.base_dataloader, shmshare.DataLoader) and skipped.base_dataloader.pool_limit == POOL
    assert len([b["i"] for b in skipped]) == 1

    _, torch_prepared, torch_seen, torch_losses = _accelerate_run(accelerate, TorchLoader)
    assert type(torch_prepared.base_dataloader) is TorchLoader  # other loaders pass untouched
    assert len(seen) == 8 and [end for _, end in seen] == [False, False, False, True] * 2
    assert seen == torch_seen
    assert losses == pytest.approx(torch_losses, rel=1e-6)


def test_accelerate_imported_after_the_first_loader_is_wrapped_when_it_is(tmp_path, monkeypatch):
    # the finder that waits for accelerate.accelerator, tried on a module of this test's own
    (tmp_path / "late_module.py").write_text("class Accelerator:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    ran = []
    finder = _accelerate._AfterImport("late_module", ran.append)
    sys.meta_path.insert(0, finder)
    try:
        import late_module
    finally:
        sys.modules.pop("late_module", None)
    assert ran == [late_module] and finder not in sys.meta_path
    assert type(late_module.__loader__) is type(late_module.__spec__.loader) is not _accelerate._ThenLoader
