"""kaisa.integrations.lightning: KFACCallback against the plain loop it stands for.

The reference is the README's loop: the model (wrapped in DDP with several
ranks), ``KFACPreconditioner(model, lr=<the optimizer's lr>)``, SGD with
momentum and a step-wise learning-rate schedule; with accumulation each
micro-batch loss is divided by the number of passes (as Lightning does) and
the non-final passes run under ``no_sync``. Everything is float64 and the
weights must agree to 1e-10 (same operations in the same order: they agree
to the last bit in practice); the schedule halves the learning rate every two
steps and KL clipping is active, so a preconditioner reading a stale
learning rate would be caught. In float32 ``'16-mixed'`` (a CPU GradScaler)
the tolerance is 1e-6 (again the same operations; what it must catch, KL
clipping on still-scaled gradients, moves the weights by orders of magnitude
more). Multi-process runs use the gloo harness of ``tests/distributed``; the
trainer runs inside its processes on their process group.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

import kaisa
from kaisa.integrations.lightning import CHECKPOINT_KEY, KFACCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import plain_loop as plain
from harness import run_distributed
from plain_loop import OPTIONS, STEPS, TOL32, TOL64, Batches


def _plain(
    data: Batches, accumulation: int, *args: Any, **kwargs: Any
) -> tuple[dict[str, torch.Tensor], int]:
    """The plain loop (tests/integrations/plain_loop.py), losses as this framework computes them."""
    return plain.reference(data, accumulation, plain.lightning_loss, *args, **kwargs)


pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec"),  # Lightning 2.6 on torch 2.13
]


class Module(pl.LightningModule):
    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype):
        super().__init__()
        self.net = plain.net(dtype)
        self.batches = batches

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.batches, batch_size=None)  # type: ignore[arg-type]

    def configure_optimizers(self) -> Any:
        optimizer, schedule = plain.optimizer_and_schedule(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ExistingGroup(ClusterEnvironment):
    """The harness's process group, already initialised: Lightning launches nothing."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return dist.get_world_size()

    def set_world_size(self, size: int) -> None:
        assert size == dist.get_world_size()

    def global_rank(self) -> int:
        return dist.get_rank()

    def set_global_rank(self, rank: int) -> None:
        assert rank == dist.get_rank()

    def local_rank(self) -> int:
        return dist.get_rank()

    def node_rank(self) -> int:
        return 0


def _trainer(root: Path, accumulation: int = 1, epochs: int = 1, **kwargs: Any) -> pl.Trainer:
    if dist.is_initialized():
        kwargs["devices"] = dist.get_world_size()
        kwargs["strategy"] = DDPStrategy(
            cluster_environment=ExistingGroup(), process_group_backend="gloo"
        )
    kwargs.setdefault("precision", "64-true")
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        accumulate_grad_batches=accumulation,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=root,
        **kwargs,
    )


def _fit(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    root: Path,
    accumulation: int = 1,
    dtype: torch.dtype = torch.float64,
    **kwargs: Any,
) -> tuple[dict[str, torch.Tensor], KFACCallback, pl.Trainer]:
    module = Module(batches, dtype)
    callback = KFACCallback(**OPTIONS)
    trainer = _trainer(root, accumulation, callbacks=[callback], **kwargs)
    trainer.fit(module)
    weights = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    return weights, callback, trainer


def _assert_same_state(got: Any, want: Any, where: str = "state") -> None:
    """Nested preconditioner state: tensors within TOL64, everything else equal."""
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, atol=TOL64, rtol=0, msg=where)
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_same_state(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same_state(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


# -- one process -----------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_single_process_equals_plain_loop(tmp_path: Path, accumulation: int) -> None:
    batches = plain.batches(0, STEPS * accumulation, torch.float64)
    want, clipped = _plain(batches, accumulation)
    got, callback, _ = _fit(batches, tmp_path, accumulation)
    pre = callback.preconditioner
    assert pre.steps == STEPS  # once per optimizer step, not per batch
    assert pre.options.accumulation_steps == accumulation
    assert pre.telemetry.kl_clipped_steps == clipped > 0
    plain.assert_weights(got, want, TOL64)
    # Teeth: without K-FAC the weights end far away.
    raw, _ = _plain(batches, accumulation, kfac=False)
    assert plain.moved(raw, want) > 1e4 * TOL64


@pytest.mark.timeout(60)
def test_16_mixed_passes_the_trainer_scaler_and_sees_unscaled_gradients(tmp_path: Path) -> None:
    """On CPU '16-mixed' needs its plugin given; Lightning unscales before the hook."""
    batches = plain.batches(0, STEPS, torch.float32)
    want, clipped = _plain(batches, 1, torch.float32, amp=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, callback, trainer = _fit(
            batches,
            tmp_path,
            dtype=torch.float32,
            precision=None,
            plugins=[MixedPrecision("16-mixed", "cpu")],
        )
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert callback.preconditioner.options.grad_scaler is scaler
    assert not [w for w in caught if "unscale" in str(w.message)]
    assert callback.preconditioner.telemetry.kl_clipped_steps == clipped > 0
    plain.assert_weights(got, want, TOL32)
    # Teeth: the same loop preconditioning still-scaled gradients ends far away.
    scaled, _ = _plain(batches, 1, torch.float32, amp=True, unscale_first=False)
    assert plain.moved(scaled, want) > 1e3 * TOL32


@pytest.mark.timeout(60)
def test_resume_from_checkpoint_equals_uninterrupted(tmp_path: Path) -> None:
    """Two epochs in one fit == one epoch, a checkpoint, and a resumed fit to two epochs."""
    batches = plain.batches(0, STEPS, torch.float64)
    options = {**OPTIONS, "inv_update_steps": 3}  # the resume lands between inverse updates

    def fit(epochs: int, ckpt: Path | None = None) -> tuple[pl.LightningModule, KFACCallback, Any]:
        module = Module(batches, torch.float64)
        callback = KFACCallback(**options)
        trainer = _trainer(tmp_path, epochs=epochs, callbacks=[callback])
        trainer.fit(module, ckpt_path=ckpt)
        return module, callback, trainer

    whole, whole_cb, _ = fit(2)
    _, _, first = fit(1)
    ckpt = tmp_path / "epoch1.ckpt"
    first.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)
    assert state[CHECKPOINT_KEY]["steps"] == STEPS
    resumed, resumed_cb, _ = fit(2, ckpt)
    assert resumed_cb.preconditioner.steps == whole_cb.preconditioner.steps == 2 * STEPS
    plain.assert_weights(resumed.state_dict(), whole.state_dict(), TOL64)
    _assert_same_state(resumed_cb.preconditioner.state_dict(), whole_cb.preconditioner.state_dict())

    # Teeth: the same checkpoint without kaisa's state resumes with fresh
    # factors (and says so), and ends elsewhere.
    del state[CHECKPOINT_KEY]
    bare = tmp_path / "bare.ckpt"
    torch.save(state, bare)
    with pytest.warns(RuntimeWarning, match="no preconditioner state"):
        fresh, _, _ = fit(2, bare)
    assert plain.moved(fresh.state_dict(), whole.state_dict()) > 1e4 * TOL64


# -- two processes ---------------------------------------------------------------------
def _ddp_case(rank: int, world_size: int, root: str) -> dict[int, Any]:
    results = {}
    for accumulation in (1, 2):
        batches = plain.batches(rank, STEPS * accumulation, torch.float64)
        want, clipped = _plain(batches, accumulation)
        got, callback, trainer = _fit(batches, Path(root) / f"r{rank}a{accumulation}", accumulation)
        results[accumulation] = {
            "want": want,
            "got": got,
            "clipped": (clipped, callback.preconditioner.telemetry.kl_clipped_steps),
            "steps": callback.preconditioner.steps,
            "world": (callback.preconditioner.world_size, trainer.world_size),
            "strategy": type(trainer.strategy).__name__,
        }
    return results


@pytest.mark.timeout(100)
def test_two_processes_ddp_equals_plain_ddp_loop(tmp_path: Path) -> None:
    """Trainer(strategy='ddp') on 2 gloo ranks, each its own data; with and without accumulation."""
    ranks = run_distributed(_ddp_case, 2, str(tmp_path), timeout=90)
    for accumulation in (1, 2):
        per_rank = [r[accumulation] for r in ranks]
        for result in per_rank:
            assert result["strategy"] == "DDPStrategy"
            assert result["world"] == (2, 2)
            assert result["steps"] == STEPS
            want_clipped, got_clipped = result["clipped"]
            assert got_clipped == want_clipped > 0
            plain.assert_weights(result["got"], result["want"], TOL64)
        # DDP keeps the ranks' weights identical; the data differed per rank.
        plain.assert_weights(per_rank[1]["got"], per_rank[0]["got"], 0.0)
    # Teeth: one process on rank 0's data alone ends elsewhere.
    alone, _ = _plain(plain.batches(0, STEPS, torch.float64), 1)
    assert plain.moved(alone, ranks[0][1]["want"]) > 1e4 * TOL64


# -- errors and packaging --------------------------------------------------------------
@pytest.mark.timeout(60)
def test_conflicting_accumulation_steps_are_refused(tmp_path: Path) -> None:
    module = Module(plain.batches(0, 4, torch.float64), torch.float64)
    trainer = _trainer(tmp_path, 2, callbacks=[KFACCallback(accumulation_steps=3)])
    with pytest.raises(
        ValueError,
        match=r"KFACCallback\(accumulation_steps=3\) conflicts with "
        r"Trainer\(accumulate_grad_batches=2\)",
    ):
        trainer.fit(module)
    given = kaisa.KFACPreconditioner(module, lr=0.1, accumulation_steps=1)
    trainer = _trainer(tmp_path, 2, callbacks=[KFACCallback(given)])
    with pytest.raises(
        ValueError,
        match=r"accumulation_steps=1 conflicts with Trainer\(accumulate_grad_batches=2\)",
    ):
        trainer.fit(module)
    with pytest.raises(ValueError, match="not both"):
        KFACCallback(given, kl_clip=None)


@pytest.mark.timeout(60)
def test_given_preconditioner_is_used(tmp_path: Path) -> None:
    batches = plain.batches(0, STEPS, torch.float64)
    module = Module(batches, torch.float64)
    given = kaisa.KFACPreconditioner(
        module, lr=lambda step: module.trainer.optimizers[0].param_groups[0]["lr"], **OPTIONS
    )
    callback = KFACCallback(given)
    _trainer(tmp_path, callbacks=[callback]).fit(module)
    assert callback.preconditioner is given and given.steps == STEPS
    want, _ = _plain(batches, 1)
    plain.assert_weights(module.net.state_dict(), want, TOL64)


def test_missing_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, "kaisa.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'kaisa\[lightning\]'"):
        importlib.import_module("kaisa.integrations.lightning")


def test_kaisa_integrations_imports_no_framework() -> None:
    code = (
        "import sys, kaisa, kaisa.integrations\n"
        "frameworks = ('lightning', 'pytorch_lightning', 'accelerate', 'deepspeed')\n"
        "loaded = [m for m in frameworks if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_sharded_strategy_is_refused_naming_it_and_the_alternative() -> None:
    from types import SimpleNamespace

    class ShardedStrategy:  # neither single-device nor DDP
        pass

    trainer = SimpleNamespace(strategy=ShardedStrategy())
    with pytest.raises(ValueError, match="ShardedStrategy") as caught:
        KFACCallback._check_strategy(trainer)  # type: ignore[arg-type]
    assert "docs/deepspeed-fsdp.md" in str(caught.value)
