"""kaisa.integrations.accelerate: prepare_preconditioner against the plain loop.

The reference is the README's loop: the model (wrapped in DDP with several
ranks), ``KFACPreconditioner(model, lr=<the optimizer's lr>)``, SGD with
momentum and a step-wise learning-rate schedule; with accumulation each
micro-batch loss is divided by the number of passes (as
``accelerator.backward`` does) and the non-final passes run under
``no_sync`` (as ``accelerator.accumulate`` does). Everything is float64 and
the weights must agree to 1e-10 (the same operations in the same order). The
accelerate loop is the documented recipe: ``accelerator.accumulate``,
``accelerator.backward``, ``preconditioner.step()``, ``optimizer.step()``,
``optimizer.zero_grad()``, the schedule stepped when gradients synced.

accelerate builds a GradScaler for fp16 only on accelerators (GPUs and the
like); on CPU the fp16 test gives an fp16 ``Accelerator`` a CPU
``torch.amp.GradScaler`` before ``prepare`` (its ``scaler`` and
``native_amp`` attributes, as its constructor sets them on a GPU), so that
``prepare``, ``backward`` and the optimizer take their scaled paths; float32,
tolerance 1e-6.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from kaisa.integrations.accelerate import AcceleratedPreconditioner, prepare_preconditioner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import plain_loop as plain
from harness import run_distributed
from plain_loop import OPTIONS, STEPS, TOL32, TOL64, Batches


def _plain(
    data: Batches, accumulation: int, *args: Any, **kwargs: Any
) -> tuple[dict[str, torch.Tensor], int]:
    """The plain loop (tests/integrations/plain_loop.py), losses as this framework computes them."""
    return plain.reference(data, accumulation, plain.accelerate_loss, *args, **kwargs)


def _fresh_accelerator(**kwargs: Any) -> Accelerator:
    """A new Accelerator (accelerate keeps its state in process-wide singletons)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


@pytest.fixture(autouse=True)
def _reset_accelerate() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _run(
    batches: Batches,
    accumulation: int,
    dtype: torch.dtype = torch.float64,
    *,
    amp: bool = False,
    clip_first: bool = False,
) -> tuple[dict[str, torch.Tensor], AcceleratedPreconditioner, Accelerator]:
    """The documented accelerate loop with kaisa."""
    if amp:
        accelerator = _fresh_accelerator(
            mixed_precision="fp16", gradient_accumulation_steps=accumulation
        )
        # What accelerate's constructor does for fp16 on a GPU, with a CPU scaler.
        accelerator.scaler = torch.amp.GradScaler("cpu")
        accelerator.native_amp = True
    else:
        accelerator = _fresh_accelerator(gradient_accumulation_steps=accumulation)
    net = plain.net(dtype)
    optimizer, schedule = plain.optimizer_and_schedule(net.parameters())
    model, optimizer = accelerator.prepare(net, optimizer)
    preconditioner = prepare_preconditioner(accelerator, model, optimizer, **OPTIONS)
    for x, y in batches:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if clip_first and accelerator.sync_gradients:
                # Unscales under fp16; a bound this large leaves the gradients as they are.
                accelerator.clip_grad_norm_(model.parameters(), 1e9)
            preconditioner.step()
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                schedule.step()
    return plain.weights(net), preconditioner, accelerator


# -- one process -----------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_single_process_equals_plain_loop(accumulation: int) -> None:
    batches = plain.batches(0, STEPS * accumulation, torch.float64)
    want, clipped = _plain(batches, accumulation)
    got, wrapper, accelerator = _run(batches, accumulation)
    pre = wrapper.preconditioner
    assert accelerator.num_processes == 1 and pre.world_size == 1
    assert pre.steps == STEPS  # once per optimizer step, not per pass
    assert pre.options.accumulation_steps == accumulation
    assert pre.telemetry.kl_clipped_steps == clipped > 0
    plain.assert_weights(got, want, TOL64)
    # Teeth: without K-FAC the weights end far away.
    raw, _ = _plain(batches, accumulation, kfac=False)
    assert plain.moved(raw, want) > 1e4 * TOL64


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clip_first", [False, True])
def test_fp16_unscales_once_before_preconditioning(clip_first: bool) -> None:
    """Under fp16 the wrapper unscales first, unless clip_grad_norm_ already did."""
    batches = plain.batches(0, STEPS, torch.float32)
    want, clipped = _plain(batches, 1, torch.float32, amp=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, wrapper, accelerator = _run(batches, 1, torch.float32, amp=True, clip_first=clip_first)
    assert wrapper.preconditioner.options.grad_scaler is accelerator.scaler
    assert not [w for w in caught if "unscale" in str(w.message)]
    assert wrapper.preconditioner.telemetry.kl_clipped_steps == clipped > 0
    assert accelerator.scaler is not None and accelerator.scaler.get_scale() > 1.0
    plain.assert_weights(got, want, TOL32)
    # Teeth: preconditioning the still-scaled gradients ends far away.
    scaled, _ = _plain(batches, 1, torch.float32, amp=True, unscale_first=False)
    assert plain.moved(scaled, want) > 1e3 * TOL32


@pytest.mark.timeout(60)
def test_register_for_checkpointing_resumes(tmp_path: Path) -> None:
    """save_state after two steps, load_state into a fresh run: the same as no interruption."""
    batches = plain.batches(0, STEPS, torch.float64)
    want, _ = _plain(batches, 1)

    def start() -> tuple[Accelerator, Any, Any, Any, AcceleratedPreconditioner]:
        accelerator = _fresh_accelerator()
        net = plain.net(torch.float64)
        optimizer, schedule = plain.optimizer_and_schedule(net.parameters())
        model, optimizer = accelerator.prepare(net, optimizer)
        pre = prepare_preconditioner(accelerator, model, optimizer, **OPTIONS)
        accelerator.register_for_checkpointing(schedule, pre)
        return accelerator, model, optimizer, schedule, pre

    def train(
        accelerator: Accelerator, model: Any, optimizer: Any, schedule: Any, pre: Any, part: Batches
    ) -> None:
        for x, y in part:
            accelerator.backward(F.cross_entropy(model(x), y))
            pre.step()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()

    first = start()
    train(*first, batches[:2])
    first[0].save_state(str(tmp_path / "state"))
    second = start()
    second[0].load_state(str(tmp_path / "state"))
    assert second[4].preconditioner.steps == 2
    train(*second, batches[2:])
    plain.assert_weights(plain.weights(second[1]), want, TOL64)


# -- two processes ---------------------------------------------------------------------
def _ddp_case(rank: int, world_size: int) -> dict[int, Any]:
    # accelerate reads the launcher's variables; the harness's gloo group already exists.
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
        got, wrapper, accelerator = _run(batches, accumulation)
        pre = wrapper.preconditioner
        results[accumulation] = {
            "want": want,
            "got": got,
            "clipped": (clipped, pre.telemetry.kl_clipped_steps),
            "steps": pre.steps,
            "world": (pre.world_size, accelerator.num_processes),
            "distributed_type": str(accelerator.distributed_type),
        }
    return results


@pytest.mark.timeout(100)
def test_two_processes_equals_plain_ddp_loop() -> None:
    """Accelerator(cpu=True) on 2 gloo ranks, each its own data; with and without accumulation."""
    ranks = run_distributed(_ddp_case, 2, timeout=90)
    for accumulation in (1, 2):
        per_rank = [r[accumulation] for r in ranks]
        for result in per_rank:
            assert result["distributed_type"].endswith("MULTI_CPU")
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
def test_conflicting_options_are_refused() -> None:
    accelerator = _fresh_accelerator(gradient_accumulation_steps=2)
    model = accelerator.prepare(plain.net(torch.float64))
    with pytest.raises(
        ValueError,
        match=r"prepare_preconditioner\(accumulation_steps=3\) conflicts with "
        r"accelerator.gradient_accumulation_steps=2",
    ):
        prepare_preconditioner(accelerator, model, accumulation_steps=3, lr=0.1)
    pre = prepare_preconditioner(accelerator, model, accumulation_steps=2, lr=0.1)
    assert pre.preconditioner.options.accumulation_steps == 2
    accelerator.scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"grad_scaler=\.\.\.\) is not accelerator.scaler"):
        prepare_preconditioner(accelerator, model, grad_scaler=torch.amp.GradScaler("cpu"), lr=0.1)


def test_missing_accelerate_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "accelerate" or m.startswith("accelerate.")]:
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, "kaisa.integrations.accelerate")
    with pytest.raises(ImportError, match=r"pip install 'kaisa\[accelerate\]'"):
        importlib.import_module("kaisa.integrations.accelerate")


def test_kaisa_integrations_imports_no_framework() -> None:
    code = (
        "import sys, kaisa, kaisa.integrations\n"
        "frameworks = ('lightning', 'pytorch_lightning', 'accelerate', 'deepspeed')\n"
        "loaded = [m for m in frameworks if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_sharded_accelerate_setup_is_refused_naming_it_and_the_alternative() -> None:
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    fake = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(ValueError, match=r"DistributedType\.DEEPSPEED") as caught:
        prepare_preconditioner(fake, plain.net(torch.float64))  # type: ignore[arg-type]
    assert "docs/deepspeed-fsdp.md" in str(caught.value)
