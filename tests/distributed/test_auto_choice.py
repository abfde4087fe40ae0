"""The automatic curvature choice under several ranks (spec §8): one choice everywhere.

Each rank captures its own share of the batch, but the choice is made from
the rows all-reduced with the factors at the first factor-update step (their
mean per rank), so every rank reaches the same :class:`BudgetChoice` and the
same work plan, even when the ranks see different numbers of rows, and it is
what :func:`kaisa.curvature.budget.choose_curvature` gives for those rows and
the side it protects, which every rank finds from the all-reduced grams and
one process finds from the same rows.
Training then continues in lockstep: identical weights on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import average_gradients, run_distributed
from torch import nn

import kaisa
from kaisa.curvature.budget import LayerWork, choose_curvature
from kaisa.curvature.costs import CostModel
from kaisa.distributed.plan import LayerShape, make_plan

WORLD_SIZE = 2
#: Rows per rank at every step: unequal, 64 on average.
LOCAL_ROWS = (48, 80)
MEAN_ROWS = sum(LOCAL_ROWS) / len(LOCAL_ROWS)
STEPS = 3
FRACTIONS = ("comm-opt", "mem-opt")
IN, HIDDEN, CLASSES = 64, 48, 10


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def expected_works() -> list[LayerWork]:
    """The budget's view of one rank's mean rows (Linear layers: plain rows)."""
    return [
        LayerWork.from_rows("0", IN + 1, HIDDEN, MEAN_ROWS),
        LayerWork.from_rows("2", HIDDEN + 1, CLASSES, MEAN_ROWS),
    ]


def _averaged_backward(model: nn.Module, rank: int, world_size: int, gen: torch.Generator) -> None:
    """This rank's rows forward and backward; gradients averaged over the ranks."""
    x = torch.randn(LOCAL_ROWS[rank], IN, generator=gen)
    y = torch.randint(0, CLASSES, (LOCAL_ROWS[rank],), generator=gen)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    average_gradients(model, world_size)


def _train(rank: int, world_size: int, fraction: str) -> dict[str, object]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # The defaults, with operator calls that cost nothing: the rule at the scale of 1.
    preconditioner = kaisa.KFACPreconditioner(
        model, lr=0.1, grad_worker_fraction=fraction, cost_model=CostModel(operator=1e-12)
    )
    before = (preconditioner.curvature_choice, preconditioner.plan)
    gen = torch.Generator().manual_seed(100 + rank)
    weights = []
    choices = []
    for _ in range(STEPS):
        _averaged_backward(model, rank, world_size, gen)
        preconditioner.step()
        optimizer.step()
        choices.append(preconditioner.curvature_choice)
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return {
        "before": before,
        "choices": choices,
        "plan": preconditioner.plan,
        "specs": [tuple(str(s) for s in layer.block.specs) for layer in preconditioner.layers],
        "intervals": (
            preconditioner.hyperparameter("factor_update_steps"),
            preconditioner.hyperparameter("inv_update_steps"),
            preconditioner.hyperparameter("factor_decay"),
        ),
        "weights": torch.stack(weights),
    }


def _worker(rank: int, world_size: int) -> dict[str, dict[str, object]]:
    return {fraction: _train(rank, world_size, fraction) for fraction in FRACTIONS}


def _single_process_protect() -> tuple[str, str] | None:
    """The side one process protects when it sees every rank's first rows at once."""
    model = make_model()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, cost_model=CostModel(operator=1e-12))
    xs, ys = [], []
    for rank in range(WORLD_SIZE):
        gen = torch.Generator().manual_seed(100 + rank)
        xs.append(torch.randn(LOCAL_ROWS[rank], IN, generator=gen))
        ys.append(torch.randint(0, CLASSES, (LOCAL_ROWS[rank],), generator=gen))
    F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
    pre.step()
    assert pre.curvature_choice is not None
    return pre.curvature_choice.protected


def test_every_rank_makes_the_budgets_choice() -> None:
    results = run_distributed(_worker, WORLD_SIZE, timeout=120)
    for fraction in FRACTIONS:
        where = f"fraction {fraction}"
        # The protected side comes from the all-reduced grams: one side on every rank.
        protected = {results[rank][fraction]["choices"][0].protected for rank in range(WORLD_SIZE)}
        assert len(protected) == 1, f"{where}: the ranks protect {protected}"
        (protect,) = protected
        assert protect is not None, where
        assert protect == _single_process_protect(), where
        expected = choose_curvature(expected_works(), 0.1, protect=protect)
        # The scenario has teeth: the choice is neither all exact nor one kind everywhere.
        kinds = {spec.split(":")[0] for sides in expected.specs.values() for spec in sides}
        assert len(kinds) > 1 and kinds != {"exact"}, expected
        provisional = make_plan(
            [LayerShape("0", IN + 1, HIDDEN), LayerShape("2", HIDDEN + 1, CLASSES)],
            WORLD_SIZE,
            fraction,
        )
        chosen = make_plan(
            [
                LayerShape("0", IN + 1, HIDDEN, *expected.specs["0"]),
                LayerShape("2", HIDDEN + 1, CLASSES, *expected.specs["2"]),
            ],
            WORLD_SIZE,
            fraction,
        )
        decay = min(0.95, max(0.5, 1.0 - expected.factor_update_steps / 200.0))
        for rank in range(WORLD_SIZE):
            got = results[rank][fraction]
            assert got["before"] == (None, provisional), f"{where}, rank {rank}"
            # Made at the first step, then kept.
            assert got["choices"] == [expected] * STEPS, f"{where}, rank {rank}"
            assert got["plan"] == chosen, f"{where}, rank {rank}"
            assert got["specs"] == [expected.specs["0"], expected.specs["2"]], where
            assert got["intervals"] == (
                expected.factor_update_steps,
                expected.inv_update_steps,
                decay,
            ), f"{where}, rank {rank}"
            # Training continues in lockstep.
            assert torch.equal(got["weights"], results[0][fraction]["weights"]), (
                f"{where}: rank {rank} holds different weights from rank 0"
            )
        moved = results[0][fraction]["weights"]
        assert not torch.equal(moved[0], moved[-1]), where


# -- the clock calibration: measured on each rank, agreed as the maximum ---------------------


def _calibrate(rank: int, world_size: int) -> dict[str, object]:
    import time

    from kaisa.autochoice import CALIBRATION_STEPS

    class Clock:
        now = 100.0

        def __call__(self) -> float:
            Clock.now += 1e-6
            return Clock.now

    time.perf_counter = Clock()  # this rank's process only
    model = make_model()
    preconditioner = kaisa.KFACPreconditioner(
        model, lr=0.1, time_budget=0.01, calibrate_budget=True, cost_model=CostModel(operator=1e-12)
    )
    # Rank 1's passes take a second each on its clock, rank 0's nothing (a
    # pre-hook after kaisa's, which starts the clock of a pass).
    model.register_forward_pre_hook(lambda *_: setattr(Clock, "now", Clock.now + rank))
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(CALIBRATION_STEPS + 2):
        _averaged_backward(model, rank, world_size, gen)
        preconditioner.step()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)  # type: ignore[operator]
    return {
        "choice": preconditioner.curvature_choice,
        "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def test_the_clock_calibration_is_the_same_on_every_rank() -> None:
    from kaisa.curvature.budget import MAX_TIME_SCALE

    works = expected_works()
    results = run_distributed(_calibrate, WORLD_SIZE, timeout=120)
    protect = results[0]["choice"].protected
    expected = choose_curvature(works, 0.01, scale=MAX_TIME_SCALE, calibrated=True, protect=protect)
    # The scale changes something.
    assert expected.specs != choose_curvature(works, 0.01, protect=protect).specs
    for rank in range(WORLD_SIZE):
        assert results[rank]["choice"] == expected, f"rank {rank}"
        assert torch.equal(results[rank]["weights"], results[0]["weights"]), f"rank {rank}"
