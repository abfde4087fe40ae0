"""One arm's training run: its optimizer (optionally with K-FAC) on a fixed data order.

The training clock covers everything a training step does (batch gather,
forward, backward, ``preconditioner.step()``, ``optimizer.step()``) and
nothing else: evaluation on the test set, progress display and bookkeeping
between steps run with the clock stopped. The learning rate follows a linear
warm-up and then a cosine decay to zero at the end of the epoch budget, per
step, with the same shape for every arm on the arm's own peak (each param
group at its ``"lr_scale"`` times that, see :mod:`kaisa.demo.optimizers`).

The kaisa arms construct ``KFACPreconditioner(model, lr=<the optimizer's
current learning rate>)`` plus only the overrides in ``ArmConfig.kfac``: the
library's defaults otherwise. The options the preconditioner actually ran
with are recorded in ``RunResult.kfac_options``.

:func:`train_arms_in_lockstep` trains several arms in one process taking
turns step by step, so that whatever else the machine does at a given moment
slows every arm alike; each arm's clock still counts its own steps only.

Under ``torch.distributed`` (a ``--nproc`` run) every rank sees the same
global batch order and trains on its own slice of each global batch, so the
global batch size, and with it the optimisation problem, does not depend on
the number of processes. Evaluation is split across ranks the same way.

Progress (rank 0, unless ``DemoConfig.progress`` is off): on a terminal a
tqdm bar per arm and epoch; on any other output (a log file, CI) one line per
arm and epoch at the epoch's end, and between them a plain progress line per
arm every ``DemoConfig.progress_seconds`` (:class:`_ProgressLines`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import Tensor, nn

from kaisa.demo.config import ArmConfig, DemoConfig
from kaisa.demo.data import NUM_CLASSES, FashionMNIST
from kaisa.demo.optimizers import TrainingOptimizer, build_optimizer

__all__ = [
    "DistContext",
    "EvalPoint",
    "RunResult",
    "build_demo_model",
    "evaluate",
    "kfac_options",
    "train_arm",
    "train_arms_in_lockstep",
    "warmup_cosine",
]


@dataclass(frozen=True)
class DistContext:
    """This process's place in the data-parallel group (``world == 1``: no group)."""

    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        """Whether this process reports (rank 0)."""
        return self.rank == 0

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum ``values`` over all ranks (identity for a single process)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        return [float(v) for v in t.tolist()]

    def all_reduce_max(self, value: float) -> float:
        """Maximum of ``value`` over all ranks."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t.item())


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation on the test set during a run."""

    arm: str
    seed: int
    step: int
    epoch: float
    train_seconds: float
    test_accuracy: float
    test_loss: float
    train_loss: float


@dataclass
class RunResult:
    """Everything measured in one (arm, seed) run."""

    arm: str
    seed: int
    steps: int
    steps_per_epoch: int
    train_seconds: float
    points: list[EvalPoint] = field(default_factory=list)
    kfac_seconds: float = 0.0
    kfac_phase_seconds: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float | None = None
    peak_memory_increase_mb: float | None = None
    diverged: bool = False
    #: Steps at which KL clipping shrank the update (K-FAC arms only).
    kl_clipped_steps: int = 0
    #: What the arm's optimizer got (e.g. Muon's parameter split); JSON-ready.
    optimizer_info: dict[str, Any] = field(default_factory=dict)
    #: The options the K-FAC preconditioner ran with (K-FAC arms only).
    kfac_options: dict[str, Any] = field(default_factory=dict)
    #: What kaisa's time budget chose: each layer's representations, the
    #: intervals, the modelled share (K-FAC arms with an automatic choice only).
    kfac_choice: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds_per_step(self) -> float:
        """Mean training-clock seconds per optimizer step."""
        return self.train_seconds / max(1, self.steps)

    @property
    def kfac_seconds_per_step(self) -> float:
        """Mean seconds per step spent in the preconditioner (0 without K-FAC)."""
        return self.kfac_seconds / max(1, self.steps)

    @property
    def kfac_share(self) -> float:
        """K-FAC's share of the training clock (``kfac_seconds / train_seconds``)."""
        return self.kfac_seconds / self.train_seconds if self.train_seconds > 0 else 0.0

    @property
    def final_test_accuracy(self) -> float | None:
        """Test accuracy at the last evaluation."""
        return self.points[-1].test_accuracy if self.points else None

    @property
    def best_test_accuracy(self) -> float | None:
        """Highest test accuracy seen at any evaluation."""
        return max(p.test_accuracy for p in self.points) if self.points else None

    def first_reaching(self, target: float) -> EvalPoint | None:
        """The first evaluation whose test accuracy is at least ``target``."""
        for p in self.points:
            if p.test_accuracy >= target:
                return p
        return None

    def summary(self, target: float) -> dict[str, Any]:
        """A JSON-ready summary of this run."""
        hit = self.first_reaching(target)
        return {
            "seed": self.seed,
            "time_to_target_s": hit.train_seconds if hit else None,
            "steps_to_target": hit.step if hit else None,
            "epochs_to_target": hit.epoch if hit else None,
            "final_test_accuracy": self.final_test_accuracy,
            "best_test_accuracy": self.best_test_accuracy,
            "train_seconds": self.train_seconds,
            "steps": self.steps,
            "seconds_per_step": self.seconds_per_step,
            "kfac_seconds": self.kfac_seconds,
            "kfac_seconds_per_step": self.kfac_seconds_per_step,
            "kfac_share": self.kfac_share,
            "kfac_phase_seconds": dict(self.kfac_phase_seconds),
            "peak_memory_mb": self.peak_memory_mb,
            "peak_memory_increase_mb": self.peak_memory_increase_mb,
            "diverged": self.diverged,
            "kl_clipped_fraction": self.kl_clipped_steps / max(1, self.steps),
        }


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Learning rate at a 0-based step: linear warm-up to ``peak``, then cosine to 0."""
    warmup_steps = max(0, min(warmup_steps, total_steps))
    decay_steps = max(1, total_steps - warmup_steps)

    def lr(step: int) -> float:
        if step < warmup_steps:
            return peak * (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr


def build_demo_model(name: str, image_shape: tuple[int, int, int]) -> nn.Module:
    """The named network from :mod:`kaisa.models` for this data's images."""
    from kaisa.models import build_model

    return build_model(name, in_channels=image_shape[0], num_classes=NUM_CLASSES)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    dist: DistContext,
    batch_size: int = 256,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> tuple[float, float]:
    """Test accuracy and mean cross-entropy over ``(x, y)``, split across ranks.

    Each batch is laid out in ``memory_format`` (the model's) before the forward pass.
    """
    was_training = model.training
    model.eval()
    xs, ys = x[dist.rank :: dist.world], y[dist.rank :: dist.world]
    correct = 0.0
    loss_sum = 0.0
    for i in range(0, xs.shape[0], batch_size):
        out = model(xs[i : i + batch_size].contiguous(memory_format=memory_format))
        target = ys[i : i + batch_size]
        loss_sum += float(F.cross_entropy(out, target, reduction="sum"))
        correct += float((out.argmax(dim=1) == target).sum())
    model.train(was_training)
    correct, loss_sum, count = dist.all_reduce_sum([correct, loss_sum, float(xs.shape[0])])
    return correct / count, loss_sum / count


# --- peak memory ---------------------------------------------------------------


def _status_kb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter for this process (Linux); True on success."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_rss_mb() -> float:
    hwm = _status_kb("VmHWM")
    if hwm is not None:
        return hwm / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb() -> float | None:
    rss = _status_kb("VmRSS")
    return rss / 1024.0 if rss is not None else None


# --- training ------------------------------------------------------------------


def _eval_interval(config: DemoConfig, last_acc: float | None, reached: bool) -> int:
    """Steps until the next evaluation: fine-grained only just below the target.

    Evaluation is excluded from the clock but not free, so the test set is
    evaluated every ``eval_every`` steps, and every ``eval_every_near`` steps
    while the accuracy is within ``near_margin`` below a target not reached
    yet, where the time to the target is decided. Both arms follow the same rule.
    """
    near = (
        not reached
        and last_acc is not None
        and config.target_accuracy - config.near_margin <= last_acc < config.target_accuracy
    )
    if near:
        return config.eval_every_near or max(1, config.eval_every // 4)
    return config.eval_every


def _make_preconditioner(model: nn.Module, arm: ArmConfig, optimizer: TrainingOptimizer) -> Any:
    """The library's preconditioner with its defaults, but ``lr`` and ``arm.kfac``'s overrides."""
    from kaisa import KFACPreconditioner

    assert arm.kfac is not None

    def current_lr(_step: int) -> float:
        return float(optimizer.param_groups[0]["lr"])

    return KFACPreconditioner(model, lr=current_lr, **arm.kfac.overrides())


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if callable(value):
        return "callable"
    return str(value)


def kfac_options(pre: Any) -> dict[str, Any]:
    """The options a ``KFACPreconditioner`` runs with, as JSON (``lr`` is the demo's callable)."""

    options = getattr(pre, "options", None)
    if options is None or not dataclasses.is_dataclass(options):
        return {}
    return {
        f.name: _jsonable(getattr(options, f.name))
        for f in dataclasses.fields(options)
        if f.init and f.name != "grad_scaler"
    }


def _phase_total(pre: Any) -> float:
    phases = getattr(getattr(pre, "telemetry", None), "phase_seconds", None)
    return float(sum(phases.values())) if phases else 0.0


def _kfac_phase_seconds(pre: Any) -> dict[str, float]:
    telemetry = getattr(pre, "telemetry", None)
    phases = getattr(telemetry, "phase_seconds", None)
    if phases is None:
        return {}
    return {str(k): float(v) for k, v in dict(phases).items()}


def train_arm(
    data: FashionMNIST,
    config: DemoConfig,
    arm: ArmConfig,
    seed: int,
    dist: DistContext | None = None,
    progress: bool = False,
    stop_at_target: bool = False,
) -> RunResult:
    """Train ``config.model`` with ``arm``'s optimizer for ``config.epochs`` epochs.

    The model's initial weights and the order of the training batches depend on
    ``seed`` only, so all arms of a comparison start from the same weights and
    see the same batches. ``stop_at_target`` ends the run at the first
    evaluation that reaches the target (for sweeps that rank by time or steps
    to the target; the final accuracy is then that evaluation's).
    """
    return train_arms_in_lockstep(data, config, [arm], seed, dist, progress, stop_at_target)[0]


def train_arms_in_lockstep(
    data: FashionMNIST,
    config: DemoConfig,
    arms: Sequence[ArmConfig],
    seed: int,
    dist: DistContext | None = None,
    progress: bool = False,
    stop_at_target: bool = False,
    *,
    turn: int = 1,
) -> list[RunResult]:
    """Train every arm as :func:`train_arm` would, ``turn`` steps of each in turn.

    Each arm has its own model, optimizer, batch order and clock; taking turns
    only changes *when* each step runs, so every arm computes exactly what it
    computes alone, while a change in the machine's load during the run falls
    on all arms alike instead of on whichever arm happened to be running. An
    arm that finishes first leaves the others to go on alone. Peak memory is
    the process's, so in a lockstep run every arm reports the same peak.
    ``turn`` (default 1, the demo's) is how many steps an arm takes before
    the next one goes; ``benchmarks/lockstep.py`` uses it to check that
    alternating every step does not slow an arm through the caches.
    """
    if isinstance(turn, bool) or not isinstance(turn, int) or turn < 1:
        raise ValueError(f"turn must be a positive integer (steps per turn), got {turn!r}")
    dist = dist or DistContext()
    runs = [
        _arm_run(data, config, arm, seed, dist, progress, stop_at_target, position=i)
        for i, arm in enumerate(arms)
    ]
    results: list[RunResult | None] = [None] * len(runs)
    while any(r is None for r in results):
        for i, run in enumerate(runs):
            for _ in range(turn):
                if results[i] is not None:
                    break
                try:
                    next(run)
                except StopIteration as done:
                    results[i] = done.value
    return [r for r in results if r is not None]


def _arm_run(
    data: FashionMNIST,
    config: DemoConfig,
    arm: ArmConfig,
    seed: int,
    dist: DistContext,
    progress: bool,
    stop_at_target: bool,
    position: int = 0,
) -> Generator[None, None, RunResult]:
    """:func:`train_arm`'s work as a generator that pauses after every training step."""
    batch = config.batch_size
    if batch % dist.world:
        raise ValueError(f"batch size {batch} is not divisible by {dist.world} processes")
    n_train = data.train_x.shape[0]
    steps_per_epoch = n_train // batch
    if steps_per_epoch < 1:
        raise ValueError(f"batch size {batch} is larger than the training set ({n_train})")
    total_steps = steps_per_epoch * config.epochs
    warmup_steps = round(config.warmup_epochs * steps_per_epoch)
    schedule = warmup_cosine(arm.lr, warmup_steps, total_steps)

    torch.manual_seed(seed)
    model: nn.Module = build_demo_model(config.model, data.image_shape)
    layout = torch.channels_last if config.channels_last else torch.contiguous_format
    # Module.to(memory_format=...) is documented but missing from torch's stubs.
    model = model.to(memory_format=layout)  # type: ignore[call-overload]
    if dist.world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    model.train()
    optimizer, optimizer_info = build_optimizer(model, arm)
    for group in optimizer.param_groups:
        group["lr"] = schedule(0) * group.get("lr_scale", 1.0)
    pre = _make_preconditioner(model, arm, optimizer) if arm.kfac is not None else None
    order = torch.Generator().manual_seed(seed)

    reset_ok = _reset_peak_rss()
    rss_before = _current_rss_mb()
    result = RunResult(arm.name, seed, 0, steps_per_epoch, 0.0, optimizer_info=optimizer_info)
    if pre is not None:
        result.kfac_options = kfac_options(pre)
    clock = 0.0
    kfac_clock = 0.0
    hooks_clock = 0.0
    after_last_step = 0.0
    loss_sum = 0.0
    loss_count = 0
    step = 0
    last_acc: float | None = None
    reached = False
    next_eval = _eval_interval(config, None, False)

    def record() -> None:
        nonlocal loss_sum, loss_count, last_acc
        acc, test_loss = evaluate(model, data.test_x, data.test_y, dist, memory_format=layout)
        train_loss = dist.all_reduce_sum([loss_sum])[0] / max(1, loss_count * dist.world)
        result.points.append(
            EvalPoint(
                arm.name, seed, step, step / steps_per_epoch, clock, acc, test_loss, train_loss
            )
        )
        loss_sum, loss_count, last_acc = 0.0, 0, acc

    show = progress and dist.is_main
    lines = (
        _ProgressLines(config, arm.name, seed, total_steps)
        if show and _terminal_columns() == 0
        else None
    )
    for epoch in range(config.epochs):
        perm = torch.randperm(n_train, generator=order)
        desc = f"{arm.name:>11} seed {seed} epoch {epoch + 1}/{config.epochs}"
        bar = _EpochBar(steps_per_epoch, desc, position) if show else None
        epoch_clock = clock
        epoch_loss = 0.0
        for i in range(steps_per_epoch):
            t0 = time.perf_counter()
            idx = perm[i * batch : (i + 1) * batch][dist.rank :: dist.world]
            x, y = data.train_x[idx].contiguous(memory_format=layout), data.train_y[idx]
            lr = schedule(step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            torch.autograd.backward(loss)
            if pre is not None:
                before = _phase_total(pre)
                k0 = time.perf_counter()
                pre.step()
                kfac_clock += time.perf_counter() - k0
                hooks_clock += before - after_last_step
                after_last_step = _phase_total(pre)
            optimizer.step()
            value = float(loss.detach())
            clock += time.perf_counter() - t0
            step += 1
            if not math.isfinite(value):
                result.diverged = True
                break
            loss_sum += value
            loss_count += 1
            if bar is not None:
                epoch_loss += value
                post = f"loss {epoch_loss / (i + 1):.3f}"
                if last_acc is not None:
                    post += f" test acc {last_acc:.4f}"
                bar.update(post)
            if step >= next_eval or step == total_steps:
                record()
                reached = reached or (last_acc is not None and last_acc >= config.target_accuracy)
                next_eval = step + _eval_interval(config, last_acc, reached)
                if reached and stop_at_target:
                    break
            if lines is not None:
                lines.step(step, epoch, clock, last_acc)
            yield
        if bar is not None:
            final = "diverged" if result.diverged else f"loss {epoch_loss / steps_per_epoch:.3f}"
            if last_acc is not None:
                final += f" test acc {last_acc:.4f}"
            bar.close(final, clock - epoch_clock)
        if result.diverged or (reached and stop_at_target):
            break
    if result.diverged and (not result.points or result.points[-1].step != step):
        record()

    result.steps = step
    result.train_seconds = clock
    phases = _kfac_phase_seconds(pre) if pre is not None else {}
    result.kfac_phase_seconds = phases
    choice = getattr(pre, "curvature_choice", None)
    if choice is not None:
        result.kfac_choice = _jsonable(dataclasses.asdict(choice))
    if pre is not None:
        result.kl_clipped_steps = pre.telemetry.kl_clipped_steps
    # K-FAC's cost: the time inside preconditioner.step() plus what its hooks
    # spend during the forward and backward passes (captures, factor products,
    # all-reduce launches): the telemetry's phase time accrued between steps.
    result.kfac_seconds = kfac_clock + hooks_clock
    peak = dist.all_reduce_max(_peak_rss_mb())
    result.peak_memory_mb = peak
    if reset_ok and rss_before is not None:
        result.peak_memory_increase_mb = dist.all_reduce_max(peak - rss_before)
    return result


def _terminal_columns() -> int:
    """Width of the terminal on stdout; 0 when it is none or reports no size."""
    try:
        if not sys.stdout.isatty():
            return 0
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class _EpochBar:
    """Progress of one epoch: a tqdm bar on a terminal, one summary line otherwise.

    A terminal that reports zero columns (a pseudo-terminal nobody sized, as
    some CI runners and ``script`` without a terminal give) gets the summary
    lines: tqdm would draw its bars zero characters wide, that is not at all.
    """

    def __init__(self, total: int, desc: str, position: int = 0) -> None:
        self._desc = desc
        self._post = ""
        self._bar: Any = None
        if _terminal_columns() > 0:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm comes with the demo extra
                return
            self._bar = tqdm(
                total=total,
                desc=desc,
                position=position,
                unit="step",
                leave=True,
                dynamic_ncols=True,
                mininterval=0.5,
                file=sys.stdout,
            )

    def update(self, postfix: str) -> None:
        self._post = postfix
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(1)

    def close(self, postfix: str, train_seconds: float) -> None:
        """End the epoch; ``train_seconds`` is the arm's training clock over it."""
        self._post = postfix
        if self._bar is not None:
            self._bar.set_postfix_str(self._post, refresh=True)
            self._bar.close()
        else:
            print(f"{self._desc}: {self._post} (training {train_seconds:.1f} s)", flush=True)


def _duration(seconds: float) -> str:
    """``42.3 s``, ``3m05s``, ``1h02m05s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class _ProgressLines:
    """Progress of one arm's run as plain lines, for output that is not a terminal.

    A log file or a CI job gets nothing from tqdm's bars, which redraw one
    line in place; instead, whenever ``config.progress_seconds`` of wall time
    have passed since the arm's last line (or its start), one line names the
    workload, arm and seed, the step, the wall time since the run started (in
    lockstep that includes the other arms' steps and the evaluations), the
    arm's training clock and the last test accuracy.
    """

    def __init__(self, config: DemoConfig, arm: str, seed: int, total_steps: int) -> None:
        self._prefix = f"[progress] workload {config.name}, arm {arm}, seed {seed}"
        self._epochs = config.epochs
        self._total = total_steps
        self._every = config.progress_seconds
        self._start = time.perf_counter()
        self._last = self._start

    def step(self, step: int, epoch: int, train_seconds: float, last_acc: float | None) -> None:
        """After a training step: print the line if it is time for one."""
        now = time.perf_counter()
        if now - self._last < self._every:
            return
        self._last = now
        acc = "none yet" if last_acc is None else f"{last_acc:.4f}"
        print(
            f"{self._prefix}: step {step}/{self._total} (epoch {epoch + 1}/{self._epochs}), "
            f"elapsed {_duration(now - self._start)}, train clock {_duration(train_seconds)}, "
            f"last test acc {acc}",
            flush=True,
        )
