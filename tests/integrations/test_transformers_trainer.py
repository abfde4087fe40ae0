"""kaisa.integrations.transformers: KFACCallback in Trainer against the plain loop.

The reference is tests/integrations/plain_loop.py: the model (in DDP with
several ranks), ``KFACPreconditioner`` with KL clipping on and ``lr`` read
from the optimizer, SGD with momentum and a learning rate halved every two
steps (the trainer is given the same optimizer and scheduler); with
accumulation each micro-batch loss is divided by the passes (as Trainer
does). Trainer reads the batches in order (the test's trainer returns a
plain DataLoader: no shuffling, no sharding; each rank its own batches).
float64 runs must agree to 1e-10 (the same operations in the same order);
bf16 autocast runs to 1e-6. Multi-process runs use the gloo harness of
``tests/distributed``; the trainer runs inside its processes on their group.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from kaisa.integrations.transformers import STATE_FILE, KFACCallback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import plain_loop as plain  # noqa: E402
from harness import run_distributed  # noqa: E402
from plain_loop import OPTIONS, STEPS, TOL32, TOL64, Batches  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]


class Classifier(nn.Module):
    """plain_loop's network, returning its loss as a HuggingFace model does."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.net = plain.net(dtype)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.net(x), labels)}


class InOrderTrainer(transformers.Trainer):  # type: ignore[misc]
    """Trainer reading this process's batches in order, one per micro-step."""

    def get_train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_dataset, batch_size=None)


def trainer_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool) -> torch.Tensor:
    """Trainer's bf16: the forward (with its loss) under CPU autocast."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with autocast if amp else contextlib.nullcontext():
        loss = F.cross_entropy(model(x), y)
    return loss.float() if amp else loss


def _train(
    batches: Batches,
    root: Path,
    accumulation: int = 1,
    dtype: torch.dtype = torch.float64,
    *,
    epochs: int = 1,
    resume: Path | None = None,
    callback: KFACCallback | None = None,
    **args: Any,
) -> tuple[Classifier, KFACCallback, Any]:
    model = Classifier(dtype)
    optimizer, schedule = plain.optimizer_and_schedule(model.parameters())
    callback = callback if callback is not None else KFACCallback(**OPTIONS)
    settings: dict[str, Any] = dict(
        output_dir=str(root),
        use_cpu=True,
        num_train_epochs=epochs,
        gradient_accumulation_steps=accumulation,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        max_grad_norm=0.0,
        seed=plain.SEED,
    )
    settings.update(args)
    trainer = InOrderTrainer(
        model=model,
        args=transformers.TrainingArguments(**settings),
        train_dataset=[{"x": x, "labels": y} for x, y in batches],
        optimizers=(optimizer, schedule),
        callbacks=[callback],
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return model, callback, trainer


def _weights(model: Classifier) -> dict[str, torch.Tensor]:
    return plain.weights(model.net)


def _plain(data: Batches, accumulation: int, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    return plain.reference(data, accumulation, trainer_loss, *args, **kwargs)


# -- one process -----------------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_single_process_equals_plain_loop(tmp_path: Path, accumulation: int) -> None:
    batches = plain.batches(0, STEPS * accumulation, torch.float64)
    want, clipped = _plain(batches, accumulation)
    model, callback, trainer = _train(batches, tmp_path, accumulation)
    pre = callback.preconditioner
    assert pre.steps == STEPS and trainer.state.global_step == STEPS
    assert pre.options.accumulation_steps == accumulation
    assert pre.telemetry.kl_clipped_steps == clipped > 0
    plain.assert_weights(_weights(model), want, TOL64)
    # Teeth: without K-FAC the weights end far away.
    raw, _ = _plain(batches, accumulation, kfac=False)
    assert plain.moved(raw, want) > 1e4 * TOL64
    # kaisa's telemetry is in Trainer's logs, next to Trainer's own.
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == STEPS
    assert steps[-1]["kaisa/kl_clipped_steps"] == clipped
    assert all(
        {"kaisa/kl_scale", "kaisa/grad_norm", "grad_norm"} <= entry.keys() for entry in steps
    )


@pytest.mark.timeout(90)
def test_clipping_comes_after_preconditioning(tmp_path: Path) -> None:
    batches = plain.batches(0, STEPS, torch.float64)
    unclipped, _ = _plain(batches, 1)
    want, _ = _plain(batches, 1, clip=0.05)
    assert plain.moved(unclipped, want) > 1e4 * TOL64  # the bound does clip
    model, callback, trainer = _train(batches, tmp_path, max_grad_norm=0.05)
    plain.assert_weights(_weights(model), want, TOL64)
    assert callback.max_grad_norm == 0.05
    assert trainer.args.max_grad_norm == 0.05  # given back when training ended
    logged = [entry["kaisa/grad_norm"] for entry in trainer.state.log_history if "loss" in entry]
    assert max(logged) > 0.05  # the norm before clipping


@pytest.mark.timeout(90)
def test_bf16_autocast_equals_plain_loop(tmp_path: Path) -> None:
    batches = plain.batches(0, STEPS, torch.float32)
    want, clipped = _plain(batches, 1, torch.float32, amp=True)
    model, callback, _ = _train(batches, tmp_path, dtype=torch.float32, bf16=True)
    assert callback.preconditioner.telemetry.kl_clipped_steps == clipped > 0
    plain.assert_weights(_weights(model), want, TOL32)
    # Teeth: the float32 run without autocast ends elsewhere.
    full, _ = _plain(batches, 1, torch.float32)
    assert plain.moved(full, want) > 1e2 * TOL32


@pytest.mark.timeout(120)
def test_resume_from_a_trainer_checkpoint_equals_uninterrupted(tmp_path: Path) -> None:
    """Two epochs in one run == one epoch, its checkpoint, and a resumed run to two."""
    batches = plain.batches(0, STEPS, torch.float64)
    options = {**OPTIONS, "inv_update_steps": 3}  # the resume lands between inverse updates
    whole, whole_cb, _ = _train(
        batches, tmp_path / "whole", epochs=2, callback=KFACCallback(**options)
    )
    _train(
        batches, tmp_path / "first", epochs=1, callback=KFACCallback(**options),
        save_strategy="epoch",
    )  # fmt: skip
    checkpoint = tmp_path / "first" / f"checkpoint-{STEPS}"
    assert (checkpoint / STATE_FILE).is_file()
    resumed, resumed_cb, _ = _train(
        batches, tmp_path / "first", epochs=2, callback=KFACCallback(**options), resume=checkpoint
    )
    assert resumed_cb.preconditioner.steps == whole_cb.preconditioner.steps == 2 * STEPS
    plain.assert_weights(_weights(resumed), _weights(whole), TOL64)
    # Teeth: the same checkpoint without kaisa's state resumes afresh (and says so).
    (checkpoint / STATE_FILE).unlink()
    with pytest.warns(RuntimeWarning, match="K-FAC starts afresh"):
        fresh, _, _ = _train(
            batches, tmp_path / "first", epochs=2, callback=KFACCallback(**options),
            resume=checkpoint,
        )  # fmt: skip
    assert plain.moved(_weights(fresh), _weights(whole)) > 1e4 * TOL64


# -- two processes ---------------------------------------------------------------------
def _ddp_case(rank: int, world_size: int, root: str) -> dict[int, Any]:
    # accelerate (inside Trainer) reads the launcher's variables; the group exists.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # unused: the process group is up
        OMP_NUM_THREADS="1",
    )
    results = {}
    for accumulation in (1, 2):
        batches = plain.batches(rank, STEPS * accumulation, torch.float64)
        want, clipped = _plain(batches, accumulation)
        model, callback, trainer = _train(batches, Path(root) / f"a{accumulation}", accumulation)
        pre = callback.preconditioner
        results[accumulation] = {
            "want": want,
            "got": _weights(model),
            "clipped": (clipped, pre.telemetry.kl_clipped_steps),
            "steps": pre.steps,
            "world": (pre.world_size, trainer.args.world_size),
        }
    return results


@pytest.mark.timeout(150)
def test_two_processes_ddp_equals_plain_ddp_loop(tmp_path: Path) -> None:
    """Trainer(use_cpu=True) on 2 gloo ranks, each its own data; with and without accumulation."""
    ranks = run_distributed(_ddp_case, 2, str(tmp_path), timeout=140)
    for accumulation in (1, 2):
        per_rank = [r[accumulation] for r in ranks]
        for result in per_rank:
            assert result["world"] == (2, 2)
            assert result["steps"] == STEPS
            want_clipped, got_clipped = result["clipped"]
            assert got_clipped == want_clipped > 0
            plain.assert_weights(result["got"], result["want"], TOL64)
        plain.assert_weights(per_rank[1]["got"], per_rank[0]["got"], 0.0)
    # Teeth: one process on rank 0's data alone ends elsewhere.
    alone, _ = _plain(plain.batches(0, STEPS, torch.float64), 1)
    assert plain.moved(alone, ranks[0][1]["want"]) > 1e4 * TOL64


# -- errors and packaging --------------------------------------------------------------
@pytest.mark.timeout(60)
def test_conflicting_accumulation_and_sharded_trainers_are_refused(tmp_path: Path) -> None:
    batches = plain.batches(0, 4, torch.float64)
    with pytest.raises(
        ValueError,
        match=r"KFACCallback\(accumulation_steps=3\) conflicts with "
        r"TrainingArguments\(gradient_accumulation_steps=2\)",
    ):
        _train(batches, tmp_path, 2, callback=KFACCallback(accumulation_steps=3, lr=0.1))
    with pytest.raises(ValueError, match="not both"):
        KFACCallback(object(), kl_clip=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be a kaisa\.KFACPreconditioner"):
        KFACCallback(object())  # type: ignore[arg-type]
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"fsdp.*docs/deepspeed-fsdp.md"):
        KFACCallback._check_args(SimpleNamespace(deepspeed=None, fsdp="full_shard"))  # type: ignore[arg-type]


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, "kaisa.integrations.transformers")
    with pytest.raises(ImportError, match=r"pip install 'kaisa\[transformers\]'"):
        importlib.import_module("kaisa.integrations.transformers")


def test_importing_kaisa_imports_no_transformers() -> None:
    code = "import sys, kaisa, kaisa.integrations\nassert 'transformers' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
