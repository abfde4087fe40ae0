"""``benchmarks/budget_value.py``: what a larger time budget buys on a cheap-step MLP."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest
import torch
from script_loader import load_script

from kaisa.demo.data import FashionMNIST


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    # Registered: its dataclass looks its module up by name.
    return load_script("benchmarks/budget_value.py", "budget_value_under_test", register=True)


def _data() -> FashionMNIST:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (256,), generator=g)
    return FashionMNIST(x, y, x[:64], y[:64], "synthetic")


def _args(**kw: object) -> argparse.Namespace:
    base = dict(budgets=[0.1, 3.0], exact=[(2, 4)], first_input_side=True, per_side=False,
                first_input_ranks=[], first_input_intervals=[(10, 20)],
                target=0.0, batch_size=16, max_steps=6, eval_every=2)  # fmt: skip
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.timeout(120)
def test_every_arm_and_rate_runs_and_a_larger_budget_keeps_more_curvature(
    bench: ModuleType,
) -> None:
    rows = bench.run_seed(_args(), _data(), seed=0)
    names = ["sgd", "budget-0.1", "budget-3", "exact-2/4", "first-input-side"]
    expected = [(n, lr) for n in names for lr in (bench.SGD_LRS if n == "sgd" else bench.KAISA_LRS)]
    assert [(r["arm"], r["lr"]) for r in rows] == expected
    for r in rows:
        # A target of 0 is reached at the first evaluation.
        assert r["steps"] == 2 and r["ran"] == 2 and r["time"] > 0 and r["ms_per_step"] > 0
    by_arm = {r["arm"]: r for r in rows}
    assert "specs" not in by_arm["sgd"] and "specs" not in by_arm["exact-2/4"]

    def exact_sides(specs: dict[str, list[str]]) -> int:
        return sum(side == "exact" for pair in specs.values() for side in pair)

    small, large = by_arm["budget-0.1"], by_arm["budget-3"]
    assert exact_sides(large["specs"]) > exact_sides(small["specs"])


@pytest.mark.timeout(120)
def test_a_target_not_reached_has_no_time_and_is_never_best(bench: ModuleType) -> None:
    rows = bench.run_seed(
        _args(budgets=[], exact=[], first_input_side=False, target=1.01, max_steps=2),
        _data(),
        seed=1,
    )
    assert [r["arm"] for r in rows] == ["sgd"] * len(bench.SGD_LRS)
    assert all(r["steps"] is None and r["time"] is None and r["ran"] == 2 for r in rows)
    assert bench.best_rate(rows, by="time") is None
    reached = dict(rows[0], steps=4, time=2.0)
    faster = dict(rows[1], steps=6, time=1.0)
    assert bench.best_rate([*rows, reached, faster], by="time") is faster


@pytest.mark.timeout(120)
def test_per_side_arms_hold_one_side_exact_and_every_other_diagonal(bench: ModuleType) -> None:
    args = _args(budgets=[], exact=[], first_input_side=False, per_side=True, max_steps=2)
    names = [name for name, _ in bench._arms(args)]
    assert names == ["sgd", "all-diagonal", "only-0A", "only-0G", "only-2A", "only-2G",
                     "only-4A", "only-4G"]  # fmt: skip
    rows = bench.run_seed(args, _data(), seed=0)
    assert {r["arm"] for r in rows} == set(names) and all(r["steps"] == 2 for r in rows)
    # What kaisa holds, read from the preconditioner: one exact side per arm.
    for name, kfac in bench._arms(args)[2:]:
        run = bench._make_run(name, 0.1, 0, kfac)
        model = run.model
        x = torch.randn(8, 784)
        torch.nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
        run.preconditioner.step()
        layer, side = name[len("only-") :][:-1], name[-1]
        held = {
            (view.name, s): kind
            for view in run.preconditioner.layers
            for s, kind in zip("AG", view.curvature, strict=True)
        }
        assert sorted(held) == [(la, s) for la in bench.LAYERS for s in "AG"]
        assert [key for key, kind in held.items() if kind == "exact"] == [(layer, side)]


def test_interval_and_budget_lists_parse(bench: ModuleType) -> None:
    assert bench._intervals("10/20,5/10") == [(10, 20), (5, 10)]
    assert bench._intervals("") == [] and bench.floats("") == []
    assert bench.floats("0.1,3") == [0.1, 3.0]
    assert bench._ranks("8,16") == [8, 16] and bench._ranks("") == []
    for bad in ("0", "8,786"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"ranks must be in \[1, 785\]"):
            bench._ranks(bad)


@pytest.mark.timeout(120)
def test_first_input_rank_arms_hold_that_side_in_that_rank(bench: ModuleType) -> None:
    args = _args(budgets=[], exact=[], first_input_side=False, first_input_ranks=[8, 16],
                 first_input_intervals=[(10, 20), (40, 80)], max_steps=2)  # fmt: skip
    names = [name for name, _ in bench._arms(args)]
    assert names == ["sgd", "first-input-r8-10/20", "first-input-r8-40/80",
                     "first-input-r16-10/20", "first-input-r16-40/80"]  # fmt: skip
    run = bench._make_run(names[3], 0.1, 0, dict(bench._arms(args))[names[3]])
    x = torch.randn(8, 784)
    torch.nn.functional.cross_entropy(run.model(x), torch.zeros(8, dtype=torch.long)).backward()
    run.preconditioner.step()
    held = {view.name: tuple(view.curvature) for view in run.preconditioner.layers}
    assert held == {"0": ("lowrank:16", "diagonal"), "2": ("diagonal", "diagonal"),
                    "4": ("diagonal", "diagonal")}  # fmt: skip


def _spd(n: int, g: torch.Generator) -> torch.Tensor:
    m = torch.randn(n, 2 * n, generator=g, dtype=torch.float64)
    return m @ m.t() / (2 * n)


def test_one_step_reduction_matches_the_dense_kronecker_reference(bench: ModuleType) -> None:
    g = torch.Generator().manual_seed(3)
    a, gf = _spd(5, g), _spd(4, g)
    grad = torch.randn(4, 5, generator=g, dtype=torch.float64)
    damping = 0.1
    ra, rg = a / (a.trace() / 5), gf / (gf.trace() / 4)
    curvature = torch.kron(rg + damping * torch.eye(4, dtype=torch.float64),
                           ra + damping * torch.eye(5, dtype=torch.float64))  # fmt: skip
    for kinds in [("exact", "exact"), ("diagonal", "diagonal"), ("exact", "diagonal"),
                  ("diagonal", "exact")]:  # fmt: skip
        held = [
            (f + damping * torch.eye(f.shape[0], dtype=torch.float64))
            if k == "exact"
            else torch.diag(f.diagonal() + damping)
            for f, k in zip((rg, ra), reversed(kinds), strict=True)
        ]
        d = torch.linalg.solve(torch.kron(*held), grad.flatten())
        expected = (grad.flatten() @ d) ** 2 / (2 * d @ curvature @ d)
        got = bench._one_step_reduction(a, gf, grad, kinds, damping)
        assert got == pytest.approx(float(expected), rel=1e-10)
    # The exact solve is the best direction under its own curvature.
    best = bench._one_step_reduction(a, gf, grad, ("exact", "exact"), damping)
    assert best >= bench._one_step_reduction(a, gf, grad, ("diagonal", "diagonal"), damping)
    # A diagonal factor held exact changes nothing.
    diag_a = torch.diag(a.diagonal())
    both = bench._one_step_reduction(diag_a, gf, grad, ("diagonal", "diagonal"), damping)
    assert bench._one_step_reduction(diag_a, gf, grad, ("exact", "diagonal"), damping) == (
        pytest.approx(both, rel=1e-12)
    )


@pytest.mark.timeout(120)
def test_side_gains_name_every_side(bench: ModuleType) -> None:
    gains = bench.side_gains(_data(), seed=0, steps=3, batch_size=16)
    assert sorted(gains) == sorted(f"{la}{s}" for la in bench.LAYERS for s in "AG")
    assert all(v > 0 and v == v for v in gains.values())
