"""DeepSpeed: kaisa on an engine with the same lines as under DDP, ZeRO stages 0, 1, 2.

``KFACPreconditioner(engine)``; ``engine.backward(loss); preconditioner.step();
engine.step()``. Two gloo processes on CPU (``DS_ACCELERATOR=cpu``), each
rank with its own batches, a model with an ``nn.Embedding``, an
``nn.MultiheadAttention`` (three blocks writing rows of one packed weight)
and two ``nn.Linear``; exact curvature, absolute damping and KL clipping that
binds, so that a wrong scale anywhere shows. Checked:

* ZeRO-1 and ZeRO-2 give ZeRO-0's weights (which read ``.grad``) to
  ``TOL32`` (measured: bit for bit) and its KL clipping factors; every rank
  holds the same weights; kaisa changed the update (the run without it is
  0.72 away, relative); each registered parameter's full gradient is
  gathered once and written back once per step;
* ``gradient_accumulation_steps=2``: kaisa steps once per optimizer step and
  follows the engine's count; stages 0, 1, 2 with two micro-batches of 4 give
  the weights of one batch of 8 per rank (the same mean loss and the same
  factor rows) to ``TOL32`` (measured: 6e-8);
* a loss scale: ZeRO-1 with a static loss scale of 2**10 gives the weights of
  ZeRO-1 without one bit for bit (the captured output gradients are unscaled
  and KL clipping computed as on unscaled gradients; a power of two scales
  exactly); reading the scale as 1 instead moves the update by 100%
  (checked, so the comparison can fail);
* fp16 ZeRO-1 (dynamic loss scale 2**12; DeepSpeed refuses fp16 on CPU
  unless told the device supports it, which the test does) stays within
  ``TOL_FP16`` of fp32 ZeRO-1 in the update and in the KL clipping factor
  (measured: 1.5e-3);
* bf16 ZeRO-1 with fp32 gradient accumulation (DeepSpeed's BF16 optimizer,
  whose step reads a buffer ``safe_set_full_grad`` misses) stays within
  ``TOL_BF16`` of fp32 (measured: 1.2e-2; the raw update is 0.73 away);
* refusals at construction: ZeRO-3, ``engine.module`` of a ZeRO-1 engine,
  ``managed_gradient_accumulation=false``, a pipeline engine, an
  ``accumulation_steps`` or ``grad_scaler`` the engine contradicts;
* the no-gradient warning of ``step()`` (once, at the caller's line): a
  preconditioner built before ``deepspeed.initialize`` (ZeRO-1 leaves
  ``.grad`` None), and a plain model after ``zero_grad()``;
* the ``deepspeed`` launcher on CPU (``--num_gpus 2`` starts two CPU
  processes) runs a script with kaisa on ZeRO-2 that reproduces ZeRO-0.

DeepSpeed compiles a small shared-memory op the first time it starts on CPU
(about 30 s, cached in ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_distributed

#: float32 runs that compute the same quantities through different buffers
#: (ZeRO's flat fp32 partitions, all-reduced full gradients).
TOL32 = 2e-6
#: fp16 against fp32: relative distance of the weight updates and of ν.
TOL_FP16 = 1e-2
#: bf16 weights (8-bit mantissa) against fp32: relative distance of the updates.
TOL_BF16 = 5e-2
TIMEOUT = 240.0
STEPS = 3
LR = 0.1
KAISA = {
    "lr": LR,
    "curvature": "exact",
    "factor_update_steps": 1,
    "inv_update_steps": 1,
    "damping": 1e-3,
    "damping_mode": "absolute",
    "kl_clip": 1e-3,
}
HERE = Path(__file__).resolve().parent


def _net() -> torch.nn.Module:
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.fc = nn.Linear(8, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            h = h + self.attn(h, h, h, need_weights=False)[0]
            return self.head(torch.tanh(self.fc(h)).mean(dim=1))

    torch.manual_seed(0)
    return Net()


def _batch(rank: int, step: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randint(0, 11, (size, 5), generator=g), torch.randint(0, 3, (size,), generator=g)


def _setup(rank: int, world_size: int) -> Any:
    """DeepSpeed on the harness's gloo group (it adopts an initialised group)."""
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _engine(ds: Any, stage: int, *, gas: int = 1, micro: int = 4, **extra: Any) -> Any:
    return _engine_for(ds, _net(), stage, gas=gas, micro=micro, **extra)


def _engine_for(
    ds: Any, model: torch.nn.Module, stage: int, *, gas: int = 1, micro: int = 4, **extra: Any
) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        **extra,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = ds.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _weights(engine: Any) -> list[torch.Tensor]:
    """The fp32 weights (ZeRO's master copy where there is one)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p)
        out.append((full if full is not None else p.detach()).float().clone())
    return out


def _train(
    ds: Any,
    rank: int,
    stage: int,
    *,
    gas: int = 1,
    micro: int = 4,
    merge: int = 1,
    kaisa_on: bool = True,
    loss_scale: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """STEPS optimizer steps; ``merge`` > 1 feeds ``merge`` micro-batches as one batch."""
    import torch.nn.functional as F

    import kaisa

    engine = _engine(ds, stage, gas=gas, micro=micro * merge, **extra)
    if loss_scale is not None:
        engine.optimizer.loss_scale = loss_scale  # a static scale on a ZeRO optimizer
    pre = kaisa.KFACPreconditioner(engine, **KAISA) if kaisa_on else None
    before = _weights(engine)
    scales = []
    half = next(engine.module.parameters()).dtype == torch.float16
    for step in range(STEPS):
        for m in range(gas):
            parts = [_batch(rank, step, m * merge + k, micro) for k in range(merge)]
            ids = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            out = engine(ids)
            loss = F.cross_entropy(out.float() if half else out, y)
            engine.backward(loss)
            if pre is not None:
                pre.step()
                if engine.is_gradient_accumulation_boundary():
                    scales.append(pre.telemetry.last_kl_scale)
            engine.step()
    after = _weights(engine)
    return {
        "update": [a - b for a, b in zip(after, before, strict=True)],
        "weights": after,
        "steps": None if pre is None else pre.steps,
        "accumulation": None if pre is None else pre.options.accumulation_steps,
        "kl_scales": scales,
        "clipped": None if pre is None else pre.telemetry.kl_clipped_steps,
    }


def _zero_case(rank: int, world_size: int) -> dict[str, Any]:
    ds = _setup(rank, world_size)
    results: dict[str, Any] = {}
    from kaisa.engines.deepspeed import DeepSpeedGradAccess

    # Count the full-gradient gathers (all-reduces at stages 1, 2) and write-backs.
    calls = {"gather": 0, "scatter": 0}
    originals = {name: getattr(DeepSpeedGradAccess, name) for name in calls}

    def counted(name: str) -> Any:
        def call(self: Any, *args: Any) -> Any:
            calls[name] += 1
            return originals[name](self, *args)

        return call

    for stage in (0, 1, 2):
        for name in calls:
            setattr(DeepSpeedGradAccess, name, counted(name))
        try:
            results[f"z{stage}"] = _train(ds, rank, stage)
        finally:
            for name, original in originals.items():
                setattr(DeepSpeedGradAccess, name, original)
        results[f"z{stage}"]["calls"] = dict(calls)
        calls.update(gather=0, scatter=0)
        results[f"z{stage}-gas2"] = _train(ds, rank, stage, gas=2)
    results["z0-merged"] = _train(ds, rank, 0, merge=2)
    results["z1-raw"] = _train(ds, rank, 1, kaisa_on=False)
    results["z1-scaled"] = _train(ds, rank, 1, loss_scale=2.0**10)
    # The same with the scale read as 1: the comparison above must be able to fail.
    real = DeepSpeedGradAccess.loss_scale
    DeepSpeedGradAccess.loss_scale = lambda self: 1.0  # type: ignore[method-assign]
    try:
        results["z1-scaled-ignored"] = _train(ds, rank, 1, loss_scale=2.0**10)
    finally:
        DeepSpeedGradAccess.loss_scale = real  # type: ignore[method-assign]
    # bf16 weights, fp32 gradient accumulation: DeepSpeed's BF16 optimizer.
    bf16 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    results["z1-bf16"] = _train(ds, rank, 1, **bf16)
    results["z1-bf16-raw"] = _train(ds, rank, 1, kaisa_on=False, **bf16)
    # fp16: DeepSpeed's CPU accelerator says it has no fp16; torch's CPU kernels do.
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True
    results["z1-fp16"] = _train(
        ds, rank, 1, fp16={"enabled": True, "initial_scale_power": 12, "loss_scale_window": 100}
    )
    return results


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest entry of a − b over all parameters."""
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over all parameters."""
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(y.pow(2).sum()) for y in b)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def zero_runs() -> list[dict[str, Any]]:
    return run_distributed(_zero_case, 2, timeout=TIMEOUT)


def test_ranks_agree(zero_runs: list[dict[str, Any]]) -> None:
    first, second = zero_runs
    for name, result in first.items():
        assert _distance(result["weights"], second[name]["weights"]) == 0.0, name


def test_zero_stages_give_zero0_weights(zero_runs: list[dict[str, Any]]) -> None:
    for run in zero_runs:
        want = run["z0"]
        assert want["steps"] == STEPS and want["accumulation"] == 1
        assert want["clipped"] > 0  # KL clipping binds: its scale is part of the check
        for stage in (1, 2):
            got = run[f"z{stage}"]
            assert _distance(got["weights"], want["weights"]) <= TOL32, stage
            assert got["kl_scales"] == pytest.approx(want["kl_scales"], rel=1e-5)
        # Each registered parameter's full gradient gathered once per step (the
        # finiteness check and the three attention blocks share the gather) and
        # written back once (the blocks' rows of in_proj_weight together).
        for stage in (0, 1, 2):
            assert run[f"z{stage}"]["calls"] == {"gather": 9 * STEPS, "scatter": 9 * STEPS}
        # kaisa changed the update: ZeRO-1 without it is far away.
        assert _relative(run["z1-raw"]["update"], want["update"]) > 0.1


def test_accumulation_follows_the_engine(zero_runs: list[dict[str, Any]]) -> None:
    for run in zero_runs:
        want = run["z0-merged"]  # one batch of 8 per rank and step
        for stage in (0, 1, 2):
            got = run[f"z{stage}-gas2"]  # two micro-batches of 4
            assert got["steps"] == STEPS and got["accumulation"] == 2
            assert len(got["kl_scales"]) == STEPS
            assert _distance(got["weights"], want["weights"]) <= TOL32, stage


def test_loss_scale_is_taken_out(zero_runs: list[dict[str, Any]]) -> None:
    for run in zero_runs:
        want = run["z1"]
        scaled = run["z1-scaled"]
        assert _distance(scaled["weights"], want["weights"]) == 0.0
        assert scaled["kl_scales"] == want["kl_scales"]
        ignored = run["z1-scaled-ignored"]
        assert _relative(ignored["update"], want["update"]) > 0.1


def test_fp16_zero1_is_close_to_fp32(zero_runs: list[dict[str, Any]]) -> None:
    for run in zero_runs:
        want, got = run["z1"], run["z1-fp16"]
        assert got["steps"] == STEPS
        assert _relative(got["update"], want["update"]) <= TOL_FP16
        for nu16, nu32 in zip(got["kl_scales"], want["kl_scales"], strict=True):
            assert nu32 < 1.0
            assert abs(nu16 - nu32) <= TOL_FP16 * nu32


def test_bf16_optimizer_takes_the_preconditioned_gradient(zero_runs: list[dict[str, Any]]) -> None:
    """bf16 ZeRO-1 with fp32 accumulation (DeepSpeed's BF16 optimizer): close to fp32.

    Its step reads an fp32 buffer that ``safe_set_full_grad`` does not write:
    a write that went astray would leave the raw update (far away).
    """
    for run in zero_runs:
        want, got = run["z1"], run["z1-bf16"]
        assert _relative(got["update"], want["update"]) <= TOL_BF16
        assert got["kl_scales"] == pytest.approx(want["kl_scales"], rel=TOL_BF16)
        assert _relative(run["z1-bf16-raw"]["update"], want["update"]) > 0.1


# -- refusals ----------------------------------------------------------------------------
def _refusal_case(rank: int, world_size: int) -> dict[str, str]:
    import kaisa

    ds = _setup(rank, world_size)
    messages: dict[str, str] = {}

    def refused(name: str, build: Any) -> None:
        try:
            build()
        except ValueError as error:
            messages[name] = str(error)
        else:
            messages[name] = "accepted"

    z3 = _engine(ds, 3)
    refused("zero3", lambda: kaisa.KFACPreconditioner(z3, lr=0.1))
    unmanaged = _engine(ds, 1, managed_gradient_accumulation=False)
    refused("unmanaged", lambda: kaisa.KFACPreconditioner(unmanaged, lr=0.1))
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    stages = PipelineModule(
        layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)],
        num_stages=1,
        loss_fn=torch.nn.CrossEntropyLoss(),
    )
    pipeline = _engine_for(ds, stages, 0)
    refused("pipeline", lambda: kaisa.KFACPreconditioner(pipeline, lr=0.1))
    z1 = _engine(ds, 1, gas=2)
    refused("module", lambda: kaisa.KFACPreconditioner(z1.module, lr=0.1))
    refused("accumulation", lambda: kaisa.KFACPreconditioner(z1, lr=0.1, accumulation_steps=3))
    refused("scaler", lambda: kaisa.KFACPreconditioner(z1, lr=0.1, grad_scaler=lambda: 1.0))
    same = kaisa.KFACPreconditioner(z1, lr=0.1, accumulation_steps=2)
    messages["same"] = str(same.options.accumulation_steps)
    # Built before deepspeed.initialize: kaisa sees a plain model whose .grad ZeRO-1
    # leaves None; step() says so (once).
    import torch.nn.functional as F

    model = _net()
    early = kaisa.KFACPreconditioner(model, **KAISA)
    engine = _engine_for(ds, model, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            ids, y = _batch(rank, step, 0, 4)
            engine.backward(F.cross_entropy(engine(ids), y))
            early.step()
            engine.step()
    found = [w for w in caught if "found no gradient" in str(w.message)]
    messages["guard"] = json.dumps(
        [[w.category.__name__, w.filename, w.lineno, str(w.message)] for w in found]
    )
    return messages


def test_refusals_name_the_problem() -> None:
    (messages,) = run_distributed(_refusal_case, 1, timeout=TIMEOUT)
    assert "ZeRO stage 3" in messages["zero3"]
    assert "ZeRO stage 1 or 2" in messages["zero3"] and "fully_shard" in messages["zero3"]
    assert "not engine.module" in messages["module"]
    assert "managed_gradient_accumulation=false" in messages["unmanaged"]
    assert "PipelineEngine" in messages["pipeline"] and "train_batch" in messages["pipeline"]
    assert "accumulation_steps=3" in messages["accumulation"]
    assert "gradient_accumulation_steps=2" in messages["accumulation"]
    assert "grad_scaler" in messages["scaler"] and "loss scale" in messages["scaler"]
    assert messages["same"] == "2"
    (guard,) = json.loads(messages["guard"])  # once, though both steps found nothing
    category, filename, _, text = guard
    assert category == "RuntimeWarning" and filename == __file__
    assert "ZeRO" in text and "zero_grad" in text


def test_no_gradient_warns_once_at_the_callers_line() -> None:
    """A plain model, step() after zero_grad(): one RuntimeWarning pointing here."""
    import torch.nn.functional as F

    import kaisa

    model = _net()
    pre = kaisa.KFACPreconditioner(model, **KAISA)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            ids, y = _batch(0, step, 0, 4)
            F.cross_entropy(model(ids), y).backward()
            optimizer.zero_grad()  # too early: step() finds no gradient
            lines.append(sys._getframe().f_lineno + 1)
            pre.step()
    found = [w for w in caught if "found no gradient" in str(w.message)]
    assert len(found) == 1
    (warning,) = found
    assert warning.category is RuntimeWarning
    assert (warning.filename, warning.lineno) == (__file__, lines[0])
    text = str(warning.message)
    assert "DeepSpeed ZeRO" in text and "hides .grad" in text and "zero_grad" in text
    # The gradients were left alone (there were none) and nothing else broke.
    assert all(p.grad is None for p in model.parameters())


# -- the deepspeed launcher ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_deepspeed_launcher_on_cpu(tmp_path: Path) -> None:
    """``deepspeed --num_gpus 2 script`` on CPU: two processes, ZeRO-2 equal to ZeRO-0."""
    launcher = Path(sys.executable).with_name("deepspeed")
    out = tmp_path / "result.json"
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        str(launcher),
        "--num_gpus",
        "2",
        "--num_nodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(HERE / "deepspeed_launch_script.py"),
        "--out",
        str(out),
    ]
    start = time.monotonic()
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT
    )
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    result = json.loads(out.read_text())
    assert result["world_size"] == 2, tail
    assert result["steps"] == STEPS
    assert result["max_difference"] <= TOL32
    assert result["clipped"] > 0
    assert time.monotonic() - start < TIMEOUT


def _dp_group_default(rank: int, world_size: int) -> list[bool]:
    """The engine's data-parallel group becomes kaisa's unless one is given."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from kaisa.engines.deepspeed import DeepSpeedGradAccess

    own = [dist.new_group([r]) for r in range(world_size)][rank]  # model parallel: dp of 1
    whole = dist.new_group(list(range(world_size)))
    given = dist.new_group(list(range(world_size)))

    def chosen(group: object, user: object) -> object:
        fake = SimpleNamespace(engine=SimpleNamespace(data_parallel_group=group))
        return DeepSpeedGradAccess.process_group(fake, user)  # type: ignore[arg-type]

    return [
        chosen(own, None) is own,  # a smaller group: planned over
        chosen(whole, None) is None,  # the whole world: kaisa's default
        chosen(None, None) is None,
        chosen(own, given) is given,  # the user's wins
    ]


@pytest.mark.timeout(120)
def test_the_engines_data_parallel_group_is_the_default_process_group() -> None:
    for checks in run_distributed(_dp_group_default, 2, timeout=90):
        assert checks == [True, True, True, True]
