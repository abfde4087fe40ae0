"""The automatic curvature choice (spec §8) and the defaults built on it, in one process.

:func:`kaisa.curvature.budget.choose_curvature` against hand-computed costs;
:class:`kaisa.KFACPreconditioner` with ``curvature='auto'``: the warning for a
budget that cannot be met, per-layer overrides, fixed intervals, the
automatic decay, bad values, :meth:`~kaisa.KFACPreconditioner.with_reference_defaults`
and checkpoints that carry the choice.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa import autochoice
from kaisa.autochoice import diagonal_mismatch
from kaisa.curvature.budget import (
    MAX_FACTOR_STEPS,
    MAX_INV_STEPS,
    MIN_FACTOR_STEPS,
    MIN_INV_STEPS,
    BudgetChoice,
    LayerWork,
    binding_side,
    choose_curvature,
)
from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel, SideSpec
from kaisa.options import REFERENCE_DEFAULTS

UNMEETABLE = "kaisa: time_budget=.* cannot be met"


# -- choose_curvature, by hand ------------------------------------------------------------------


#: Operator calls that cost nothing: these tests check the rule at the scale of 1.
NO_OPERATORS = CostModel(operator=1e-12)


def layers(*sizes: tuple[int, int], rows: float = 32.0) -> list[LayerWork]:
    return [LayerWork.from_rows(f"l{i}", a, g, rows) for i, (a, g) in enumerate(sizes)]


# Side sizes where a low rank costs as much as the exact side (16, 32, 64: the
# first rung is k = n/2), next to plain ones.
SIZES = [(10, 40), (16, 3), (33, 32), (65, 64), (7, 129)]


def test_the_choice_is_a_pure_function_of_the_costs() -> None:
    work = layers(*SIZES, rows=48.0)
    for budget in (1e-6, 0.05, 0.1, 0.5, 1e6):
        first = choose_curvature(work, budget)
        assert choose_curvature(list(work), budget) == first
        assert choose_curvature(copy.deepcopy(work), budget) == first
        assert isinstance(first, BudgetChoice)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("sizes", [[(10, 40)], [(16, 3)], [(32, 32)], SIZES], ids=str)
def test_a_tiny_budget_degrades_to_the_cheapest(method: str, sizes: list[tuple[int, int]]) -> None:
    rows = 8.0
    choice = choose_curvature(layers(*sizes, rows=rows), 1e-9, compute_method=method)
    assert choice.specs == {f"l{i}": ("diagonal", "diagonal") for i in range(len(sizes))}
    assert (choice.factor_update_steps, choice.inv_update_steps) == (
        MAX_FACTOR_STEPS,
        MAX_INV_STEPS,
    )
    assert choice.within_budget is False
    # Diagonal sides: row moments 2·rows·n per factor update, a refresh of n,
    # and n per column to apply (each side to the other side's columns);
    # captures and applies weighted as the cost model weighs them.
    by_hand = sum(
        DEFAULT_COST_MODEL.capture * 2 * rows * (a + g) / MAX_FACTOR_STEPS
        + (a + g) / MAX_INV_STEPS
        + DEFAULT_COST_MODEL.apply * 2 * a * g
        for a, g in sizes
    )
    assert choice.kfac_work == pytest.approx(by_hand, rel=1e-12)
    assert choice.training_work == sum(3 * rows * a * g for a, g in sizes)
    assert choice.share == pytest.approx(by_hand / choice.training_work, rel=1e-12)


def test_a_tiny_budget_keeps_what_the_user_fixed() -> None:
    work = [
        LayerWork.from_rows("l0", 20, 12, 8.0, a_fixed="exact"),
        LayerWork.from_rows("l1", 30, 6, 8.0, g_fixed="kvec"),
    ]
    choice = choose_curvature(work, 1e-9, factor_update_steps=3)
    assert choice.specs == {"l0": ("exact", "diagonal"), "l1": ("diagonal", "kvec")}
    assert (choice.factor_update_steps, choice.inv_update_steps) == (3, MAX_INV_STEPS)
    assert choice.within_budget is False


def exact_work(
    sizes: list[tuple[int, int]],
    rows: float,
    f: int,
    i: int,
    model: CostModel = DEFAULT_COST_MODEL,
) -> float:
    """Exact eigen sides by hand: grams rows·n² every ``f`` steps, one eigendecomposition
    eigh·n³ per side every ``i``, and Q_Gᵀ ∇ Q_A and back (2n² per column on each side),
    weighed by ``model``."""
    return sum(
        model.capture * rows * (a * a + g * g) / f
        + model.eigh * (a**3 + g**3) / i
        + model.apply * (2 * a * a * g + 2 * g * g * a)
        for a, g in sizes
    )


def test_a_huge_budget_keeps_everything_exact_at_the_shortest_intervals() -> None:
    rows = 16.0
    choice = choose_curvature(layers(*SIZES, rows=rows), 1e6)
    assert choice.specs == {f"l{i}": ("exact", "exact") for i in range(len(SIZES))}
    # Steps 1-3 start from (MIN_FACTOR_STEPS, MIN_INV_STEPS) and move nothing; step 4
    # spends the rest of the allowance on inverses at every factor update.
    assert (MIN_FACTOR_STEPS, MIN_INV_STEPS) == (10, 100)
    assert (choice.factor_update_steps, choice.inv_update_steps) == (10, 10)
    assert choice.within_budget is True
    assert choice.kfac_work == pytest.approx(exact_work(SIZES, rows, 10, 10), rel=1e-12)


@pytest.mark.parametrize("fits", [10, 20, 40, 80])
def test_what_is_left_of_the_allowance_buys_fresher_eigenbases(fits: int) -> None:
    """Step 4: the inverse interval is the shortest 10·2^k that fits, never the 100 of step 1.

    The budget lies between the work at inverses every ``fits`` and every ``fits / 2``
    steps (both above the work at every 100, so steps 1-3 move nothing).
    """
    rows, sizes = 16.0, [(65, 64), (129, 64)]
    work = layers(*sizes, rows=rows)
    train = sum(w.training for w in work)
    low = exact_work(sizes, rows, 10, fits)
    high = exact_work(sizes, rows, 10, fits // 2) if fits > 10 else 2 * low
    budget = (low + high) / 2 / train
    assert exact_work(sizes, rows, 10, 100) < low < high
    choice = choose_curvature(work, budget)
    assert choice.specs == {"l0": ("exact", "exact"), "l1": ("exact", "exact")}
    assert (choice.factor_update_steps, choice.inv_update_steps) == (10, fits)
    assert choice.within_budget is True
    assert choice.kfac_work == pytest.approx(low, rel=1e-12)
    assert choice.kfac_work <= budget * train
    # Between the work at 100 and at 80 nothing fits: inverses stay at 100.
    budget = (exact_work(sizes, rows, 10, 100) + exact_work(sizes, rows, 10, 80)) / 2 / train
    assert choose_curvature(work, budget).inv_update_steps == 100


def test_fresher_eigenbases_follow_a_fixed_factor_interval_never_a_fixed_inverse_one() -> None:
    rows, sizes = 16.0, [(65, 64)]
    work = layers(*sizes, rows=rows)
    # A factor interval of 3 fixed: candidates 3, 6, 12, ..., 96.
    choice = choose_curvature(work, 1e6, factor_update_steps=3)
    assert (choice.factor_update_steps, choice.inv_update_steps) == (3, 3)
    train = sum(w.training for w in work)
    budget = (exact_work(sizes, rows, 3, 12) + exact_work(sizes, rows, 3, 6)) / 2 / train
    choice = choose_curvature(work, budget, factor_update_steps=3)
    assert (choice.factor_update_steps, choice.inv_update_steps) == (3, 12)
    # An inverse interval the user fixed is never shortened.
    choice = choose_curvature(work, 1e6, inv_update_steps=100)
    assert (choice.factor_update_steps, choice.inv_update_steps) == (10, 100)
    # Over budget (the cheapest choice): nothing is spent.
    choice = choose_curvature(work, 1e-9)
    assert choice.within_budget is False
    assert choice.inv_update_steps == MAX_INV_STEPS


def test_a_wide_linear_layer_at_the_default_budget() -> None:
    """nn.Linear(3137, 128) on 128 rows: A (3138 wide) cannot stay exact within 0.1.

    Neither can G: its exact application alone, ``2·g²`` per column of ``A``,
    is ``2g / (3·rows)`` = 2/3 of the layer's own work, whatever A and the
    intervals are. The choice fits the budget.
    """
    a, g, rows = 3137 + 1, 128, 128.0
    choice = choose_curvature([LayerWork.from_rows("fc", a, g, rows)], 0.1)
    a_spec, g_spec = choice.specs["fc"]
    assert a_spec != "exact"
    assert (2 * g * g * a) / (3 * rows * a * g) == pytest.approx(2 / 3)
    assert g_spec != "exact"
    assert choice.within_budget is True
    assert choice.share <= 0.1


def test_with_a_correction_on_the_choice_is_the_plain_one_and_names_what_it_leaves() -> None:
    """The correction does not change the ladder: a layer the budget holds in Kronecker
    vectors keeps K-FAC's solve (and is named once); every exact, low-rank or diagonal
    one is corrected."""
    model = MLP()
    plain = kaisa.KFACPreconditioner(model, lr=0.1, cost_model=NO_OPERATORS, time_budget=0.15)
    run(model, plain, range(2))
    plain.remove_hooks()
    model = MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = kaisa.KFACPreconditioner(
            model, lr=0.1, cost_model=NO_OPERATORS, time_budget=0.15, eigenvalue_correction="ekfac"
        )
        run(model, pre, range(2))
    choice = pre.curvature_choice
    assert choice is not None and choice.within_budget
    assert choice == plain.curvature_choice
    assert choice == choose_curvature(mlp_work(), 0.15, protect=choice.protected)
    reached = ("exact", "lowrank", "diagonal")
    left = [layer.name for layer in pre.layers if not layer.corrected]
    assert left  # the budget holds a side of this MLP in Kronecker vectors
    for layer in pre.layers:
        assert layer.corrected == all(SideSpec.parse(s).kind in reached for s in layer.curvature)
    said = [str(w.message) for w in caught if "eigenvalue_correction" in str(w.message)]
    assert len(said) == 1 and all(repr(name) in said[0] for name in left)
    assert "a larger time_budget" in said[0]  # what would let it reach them


@pytest.mark.parametrize("budget", [-1, 0, float("inf"), float("nan")])
def test_choose_curvature_refuses_a_bad_budget(budget: float) -> None:
    with pytest.raises(ValueError, match=r"time_budget must be a finite number > 0"):
        choose_curvature(layers((4, 4)), budget)
    with pytest.raises(TypeError, match=r"time_budget must be a number > 0; got 'x'"):
        choose_curvature(layers((4, 4)), "x")  # type: ignore[arg-type]


def test_the_default_cost_model_is_the_one_the_choice_uses() -> None:
    work = layers(*SIZES, rows=48.0)
    for budget in (1e-6, 0.05, 0.1, 0.5, 1e6):
        assert choose_curvature(work, budget, cost_model=DEFAULT_COST_MODEL) == (
            choose_curvature(work, budget)
        )
        assert choose_curvature(work, budget, cost_model=CostModel()) == (
            choose_curvature(work, budget)
        )


def test_another_cost_model_is_weighed_as_given() -> None:
    """A machine whose decompositions are dearer: the same rule on other weights."""
    rows, sizes = 16.0, [(65, 64), (129, 64)]
    work = layers(*sizes, rows=rows)
    dear = CostModel(eigh=64.0, cholesky_inverse=4.0, capture=1.0, apply=3.0)
    choice = choose_curvature(work, 1e6, cost_model=dear)
    assert choice.specs == {"l0": ("exact", "exact"), "l1": ("exact", "exact")}
    assert choice.kfac_work == pytest.approx(exact_work(sizes, rows, 10, 10, dear), rel=1e-12)
    # A budget between the work at inverses every 40 and every 20 steps under
    # those weights: step 4 stops at 40 there, and at 10 under the defaults.
    train = sum(w.training for w in work)
    budget = (exact_work(sizes, rows, 10, 40, dear) + exact_work(sizes, rows, 10, 20, dear)) / 2
    budget /= train
    assert choose_curvature(work, budget, cost_model=dear).inv_update_steps == 40
    assert choose_curvature(work, budget).inv_update_steps == 10


def test_choose_curvature_refuses_what_is_not_a_cost_model() -> None:
    with pytest.raises(TypeError, match=r"cost_model must be a CostModel; got dict"):
        choose_curvature(layers((4, 4)), 0.1, cost_model={"eigh": 8.0})  # type: ignore[arg-type]


# -- the choice as plain data -------------------------------------------------------------------


def saved_choice() -> dict[str, Any]:
    work = layers((10, 40), (33, 32), (7, 129), rows=48.0)
    choice = choose_curvature(work, 0.05, scale=2**0.5, calibrated=True)
    assert len(set(choice.specs.values())) > 1  # a mix of representations
    return choice.state_dict()


def test_a_choice_restores_itself_from_its_state() -> None:
    work = layers(*SIZES, rows=48.0)
    for budget in (1e-6, 0.05, 1e6):
        choice = choose_curvature(work, budget)
        state = choice.state_dict()
        assert state == dataclasses.asdict(choice)
        assert BudgetChoice.from_state(state) == choice
        # Through JSON (pairs become lists, numbers may be ints): the same choice.
        assert BudgetChoice.from_state(json.loads(json.dumps(state))) == choice
    # A choice saved before the clock calibration lacks its two fields.
    old = {k: v for k, v in saved_choice().items() if k not in ("time_scale", "calibrated")}
    restored = BudgetChoice.from_state(old)
    assert (restored.time_scale, restored.calibrated) == (1.0, False)
    # Representations are read as specs and written back in their own spelling.
    state = {**saved_choice(), "specs": {"l0": [" LowRank : 8 ", "KVEC"]}, "budget": 1}
    restored = BudgetChoice.from_state(state)
    assert restored.specs == {"l0": ("lowrank:8", "kvec")}
    assert restored.budget == 1.0 and isinstance(restored.budget, float)


def with_(**changes: Any) -> dict[str, Any]:
    return {**saved_choice(), **changes}


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in saved_choice().items() if k != key}


WHERE = "state_dict 'curvature_choice'"
BAD_STATES: list[tuple[str, Any, type[Exception], str]] = [
    ("not a dict", "auto", TypeError, f"{WHERE} must be a dict or None; got str"),
    ("a list", [("exact", "exact")], TypeError, f"{WHERE} must be a dict or None; got list"),
    (
        "a field missing",
        without("budget"),
        ValueError,
        f"{WHERE} is malformed: missing ['budget'], unexpected []",
    ),
    (
        "a field too many",
        with_(cost=1.0),
        ValueError,
        f"{WHERE} is malformed: missing [], unexpected ['cost']",
    ),
    (
        "specs as a list",
        with_(specs=[("exact", "exact")]),
        TypeError,
        f"{WHERE} is malformed: 'specs' must map layer names to (A, G); got list",
    ),
    (
        "a single representation",
        with_(specs={"l0": "exact"}),
        TypeError,
        f"{WHERE} is malformed: specs['l0'] must be a pair (A, G) of representations; got 'exact'",
    ),
    (
        "three representations",
        with_(specs={"l0": ("exact", "kvec", "diagonal")}),
        TypeError,
        f"{WHERE} is malformed: specs['l0'] must be a pair (A, G) of representations; "
        "got ('exact', 'kvec', 'diagonal')",
    ),
    (
        "a layer name not a string",
        with_(specs={3: ("exact", "exact")}),
        TypeError,
        f"{WHERE} is malformed: specs[3] must be a pair (A, G) of representations; "
        "got ('exact', 'exact')",
    ),
    (
        "an unknown representation",
        with_(specs={"l0": ("kvec", "x")}),
        ValueError,
        f"{WHERE} is malformed: specs['l0']: curvature representation must be one of "
        "'exact', 'lowrank', 'kvec', 'diagonal' (lowrank as 'lowrank:K'); got 'x'",
    ),
    (
        "a low rank without its rank",
        with_(specs={"l0": ("lowrank", "kvec")}),
        ValueError,
        f"{WHERE} is malformed: specs['l0']: 'lowrank' needs its rank: 'lowrank:K' with "
        "K >= 1; got 'lowrank'",
    ),
    (
        "a representation not a string",
        with_(specs={"l0": ("exact", 3)}),
        ValueError,
        f"{WHERE} is malformed: specs['l0']: a curvature representation must be a string; got 3",
    ),
    (
        "a factor interval of 0",
        with_(factor_update_steps=0),
        ValueError,
        f"{WHERE}: 'factor_update_steps' must be an integer >= 1; got 0",
    ),
    (
        "an inverse interval as a string",
        with_(inv_update_steps="2"),
        TypeError,
        f"{WHERE}: 'inv_update_steps' must be an integer >= 1; got '2'",
    ),
    (
        "an inverse interval as a bool",
        with_(inv_update_steps=True),
        TypeError,
        f"{WHERE}: 'inv_update_steps' must be an integer >= 1; got True",
    ),
    (
        "an interval as a float",
        with_(factor_update_steps=10.0),
        TypeError,
        f"{WHERE}: 'factor_update_steps' must be an integer >= 1; got 10.0",
    ),
    (
        "work as a string",
        with_(kfac_work="1"),
        TypeError,
        f"{WHERE}: 'kfac_work' must be a number; got '1'",
    ),
    (
        "work as a bool",
        with_(training_work=False),
        TypeError,
        f"{WHERE}: 'training_work' must be a number; got False",
    ),
    (
        "work NaN",
        with_(training_work=float("nan")),
        ValueError,
        f"{WHERE}: 'training_work' must be a finite number >= 0; got nan",
    ),
    (
        "a negative budget",
        with_(budget=-0.1),
        ValueError,
        f"{WHERE}: 'budget' must be a finite number >= 0; got -0.1",
    ),
    (
        "an infinite budget",
        with_(budget=float("inf")),
        ValueError,
        f"{WHERE}: 'budget' must be a finite number >= 0; got inf",
    ),
    (
        "within_budget not a bool",
        with_(within_budget=1),
        TypeError,
        f"{WHERE}: 'within_budget' must be True or False; got 1",
    ),
    (
        "calibrated not a bool",
        with_(calibrated="yes"),
        TypeError,
        f"{WHERE}: 'calibrated' must be True or False; got 'yes'",
    ),
    (
        "a time scale below 1",
        with_(time_scale=0.5),
        ValueError,
        f"{WHERE}: 'time_scale' must be a number in [1, 16]; got 0.5",
    ),
    (
        "a time scale above the largest",
        with_(time_scale=32.0),
        ValueError,
        f"{WHERE}: 'time_scale' must be a number in [1, 16]; got 32.0",
    ),
    (
        "a time scale as a bool",
        with_(time_scale=True),
        ValueError,
        f"{WHERE}: 'time_scale' must be a number in [1, 16]; got True",
    ),
    (
        "a time scale NaN",
        with_(time_scale=float("nan")),
        ValueError,
        f"{WHERE}: 'time_scale' must be a number in [1, 16]; got nan",
    ),
]


@pytest.mark.parametrize(
    ("saved", "error", "message"),
    [pytest.param(s, e, m, id=name) for name, s, e, m in BAD_STATES],
)
def test_a_bad_saved_choice_is_refused(saved: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        BudgetChoice.from_state(saved)


def test_a_saved_choice_is_refused_in_the_callers_words() -> None:
    with pytest.raises(ValueError, match=r"^checkpoint\['choice'\]: 'budget' must be"):
        BudgetChoice.from_state(with_(budget=-1.0), where="checkpoint['choice']")


# -- the preconditioner's choice ----------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


ROWS = 24


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 20, generator=gen), torch.randint(0, 5, (ROWS,), generator=gen)


def mlp_work(**fixed: tuple[str | None, str | None]) -> list[LayerWork]:
    """The budget's view of :class:`MLP` on one batch (Linear: plain row products)."""
    out = []
    for name, a, g in (("fc1", 21, 16), ("fc2", 17, 5)):
        a_fixed, g_fixed = fixed.get(name, (None, None))
        out.append(LayerWork.from_rows(name, a, g, ROWS, a_fixed, g_fixed))
    return out


def run(
    model: nn.Module, pre: kaisa.KFACPreconditioner, steps: range, lr: float = 0.1
) -> list[list[torch.Tensor]]:
    """Train ``steps`` steps with plain SGD; the preconditioned gradients of each."""
    grads = []
    for step in steps:
        x, y = batch(step)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        grads.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)  # type: ignore[operator]
    return grads


def specs_of(pre: kaisa.KFACPreconditioner) -> dict[str, tuple[str, str]]:
    return {layer.name: tuple(str(s) for s in layer.block.specs) for layer in pre.layers}  # type: ignore[misc]


def test_the_defaults() -> None:
    pre = kaisa.KFACPreconditioner(MLP(), lr=0.1, cost_model=NO_OPERATORS)
    options = pre.options
    assert (options.curvature, options.time_budget) == ("auto", 0.1)
    assert (options.damping, options.damping_mode, options.kl_clip) == (0.03, "relative", 0.003)
    assert options.factor_init == "first_batch"
    assert options.auto == {"factor_update_steps", "inv_update_steps", "factor_decay"}
    assert pre.curvature_choice is None
    run(pre.model, pre, range(1))
    choice = pre.curvature_choice
    assert choice is not None
    assert choice == choose_curvature(mlp_work(), 0.1, protect=choice.protected)
    assert specs_of(pre) == choice.specs
    assert {(la.a_spec, la.g_spec) for la in pre.plan.layers} == set(choice.specs.values())
    assert pre.hyperparameter("factor_update_steps") == choice.factor_update_steps
    assert pre.hyperparameter("inv_update_steps") == choice.inv_update_steps


def test_an_unmeetable_budget_warns_once_and_takes_the_cheapest() -> None:
    model = MLP()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, cost_model=NO_OPERATORS, time_budget=1e-6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Two factor-update steps (0 and MAX_FACTOR_STEPS) and two inverse updates.
        run(model, pre, range(MAX_FACTOR_STEPS + 1))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "time_budget=1e-06 cannot be met" in messages[0]
    assert "using the cheapest" in messages[0]
    choice = pre.curvature_choice
    assert choice is not None and not choice.within_budget
    # (No clock calibration by default: the cost model's choice, made once.)
    assert not choice.calibrated
    assert choice == choose_curvature(mlp_work(), 1e-6, protect=choice.protected)
    assert specs_of(pre) == {"fc1": ("diagonal", "diagonal"), "fc2": ("diagonal", "diagonal")}
    assert pre.hyperparameter("factor_update_steps") == MAX_FACTOR_STEPS
    assert pre.hyperparameter("inv_update_steps") == MAX_INV_STEPS
    assert pre.hyperparameter("factor_decay") == pytest.approx(1 - MAX_FACTOR_STEPS / 200)
    # Steps 0 and MAX_FACTOR_STEPS.
    assert [layer.block.updates for layer in pre.layers] == [2, 2]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_budget_warning_points_at_the_callers_step() -> None:
    model = MLP()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, cost_model=NO_OPERATORS, time_budget=1e-6)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=UNMEETABLE) as caught:
        pre.step()
    assert caught[0].filename == __file__


def test_a_per_layer_override_is_kept_and_the_rest_is_chosen() -> None:
    model = MLP()
    pre = kaisa.KFACPreconditioner(
        model,
        lr=0.1,
        cost_model=NO_OPERATORS,
        curvature={"fc1": ("kvec", "auto")},
        time_budget=1e-6,
    )
    assert pre.options.fixed_sides("fc1") == ("kvec", None)
    assert pre.options.fixed_sides("fc2") == (None, None)
    with pytest.warns(RuntimeWarning, match=UNMEETABLE):
        run(model, pre, range(1))
    choice = pre.curvature_choice
    assert choice is not None
    assert choice == choose_curvature(mlp_work(fc1=("kvec", None)), 1e-6, protect=choice.protected)
    # kvec stays although diagonal is cheaper; the free sides go to the bottom.
    assert specs_of(pre) == {"fc1": ("kvec", "diagonal"), "fc2": ("diagonal", "diagonal")}


def test_an_override_of_every_side_leaves_only_the_intervals() -> None:
    model = MLP()
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, cost_model=NO_OPERATORS, curvature=("exact", "kvec"), time_budget=1e6
    )
    run(model, pre, range(1))
    assert specs_of(pre) == {"fc1": ("exact", "kvec"), "fc2": ("exact", "kvec")}
    assert pre.curvature_choice is not None
    assert pre.hyperparameter("factor_update_steps") == MIN_FACTOR_STEPS


@pytest.mark.parametrize(
    ("factor_update_steps", "decay"),
    [(5, 0.95), (20, 0.9), (40, 0.8), (80, 0.6), (400, 0.5)],
)
def test_fixed_intervals_are_kept_and_the_decay_follows_them(
    factor_update_steps: int, decay: float
) -> None:
    """``factor_decay=None``: ``1 − F/200``, kept within [0.5, 0.95]."""
    model = MLP()
    pre = kaisa.KFACPreconditioner(
        model,
        lr=0.1,
        cost_model=NO_OPERATORS,
        factor_update_steps=factor_update_steps,
        time_budget=1e6,
        # The schedule as given (stale_refresh shortens it when the curvature
        # drifts, as this MLP's does: tests/test_stale_refresh.py).
        stale_refresh=False,
    )
    run(model, pre, range(11))
    choice = pre.curvature_choice
    assert choice is not None
    assert choice.factor_update_steps == factor_update_steps
    assert not choice.calibrated  # no clock by default
    assert choice == choose_curvature(
        mlp_work(), 1e6, factor_update_steps=factor_update_steps, protect=choice.protected
    )
    assert pre.hyperparameter("factor_update_steps") == factor_update_steps
    assert pre.hyperparameter("inv_update_steps") == choice.inv_update_steps
    assert pre.hyperparameter("factor_decay") == pytest.approx(decay)
    # Factor updates at the multiples of the interval among steps 0..10.
    expected_updates = len(range(0, 11, factor_update_steps))
    assert [layer.block.updates for layer in pre.layers] == [expected_updates] * 2


def test_a_chosen_interval_sets_the_decay() -> None:
    model = MLP()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, cost_model=NO_OPERATORS, time_budget=1e-6)
    with pytest.warns(RuntimeWarning, match=UNMEETABLE):
        run(model, pre, range(1))
    assert pre.hyperparameter("factor_decay") == pytest.approx(1 - MAX_FACTOR_STEPS / 200)
    fixed = kaisa.KFACPreconditioner(
        MLP(), lr=0.1, cost_model=NO_OPERATORS, time_budget=1e-6, factor_decay=0.7
    )
    with pytest.warns(RuntimeWarning, match=UNMEETABLE):
        run(fixed.model, fixed, range(1))
    assert fixed.hyperparameter("factor_decay") == 0.7


def test_nothing_left_to_choose_but_the_decay_is_not_a_budget_choice() -> None:
    options: dict[str, Any] = dict(
        curvature="exact", factor_update_steps=1, inv_update_steps=1, lr=0.1
    )
    model = MLP()
    pending = kaisa.KFACPreconditioner(model, cost_model=NO_OPERATORS, **options)
    decided = kaisa.KFACPreconditioner(copy.deepcopy(model), factor_decay=0.95, **options)
    x, y = batch(0)
    F.cross_entropy(pending.model(x), y).backward()
    F.cross_entropy(decided.model(x), y).backward()
    # Both capture only what exact sides hold: the grams.
    assert pending.memory_usage()["captures"] == decided.memory_usage()["captures"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pending.step()
    assert pending.hyperparameter("factor_decay") == 0.95


# -- bad values ---------------------------------------------------------------------------------

ALLOWED = r"allowed: 'auto', 'exact', 'lowrank:K', 'kvec', 'diagonal'"
BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"time_budget": -1}, ValueError, r"time_budget must be a finite number > 0 .*got -1"),
    ({"time_budget": 0}, ValueError, r"time_budget must be a finite number > 0 .*got 0"),
    ({"time_budget": float("inf")}, ValueError, r"time_budget must be a finite .*got inf"),
    ({"time_budget": "x"}, TypeError, r"time_budget must be a number > 0; got 'x'"),
    ({"time_budget": True}, TypeError, r"time_budget must be a number > 0; got True"),
    (
        {"curvature": "lowrank"},
        ValueError,
        r"curvature: 'lowrank' needs its rank: 'lowrank:K' with K >= 1; got 'lowrank'; " + ALLOWED,
    ),
    ({"curvature": "lowrank:0"}, ValueError, r"curvature: .*rank k >= 1.*got 0; " + ALLOWED),
    ({"curvature": "foo"}, ValueError, r"curvature: .*got 'foo'; " + ALLOWED),
    (
        {"curvature": ("exact",)},
        ValueError,
        r"curvature must be one representation or a pair \(A, G\); got \('exact',\)",
    ),
    (
        {"curvature": ("exact", "kvec", "diagonal")},
        ValueError,
        r"curvature must be one representation or a pair \(A, G\)",
    ),
    ({"curvature": {"fc1": ("kvec", "bar")}}, ValueError, r"curvature\['fc1'\]: .*'bar'"),
    (
        {"curvature": {"(": "exact"}},
        ValueError,
        r"curvature holds an invalid regular expression '\('",
    ),
    ({"curvature": {3: "exact"}}, TypeError, r"curvature keys must be regular expressions"),
    ({"curvature": 3}, TypeError, r"curvature must be 'auto', a representation .*; got 3"),
    (
        {"curvature": "lowrank:999"},
        ValueError,
        r"layer 'fc1', factor A: 'lowrank:999' has a rank above the factor's side 11; "
        r"allowed: 1 <= k <= 11",
    ),
    (
        {"curvature": {"fc1": ("auto", "lowrank:4")}},
        ValueError,
        r"layer 'fc1', factor G: 'lowrank:4' has a rank above the factor's side 3",
    ),
]


class TenWide(nn.Module):
    """A 10-wide layer (A side 11 with the bias, G side 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(x)


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_curvature_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        kaisa.KFACPreconditioner(TenWide(), lr=0.1, **kwargs)


def test_good_curvature_arguments() -> None:
    for curvature in (
        "auto",
        "EXACT",
        (" lowrank : 11 ", "auto"),
        ("kvec", "auto"),
        ["diagonal", "lowrank:3"],
        {r"fc\d": ("lowrank:2", "exact")},
        {"nothing matches": "kvec"},
    ):
        kaisa.KFACPreconditioner(TenWide(), lr=0.1, curvature=curvature)  # type: ignore[arg-type]


# -- reference defaults -------------------------------------------------------------------------


def test_with_reference_defaults_restores_the_published_semantics() -> None:
    saved = dict(REFERENCE_DEFAULTS)
    model = MLP()
    pre = kaisa.KFACPreconditioner.with_reference_defaults(model, lr=0.1)
    for name, value in REFERENCE_DEFAULTS.items():
        assert getattr(pre.options, name) == value, name
    assert pre.options.auto == frozenset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, pre, range(3))
    assert pre.curvature_choice is None
    assert specs_of(pre) == {"fc1": ("exact", "exact"), "fc2": ("exact", "exact")}
    for name, value in (
        ("factor_update_steps", 1),
        ("inv_update_steps", 1),
        ("damping", 0.001),
        ("factor_decay", 0.95),
        ("kl_clip", 0.001),
    ):
        assert pre.hyperparameter(name) == value, name
    assert [layer.block.updates for layer in pre.layers] == [3, 3]
    # Given arguments win; the table itself is left alone.
    other = kaisa.KFACPreconditioner.with_reference_defaults(
        MLP(), lr=0.1, damping=0.5, curvature="kvec", factor_init="first_batch"
    )
    assert (other.options.damping, other.options.curvature) == (0.5, "kvec")
    assert (other.options.factor_init, other.options.damping_mode) == ("first_batch", "absolute")
    assert saved == REFERENCE_DEFAULTS


# -- checkpoints carry the choice ---------------------------------------------------------------

#: Intervals short enough that the steps after the checkpoint update factors
#: and second-order state; the mix of diagonal, kvec and exact comes from the
#: budget and the overrides.
CHECKPOINT_OPTIONS: dict[str, Any] = dict(
    curvature={"fc1": ("kvec", "auto"), "fc2": ("auto", "exact")},
    time_budget=1e-6,
    factor_update_steps=1,
    inv_update_steps=2,
    lr=0.1,
)
SAVE_AT, STOP_AT = 3, 8


def checkpoint(
    model: nn.Module, pre: kaisa.KFACPreconditioner
) -> tuple[dict[str, Any], dict[str, Any]]:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "pre": pre.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    return saved["model"], saved["pre"]


@pytest.mark.filterwarnings("ignore:kaisa. time_budget")
@pytest.mark.parametrize("intervals", ["fixed", "chosen"])
def test_a_checkpoint_carries_the_choice(intervals: str) -> None:
    options = dict(CHECKPOINT_OPTIONS)
    if intervals == "chosen":
        del options["factor_update_steps"], options["inv_update_steps"]
    torch.manual_seed(3)
    model = MLP()
    pre = kaisa.KFACPreconditioner(model, **options)
    run(model, pre, range(SAVE_AT))
    model_state, pre_state = checkpoint(model, pre)
    original = run(model, pre, range(SAVE_AT, STOP_AT))
    choice = pre.curvature_choice
    assert choice is not None
    assert choice.specs == {"fc1": ("kvec", "diagonal"), "fc2": ("diagonal", "exact")}

    fresh_model = MLP()
    fresh_model.load_state_dict(model_state)
    fresh = kaisa.KFACPreconditioner(fresh_model, **options)
    assert fresh.curvature_choice is None
    fresh.load_state_dict(pre_state)  # before its first step
    assert fresh.curvature_choice == choice
    assert fresh.plan == pre.plan
    assert specs_of(fresh) == choice.specs
    for name in ("factor_update_steps", "inv_update_steps", "factor_decay"):
        assert fresh.hyperparameter(name) == pre.hyperparameter(name), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # adopting a choice does not choose again
        resumed = run(fresh_model, fresh, range(SAVE_AT, STOP_AT))
    assert fresh.curvature_choice == choice
    for step, (got, expected) in enumerate(zip(resumed, original, strict=True), SAVE_AT):
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e), f"step {step}"
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:kaisa. time_budget")
def test_a_checkpoint_is_refused_by_a_preconditioner_with_another_choice() -> None:
    model = MLP()
    pre = kaisa.KFACPreconditioner(model, **CHECKPOINT_OPTIONS)
    run(model, pre, range(1))
    _, state = checkpoint(model, pre)
    # Another budget: another choice, already made.
    other_options = {**CHECKPOINT_OPTIONS, "time_budget": 1e6}
    other = kaisa.KFACPreconditioner(MLP(), **other_options)
    run(other.model, other, range(1))
    assert other.curvature_choice != pre.curvature_choice
    with pytest.raises(ValueError, match=r"another automatic curvature choice"):
        other.load_state_dict(state)
    # A side the checkpoint chose, fixed otherwise here.
    fixed = kaisa.KFACPreconditioner(MLP(), **{**CHECKPOINT_OPTIONS, "curvature": "exact"})
    with pytest.raises(ValueError, match=r"curvature fixes it to 'exact'"):
        fixed.load_state_dict(state)
    # The same choice, already made, is accepted.
    same = kaisa.KFACPreconditioner(MLP(), **CHECKPOINT_OPTIONS)
    run(same.model, same, range(1))
    same.load_state_dict(state)
    assert same.curvature_choice == pre.curvature_choice


def test_a_low_rank_checkpoint_resumes_bit_identically() -> None:
    options: dict[str, Any] = dict(
        curvature=("lowrank:4", "lowrank:2"),
        factor_update_steps=1,
        inv_update_steps=2,
        factor_decay=0.9,
        lr=0.1,
    )
    torch.manual_seed(3)
    model = MLP()
    pre = kaisa.KFACPreconditioner(model, **options)
    run(model, pre, range(SAVE_AT))
    model_state, pre_state = checkpoint(model, pre)
    original = run(model, pre, range(SAVE_AT, STOP_AT))
    fresh_model = MLP()
    fresh_model.load_state_dict(model_state)
    fresh = kaisa.KFACPreconditioner(fresh_model, **options)
    fresh.load_state_dict(pre_state)
    resumed = run(fresh_model, fresh, range(SAVE_AT, STOP_AT))
    for step, (got, expected) in enumerate(zip(resumed, original, strict=True), SAVE_AT):
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e), f"step {step}"


def _schedule_choice(
    intervals: object, **options: Any
) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """The sides chosen on a small GPT at ``time_budget=2`` after one step, and the
    messages of the warnings that step raised."""
    from kaisa.models import GPT

    torch.manual_seed(0)
    model = GPT(d_model=64, n_layer=2, n_head=4, context=32)
    pre = kaisa.KFACPreconditioner(
        model, lr=0.01, time_budget=2.0,
        **{"factor_update_steps": intervals, "inv_update_steps": intervals, **options},
    )  # fmt: skip
    idx = torch.randint(0, 256, (8, 33))
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.reshape(-1, 256), idx[:, 1:].reshape(-1)).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre.step()
    choice = pre.curvature_choice  # None when nothing was left to it
    specs = {} if choice is None else dict(choice.specs)
    return specs, [str(w.message) for w in caught]


def test_a_schedule_of_intervals_is_costed_at_the_step_of_the_choice() -> None:
    """options.py's time_budget note: refreshing every step at first (a schedule)
    buys cheaper sides than every 5 steps throughout, at the same budget."""

    def specs(intervals: object) -> dict[str, tuple[str, str]]:
        return _schedule_choice(intervals)[0]

    constant = specs(5)
    early = specs(lambda step: 1 if step < 100 else 5)
    assert constant.keys() == early.keys()
    exact = [
        sum(side == "exact" for pair in choice.values() for side in pair)
        for choice in (constant, early)
    ]
    assert exact[1] < exact[0], (constant, early)


def test_a_choice_costed_on_a_schedule_says_so_once() -> None:
    """The choice above is not made silently: one warning names the step, the
    scheduled intervals' values there and the way out; none for numbers, and none
    when no side is left to the choice."""
    early = lambda step: 1 if step < 100 else 5  # noqa: E731
    _, messages = _schedule_choice(early)
    scheduled = [m for m in messages if "schedule" in m]
    assert len(scheduled) == 1, messages
    assert (
        "made at step 0 for factor_update_steps=1, inv_update_steps=1, this step's values of "
        "schedules;" in scheduled[0]
    )
    assert "curvature='exact'" in scheduled[0] and "time_budget=2" in scheduled[0]
    # Only the inverse interval a schedule: only it is named.
    _, messages = _schedule_choice(5, inv_update_steps=early)
    assert any("for inv_update_steps=1, this step's value of a schedule;" in m for m in messages)
    assert not any("factor_update_steps=5" in m and "schedule" in m for m in messages)
    _, messages = _schedule_choice(5)
    assert not any("schedule" in m for m in messages), messages
    specs, messages = _schedule_choice(early, curvature="exact")
    assert specs == {}  # no choice made
    assert not any("schedule" in m for m in messages), messages


# -- the protected side: the one whose diagonal would bind ---------------------------------------


def _pixel_mlp_work(rows: float = 128.0) -> list[LayerWork]:
    """The budget's view of a 784-256-256-10 MLP (a cheap step, a wide first input side)."""
    return [
        LayerWork.from_rows("0", 785, 256, rows),
        LayerWork.from_rows("2", 257, 256, rows),
        LayerWork.from_rows("4", 257, 10, rows),
    ]


def test_the_protected_side_keeps_its_lowest_low_rank_while_other_moves_are_left() -> None:
    work = _pixel_mlp_work()
    plain = choose_curvature(work, 0.2)
    # The largest saving gives the widest side up first, down to the diagonal.
    assert plain.specs["0"][0] == "diagonal" and plain.protected is None
    protected = choose_curvature(work, 0.2, protect=("0", "a"))
    assert protected.protected == ("0", "a")
    assert protected.specs["0"][0] == "lowrank:8" and protected.within_budget
    assert protected.kfac_work <= 0.2 * protected.training_work
    # The other sides paid for it.
    assert protected.specs["2"] != plain.specs["2"] or protected.specs["4"] != plain.specs["4"]
    # Where the budget cannot be met, the protected side goes last, to the cheapest.
    cheapest = choose_curvature(work, 1e-9, protect=("0", "a"))
    assert cheapest == dataclasses.replace(choose_curvature(work, 1e-9), protected=("0", "a"))
    assert set(cheapest.specs.values()) == {("diagonal", "diagonal")}


def test_protecting_a_side_the_rule_keeps_changes_nothing_but_the_record() -> None:
    work = _pixel_mlp_work()
    for budget in (0.05, 0.2, 1.0, 1e6):
        plain = choose_curvature(work, budget)
        for name, (a, _g) in plain.specs.items():
            if a == "exact" or a.startswith("lowrank:"):
                kept = choose_curvature(work, budget, protect=(name, "a"))
                assert kept == dataclasses.replace(plain, protected=(name, "a"))


def test_a_fixed_or_unknown_side_is_not_protected() -> None:
    work = mlp_work(fc1=("kvec", None))
    plain = choose_curvature(work, 1e-6)
    assert choose_curvature(work, 1e-6, protect=("fc1", "a")) == plain
    assert choose_curvature(work, 1e-6, protect=("fc9", "g")) == plain


def test_binding_side_is_the_largest_mismatch_above_one() -> None:
    assert binding_side({}) is None
    assert binding_side({("a", "a"): 1.0, ("b", "g"): 0.5}) is None
    assert binding_side({("a", "a"): 3.0, ("b", "g"): 7.0, ("c", "a"): 7.0}) == ("b", "g")


def _dense_mismatch(factor: torch.Tensor, damping: float) -> float:
    f = factor.double() / (factor.double().trace() / factor.shape[0])
    gamma = damping**0.5
    d = torch.diag((f.diagonal() + gamma).rsqrt())
    m = d @ (f + gamma * torch.eye(f.shape[0], dtype=torch.float64)) @ d
    return float(torch.linalg.eigvalsh(m)[-1])


@pytest.mark.parametrize("n", [1, 7, 40])
def test_diagonal_mismatch_matches_a_dense_float64_reference(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(3 * n + 4, n, generator=g, dtype=torch.float64)
    rows[:, 0] += 6.0  # a dominant mean direction, as raw inputs have
    factor = (rows.t() @ rows / rows.shape[0]).float()
    got = diagonal_mismatch(5.0 * factor, 0.03)
    assert got == pytest.approx(max(_dense_mismatch(factor, 0.03), 1.0), rel=1e-5)
    # In float64 and in bfloat16 (products in float32) the same value.
    assert diagonal_mismatch(factor.double(), 0.03) == pytest.approx(got, rel=1e-5)
    assert diagonal_mismatch(factor.bfloat16(), 0.03) == pytest.approx(got, rel=2e-2)
    # A diagonal factor leaves nothing: ratio 1 (up to rounding); an empty one too.
    assert diagonal_mismatch(torch.diag(factor.diagonal()), 0.03) == pytest.approx(1.0)
    assert diagonal_mismatch(torch.zeros(n, n), 0.03) == 1.0


class _FactorProducts(torch.overrides.TorchFunctionMode):
    """Counts matrix products whose left operand is ``factor``'s storage."""

    def __init__(self, factor: torch.Tensor) -> None:
        super().__init__()
        self.factor = factor
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        first = args[0] if args else None
        if (
            func is torch.Tensor.matmul
            and isinstance(first, torch.Tensor)
            and first.data_ptr() == self.factor.data_ptr()
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("n", "rows"), [(300, 600), (500, 700)])
def test_diagonal_mismatch_resolves_a_clustered_top_within_its_product_cap(
    n: int, rows: int
) -> None:
    """A gram of many similar rows: its top eigenvalues cluster, a power
    iteration's 100 products leave it 3e-4 low, Lanczos gets within 1e-5 in
    at most ``MISMATCH_ITERATIONS`` products."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, n, generator=g, dtype=torch.float64)
    factor = (x.t() @ x / rows).float()
    counter = _FactorProducts(factor)
    with counter:
        got = diagonal_mismatch(factor, 1e-3)
    assert got == pytest.approx(_dense_mismatch(factor, 1e-3), rel=1e-5)
    assert 0 < counter.count <= autochoice.MISMATCH_ITERATIONS


class _PixelMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def test_the_preconditioner_protects_the_inputs_that_bind() -> None:
    """Inputs with a few directions shared across coordinates (pixels with a common
    intensity): the first layer's input side is the one the choice protects."""
    torch.manual_seed(0)
    model = _PixelMLP()
    # The default budget, at which the largest saving would give that side up.
    pre = kaisa.KFACPreconditioner(model, lr=0.1, cost_model=NO_OPERATORS)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(128, 3, generator=gen) @ torch.randn(3, 64, generator=gen) * 4.0
    x = 10.0 + base + 0.1 * torch.randn(128, 64, generator=gen)  # a common intensity
    F.cross_entropy(model(x), torch.randint(0, 4, (128,), generator=gen)).backward()
    pre.step()
    choice = pre.curvature_choice
    assert choice is not None and choice.protected == ("fc1", "a")
    assert choice.specs["fc1"][0].startswith("lowrank:")
    work = [
        LayerWork.from_rows(name, 65, g, 128) for name, g in (("fc1", 64), ("fc2", 64), ("fc3", 4))
    ]
    kw: dict[str, Any] = {"cost_model": NO_OPERATORS, "scale": choice.time_scale}
    assert choice == choose_curvature(work, 0.1, protect=("fc1", "a"), **kw)
    # Without the protection the largest saving would have given that side up.
    assert choose_curvature(work, 0.1, **kw).specs["fc1"][0] == "diagonal"
    # The record survives a checkpoint, and old checkpoints without it protect nothing.
    state = choice.state_dict()
    assert BudgetChoice.from_state(state) == choice
    assert BudgetChoice.from_state({**state, "protected": ["fc1", "a"]}) == choice
    del state["protected"]
    assert BudgetChoice.from_state(state).protected is None
    for bad in (["fc1"], ["fc1", "b"], "fc1", [1, "a"]):
        with pytest.raises(ValueError, match="'protected' must be None or a pair"):
            BudgetChoice.from_state({**choice.state_dict(), "protected": bad})
