"""The eigenvalue correction and grafting through the preconditioner (issue 31, spec §11)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa

OPTIONS = {
    "curvature": "exact",
    "factor_update_steps": 2,
    "inv_update_steps": 4,
    "calibrate_budget": False,
    "lr": 0.1,
}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


_TEACHER = torch.randn(6, 3, generator=torch.Generator().manual_seed(7))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the labels a fixed linear teacher gives them (a task that can be learned)."""
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(100 + step))
    return x, (x @ _TEACHER).argmax(dim=1)


def _train(model: nn.Module, pre: kaisa.KFACPreconditioner, steps: range) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in steps:
        optimizer.zero_grad()
        x, y = _batch(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        pre.step()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("correction", ["ekfac", "adam"])
def test_the_corrected_solve_keeps_a_running_average_and_trains(correction: str) -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, eigenvalue_correction=correction, **OPTIONS)
    losses = _train(model, pre, range(40))
    assert losses[-1] < 0.85 * losses[0]
    for layer in pre.layers:
        state = layer.block.state_dict()
        assert state["eigen_scale_updates"] == 40
        scales = state["eigen_scales"]
        assert isinstance(scales, torch.Tensor) and scales.shape == (layer.g_size, layer.a_size)
        assert bool((scales >= 0).all()) and bool(scales.sum() > 0)
    # S is second-order state: counted, and gone without the correction (it
    # replaces the precomputed eigenvalue outer product, of the same shape).
    plain = kaisa.KFACPreconditioner(_net(), compute_eigenvalue_outer_product=False, **OPTIONS)
    with_s = pre.memory_usage()["second_order"]
    assert with_s - plain.memory_usage()["second_order"] == 4 * (12 * 7 + 3 * 13)


@pytest.mark.parametrize("correction", ["ekfac", "adam"])
def test_a_checkpoint_with_the_corrected_scales_resumes_bit_identically(correction: str) -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, eigenvalue_correction=correction, **OPTIONS)
    _train(model, pre, range(10))
    state = copy.deepcopy(pre.state_dict())
    weights = copy.deepcopy(model.state_dict())
    _train(model, pre, range(10, 20))
    expected = [p.detach().clone() for p in model.parameters()]
    fresh = _net()
    fresh.load_state_dict(weights)
    resumed = kaisa.KFACPreconditioner(fresh, eigenvalue_correction=correction, **OPTIONS)
    resumed.load_state_dict(state)
    _train(fresh, resumed, range(10, 20))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), expected, strict=True))


def test_checkpoints_without_the_option_or_with_stray_scales() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, **OPTIONS)
    _train(model, pre, range(4))
    state = pre.state_dict()
    # Written before the option existed: read as 'off'.
    del state["options"]["eigenvalue_correction"]
    kaisa.KFACPreconditioner(_net(), **OPTIONS).load_state_dict(state)
    # Into a corrected preconditioner: converted, S starts afresh.
    corrected = kaisa.KFACPreconditioner(_net(), eigenvalue_correction="adam", **OPTIONS)
    with pytest.warns(RuntimeWarning, match="eigenvalue_correction='off'"):
        corrected.load_state_dict(state)
    assert corrected.inverse_update_due
    # Scales in a layer that does not use them are refused, naming the layer.
    state["layers"]["0"]["eigen_scales"] = torch.zeros(12, 7)
    state["layers"]["0"]["eigen_scale_updates"] = 3
    target = kaisa.KFACPreconditioner(_net(), **OPTIONS)
    with pytest.raises(ValueError, match=r"layer '0'.*eigen_scales"):
        target.load_state_dict(state)


def test_the_correction_applies_to_exact_low_rank_and_diagonal_sides_only() -> None:
    """Exact, low-rank and diagonal sides have explicit bases (``Q``, the top ``k``
    eigenvectors and a rest, the identity); a Kronecker-vector side does not."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3), nn.Tanh()
    )
    model.append(nn.Linear(3, 3))
    curvature = {
        "^0$": "exact",
        "^2$": ("lowrank:2", "exact"),
        "^4$": ("exact", "diagonal"),
        "^6$": ("kvec", "exact"),
    }
    with pytest.warns(RuntimeWarning, match="reaches 3 of 4 layers"):
        pre = kaisa.KFACPreconditioner(
            model, eigenvalue_correction="adam", **{**OPTIONS, "curvature": curvature}
        )
    _train(model, pre, range(3))
    states = {layer.name: layer.block.state_dict() for layer in pre.layers}
    assert "eigen_scales" in states["0"] and "eigen_scales" in states["4"]
    assert "eigen_scales" not in states["6"]
    assert states["4"]["eigen_scales"].shape == (3, 9)  # (out, in + bias)
    # A (12 + bias) held at rank 2: two eigen-directions and one entry for the rest.
    assert states["2"]["eigen_scales"].shape == (8, 3)


def test_layers_the_correction_does_not_reach_are_named_at_construction() -> None:
    """Fixed representations: a Kronecker-vector side leaves its layer out, said once, by name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    curvature = {"^0$": "exact", "^2$": ("kvec", "exact"), "^4$": ("exact", "diagonal")}
    with pytest.warns(RuntimeWarning) as caught:
        pre = kaisa.KFACPreconditioner(
            model, eigenvalue_correction="adam", **{**OPTIONS, "curvature": curvature}
        )
    texts = [str(w.message) for w in caught if "eigenvalue_correction" in str(w.message)]
    assert len(texts) == 1
    assert "reaches 2 of 3 layers" in texts[0] and "'2' (A kvec, G exact)" in texts[0]
    assert {layer.name: layer.corrected for layer in pre.layers} == {
        "0": True,
        "2": False,
        "4": True,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not again at the steps
        _train(model, pre, range(3))
    # Off, or every layer reached: nothing said, and no layer is "corrected" when off.
    for correction, kinds in (("off", curvature), ("adam", "exact")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            quiet = kaisa.KFACPreconditioner(
                _net(), eigenvalue_correction=correction, **{**OPTIONS, "curvature": kinds}
            )
        assert all(layer.corrected == (correction == "adam") for layer in quiet.layers)


class _Tied(nn.Module):
    """A token embedding tied to the output head, a hidden layer between."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 6)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


def test_a_tied_weight_is_corrected_in_its_summed_curvature_and_nothing_is_said() -> None:
    for correction in ("adam", "ekfac"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every layer reached: no warning
            pre = kaisa.KFACPreconditioner(_Tied(), eigenvalue_correction=correction, **OPTIONS)
        assert [layer.name for layer in pre.layers if layer.corrected] == [
            "embed",
            "hidden",
            "head",
        ]
        pre.remove_hooks()
    off = kaisa.KFACPreconditioner(_Tied(), eigenvalue_correction="off", **OPTIONS)
    assert not any(layer.corrected for layer in off.layers)
    off.remove_hooks()


def test_layers_the_automatic_choice_leaves_uncorrected_are_named_when_it_is_made() -> None:
    """Sides left to the budget: nothing is said until the choice is made, then once."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    curvature = {"^0$": ("lowrank:4", "auto"), "^2$": "auto"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = kaisa.KFACPreconditioner(
            model, eigenvalue_correction="adam", **{**OPTIONS, "curvature": curvature}
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    said: list[str] = []
    for step in range(12):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).square().mean().backward()
            pre.step()
        said += [str(w.message) for w in caught if "eigenvalue_correction" in str(w.message)]
        optimizer.step()
        optimizer.zero_grad()
    assert pre.curvature_choice is not None
    left = [layer.name for layer in pre.layers if not layer.corrected]
    specs = {layer.name: layer.curvature for layer in pre.layers}
    assert "0" in left, specs
    assert len(said) == 1, said
    for name in left:
        a, g = specs[name]
        assert f"{name!r} (A {a}, G {g})" in said[0]


def test_a_diagonal_side_is_corrected_in_the_other_sides_basis_only() -> None:
    """Layer ``(exact A, diagonal G)``: ``P = [(∇ Q_A) ⊘ √(S + γ s̄)] Q_Aᵀ`` with ``S``
    the mean of ``(∇ Q_A)²`` over the steps (float64, recomputed from the gradients)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4)).double()
    options = {**OPTIONS, "factor_update_steps": 1, "inv_update_steps": 1, "damping": 0.01}
    pre = kaisa.KFACPreconditioner(
        model,
        eigenvalue_correction="adam",
        eigenvalue_decay=0.5,
        inv_dtype=torch.float64,
        **{**options, "curvature": ("exact", "diagonal"), "kl_clip": None},
    )
    layer = model[0]
    squares = []
    for step in range(3):
        model.zero_grad()
        x, y = _batch(step)
        loss = F.cross_entropy(model(x.double())[:, :3], y)
        loss.backward()
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1).clone()
        pre.step()
        qa = pre.layers[0].block.second_order["a"][0]  # refreshed at this step
        v = grad @ qa
        squares.append(v * v)
    scales = squares[0]
    for k, square in enumerate(squares[1:], start=1):
        xi = min(0.5, k / (k + 1))
        scales = xi * scales + (1 - xi) * square
    expected = (v / (scales + 0.01 * scales.mean()).sqrt()) @ qa.t()
    got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("correction", ["off", "adam"])
def test_grafting_gives_each_layer_the_raw_gradient_norm(correction: str) -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(
        model, grafting="layer", kl_clip=None, eigenvalue_correction=correction, **OPTIONS
    )
    for step in range(3):
        model.zero_grad()
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        raw = [layer.handler.grad_matrix() for layer in pre.layers]
        pre.step()
        for layer, before in zip(pre.layers, raw, strict=True):
            after = layer.handler.grad_matrix()
            assert before is not None and after is not None
            torch.testing.assert_close(after.norm(), before.norm(), rtol=1e-5, atol=0.0)
            assert not torch.allclose(after, before)  # the direction is K-FAC's


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (
            {"eigenvalue_correction": "shampoo"},
            ValueError,
            "eigenvalue_correction must be one of 'off', 'ekfac', 'adam'",
        ),
        ({"eigenvalue_correction": None}, ValueError, "eigenvalue_correction must be one of"),
        ({"grafting": "global"}, ValueError, "grafting must be one of 'off', 'layer'"),
        ({"eigenvalue_decay": 1.0}, ValueError, "eigenvalue_decay must be a number >= 0 and < 1"),
        ({"eigenvalue_decay": "0.9"}, TypeError, "eigenvalue_decay must be a number"),
        (
            {"eigenbasis_tolerance": 1.0},
            ValueError,
            "eigenbasis_tolerance must be a number >= 0 and < 1",
        ),
        ({"eigenbasis_tolerance": -0.1}, ValueError, "eigenbasis_tolerance must be a number >= 0"),
        ({"eigenbasis_tolerance": "0.1"}, TypeError, "eigenbasis_tolerance must be a number"),
        ({"eigenbasis_tolerance": True}, TypeError, "eigenbasis_tolerance must be a number"),
        (
            {"eigenbasis_tolerance": 0.1, "compute_method": "inverse", "curvature": "exact"},
            ValueError,
            "eigenbasis_tolerance keeps eigenbases, and compute_method='inverse'",
        ),
    ],
)
def test_bad_options_are_refused_by_name(
    options: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        kaisa.KFACPreconditioner(_net(), **options)  # type: ignore[arg-type]
