"""Representations in the plan, the cost model and ``kaisa plan`` (spec §8, §5)."""

from __future__ import annotations

import json

import pytest

from kaisa.cli.plan import main
from kaisa.distributed.cost import rank_memory, rank_traffic
from kaisa.distributed.layer_shapes import bert_large_shapes
from kaisa.distributed.plan import LayerShape, make_plan


def test_plan_records_and_costs_each_representation() -> None:
    shapes = [
        LayerShape("wide", 3137, 128, "lowrank:16", "exact"),
        LayerShape("conv", 289, 64, "kvec", "diagonal"),
        LayerShape("head", 129, 10),
    ]
    plan = make_plan(shapes, 2, "mem-opt")
    assert [(la.a_spec, la.g_spec) for la in plan.layers] == [
        ("lowrank:16", "exact"),
        ("kvec", "diagonal"),
        ("exact", "exact"),
    ]
    # Factors: a gram for exact and low-rank sides, two rows of moments otherwise.
    factors = 3137**2 + 128**2 + 2 * 289 + 2 * 64 + 129**2 + 10**2
    # Second-order state: U, λ, σ of the low-rank side; Q, λ of a mixed layer's exact
    # side (eigen form, no outer product); one vector per moments side; the exact layer
    # with its eigenvalue outer product.
    wide = 3137 * 16 + 16 + 1 + 128 * 128 + 128
    conv = 289 + 64
    head = 129**2 + 129 + 10**2 + 10 + 129 * 10
    state = {"wide": wide, "conv": conv, "head": head}
    for rank in range(2):
        own = [la.name for la in plan.layers if plan.is_grad_worker(la.name, rank)]
        memory = rank_memory(plan, rank)
        assert memory.factors == factors
        assert memory.second_order == sum(state[name] for name in own)
    traffic = rank_traffic(plan, 0, symmetry_aware=True)
    assert traffic.factor_allreduce == (
        3137 * 3138 // 2 + 128 * 129 // 2 + 2 * 289 + 2 * 64 + 129 * 130 // 2 + 10 * 11 // 2
    )
    assert traffic.inverse_broadcast == 0  # one gradient worker per layer
    assert traffic.grad_broadcast == 3137 * 128 + 289 * 64 + 129 * 10


def test_a_bad_representation_names_the_layer() -> None:
    with pytest.raises(ValueError, match=r"layer 'x', factor A: 'lowrank:20' has a rank above"):
        LayerShape("x", 10, 4, "lowrank:20")
    with pytest.raises(ValueError, match="must be one of 'exact', 'lowrank', 'kvec', 'diagonal'"):
        LayerShape("x", 10, 4, "dense")


def test_cli_shows_the_representation_per_layer(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "bert-large", "--world-size", "8", "--json", "--fraction", "mem-opt"]
    assert main([*argv, "--curvature", "lowrank:64,exact", "--show-plan"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["curvature"] == "lowrank:64,exact"
    assert {(la["a_spec"], la["g_spec"]) for la in out["plan"]["layers"]} == {
        ("lowrank:64", "exact")
    }
    exact = make_plan(bert_large_shapes(), 8, "mem-opt")
    assert out["fractions"][0]["memory_mb"]["second_order"]["mean"] < (
        sum(rank_memory(exact, r).second_order for r in range(8)) / 8 * 4 / 1e6
    )
    assert main(["--model", "small_cnn", "--world-size", "2", "--curvature", "kvec"]) == 0
    assert "curvature='kvec'" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("lowrank", "'lowrank' needs its rank"),
        ("dense", "must be one of 'exact', 'lowrank', 'kvec', 'diagonal'"),
        ("exact,kvec,diagonal", "one representation or a pair A,G"),
    ],
)
def test_cli_refuses_a_bad_curvature(
    capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    assert main(["--model", "small_cnn", "--world-size", "2", "--curvature", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kaisa plan: error: argument --curvature:") and message in err


def test_cli_keeps_a_layer_kinds_own_side_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """The embedding's A is diagonal in a training run, and so in the plan."""
    argv = ["--model", "transformer", "--world-size", "2", "--json", "--show-plan"]
    assert main(argv) == 0
    layers = {la["name"]: la for la in json.loads(capsys.readouterr().out)["plan"]["layers"]}
    assert (layers["embed"]["a_spec"], layers["embed"]["g_spec"]) == ("diagonal", "exact")
    assert (layers["head"]["a_spec"], layers["head"]["g_spec"]) == ("exact", "exact")
    assert main([*argv, "--curvature", "exact"]) == 0
    layers = {la["name"]: la for la in json.loads(capsys.readouterr().out)["plan"]["layers"]}
    assert layers["embed"]["a_spec"] == "exact"  # asked for explicitly
