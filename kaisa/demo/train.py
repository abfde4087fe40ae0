"""One arm's training run: its optimizer (optionally with K-FAC) on a fixed data order.

The training clock covers everything a training step does (batch gather,
forward, backward, ``preconditioner.step()``, ``optimizer.step()``) and
nothing else: evaluation on the test set, progress display and bookkeeping
between steps run with the clock stopped. The learning rate follows a linear
warm-up and then a cosine decay to zero at the end of the budget (epochs, or
steps for a workload with a step budget), per step, with the same shape for
every arm on the arm's own peak (each param group at its ``"lr_scale"``
times that, see :mod:`kaisa.demo.optimizers`).

Two kinds of workload share the loop. An image workload (Fashion-MNIST)
takes each epoch's batches from a permutation of the training images and is
evaluated by its test accuracy (higher is better). The language model
(``DemoConfig.dataset == "fortunes"``) takes each step's batch of byte
windows at random offsets of the training stream
(:meth:`~kaisa.demo.text.TextCorpus.sample_batch`) and is evaluated on the
fixed validation windows by its mean next-byte cross-entropy in nats per byte
(lower is better; :func:`evaluate_text`). Either way the batches depend on
the seed only, and ``DemoConfig.metric`` decides what "reached the target"
means (:data:`~kaisa.demo.config.METRICS`).

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

from kaisa.demo.config import METRICS, ArmConfig, DemoConfig, Metric
from kaisa.demo.data import NUM_CLASSES
from kaisa.demo.datasets import Dataset
from kaisa.demo.optimizers import TrainingOptimizer, build_optimizer
from kaisa.demo.text import TextCorpus

__all__ = [
    "DistContext",
    "EvalPoint",
    "RunResult",
    "build_demo_model",
    "evaluate",
    "evaluate_text",
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
    """One evaluation on the held-out data during a run.

    For an image workload the test set's accuracy and mean cross-entropy; for
    the language model the fixed validation windows' next-byte accuracy and
    mean cross-entropy in nats per byte.
    """

    arm: str
    seed: int
    step: int
    epoch: float
    train_seconds: float
    test_accuracy: float
    test_loss: float
    train_loss: float

    def value(self, metric: str) -> float:
        """The value of ``metric`` (``"accuracy"`` or ``"val_loss"``) at this evaluation."""
        return self.test_loss if metric == "val_loss" else self.test_accuracy


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
    #: With ``adaptive_intervals``: the intervals' multiplier at the end
    #: (``factor``) and how often it changed (``changes``); with
    #: ``stale_refresh``: how often the curvature was found stale
    #: (``stale_refreshes``); empty otherwise.
    interval_stretch: dict[str, int] = field(default_factory=dict)
    #: What the run is measured by (a key of ``METRICS``): which evaluation
    #: value the target applies to and which way is better.
    metric: str = "accuracy"

    @property
    def metric_spec(self) -> Metric:
        """The :class:`~kaisa.demo.config.Metric` of ``metric``."""
        return METRICS[self.metric]

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

    @property
    def final_value(self) -> float | None:
        """The metric's value at the last evaluation."""
        return self.points[-1].value(self.metric) if self.points else None

    @property
    def best_value(self) -> float | None:
        """The metric's best value at any evaluation (highest accuracy, lowest loss)."""
        if not self.points:
            return None
        return self.metric_spec.best([p.value(self.metric) for p in self.points])

    def first_reaching(self, target: float) -> EvalPoint | None:
        """The first evaluation that reaches ``target``.

        That is, whose test accuracy is at least ``target`` (or, for a loss
        metric, whose loss is at most ``target``).
        """
        metric = self.metric_spec
        for p in self.points:
            if metric.reached(p.value(self.metric), target):
                return p
        return None

    def summary(self, target: float) -> dict[str, Any]:
        """A JSON-ready summary of this run.

        The metric's last and best values are ``final_<key>`` and
        ``best_<key>`` (``final_test_accuracy``, or ``final_val_loss`` for the
        language model).
        """
        hit = self.first_reaching(target)
        key = self.metric_spec.key
        return {
            "seed": self.seed,
            "time_to_target_s": hit.train_seconds if hit else None,
            "steps_to_target": hit.step if hit else None,
            "epochs_to_target": hit.epoch if hit else None,
            f"final_{key}": self.final_value,
            f"best_{key}": self.best_value,
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


def build_demo_model(
    name: str, image_shape: tuple[int, int, int] | None = None, *, context: int | None = None
) -> nn.Module:
    """The named network from :mod:`kaisa.models` for the data.

    For images, ``image_shape`` ``(C, H, W)``: the network for ``C`` channels
    and Fashion-MNIST's classes. For text, ``context``: the byte-level
    language model with that context (``image_shape`` is then ``None``).
    """
    from kaisa.models import build_model

    if context is not None:
        from kaisa.demo.text import VOCAB_SIZE

        return build_model(name, vocab_size=VOCAB_SIZE, context=context)
    if image_shape is None:
        raise ValueError("build_demo_model needs image_shape for images or context for text")
    return build_model(name, in_channels=image_shape[0], num_classes=NUM_CLASSES)


def _model_for(config: DemoConfig, data: Dataset) -> nn.Module:
    if isinstance(data, TextCorpus):
        return build_demo_model(config.model, context=config.context)
    return build_demo_model(config.model, data.image_shape)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    dist: DistContext,
    batch_size: int = 256,
    memory_format: torch.memory_format = torch.contiguous_format,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """Test accuracy and mean cross-entropy over ``(x, y)``, split across ranks.

    Each batch is copied to ``device`` (the model's) and laid out in
    ``memory_format`` (the model's) before the forward pass.
    """
    was_training = model.training
    model.eval()
    xs, ys = x[dist.rank :: dist.world], y[dist.rank :: dist.world]
    correct = 0.0
    loss_sum = 0.0
    for i in range(0, xs.shape[0], batch_size):
        inputs = xs[i : i + batch_size].to(device)
        out = model(inputs.contiguous(memory_format=memory_format))
        target = ys[i : i + batch_size].to(device)
        loss_sum += float(F.cross_entropy(out, target, reduction="sum"))
        correct += float((out.argmax(dim=1) == target).sum())
    model.train(was_training)
    correct, loss_sum, count = dist.all_reduce_sum([correct, loss_sum, float(xs.shape[0])])
    return correct / count, loss_sum / count


@torch.no_grad()
def evaluate_text(
    model: nn.Module,
    windows: Tensor,
    dist: DistContext,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """Next-byte accuracy and mean cross-entropy (nats per byte) over ``windows``.

    ``windows`` ``(W, T + 1)`` are the fixed validation windows: the model
    reads each window's first ``T`` bytes and is scored on predicting the
    last ``T``, every position counting once. Runs in eval mode without
    gradients; the windows are split across ranks and the sums all-reduced.
    Each chunk of windows is copied to ``device`` (the model's).
    """
    was_training = model.training
    model.eval()
    mine = windows[dist.rank :: dist.world]
    correct = 0.0
    loss_sum = 0.0
    for i in range(0, mine.shape[0], batch_size):
        chunk = mine[i : i + batch_size].to(device)
        x, y = chunk[:, :-1], chunk[:, 1:]
        logits = model(x)
        flat = logits.reshape(-1, logits.shape[-1])
        loss_sum += float(F.cross_entropy(flat, y.reshape(-1), reduction="sum"))
        correct += float((flat.argmax(dim=1) == y.reshape(-1)).sum())
    model.train(was_training)
    count = float(mine.shape[0] * max(0, windows.shape[1] - 1))
    correct, loss_sum, count = dist.all_reduce_sum([correct, loss_sum, count])
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


def _eval_interval(config: DemoConfig, last: float | None, reached: bool) -> int:
    """Steps until the next evaluation: fine-grained only just short of the target.

    Evaluation is excluded from the clock but not free, so the held-out data
    is evaluated every ``eval_every`` steps, and every ``eval_every_near``
    steps while the metric's last value ``last`` is within ``near_margin`` of
    a target not reached yet (below it for an accuracy, above it for a loss),
    where the time to the target is decided. Every arm follows the same rule.
    """
    near = (
        not reached
        and last is not None
        and config.metric_spec.near(last, config.target, config.near_margin)
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


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so that a host clock read around it is true."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    data: Dataset,
    config: DemoConfig,
    arm: ArmConfig,
    seed: int,
    dist: DistContext | None = None,
    progress: bool = False,
    stop_at_target: bool = False,
) -> RunResult:
    """Train ``config.model`` with ``arm``'s optimizer over ``config``'s budget.

    The model's initial weights and the order of the training batches depend on
    ``seed`` only, so all arms of a comparison start from the same weights and
    see the same batches. ``stop_at_target`` ends the run at the first
    evaluation that reaches the target (for sweeps that rank by time or steps
    to the target; the final accuracy is then that evaluation's).
    """
    return train_arms_in_lockstep(data, config, [arm], seed, dist, progress, stop_at_target)[0]


def train_arms_in_lockstep(
    data: Dataset,
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
    data: Dataset,
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
    text = isinstance(data, TextCorpus)
    if isinstance(data, TextCorpus):
        n_train = int(data.train.numel())
        steps_per_epoch = data.steps_per_epoch(batch, config.context)
        if steps_per_epoch < 1:
            raise ValueError(
                f"batch size {batch} x {config.context} bytes is larger than the training "
                f"stream ({n_train} bytes)"
            )
        val_windows = data.validation_windows(config.context)
    else:
        n_train = data.train_x.shape[0]
        steps_per_epoch = n_train // batch
        if steps_per_epoch < 1:
            raise ValueError(f"batch size {batch} is larger than the training set ({n_train})")
    total_steps = (
        config.max_steps if config.max_steps is not None else steps_per_epoch * config.epochs
    )
    last_step = total_steps if config.step_limit is None else min(total_steps, config.step_limit)
    epochs = -(-total_steps // steps_per_epoch)
    warmup_steps = (
        config.warmup_steps
        if config.warmup_steps is not None
        else round(config.warmup_epochs * steps_per_epoch)
    )
    schedule = warmup_cosine(arm.lr, warmup_steps, total_steps)
    metric = config.metric_spec

    torch.manual_seed(seed)
    device = torch.device(config.device)
    model: nn.Module = _model_for(config, data).to(device)
    layout = torch.channels_last if config.channels_last and not text else torch.contiguous_format
    if not text:
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
    result = RunResult(
        arm.name, seed, 0, steps_per_epoch, 0.0, optimizer_info=optimizer_info, metric=config.metric
    )
    if pre is not None:
        result.kfac_options = kfac_options(pre)
    clock = 0.0
    kfac_clock = 0.0
    hooks_clock = 0.0
    after_last_step = 0.0
    loss_sum = 0.0
    loss_count = 0
    step = 0
    last: float | None = None
    reached = False
    next_eval = _eval_interval(config, None, False)

    def record() -> None:
        nonlocal loss_sum, loss_count, last
        if isinstance(data, TextCorpus):
            acc, test_loss = evaluate_text(model, val_windows, dist, device=device)
        else:
            acc, test_loss = evaluate(
                model, data.test_x, data.test_y, dist, memory_format=layout, device=device
            )
        train_loss = dist.all_reduce_sum([loss_sum])[0] / max(1, loss_count * dist.world)
        point = EvalPoint(
            arm.name, seed, step, step / steps_per_epoch, clock, acc, test_loss, train_loss
        )
        result.points.append(point)
        loss_sum, loss_count, last = 0.0, 0, point.value(config.metric)

    show = progress and dist.is_main
    lines = (
        _ProgressLines(config, arm.name, seed, last_step, epochs)
        if show and _terminal_columns() == 0
        else None
    )
    postfix = "test acc" if metric.name == "accuracy" else "val loss"
    done = False
    for epoch in range(epochs):
        if not text:
            perm = torch.randperm(n_train, generator=order)
        in_epoch = min(steps_per_epoch, last_step - step)
        desc = f"{arm.name:>11} seed {seed} epoch {epoch + 1}/{epochs}"
        bar = _EpochBar(in_epoch, desc, position) if show else None
        epoch_clock = clock
        epoch_loss = 0.0
        for i in range(in_epoch):
            t0 = time.perf_counter()
            if isinstance(data, TextCorpus):
                x, y = data.sample_batch(batch, config.context, order)
                x, y = x[dist.rank :: dist.world], y[dist.rank :: dist.world]
            else:
                idx = perm[i * batch : (i + 1) * batch][dist.rank :: dist.world]
                x, y = data.train_x[idx].contiguous(memory_format=layout), data.train_y[idx]
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lr = schedule(step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            optimizer.zero_grad(set_to_none=True)
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            torch.autograd.backward(loss)
            if pre is not None:
                before = _phase_total(pre)
                _synchronize(device)  # K-FAC's clock takes in its own device work only
                k0 = time.perf_counter()
                pre.step()
                _synchronize(device)
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
                if last is not None:
                    post += f" {postfix} {last:.4f}"
                bar.update(post)
            if step >= next_eval or step == last_step:
                record()
                reached = reached or (last is not None and metric.reached(last, config.target))
                next_eval = step + _eval_interval(config, last, reached)
                if reached and stop_at_target:
                    done = True
                    break
            if lines is not None:
                lines.step(step, epoch, clock, last)
            yield
        if bar is not None:
            final = "diverged" if result.diverged else f"loss {epoch_loss / max(1, in_epoch):.3f}"
            if last is not None:
                final += f" {postfix} {last:.4f}"
            bar.close(final, clock - epoch_clock)
        if result.diverged or done or step >= last_step:
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
        if pre.options.adaptive_intervals:  # the intervals in force were stretched
            result.interval_stretch = {
                "factor": pre.interval_stretch,
                "changes": pre.telemetry.interval_changes,
            }
        if pre.options.stale_refresh:  # refreshes the staleness added
            result.interval_stretch["stale_refreshes"] = pre.telemetry.stale_refreshes
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
    arm's training clock and the last value of the workload's metric ("last
    test acc", or "last val loss" for the language model).
    """

    def __init__(
        self, config: DemoConfig, arm: str, seed: int, total_steps: int, epochs: int
    ) -> None:
        self._prefix = f"[progress] workload {config.name}, arm {arm}, seed {seed}"
        self._epochs = epochs
        self._total = total_steps
        self._every = config.progress_seconds
        self._label = "test acc" if config.metric == "accuracy" else "val loss"
        self._start = time.perf_counter()
        self._last = self._start

    def step(self, step: int, epoch: int, train_seconds: float, last: float | None) -> None:
        """After a training step: print the line if it is time for one."""
        now = time.perf_counter()
        if now - self._last < self._every:
            return
        self._last = now
        value = "none yet" if last is None else f"{last:.4f}"
        print(
            f"{self._prefix}: step {step}/{self._total} (epoch {epoch + 1}/{self._epochs}), "
            f"elapsed {_duration(now - self._start)}, train clock {_duration(train_seconds)}, "
            f"last {self._label} {value}",
            flush=True,
        )
