"""Batch-split invariance under KAISA (spec §3, §5), in real gloo process groups.

For world sizes 1, 2 and 4, every gradient-worker fraction the world size
allows, both compute methods, ``symmetry_aware`` and ``colocate_factors`` on
and off, splitting one global batch over the ranks must give the weights one
process gets from the whole batch, and every rank must hold the same weights
after every step. Also checked: a DistributedDataParallel-wrapped model,
factors computed in ``step()`` rather than in the hooks, gradient
accumulation (two micro-batches, each loss halved), one all-reduce bucket
per layer, a layer called twice per forward pass, a model with attention, an
embedding and a Conv1d, a model with fewer layers
than gradient-worker columns, and a layer that no rank uses at some steps.
These hold the curvature exact (spec §4). Fixed mixed representations
(spec §8: every side kind, ``'exact'``, ``'lowrank:K'``, ``'kvec'`` and
``'diagonal'``, on ``A`` and on ``G``, in every fraction) must reproduce the
single process as well: their factors are grams or row moments averaged over
the ranks like any other, refreshed by the rank the plan names and broadcast
in the column.
A last test has one rank skip a layer the others use (data-dependent
control flow): the ranks must agree, must not hang, and must reproduce one
process in which that rank's share of the batch skips the layer (its
factors then average over the rows that went through it).

Process start-up dominates the cost, so each world size is one spawned run
that loops over all its configurations, building a fresh model and
preconditioner for each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import kaisa

STEPS = 4
GLOBAL_BATCH = 16
LR = 0.1
SEED = 1234
CLASSES = 3

# Small enough a decay that the batch factors, not the identity the factors
# start from, shape the steps; the default damping and KL bound.
DAMPING = 1e-3
FACTOR_DECAY = 0.3
KL_CLIP = 1e-3
# With factor_init='first_batch' the factors are the (rank-deficient) batch
# factors, with no identity in them: a damping of 1e-3 relative to their mean
# eigenvalue would make the solves ill-conditioned enough (about 1e3) to
# amplify float32 summation-order differences past TOLERANCE.
# It moves the weights less (by about 0.012 in these four steps, 4000 x
# TOLERANCE), so its check for teeth asks for 1e3 x TOLERANCE, not 1e4 x.
RELATIVE_DAMPING = 0.1

# Tolerance on the weights (absolute; they are O(0.1-1)), float32 throughout.
# Splitting the batch changes only the order of float32 sums: per-rank partial
# sums of āᵀā, δᵀδ and the gradients, then the all-reduce (DDP also divides
# by N before summing), so factors and gradients match the single process to
# a few ulps; the damped solves and four SGD steps amplify that a little.
# Measured worst case over all configurations: 2.8e-7 (about 10 ulps at the
# weights' scale), so 3e-6 leaves a 10x margin. The errors this test exists
# to catch are far larger: a G that grows with N² (the published
# implementation's convention, spec §3) at N = 2 moves the weights by
# 8e-3 (eigen) and 2e-2 (inverse), K-FAC itself moves them by ~0.2 (checked).
TOLERANCE = 3e-6
# The eigenvalue-corrected solves (spec §11) divide each rotated gradient entry
# by the root of (a running average of) its own square: a sign-like map whose
# slope near 0 is 1/√(γ s̄), so they amplify float32 summation-order
# differences more than K-FAC's solve does. Measured worst case over these
# configurations: 1.2e-5 (N = 2; 7e-6 at N = 4, 2e-7 at N = 1); 3e-5 leaves a
# 2.5x margin and is over 1000x below what these runs move the weights.
CORRECTED_TOLERANCE = 3e-5


class Net(nn.Module):
    """Conv2d (with and without bias) and Linear (with and without bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 5, 3, stride=2, bias=False)
        self.fc1 = nn.Linear(5 * 2 * 2, 8)
        self.fc2 = nn.Linear(8, CLASSES, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.tanh(self.conv2(x))
        x = torch.tanh(self.fc1(x.flatten(1)))
        return self.fc2(x)


class SharedNet(nn.Module):
    """A Linear layer called twice per forward pass (weight sharing, spec §3)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2)
        self.shared = nn.Linear(12, 12)
        self.head = nn.Linear(12, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv(x)).flatten(1)
        x = torch.tanh(self.shared(torch.tanh(self.shared(x))))
        return self.head(x)


class OneLayer(nn.Module):
    """One registered layer: at N = 4 most gradient-worker columns own nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * 2 * 2, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.avg_pool2d(x, 3).flatten(1))


class Branchy(nn.Module):
    """A Linear layer that the forward pass skips while ``use_branch`` is off.

    ``skip_rows`` (one process standing in for several ranks) makes only those
    rows of the batch skip it: the layer is then called on the other rows.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2)
        self.branch = nn.Linear(12, 12)
        self.head = nn.Linear(12, CLASSES)
        self.use_branch = True
        self.skip_rows: slice | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv(x)).flatten(1)
        if self.skip_rows is not None:
            keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
            keep[self.skip_rows] = False
            out = x.clone()
            out[keep] = torch.tanh(self.branch(x[keep]))
            x = out
        elif self.use_branch:
            x = torch.tanh(self.branch(x))
        return self.head(x)


class Attention(nn.Module):
    """The transformer layer kinds: Embedding, Conv1d, MultiheadAttention (four blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 8)
        self.proj = nn.Linear(2, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(2).transpose(1, 2)  # (N, 36 positions, 2 channels)
        ids = torch.bucketize(x[:, 0].flatten(1), torch.tensor([-1.0, -0.3, 0.3, 1.0]))
        h = self.proj(tokens) + self.embed(ids)
        h = torch.tanh(self.conv(h.transpose(1, 2))).transpose(1, 2)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(1))


class Grouped(nn.Module):
    """Grouped convolutions: a depthwise one (with bias) and one of two groups (without)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.grouped = nn.Conv2d(4, 6, 3, stride=2, groups=2, bias=False)
        self.head = nn.Linear(6 * 2 * 2, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv(x))
        x = torch.tanh(self.depthwise(x))
        x = torch.tanh(self.grouped(x))
        return self.head(x.flatten(1))


MODELS = {
    "net": Net,
    "grouped": Grouped,
    "shared": SharedNet,
    "one_layer": OneLayer,
    "branchy": Branchy,
    "attention": Attention,
}


class NamedLikeDDP(nn.Module):
    """A model under DistributedDataParallel's layer names (``module.`` prefix), in one process."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)  # type: ignore[no-any-return]


#: ``curvature`` rules for :class:`Net` (conv1: a = 19, g = 4; conv2: a = 36, g = 5;
#: fc1: a = 21, g = 8; fc2: a = 8, g = 3), as hashable ``(regex, (A, G))`` pairs
#: (matching the names under DDP's ``module.`` prefix too).
#: Each mix holds every side kind on ``A`` and on ``G``; ``mix_exact_layer`` keeps
#: one layer exact on both sides (the compute method's own solve).
Curvature = tuple[tuple[str, tuple[str, str]], ...]
MIXED: dict[str, Curvature] = {
    "mix_a": (
        (r"(^|\.)conv1$", ("lowrank:4", "exact")),
        (r"(^|\.)conv2$", ("kvec", "diagonal")),
        (r"(^|\.)fc1$", ("exact", "lowrank:3")),
        (r"(^|\.)fc2$", ("diagonal", "kvec")),
    ),
    "mix_b": (
        (r"(^|\.)conv1$", ("diagonal", "kvec")),
        (r"(^|\.)conv2$", ("lowrank:8", "lowrank:2")),
        (r"(^|\.)fc1$", ("kvec", "exact")),
        (r"(^|\.)fc2$", ("exact", "diagonal")),
    ),
    "mix_exact_layer": (
        (r"(^|\.)conv1$", ("exact", "exact")),
        (r"(^|\.)conv2$", ("diagonal", "lowrank:2")),
        (r"(^|\.)fc1$", ("lowrank:5", "kvec")),
        (r"(^|\.)fc2$", ("kvec", "exact")),
    ),
}
BRANCH_SKIPPED = (1, 2)  # steps at which Branchy skips its branch on every rank
PARTIAL_WORLD = 4  # world size of the test in which one rank alone skips it
SMALL_BUCKET_MB = 1e-4  # 26 float32 elements: one all-reduce bucket per layer


ReferenceKey = tuple[
    str, bool, str, bool, int | None, str | None, bool, str, str, float, float | None, bool, int
]


@dataclass(frozen=True)
class Config:
    fraction: float = 1.0
    compute_method: str = "eigen"
    symmetry_aware: bool = False
    colocate_factors: bool = True
    ddp: bool = False
    update_factors_in_hook: bool = True
    accumulation_steps: int = 1
    eigen_outer_product: bool = True
    model: str = "net"
    bucket_cap_mb: float = 25.0
    branch_skipped_on: int | None = None  # Branchy: the one rank that skips (None: all)
    # damping_mode='relative' and factor_init='first_batch' (the demo's settings).
    relative: bool = False
    # A key of MIXED (fixed representations, Net only), or None: all exact.
    curvature: str | None = None
    # One process only: the model under DDP's layer names (see NamedLikeDDP).
    ddp_names: bool = False
    # Eigenvalue correction of the exact layers (spec §11) and grafting.
    correction: str = "off"
    grafting: str = "off"
    # A multiple of the damping.
    damping_scale: float = 1.0
    # eigenbasis_tolerance: bases kept while they still diagonalise the factors.
    basis_tolerance: float | None = None
    # adaptive_intervals: the intervals stretched while bases stay kept.
    adaptive: bool = False
    # inv_update_steps (factors every step).
    inv_steps: int = 2
    # fresh_start_steps: inverses at least every 2 steps before this step.
    fresh_start: int = 0
    stale_refresh: bool = True

    def reference_key(self) -> ReferenceKey:
        """The single-process run this configuration must reproduce.

        A low-rank side's first basis is seeded by its layer's name, which DDP
        prefixes with ``module.``; with fixed representations a DDP run is
        compared with a single process under the same names (the plain model
        differs: see :func:`test_low_rank_sides_do_not_depend_on_a_ddp_wrapper`).
        """
        return (
            self.compute_method,
            self.eigen_outer_product,
            self.model,
            self.relative,
            self.branch_skipped_on,
            self.curvature,
            self.ddp and self.curvature is not None,
            self.correction,
            self.grafting,
            self.damping_scale,
            self.basis_tolerance,
            self.adaptive,
            self.inv_steps,
            self.fresh_start,
            self.stale_refresh,
        )


def fractions(world_size: int) -> list[float]:
    """Every fraction ``m / N`` with ``m`` dividing ``N``."""
    return [m / world_size for m in range(1, world_size + 1) if world_size % m == 0]


def configs(world_size: int) -> list[Config]:
    grid = [
        Config(f, method, sym, colocate)
        for f, method, sym, colocate in itertools.product(
            fractions(world_size), ("eigen", "inverse"), (False, True), (False, True)
        )
    ]
    extra = []
    for i, (f, method) in enumerate(itertools.product(fractions(world_size), ("eigen", "inverse"))):
        extra += [
            Config(f, method, symmetry_aware=i % 2 == 1, ddp=True, bucket_cap_mb=SMALL_BUCKET_MB),
            Config(f, method, colocate_factors=i % 2 == 1, update_factors_in_hook=False),
            Config(f, method, accumulation_steps=2, ddp=i % 2 == 0),
            Config(f, method, accumulation_steps=2, ddp=i % 2 == 1, update_factors_in_hook=False),
        ]
    for i, f in enumerate(fractions(world_size)):
        extra += [
            # The eigen method without the precomputed outer product.
            Config(f, "eigen", eigen_outer_product=False, ddp=True),
            # Small buckets, all-reduced from the hooks while the backward pass runs.
            Config(f, "eigen", symmetry_aware=True, bucket_cap_mb=SMALL_BUCKET_MB),
            Config(f, "inverse", model="shared", colocate_factors=False, ddp=i % 2 == 0),
            Config(f, "eigen", model="shared", accumulation_steps=2, symmetry_aware=True),
            Config(f, "inverse", model="one_layer", ddp=i % 2 == 1),
            # A layer that no rank uses at some steps (DDP: find_unused_parameters).
            Config(f, "eigen", model="branchy", ddp=i % 2 == 0),
            Config(f, "inverse", model="branchy", ddp=i % 2 == 1, update_factors_in_hook=False),
            # Relative damping, factors from the first batch on.
            Config(f, "eigen", relative=True, ddp=i % 2 == 1, symmetry_aware=i % 2 == 0),
            Config(f, "inverse", relative=True, accumulation_steps=2, colocate_factors=False),
            # Attention, an embedding and a Conv1d (issue 16).
            Config(f, "eigen", model="attention", ddp=i % 2 == 0),
            # Grouped and depthwise convolutions (session 43).
            Config(f, "eigen", model="grouped", ddp=i % 2 == 1, symmetry_aware=i % 2 == 0),
            Config(f, "inverse", model="grouped", accumulation_steps=2, ddp=i % 2 == 0),
            # Eigenvalue correction (S with the gradient workers), grafting (issue 31).
            # The corrected solve is not invariant to the basis chosen inside a
            # (near-)degenerate eigenspace, which summation order decides: the
            # attention model's factors are full rank at this batch (Net's fc1
            # sees 16 rows of 21 inputs), and factors from the first batch on
            # (relative) have no eigenvalue cluster at the identity's.
            Config(f, "eigen", model="attention", correction="adam", relative=True, ddp=i % 2 == 0),
            Config(
                f,
                "eigen",
                model="attention",
                correction="adam",
                grafting="layer",
                relative=True,
                accumulation_steps=2,
                symmetry_aware=True,
            ),
            Config(
                f,
                "eigen",
                model="attention",
                correction="ekfac",
                relative=True,
                colocate_factors=False,
                update_factors_in_hook=False,
                ddp=i % 2 == 1,
            ),
            Config(f, "eigen", grafting="layer", accumulation_steps=2, ddp=i % 2 == 0),
            Config(f, "inverse", model="attention", accumulation_steps=2, symmetry_aware=True),
            # Stale bases only refreshed (eigenbasis_tolerance): the owner of a side
            # decides, so every rank keeps or replaces the same bases. The
            # tolerances lie between the shares of the sides kept and refreshed
            # at step 2 (one process): Net 0.13 | 0.20, attention 0.18 | 0.21.
            Config(f, "eigen", relative=True, basis_tolerance=0.17, ddp=i % 2 == 0),
            Config(
                f,
                "eigen",
                model="attention",
                correction="ekfac",
                relative=True,
                basis_tolerance=0.19,
                colocate_factors=False,
                ddp=i % 2 == 1,
            ),
            # Intervals that follow the bases (adaptive_intervals), inverses
            # every step: step 0's update is no evidence (the sides held the
            # identity); at this tolerance every side keeps its basis at step 1
            # and again at step 2, so the intervals double at each on every rank
            # alike (the counts are summed over the ranks): 2 after step 1,
            # 4 after step 2, and step 3 captures and refreshes nothing.
            Config(
                f,
                "eigen",
                relative=True,
                basis_tolerance=0.9,
                adaptive=True,
                inv_steps=1,
                symmetry_aware=i % 2 == 1,
                ddp=i % 2 == 0,
            ),
            # A fresh start: inverses every 4 steps, capped at 2 before step 3:
            # updates at steps 0 and 2 (without it, at step 0 only; stale_refresh,
            # which would refresh at step 2 too, off).
            Config(
                f,
                "eigen",
                relative=True,
                inv_steps=4,
                fresh_start=3,
                stale_refresh=False,
                ddp=i % 2 == 1,
            ),
        ]
    mixed = []
    for i, f in enumerate(fractions(world_size)):
        mixed += [
            Config(f, "eigen", curvature="mix_a"),
            Config(f, "eigen", curvature="mix_a", relative=True, update_factors_in_hook=False),
            Config(
                f,
                "eigen",
                curvature="mix_b",
                colocate_factors=False,
                symmetry_aware=True,
                ddp=i % 2 == 0,
                accumulation_steps=2,
            ),
            Config(f, "inverse", curvature="mix_exact_layer", bucket_cap_mb=SMALL_BUCKET_MB),
            # The correction of an (exact, diagonal) layer, fc2 (its diagonal side's
            # basis is the identity), and of a layer low-rank on both sides, conv2
            # (S with a rest row and column); kvec layers have no explicit basis.
            Config(
                f, "eigen", curvature="mix_b", correction="ekfac", relative=True, ddp=i % 2 == 1
            ),
            # The same under absolute damping, Adam's divisor. (Not mix_a: its cuts,
            # conv1's A at 4 and fc1's G at 3, fall where this net's spectra are flat
            # or at rounding level, so its corrected step moves by ~4e-4 of itself
            # for a 1e-7 change of the factor: one process summing in another order
            # differs as much. The unit tests cover one-sided ranks in float64.)
            Config(f, "eigen", curvature="mix_b", correction="adam", ddp=i % 2 == 0),
        ]
    return grid + extra + mixed


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of every step: ``(STEPS, GLOBAL_BATCH, ...)``."""
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(STEPS, GLOBAL_BATCH, 2, 6, 6, generator=gen)
    y = torch.randint(0, CLASSES, (STEPS, GLOBAL_BATCH), generator=gen)
    return x, y


def make_model(kind: str = "net") -> nn.Module:
    torch.manual_seed(SEED)
    return MODELS[kind]()


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def make_preconditioner(model: nn.Module, config: Config) -> kaisa.KFACPreconditioner:
    curvature = "exact" if config.curvature is None else dict(MIXED[config.curvature])
    return kaisa.KFACPreconditioner(
        model,
        curvature=curvature,
        factor_update_steps=1,
        inv_update_steps=config.inv_steps,
        damping=(RELATIVE_DAMPING if config.relative else DAMPING) * config.damping_scale,
        factor_decay=FACTOR_DECAY,
        kl_clip=KL_CLIP,
        lr=LR,
        accumulation_steps=config.accumulation_steps,
        colocate_factors=config.colocate_factors,
        compute_method=config.compute_method,
        compute_eigenvalue_outer_product=config.eigen_outer_product,
        grad_worker_fraction=config.fraction,
        symmetry_aware=config.symmetry_aware,
        update_factors_in_hook=config.update_factors_in_hook,
        allreduce_bucket_cap_mb=config.bucket_cap_mb,
        damping_mode="relative" if config.relative else "absolute",
        factor_init="first_batch" if config.relative else "identity",
        eigenvalue_correction=config.correction,
        grafting=config.grafting,
        eigenbasis_tolerance=config.basis_tolerance,
        adaptive_intervals=config.adaptive,
        fresh_start_steps=config.fresh_start,
        stale_refresh=config.stale_refresh,
    )


def train(config: Config, rank: int, world_size: int) -> list[torch.Tensor]:
    """Run STEPS steps on this rank's share of each global batch; weights after each step.

    Without a process group (``world_size == 1`` and no ``dist``), this is the
    single-process reference seeing the whole batch.
    """
    xs, ys = data()
    model = make_model(config.model)
    net: nn.Module = model
    if config.ddp:
        net = nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=config.model == "branchy"
        )
    elif config.ddp_names:
        net = NamedLikeDDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    preconditioner = make_preconditioner(net, config)
    assert preconditioner.world_size == world_size
    local = GLOBAL_BATCH // world_size
    micro = local // config.accumulation_steps
    history = []
    for step in range(STEPS):
        x = xs[step, rank * local : (rank + 1) * local]
        y = ys[step, rank * local : (rank + 1) * local]
        optimizer.zero_grad()
        if isinstance(model, Branchy):
            skipped = step in BRANCH_SKIPPED
            if world_size == 1 and config.branch_skipped_on is not None:
                # One process: only the skipping rank's share of the batch skips.
                share = GLOBAL_BATCH // PARTIAL_WORLD
                first = config.branch_skipped_on * share
                model.skip_rows = slice(first, first + share) if skipped else None
            else:
                model.use_branch = not skipped or config.branch_skipped_on not in (None, rank)
        for k in range(config.accumulation_steps):
            xb, yb = x[k * micro : (k + 1) * micro], y[k * micro : (k + 1) * micro]
            last = k == config.accumulation_steps - 1
            sync = net.no_sync() if config.ddp and not last else contextlib.nullcontext()
            with sync:
                loss = F.cross_entropy(net(xb), yb) / config.accumulation_steps
                loss.backward()
        if world_size > 1 and not config.ddp:
            for p in model.parameters():
                if p.grad is None and config.branch_skipped_on is not None:
                    p.grad = torch.zeros_like(p)  # used on the other ranks
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
        preconditioner.step()
        optimizer.step()
        history.append(flat_weights(model))
    # Nothing was left to the automatic choice: the plan holds the fixed representations.
    assert preconditioner.curvature_choice is None
    rules = MIXED[config.curvature] if config.curvature is not None else ((".*", ("exact",) * 2),)
    for la in preconditioner.plan.layers:
        (fixed,) = [sides for pattern, sides in rules if re.search(pattern, la.name)]
        assert (la.a_spec, la.g_spec) == fixed, la
    preconditioner.remove_hooks()
    telemetry = preconditioner.telemetry
    KEPT[config] = (telemetry.kept_eigenbases, telemetry.side_refreshes)
    STRETCH[config] = preconditioner.interval_stretch
    return history


#: Per configuration run in this process: (bases kept, side refreshes) of its last run.
KEPT: dict[Config, tuple[int, int]] = {}
#: Per configuration run in this process: the intervals' multiplier after its last run.
STRETCH: dict[Config, int] = {}


def _worker(rank: int, world_size: int, config_dicts: list[dict[str, object]]) -> list[object]:
    return [
        torch.stack(train(Config(**c), rank, world_size))  # type: ignore[arg-type]
        for c in config_dicts
    ]


def reference(config: Config) -> torch.Tensor:
    """Single process, no process group, whole global batch: ``(STEPS, params)``."""
    assert not dist.is_initialized()
    plain = Config(
        compute_method=config.compute_method,
        eigen_outer_product=config.eigen_outer_product,
        model=config.model,
        relative=config.relative,
        branch_skipped_on=config.branch_skipped_on,
        curvature=config.curvature,
        ddp_names=config.reference_key()[6],
        correction=config.correction,
        grafting=config.grafting,
        damping_scale=config.damping_scale,
        basis_tolerance=config.basis_tolerance,
        adaptive=config.adaptive,
        inv_steps=config.inv_steps,
    )
    return torch.stack(train(plain, 0, 1))


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread for the in-process reference (the machine is small and shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_RUNS: dict[int, list[list[torch.Tensor]]] = {}
_REFERENCES: dict[ReferenceKey, torch.Tensor] = {}


def runs(world_size: int) -> tuple[list[Config], list[list[torch.Tensor]]]:
    """Every configuration of a world size, in one spawned run shared by the tests below."""
    cases = configs(world_size)
    if world_size not in _RUNS:
        _RUNS[world_size] = run_distributed(
            _worker, world_size, [asdict(c) for c in cases], timeout=300
        )
    return cases, _RUNS[world_size]


def references_for(cases: list[Config]) -> dict[ReferenceKey, torch.Tensor]:
    """The single-process references of ``cases``, each checked to have teeth."""
    with single_thread():
        for c in cases:
            key = c.reference_key()
            if key not in _REFERENCES:
                _REFERENCES[key] = reference(c)
    references = {c.reference_key(): _REFERENCES[c.reference_key()] for c in cases}
    for key, ref in references.items():
        initial = flat_weights(make_model(key[2]))
        # The check has teeth: K-FAC moves the weights by far more than TOLERANCE.
        # (Relative damping, the corrected solves and grafting move them less in four steps.)
        moved = 1e3 if key[3] or key[7] != "off" or key[8] != "off" else 1e4
        assert (ref[-1] - initial).abs().max() > moved * TOLERANCE, key
    return references


def check_run(
    config: Config, per_rank: list[torch.Tensor], reference_run: torch.Tensor, world_size: int
) -> None:
    """Identical weights on every rank after every step, equal to one process's."""
    for rank in range(1, world_size):
        for step in range(STEPS):
            assert torch.equal(per_rank[rank][step], per_rank[0][step]), (
                f"{config}: after step {step}, rank {rank} holds different weights from rank 0"
            )
    tolerance = TOLERANCE if config.correction == "off" else CORRECTED_TOLERANCE
    torch.testing.assert_close(
        per_rank[0],
        reference_run,
        rtol=0.0,
        atol=tolerance,
        msg=lambda m: f"{config} (world size {world_size}): {m}",
    )


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_batch_split_invariance(world_size: int) -> None:
    """Exact curvature (spec §4) in every configuration."""
    cases, results = runs(world_size)
    chosen = [i for i, c in enumerate(cases) if c.curvature is None]
    references = references_for([cases[i] for i in chosen])
    for i in chosen:
        config = cases[i]
        check_run(
            config,
            [result[i] for result in results],
            references[config.reference_key()],
            world_size,
        )


def test_the_tolerance_configurations_keep_some_bases_and_refresh_others() -> None:
    """The equivalence above has teeth for ``eigenbasis_tolerance``: in one process each
    such configuration keeps some bases and decomposes others, and moves the weights
    differently from refreshing every basis."""
    tolerant = [
        c
        for c in configs(2)
        if c.basis_tolerance is not None and c.fraction == 1.0 and not c.adaptive
    ]
    assert tolerant
    with single_thread():
        for config in tolerant:
            plain = dataclasses.replace(config, fraction=1.0, ddp=False)
            weights = train(plain, 0, 1)[-1]
            kept, refreshes = KEPT[plain]
            assert 0 < kept < refreshes, config
            every = train(dataclasses.replace(plain, basis_tolerance=None), 0, 1)[-1]
            assert not torch.allclose(weights, every, atol=10 * CORRECTED_TOLERANCE), config


def test_the_adaptive_configuration_stretches_its_intervals() -> None:
    """The equivalence above has teeth for ``adaptive_intervals``: in one process the
    intervals double at steps 1 and 2, and the weights differ from the same run without it."""
    (config,) = [c for c in configs(2) if c.adaptive and c.fraction == 1.0]
    with single_thread():
        plain = dataclasses.replace(config, ddp=False, symmetry_aware=False)
        weights = train(plain, 0, 1)[-1]
        assert STRETCH[plain] == 4
        fixed = dataclasses.replace(plain, adaptive=False)
        unstretched = train(fixed, 0, 1)[-1]
        assert STRETCH[fixed] == 1
        assert not torch.allclose(weights, unstretched, atol=10 * TOLERANCE)


def test_the_fresh_start_configuration_refreshes_inside_it() -> None:
    """The equivalence above has teeth for ``fresh_start_steps``: in one process the
    inverses are refreshed at step 2 too, and the weights differ from the same run
    without it."""
    (config,) = [c for c in configs(2) if c.fresh_start and c.fraction == 1.0]
    with single_thread():
        plain = dataclasses.replace(config, ddp=False)
        weights = train(plain, 0, 1)[-1]
        refreshes = KEPT[plain][1]
        later = dataclasses.replace(plain, fresh_start=0)
        late = train(later, 0, 1)[-1]
        assert refreshes == 2 * KEPT[later][1] > 0  # steps 0 and 2, against step 0
        assert not torch.allclose(weights, late, atol=10 * TOLERANCE)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mixed_representations_batch_split_invariance(world_size: int) -> None:
    """Fixed mixed representations (spec §8), every fraction, reproduce one process (§5).

    Runs in the same spawned processes as :func:`test_batch_split_invariance`.
    A layer with an exact A and a non-exact G is among them: its solve ends
    in a transposed view, which the gradient broadcast must not send as is.
    """
    cases, results = runs(world_size)
    chosen = [i for i, c in enumerate(cases) if c.curvature is not None]
    assert {cases[i].curvature for i in chosen} == set(MIXED)
    assert {cases[i].fraction for i in chosen} == set(fractions(world_size))
    references = references_for([cases[i] for i in chosen])
    for i in chosen:
        # The representations matter: the mixed run is not the exact one.
        config = cases[i]
        exact = dataclasses.replace(config, curvature=None)
        exact_run = references_for([exact])[exact.reference_key()]
        difference = references[config.reference_key()][-1] - exact_run[-1]
        assert difference.abs().max() > 1e3 * TOLERANCE, config
    for i in chosen:
        config = cases[i]
        check_run(
            config,
            [result[i] for result in results],
            references[config.reference_key()],
            world_size,
        )


def test_a_layer_that_only_some_ranks_use() -> None:
    """Data-dependent control flow: at some steps one rank skips a layer the others use.

    Whether a rank called the layer must not decide which collectives it takes
    part in (the broadcasts and all-reduces would not pair up: a hang or a
    gloo size mismatch). Every rank must end each step with the same weights,
    and those must be one process's, in which the skipping rank's rows skip
    the layer: the layer's factors are the mean over the rows that went
    through it, not an average with zeros for the rank that skipped it.
    """
    world_size = PARTIAL_WORLD
    cases = [
        Config(
            f, method, model="branchy", ddp=ddp, update_factors_in_hook=hook, branch_skipped_on=1
        )
        for f, method, ddp, hook in itertools.product(
            (0.25, 0.5, 1.0), ("eigen", "inverse"), (False, True), (False, True)
        )
        if (method == "eigen") == (ddp == hook)  # half of the combinations
    ]
    results = run_distributed(_worker, world_size, [asdict(c) for c in cases], timeout=120)
    with single_thread():
        references = {c.reference_key(): reference(c) for c in cases}
    for i, config in enumerate(cases):
        for rank in range(1, world_size):
            assert torch.equal(results[rank][i], results[0][i]), (
                f"{config}: rank {rank} holds different weights from rank 0"
            )
        torch.testing.assert_close(
            results[0][i],
            references[config.reference_key()],
            rtol=0.0,
            atol=TOLERANCE,
            msg=lambda m, config=config: f"{config}: {m}",
        )


def test_low_rank_sides_do_not_depend_on_a_ddp_wrapper() -> None:
    """One process: the same model, plain and under DDP's layer names, trains alike.

    DistributedDataParallel only renames the layers (``module.conv1``); the
    subspace iteration's two steps from a name-seeded basis do not converge,
    so the seed shows in the weights.
    """
    with single_thread():
        plain = torch.stack(train(Config(curvature="mix_b"), 0, 1))
        named = torch.stack(train(Config(curvature="mix_b", ddp_names=True), 0, 1))
    torch.testing.assert_close(named, plain, rtol=0.0, atol=TOLERANCE)
