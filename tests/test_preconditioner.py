"""The front door end to end, on one process: against a dense float64 K-FAC step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa

D = torch.float64


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3, bias=False)).double()


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def kron_solve(
    grad: torch.Tensor, a: torch.Tensor, g: torch.Tensor, damping: float
) -> torch.Tensor:
    big = torch.kron(g, a) + damping * torch.eye(a.shape[0] * g.shape[0], dtype=D)
    return torch.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)


def dense_reference_step(
    model: nn.Sequential,
    x: torch.Tensor,
    y: torch.Tensor,
    decay: float,
    damping: float,
    lr: float,
    kappa: float,
    relative: bool = False,
    first_batch: bool = False,
) -> list[torch.Tensor]:
    """One K-FAC step from the definitions, with no code from kaisa.

    ``first_batch``: the factors are the batch factors (no identity);
    ``relative``: each factor is divided by trace/size before the damped solve.
    """
    if first_batch:
        decay = 0.0
    layers = [model[0], model[2]]
    inputs: list[torch.Tensor] = []
    deltas: list[torch.Tensor] = []

    def hook(_m: nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
        inputs.append(args[0].detach())
        out.register_hook(lambda g: deltas.append(g.detach()))

    handles = [layer.register_forward_hook(hook) for layer in layers]
    loss_fn(model, x, y).backward()
    for h in handles:
        h.remove()
    deltas = deltas[::-1]
    pairs = []
    for layer, xin, delta in zip(layers, inputs, deltas, strict=True):
        rows = xin
        if layer.bias is not None:
            rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=D)], 1)
        a = decay * torch.eye(rows.shape[1], dtype=D) + (1 - decay) * rows.T @ rows / rows.shape[0]
        g_size = delta.shape[1]
        g = decay * torch.eye(g_size, dtype=D) + (1 - decay) * delta.T @ delta / delta.shape[0]
        if relative:
            a = a / (torch.trace(a) / a.shape[0])
            g = g / (torch.trace(g) / g.shape[0])
        grad = layer.weight.grad
        if layer.bias is not None:
            grad = torch.cat([grad, layer.bias.grad[:, None]], 1)
        pairs.append((kron_solve(grad, a, g, damping), grad))
    s = lr**2 * sum(float((p * g).sum()) for p, g in pairs)
    nu = min(1.0, math.sqrt(kappa / abs(s)))
    return [nu * p for p, _ in pairs]


def assert_step_matches(
    model: nn.Sequential,
    pre: kaisa.KFACPreconditioner,
    x: torch.Tensor,
    y: torch.Tensor,
    expected: list[torch.Tensor],
) -> None:
    """One backward pass and ``pre.step()``; the gradients must equal ``expected``."""
    loss_fn(model, x, y).backward()
    pre.step()
    got = [
        torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1),
        model[2].weight.grad,
    ]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("outer", [True, False])
@pytest.mark.parametrize("in_hook", [True, False])
def test_step_matches_dense_kfac(outer: bool, in_hook: bool) -> None:
    model = mlp()
    ref_model = copy.deepcopy(model)
    x, y = torch.randn(11, 5, dtype=D), torch.randint(0, 3, (11,))
    decay, damping, lr, kappa = 0.6, 0.02, 0.5, 1e-4
    expected = dense_reference_step(ref_model, x, y, decay, damping, lr, kappa)
    # Spec §3/§4: exact curvature, identity-initialised factors, absolute damping.
    pre = kaisa.KFACPreconditioner.with_reference_defaults(
        model,
        factor_decay=decay,
        damping=damping,
        lr=lr,
        kl_clip=kappa,
        inv_dtype=D,
        compute_eigenvalue_outer_product=outer,
        update_factors_in_hook=in_hook,
    )
    assert_step_matches(model, pre, x, y, expected)


@pytest.mark.parametrize("outer", [True, False])
def test_relative_damping_and_first_batch_init_match_dense_kfac(outer: bool) -> None:
    model = mlp()
    ref_model = copy.deepcopy(model)
    x, y = torch.randn(13, 5, dtype=D), torch.randint(0, 3, (13,))
    damping, lr, kappa = 0.05, 0.5, 1e-4
    expected = dense_reference_step(
        ref_model, x, y, 0.95, damping, lr, kappa, relative=True, first_batch=True
    )
    # Exact curvature (the reference defaults) with the two non-reference conventions.
    pre = kaisa.KFACPreconditioner.with_reference_defaults(
        model,
        factor_decay=0.95,
        damping=damping,
        lr=lr,
        kl_clip=kappa,
        inv_dtype=D,
        compute_eigenvalue_outer_product=outer,
        damping_mode="relative",
        factor_init="first_batch",
    )
    assert_step_matches(model, pre, x, y, expected)
    assert [layer.block.updates for layer in pre.layers] == [1, 1]


def test_inverse_method_step_and_kl_clip_off() -> None:
    model = mlp()
    x, y = torch.randn(9, 5, dtype=D), torch.randint(0, 3, (9,))
    # Absolute damping added to each exact factor (spec §4's inverse method).
    pre = kaisa.KFACPreconditioner.with_reference_defaults(
        model, compute_method="inverse", factor_decay=0.0, damping=0.1, kl_clip=None, inv_dtype=D
    )
    loss_fn(model, x, y).backward()
    raw = model[2].weight.grad.clone()
    pre.step()
    block = pre.layers[1].block
    eye_a, eye_g = torch.eye(7, dtype=D), torch.eye(3, dtype=D)
    expected = (
        torch.linalg.inv(block.g + 0.1 * eye_g) @ raw @ torch.linalg.inv(block.a + 0.1 * eye_a)
    )
    torch.testing.assert_close(model[2].weight.grad, expected)


def test_layers_found_and_left_alone() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(4, 4)
            self.frozen.weight.requires_grad_(False)
            self.frozen.bias.requires_grad_(False)
            self.overriding = Doubled(4, 4)
            self.skipped = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)
            self.norm = nn.LayerNorm(4)

    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    with pytest.warns(UserWarning, match="overrides nn.Linear.forward"):
        pre = kaisa.KFACPreconditioner(Net(), lr=0.1, skip_layers=["skipped"])
    assert [layer.name for layer in pre.layers] == ["head"]
    with pytest.raises(ValueError, match="no layer"):
        kaisa.KFACPreconditioner(nn.Sequential(nn.Linear(2, 2)), lr=0.1, skip_layers="Linear$")


@pytest.fixture
def _no_layers_model() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(3))


def test_model_without_layers_is_refused(_no_layers_model: nn.Module) -> None:
    with pytest.raises(ValueError, match="no layer K-FAC can precondition"):
        kaisa.KFACPreconditioner(_no_layers_model, lr=0.1)


@pytest.mark.parametrize(("kappa", "clipped"), [(1e-12, True), (1e12, False), (None, False)])
def test_telemetry_records_kl_clipping(kappa: float | None, clipped: bool) -> None:
    model = mlp()
    x, y = torch.randn(9, 5, dtype=D), torch.randint(0, 3, (9,))
    pre = kaisa.KFACPreconditioner(model, kl_clip=kappa, lr=0.5, inv_dtype=D)
    for _ in range(2):
        model.zero_grad()
        loss_fn(model, x, y).backward()
        raw = model[2].weight.grad.clone()
        pre.step()
    assert pre.telemetry.kl_clipped_steps == (2 if clipped else 0)
    scale = pre.telemetry.last_kl_scale
    if clipped:
        assert 0.0 < scale < 1e-3
    else:
        assert scale == 1.0
    assert pre.telemetry.summary()["kl_clipped_steps"] == pre.telemetry.kl_clipped_steps
    assert not torch.equal(model[2].weight.grad, raw)


def test_reprs_name_each_hyperparameter_once_and_telemetry_prints_its_counters() -> None:
    import kaisa as k

    pre = k.KFACPreconditioner(nn.Linear(3, 3), lr=0.1)
    assert repr(pre).count("kl_clip=") == 1 and "kl_clip=0.003" in repr(pre)
    assert repr(k.KFACPreconditioner(nn.Linear(3, 3), kl_clip=None)).count("kl_clip=None") == 1
    text = repr(pre.telemetry)
    assert text.startswith("Telemetry(steps=0") and "outlier_factor_updates=0" in text


def test_the_command_prints_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kaisa import __version__
    from kaisa.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kaisa {__version__}"
