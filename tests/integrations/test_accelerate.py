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

import contextlib
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
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kaisa
from kaisa.integrations.accelerate import AcceleratedPreconditioner, prepare_preconditioner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_distributed

SEED = 7
LR = 0.2
STEPS = 4  # optimizer steps per run
BATCH = 8
#: Exact Kronecker blocks, inverses every other step, KL clipping on
#: (kl_clipped_steps > 0 is checked).
OPTIONS: dict[str, Any] = {
    "curvature": "exact",
    "factor_update_steps": 1,
    "inv_update_steps": 2,
    "kl_clip": 1e-3,
}
TOL64 = 1e-10
TOL32 = 1e-6

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _batches(rank: int, count: int, dtype: torch.dtype) -> Batches:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (
            torch.randn(BATCH, 8, generator=g, dtype=dtype),
            torch.randint(0, 4, (BATCH,), generator=g),
        )
        for _ in range(count)
    ]


def _optimizer(params: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _weights(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _reference(
    batches: Batches,
    accumulation: int,
    dtype: torch.dtype = torch.float64,
    *,
    kfac: bool = True,
    amp: bool = False,
    unscale_first: bool = True,
) -> tuple[dict[str, torch.Tensor], int]:
    """The plain loop: weights after it and the number of KL-clipped steps."""
    net = _net(dtype)
    model: nn.Module = DistributedDataParallel(net) if dist.is_initialized() else net
    optimizer, schedule = _optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if amp else None
    pre = (
        kaisa.KFACPreconditioner(
            model,
            lr=lambda step: optimizer.param_groups[0]["lr"],
            accumulation_steps=accumulation,
            grad_scaler=scaler,
            **OPTIONS,
        )
        if kfac
        else None
    )
    for start in range(0, len(batches), accumulation):
        optimizer.zero_grad()
        for i, (x, y) in enumerate(batches[start : start + accumulation]):
            last = i == accumulation - 1
            sync = (
                model.no_sync() if isinstance(model, DistributedDataParallel) and not last else None
            )
            with sync or contextlib.nullcontext():
                # As accelerate's prepared model: the forward under autocast, its
                # outputs converted to float32, the loss outside.
                autocast = torch.autocast("cpu", dtype=torch.float16)
                with autocast if amp else contextlib.nullcontext():
                    out = model(x)
                loss = F.cross_entropy(out.float() if amp else out, y)
                loss = loss / accumulation
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None and unscale_first:
            scaler.unscale_(optimizer)
        if pre is not None:
            with warnings.catch_warnings():
                if not unscale_first:
                    warnings.simplefilter("ignore")  # kaisa: "call scaler.unscale_ first"
                pre.step()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        schedule.step()
    clipped = pre.telemetry.kl_clipped_steps if pre is not None else 0
    return _weights(net), clipped


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
    net = _net(dtype)
    optimizer, schedule = _optimizer(net.parameters())
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
    return _weights(net), preconditioner, accelerator


def _assert_weights(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float
) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=tol, rtol=0, msg=name)


def _moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# -- one process -----------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_single_process_equals_plain_loop(accumulation: int) -> None:
    batches = _batches(0, STEPS * accumulation, torch.float64)
    want, clipped = _reference(batches, accumulation)
    got, wrapper, accelerator = _run(batches, accumulation)
    pre = wrapper.preconditioner
    assert accelerator.num_processes == 1 and pre.world_size == 1
    assert pre.steps == STEPS  # once per optimizer step, not per pass
    assert pre.options.accumulation_steps == accumulation
    assert pre.telemetry.kl_clipped_steps == clipped > 0
    _assert_weights(got, want, TOL64)
    # Teeth: without K-FAC the weights end far away.
    plain, _ = _reference(batches, accumulation, kfac=False)
    assert _moved(plain, want) > 1e4 * TOL64


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clip_first", [False, True])
def test_fp16_unscales_once_before_preconditioning(clip_first: bool) -> None:
    """Under fp16 the wrapper unscales first, unless clip_grad_norm_ already did."""
    batches = _batches(0, STEPS, torch.float32)
    want, clipped = _reference(batches, 1, torch.float32, amp=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, wrapper, accelerator = _run(batches, 1, torch.float32, amp=True, clip_first=clip_first)
    assert wrapper.preconditioner.options.grad_scaler is accelerator.scaler
    assert not [w for w in caught if "unscale" in str(w.message)]
    assert wrapper.preconditioner.telemetry.kl_clipped_steps == clipped > 0
    assert accelerator.scaler is not None and accelerator.scaler.get_scale() > 1.0
    _assert_weights(got, want, TOL32)
    # Teeth: preconditioning the still-scaled gradients ends far away.
    scaled, _ = _reference(batches, 1, torch.float32, amp=True, unscale_first=False)
    assert _moved(scaled, want) > 1e3 * TOL32


@pytest.mark.timeout(60)
def test_register_for_checkpointing_resumes(tmp_path: Path) -> None:
    """save_state after two steps, load_state into a fresh run: the same as no interruption."""
    batches = _batches(0, STEPS, torch.float64)
    want, _ = _reference(batches, 1)

    def start() -> tuple[Accelerator, Any, Any, Any, AcceleratedPreconditioner]:
        accelerator = _fresh_accelerator()
        net = _net(torch.float64)
        optimizer, schedule = _optimizer(net.parameters())
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
    _assert_weights(_weights(second[1]), want, TOL64)


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
        batches = _batches(rank, STEPS * accumulation, torch.float64)
        want, clipped = _reference(batches, accumulation)
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
            _assert_weights(result["got"], result["want"], TOL64)
        # DDP keeps the ranks' weights identical; the data differed per rank.
        _assert_weights(per_rank[1]["got"], per_rank[0]["got"], 0.0)
    # Teeth: one process on rank 0's data alone ends elsewhere.
    alone, _ = _reference(_batches(0, STEPS, torch.float64), 1)
    assert _moved(alone, ranks[0][1]["want"]) > 1e4 * TOL64


# -- errors and packaging --------------------------------------------------------------
def test_conflicting_options_are_refused() -> None:
    accelerator = _fresh_accelerator(gradient_accumulation_steps=2)
    model = accelerator.prepare(_net(torch.float64))
    with pytest.raises(
        ValueError,
        match=r"prepare_preconditioner\(accumulation_steps=3\) conflicts with "
        r"accelerator.gradient_accumulation_steps=2",
    ):
        prepare_preconditioner(accelerator, model, accumulation_steps=3)
    pre = prepare_preconditioner(accelerator, model, accumulation_steps=2)
    assert pre.preconditioner.options.accumulation_steps == 2
    accelerator.scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"grad_scaler=\.\.\.\) is not accelerator.scaler"):
        prepare_preconditioner(accelerator, model, grad_scaler=torch.amp.GradScaler("cpu"))


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
