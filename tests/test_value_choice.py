"""``benchmarks/value_choice.py``: the experimental choice judged by what each side buys."""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType

import pytest
import torch
from script_loader import load_script

import kaisa
import kaisa.autochoice as autochoice
from kaisa.curvature.budget import LayerWork, choose_curvature
from kaisa.curvature.costs import SideSpec


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/value_choice.py", "value_choice_under_test")


def _factor(n: int, seed: int) -> torch.Tensor:
    """An SPD factor with a few dominant directions, like a layer's inputs."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(4 * n, n, generator=g, dtype=torch.float64)
    rows[:, :3] *= torch.tensor([20.0, 8.0, 4.0], dtype=torch.float64)
    mix = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    rows = rows @ mix
    return rows.t() @ rows / rows.shape[0]


def _dense_top_ratio(factor: torch.Tensor, held: torch.Tensor, gamma: float) -> float:
    """The largest eigenvalue of ``(H + γI)⁻¹ (F + γI)``, by a Cholesky whitening."""
    eye = torch.eye(factor.shape[0], dtype=torch.float64)
    chol = torch.linalg.cholesky(held + gamma * eye)
    inner = torch.linalg.solve_triangular(chol, factor + gamma * eye, upper=False)
    whitened = torch.linalg.solve_triangular(chol, inner.t(), upper=False)
    return float(torch.linalg.eigvalsh((whitened + whitened.t()) / 2)[-1])


@pytest.mark.parametrize("spec", ["exact", "lowrank:2", "lowrank:5", "diagonal"])
def test_top_ratio_matches_a_dense_float64_reference(bench: ModuleType, spec: str) -> None:
    n, gamma = 12, math.sqrt(0.03)
    factor = _factor(n, seed=1)
    f = factor / (factor.trace() / n)
    values, vectors = torch.linalg.eigh(f)
    parsed = SideSpec.parse(spec)
    if parsed.kind == "exact":
        held = f
    elif parsed.kind == "lowrank":
        k = parsed.rank
        top, basis = values[n - k :], vectors[:, n - k :]
        sigma = values[: n - k].mean()
        held = basis @ torch.diag(top) @ basis.t() + sigma * (
            torch.eye(n, dtype=torch.float64) - basis @ basis.t()
        )
    else:
        held = torch.diag(f.diagonal())
    # The factor's overall scale does not matter: it is taken to mean eigenvalue 1.
    got = bench.top_ratio(7.0 * factor, parsed, gamma)
    assert got == pytest.approx(_dense_top_ratio(f, held, gamma), rel=1e-9)


def test_more_rank_leaves_a_smaller_worst_direction(bench: ModuleType) -> None:
    factor, gamma = _factor(16, seed=2), math.sqrt(0.03)
    ratios = [bench.top_ratio(factor, SideSpec.parse(s), gamma) for s in
              ("diagonal", "lowrank:1", "lowrank:3", "lowrank:8", "exact")]  # fmt: skip
    assert ratios[-1] == 1.0
    # Holding the three dominant directions leaves less than holding one, or the diagonal.
    assert ratios[1] > ratios[2] and ratios[2] < ratios[0]
    assert all(r >= 1.0 for r in ratios)


def _mlp_works(rows: float = 128.0) -> list[LayerWork]:
    return [
        LayerWork.from_rows("0", 785, 256, rows),
        LayerWork.from_rows("2", 257, 256, rows),
        LayerWork.from_rows("4", 257, 10, rows),
    ]


@pytest.mark.parametrize("rule", ["worst", "protect"])
@pytest.mark.parametrize("budget_", [0.05, 0.1, 0.5, 2.0])
@pytest.mark.parametrize("intervals", [(None, None), (5, 5), (10, None)])
def test_without_values_the_rule_is_the_librarys(
    bench: ModuleType, rule: str, budget_: float, intervals: tuple[int | None, int | None]
) -> None:
    f, i = intervals
    works = _mlp_works()
    ours = bench.choose_valued(
        works, budget_, {}, factor_update_steps=f, inv_update_steps=i, rule=rule
    )
    theirs = choose_curvature(works, budget_, factor_update_steps=f, inv_update_steps=i)
    assert ours == theirs


def test_the_side_that_binds_is_given_up_last(bench: ModuleType) -> None:
    works = _mlp_works()
    plain = choose_curvature(works, 0.2)
    # The library's rule gives up the widest side first: it saves the most.
    assert plain.specs["0"][0] == "diagonal"
    values = {("0", "a", str(s)): v for s, v in
              zip(("exact", "lowrank:256", "lowrank:128", "lowrank:64", "lowrank:32",
                   "lowrank:16", "lowrank:8", "kvec", "diagonal"),
                  (0.0, 0.5, 0.9, 1.2, 1.8, 2.6, 3.2, 5.5, 5.5), strict=True)}  # fmt: skip
    for layer in ("0", "2", "4"):
        for side in "ag":
            values.setdefault((layer, side, "diagonal"), 2.0)
    valued = bench.choose_valued(works, 0.2, values)
    assert valued.within_budget and valued.kfac_work <= plain.budget * plain.training_work
    assert valued.specs["0"][0].startswith("lowrank:")
    # 'protect' takes the library's moves but keeps the binding side at its lowest low rank.
    protected = bench.choose_valued(works, 0.2, values, rule="protect")
    assert protected.within_budget and protected.specs["0"][0] == "lowrank:8"
    with pytest.raises(ValueError, match="rule must be one of"):
        bench.choose_valued(works, 0.2, values, rule="best")


def test_protect_agrees_with_the_library_where_it_keeps_the_binding_side(
    bench: ModuleType,
) -> None:
    works = _mlp_works()
    plain = choose_curvature(works, 2.0)
    bound = next(
        name for name, (a, _) in plain.specs.items() if a == "exact" or a.startswith("lowrank:")
    )
    values = {(bound, "a", "diagonal"): 3.0}
    assert bench.choose_valued(works, 2.0, values, rule="protect") == dataclasses.replace(
        plain, protected=(bound, "a")
    )


@pytest.mark.timeout(120)
def test_install_makes_the_preconditioners_choice_the_valued_one(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Restored after the test: install() patches the class for the whole process.
    monkeypatch.setattr(autochoice.AutoChoice, "choose", autochoice.AutoChoice.choose)
    monkeypatch.setattr(autochoice, "choose_curvature", autochoice.choose_curvature)
    seen: dict[str, object] = {}
    real = bench.choose_valued

    def spy(works: list[LayerWork], time_budget: float, values: object, **kw: object) -> object:
        seen.update(works=works, budget=time_budget, values=values, kw=kw)
        return real(works, time_budget, values, **kw)

    monkeypatch.setattr(bench, "choose_valued", spy)
    bench.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pre = kaisa.KFACPreconditioner(model, optimizer=optimizer, time_budget=0.1)
    x = torch.randn(64, 40)
    torch.nn.functional.cross_entropy(model(x), torch.randint(0, 4, (64,))).backward()
    pre.step()
    choice = pre.curvature_choice
    assert choice is not None and seen, "the choice went through the valued rule"
    values = seen["values"]
    # Every free side of both layers was valued, at every rung of its ladder.
    assert {(k[0], k[1]) for k in values} == {("0", "a"), ("0", "g"), ("2", "a"), ("2", "g")}
    assert values["0", "a", "exact"] == 0.0 and values["0", "a", "diagonal"] > 0.0
    again = real(seen["works"], seen["budget"], values, **seen["kw"])
    assert choice == again


def test_top_ratios_of_a_ladder_are_each_rungs_and_kvec_is_valued_as_the_diagonal(
    bench: ModuleType,
) -> None:
    factor, gamma = _factor(20, seed=3), math.sqrt(0.03)
    rungs = [SideSpec.parse(s) for s in ("exact", "lowrank:8", "lowrank:4", "kvec", "diagonal")]
    together = bench.top_ratios(factor, rungs, gamma)
    alone = [bench.top_ratio(factor, spec, gamma) for spec in rungs[:3]]
    assert together[:3] == alone
    assert together[3] == together[4] == bench.top_ratio(factor, SideSpec("diagonal"), gamma)
