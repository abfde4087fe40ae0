"""The chaos soak (issue 30, item 7): a training loop that misbehaves at random.

A small classifier (``Linear(16, 32)``, ``Tanh``, ``Linear(32, 32)`` under
non-reentrant gradient checkpointing, ``Tanh``, ``Linear(32, 4)``) learns a
noisy linear teacher's labels from a stream of fresh batches of 32 (the loss
is measured on 4096 held-out points) with SGD + momentum, a ``GradScaler``,
a 0-d tensor ``lr`` (divided by 5 after 70% of the steps, in place) and
exact K-FAC (factors every 5 steps, inverses every 20). At every step, with probability
``--rate``, the loop injects one fault drawn (seeded) from :data:`FAULTS`:
every fault of issue 30 and of the older fault table. The loop catches what
a real loop would catch (the injected exceptions, a ``KeyboardInterrupt``)
and goes on with the next batch, as users do.

Checked at the end (and asserted by ``tests/test_chaos_soak.py`` on a short
run): nothing wedges (every step after a fault completes; the last steps are
clean), nothing leaks (the model carries as many hooks as after
construction, one live preconditioner, no capture held between steps), the
ranks hold identical weights, and the final loss on the whole data set is
within 10% of a clean run's (the same loop and data without faults).

With ``--world-size 2`` two gloo ranks train data-parallel (gradients
averaged by hand, as DDP would); faults that a job must inject on every rank
alike (a skipped batch, an exception, a frozen layer, a checkpoint) are drawn
from a generator seeded alike, the others (evaluation mode, a 0-row or a NaN
batch, double backward, ``step()`` twice) on one rank only.

    python benchmarks/chaos_soak.py                    # 2000 steps, 1 and 2 ranks
    python benchmarks/chaos_soak.py --steps 300 --world-size 1

writes ``benchmarks/results/chaos_soak.json`` (``--json PATH`` elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import os
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import kaisa

#: Every fault the loop injects. ``(name, on every rank alike)``.
FAULTS: tuple[tuple[str, bool], ...] = (
    # exceptions at each point of an iteration, caught by the loop, batch skipped
    ("raise in forward", True),
    ("raise after forward", True),
    ("raise after backward", True),
    ("KeyboardInterrupt in backward", True),
    ("schedule raises in step()", True),
    ("raise after step()", True),
    # batches skipped on purpose
    ("skip after backward", True),
    ("skip after backward, discard_captures()", True),
    # passes that are not one forward and one backward
    ("forward without backward", False),
    ("two losses, retain_graph", False),
    ("gradient penalty (double backward)", False),
    ("autograd.grad on the input first", False),
    ("step() twice", True),
    # what reaches the layers
    ("eval mode", False),
    ("frozen layer", True),
    ("0-row batch", False),
    ("NaN batch", False),
    ("x1e6 batch", False),
    # the preconditioner itself
    ("checkpoint and rebuild", True),
)

#: Probability of a fault at a step (the soak's default).
DEFAULT_RATE = 0.3
#: The last steps of a run are clean (the loss is measured after them).
CLEAN_TAIL = 20


class Injected(RuntimeError):
    """A fault the soak raised on purpose."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.block, h, use_reentrant=False) if self.training else self.block(h)
        return self.out(h)


#: The teacher: labels are ``argmax(x @ TEACHER + 3 ε)`` (16 features, 4 classes).
TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))


def sample(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` fresh points of the noisy teacher (a stream: the loss settles at the noise's
    floor rather than falling for as long as the points can be memorised)."""
    x = torch.randn(n, 16, generator=gen)
    return x, (x @ TEACHER + 3.0 * torch.randn(n, 4, generator=gen)).argmax(1)


class _Run:
    """The model, optimizer, scaler and preconditioner of one run."""

    LR = 0.05

    def __init__(self, damping_fails: list[bool]) -> None:
        torch.manual_seed(1)
        self.model = Net()
        self.lr = torch.tensor(self.LR)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
        self.damping_fails = damping_fails
        self.pre = self.build()

    def damping(self, step: int) -> float:
        if self.damping_fails[0]:
            raise Injected(f"the damping schedule raised at step {step}")
        return 0.03

    def build(self) -> kaisa.KFACPreconditioner:
        # (Built with every layer trainable, as at the start, even while one is frozen.)
        frozen = [p for p in self.model.parameters() if not p.requires_grad]
        self.model.requires_grad_(True)
        try:
            return self._build()
        finally:
            for p in frozen:
                p.requires_grad_(False)

    def _build(self) -> kaisa.KFACPreconditioner:
        return kaisa.KFACPreconditioner(
            self.model,
            grad_scaler=self.scaler,
            lr=self.lr,
            damping=self.damping,
            curvature="exact",
            factor_update_steps=5,
            inv_update_steps=20,
        )


def _hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


def _live_preconditioners() -> int:
    gc.collect()
    return sum(isinstance(o, kaisa.KFACPreconditioner) for o in gc.get_objects())


def _average(model: nn.Module, world_size: int) -> None:
    """Data-parallel gradients, as DDP would average them (zeros where there is none)."""
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)


def soak(
    steps: int,
    *,
    faults: bool,
    seed: int = 0,
    rate: float = DEFAULT_RATE,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """Train ``steps`` steps, injecting faults when ``faults``; what the checks need.

    Returns the final loss on the whole data set, the faults injected (by
    name), the hooks on the model after construction and at the end, the
    live preconditioners at the end, the largest capture held between steps,
    the steps that completed (``preconditioner.steps``), the weights, and
    the wall time.
    """
    x_all, y_all = sample(4096, torch.Generator().manual_seed(1))  # held out
    damping_fails = [False]
    run = _Run(damping_fails)
    hooks_after_construction = _hooks(run.model)
    shared = torch.Generator().manual_seed(1000 + seed)  # alike on every rank
    own = torch.Generator().manual_seed(2000 + 7 * seed + rank)  # this rank's
    batches = torch.Generator().manual_seed(3000 + 11 * seed + rank)
    injected: Counter[str] = Counter()
    held_between_steps = 0
    frozen_until = -1
    start = time.perf_counter()
    for step in range(steps):
        model, opt, scaler = run.model, run.opt, run.scaler
        if step == int(0.7 * steps):
            run.lr.fill_(0.2 * run.LR)  # (in place, as a compiled optimizer's scheduler does)
        x, y = sample(32, batches)
        # One draw from each generator at every step, whatever happens.
        draw = float(torch.rand((), generator=shared))
        pick = int(torch.randint(0, len(FAULTS), (), generator=shared))
        mine = float(torch.rand((), generator=own)) < 0.5 or world_size == 1
        fault = None
        if faults and step < steps - CLEAN_TAIL and draw < rate:
            name, alike = FAULTS[pick]
            if alike or mine:
                fault = name
                injected[name] += 1
        if step == frozen_until:
            model.mid.requires_grad_(True)
        if fault == "frozen layer":
            model.mid.requires_grad_(False)  # for the next few steps
            frozen_until = step + 7
        model.train(fault != "eval mode")
        if fault == "0-row batch":
            x, y = x[:0], y[:0]
        if fault == "NaN batch":
            x[0, 0] = float("nan")
        if fault == "x1e6 batch":
            x = x * 1e6
        opt.zero_grad()
        unscaled = False
        try:
            if fault == "raise in forward":
                h = model.inp(x)
                raise Injected("in the forward pass")
            if fault == "forward without backward":
                model(x)  # (a metric computed with autograd on)
            if fault == "autograd.grad on the input first":
                x.requires_grad_(True)
            out = model(x)
            loss = F.cross_entropy(out, y, reduction="sum") / max(1, len(y))
            if fault == "raise after forward":
                raise Injected("after the forward pass")
            if fault == "KeyboardInterrupt in backward":
                h = out * 1.0
                h.register_hook(_interrupt)
                loss = F.cross_entropy(h, y, reduction="sum") / max(1, len(y))
            if fault == "autograd.grad on the input first":
                torch.autograd.grad(loss, x, retain_graph=True)
            if fault == "two losses, retain_graph":
                scaler.scale(0.5 * loss).backward(retain_graph=True)
                scaler.scale(0.5 * loss).backward()
            elif fault == "gradient penalty (double backward)":
                params = [p for p in model.parameters() if p.requires_grad]
                grads = torch.autograd.grad(loss, params, create_graph=True)
                penalty = sum(g.square().sum() for g in grads)
                scaler.scale(loss + 1e-4 * penalty).backward()
            else:
                scaler.scale(loss).backward()
            if fault == "raise after backward":
                raise Injected("between backward() and step()")
            if fault in ("skip after backward", "skip after backward, discard_captures()"):
                if fault.endswith("discard_captures()"):
                    run.pre.discard_captures()
                continue
            if world_size > 1:
                _average(model, world_size)
            scaler.unscale_(opt)
            unscaled = True
            damping_fails[0] = fault == "schedule raises in step()"
            try:
                run.pre.step()
            finally:
                damping_fails[0] = False
            if fault == "step() twice":
                run.pre.step()
            if fault == "raise after step()":
                raise Injected("after step(), before the optimizer's")
            scaler.step(opt)
            scaler.update()
        except (Injected, KeyboardInterrupt):
            opt.zero_grad()
            if unscaled:
                scaler.update()  # (the scaler's iteration ends too)
            continue
        held_between_steps = max(held_between_steps, run.pre.memory_usage()["captures"])
        if fault == "checkpoint and rebuild":
            buffer = io.BytesIO()
            torch.save({"pre": run.pre.state_dict(), "opt": opt.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            run.pre.remove_hooks()
            run.pre = run.build()  # (the old one is dropped: collected with its hooks)
            run.pre.load_state_dict(saved["pre"])
    seconds = time.perf_counter() - start
    model = run.model
    model.mid.requires_grad_(True)
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(x_all), y_all).item()
    return {
        "final_loss": loss,
        "faults": dict(sorted(injected.items())),
        "faults_total": sum(injected.values()),
        "hooks_after_construction": hooks_after_construction,
        "hooks_at_end": _hooks(model),
        "live_preconditioners": _live_preconditioners(),
        "captures_held_between_steps": held_between_steps,
        "preconditioner_steps": run.pre.steps,
        "seconds": seconds,
        "weights": [p.detach().clone() for p in model.parameters()],
    }


def _interrupt(grad: torch.Tensor) -> None:
    raise KeyboardInterrupt("injected during the backward pass")


def clean_and_faulty(
    steps: int, *, seed: int = 0, rate: float = DEFAULT_RATE, rank: int = 0, world_size: int = 1
) -> dict[str, dict[str, Any]]:
    """The clean run and the faulty one (same data), warnings silenced (they are tested
    elsewhere: each fault's own test)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            kind: soak(steps, faults=kind == "faulty", seed=seed, rate=rate, rank=rank,
                       world_size=world_size)
            for kind in ("clean", "faulty")
        }  # fmt: skip


# -- the command line --------------------------------------------------------------


def _rank_main(rank: int, world_size: int, port: int, steps: int, seed: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=600))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    result = clean_and_faulty(steps, seed=seed, rank=rank, world_size=world_size)
    dist.barrier()
    dist.destroy_process_group()
    torch.save(result, Path(out) / f"rank{rank}.pt")


def run_ranks(world_size: int, steps: int, seed: int) -> list[dict[str, dict[str, Any]]]:
    """:func:`clean_and_faulty` on ``world_size`` gloo ranks (spawned processes)."""
    import multiprocessing

    if world_size == 1:
        return [clean_and_faulty(steps, seed=seed)]
    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="chaos-soak-") as out:
        procs = [
            ctx.Process(target=_rank_main, args=(r, world_size, store.port, steps, seed, out))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        codes = [p.exitcode for p in procs]
        if any(code != 0 for code in codes):
            raise RuntimeError(f"chaos soak: rank exit codes {codes}")
        return [
            torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)
        ]


def summary(results: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The JSON record of one world size: the checks and their numbers."""
    first = results[0]
    clean, faulty = first["clean"], first["faulty"]
    identical = all(
        torch.equal(a, b)
        for other in results[1:]
        for a, b in zip(first["faulty"]["weights"], other["faulty"]["weights"], strict=True)
    )
    return {
        "world_size": len(results),
        "clean_loss": clean["final_loss"],
        "faulty_loss": faulty["final_loss"],
        "faulty_over_clean": faulty["final_loss"] / clean["final_loss"],
        "within_10_percent": faulty["final_loss"] <= 1.1 * clean["final_loss"],
        "finite_weights": all(bool(w.isfinite().all()) for w in faulty["weights"]),
        "ranks_identical": identical,
        "faults_per_rank": [r["faulty"]["faults"] for r in results],
        "faults_total_per_rank": [r["faulty"]["faults_total"] for r in results],
        "hooks_after_construction": faulty["hooks_after_construction"],
        "hooks_at_end": faulty["hooks_at_end"],
        "live_preconditioners": faulty["live_preconditioners"],
        "captures_held_between_steps": faulty["captures_held_between_steps"],
        "preconditioner_steps": {
            "clean": clean["preconditioner_steps"],
            "faulty": faulty["preconditioner_steps"],
        },
        "seconds": {"clean": clean["seconds"], "faulty": faulty["seconds"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, action="append", choices=(1, 2))
    parser.add_argument(
        "--json", default=str(Path(__file__).parent / "results" / "chaos_soak.json")
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from common import LoadRecord, machine_info, write_json

    torch.set_num_threads(1)
    records = []
    with LoadRecord() as load:
        for world_size in args.world_size or [1, 2]:
            record = summary(run_ranks(world_size, args.steps, args.seed))
            records.append(record)
            print(
                f"{world_size} rank(s), {args.steps} steps: loss {record['faulty_loss']:.4f} with "
                f"{record['faults_total_per_rank']} faults, clean {record['clean_loss']:.4f} "
                f"(x{record['faulty_over_clean']:.3f}); hooks {record['hooks_at_end']}/"
                f"{record['hooks_after_construction']}, live preconditioners "
                f"{record['live_preconditioners']}, ranks identical {record['ranks_identical']}, "
                f"{record['seconds']['faulty']:.1f} s"
            )
    write_json(
        args.json,
        {
            "command": "python benchmarks/chaos_soak.py " + " ".join(argv or sys.argv[1:]),
            "steps": args.steps,
            "seed": args.seed,
            "rate": DEFAULT_RATE,
            "threads": 1,
            "machine": machine_info(),
            "load": load.as_dict(),
            "runs": records,
        },
    )
    ok = all(r["within_10_percent"] and r["finite_weights"] and r["ranks_identical"]
             for r in records)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
