"""The extension point: a handler for a layer of the user's own (examples/custom_layer.py).

Registered with ``kaisa.register_handler``, the example's ``Dense`` layer must
be preconditioned exactly as ``nn.Linear`` is (same factors, same steps, in
float64); subclasses use the nearest registered ancestor's factory;
unregistered, the layer is reported raw and a model of nothing else is refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from script_loader import load_script
from torch import nn

import kaisa
from kaisa.layers import registry

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_layer.py"


def _example() -> ModuleType:
    return load_script("examples/custom_layer.py", "custom_layer_example")


EX = _example()


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._REGISTRY, EX.Dense, EX.dense_handler)


def _train(model: nn.Module, steps: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, curvature="exact", factor_update_steps=1, inv_update_steps=1
    )
    for _ in range(steps):
        x = torch.randn(32, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (32,), generator=gen)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    dense = nn.Sequential(EX.Dense(6, 10), nn.Tanh(), EX.Dense(10, 3)).double()
    linear = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    with torch.no_grad():
        for d, lin in ((dense[0], linear[0]), (dense[2], linear[2])):
            lin.weight.copy_(d.kernel.t())  # Dense stores (in, out)
            lin.bias.copy_(d.offset)
    return dense, linear


@pytest.mark.usefixtures("registered")
def test_a_registered_handler_takes_the_steps_of_nn_linear() -> None:
    dense, linear = _pair()
    initial = dense[0].kernel.detach().clone()
    got, want = _train(dense), _train(linear)
    for i in (0, 2):
        torch.testing.assert_close(got[f"{i}.kernel"].t(), want[f"{i}.weight"], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[f"{i}.offset"], want[f"{i}.bias"], rtol=0, atol=1e-12)
    assert (got["0.kernel"] - initial).abs().max() > 1e-3  # it moved


@pytest.mark.usefixtures("registered")
def test_subclasses_use_the_nearest_registered_factory_and_coverage_names_the_kind() -> None:
    class Wider(EX.Dense):  # type: ignore[name-defined,misc]
        pass

    model = nn.Sequential(Wider(4, 5), nn.ReLU(), nn.Linear(5, 2))
    coverage = str(kaisa.KFACPreconditioner(model, lr=0.1).coverage())
    assert "0.kernel" in coverage and "kronecker (dense)" in coverage
    assert "3 of 4" not in coverage and "4 of 4 trainable parameters preconditioned" in coverage


def test_without_the_handler_the_layer_is_raw_and_named() -> None:
    model = nn.Sequential(EX.Dense(4, 5), nn.ReLU(), nn.Linear(5, 2))
    coverage = str(kaisa.KFACPreconditioner(model, lr=0.1).coverage())
    assert "no handler for Dense" in coverage
    with pytest.raises(ValueError, match="no layer K-FAC can precondition"):
        kaisa.KFACPreconditioner(EX.Dense(4, 5), lr=0.1)


@pytest.mark.timeout(120)
def test_the_example_runs_from_a_plain_install() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=100, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "4 of 4 trainable parameters preconditioned" in result.stdout
    assert "final training loss" in result.stdout


@pytest.mark.usefixtures("registered")
def test_factor_sample_names_the_layers_whose_handler_cannot_draw_rows() -> None:
    """``factor_sample`` below 1: a handler without ``sample_rows`` takes every row, said aloud."""
    torch.manual_seed(0)
    model = nn.Sequential(EX.Dense(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    with pytest.warns(
        UserWarning, match=r"factor_sample=0.5 cannot draw the rows of 1 layer\(s\) \(0\)"
    ):
        pre = kaisa.KFACPreconditioner(model, lr=0.1, curvature="exact", factor_sample=0.5)
    x = torch.randn(8, 6, dtype=torch.float64)
    model(x).square().sum().backward()
    pre.step()
    # The Dense layer's A is over all 8 rows; the Linear's over the 4 drawn.
    rows = torch.cat([x, torch.ones(8, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(pre.layers[0].block.a, rows.T @ rows / 8, rtol=1e-12, atol=1e-12)
