"""kaisa on a ``torch.compile`` d model: the same names, portable checkpoints, the same steps.

``torch.compile(model)`` wraps the model (``_orig_mod``), which prefixes every
module and parameter name; kaisa names layers as if nothing were compiled, so
``coverage()``, checkpoints, ``skip_layers`` and ``curvature`` patterns agree
with the eager run, and a checkpoint moves between the two bit-identically.
Compiled with the ``eager`` and ``aot_eager`` backends (no C++ toolchain
needed, fast on CPU).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.layers.registry import plain_name

BACKENDS = ("eager", "aot_eager")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.norm = nn.LayerNorm(8)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.norm(self.body(torch.tanh(self.fc1(x)))))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def _train(run: nn.Module, pre: kaisa.KFACPreconditioner, steps: range) -> None:
    params = list(run.parameters())
    for step in steps:
        x, y = _batch(step)
        run.zero_grad()
        F.cross_entropy(run(x), y).backward()
        pre.step()
        with torch.no_grad():
            for p in params:
                p.sub_(0.1 * p.grad)  # type: ignore[operator]


def _variant(init: Net, how: str, backend: str) -> tuple[Net, nn.Module]:
    """``(the eager module, what is run and given to kaisa)``: eager, whole or part compiled."""
    model = copy.deepcopy(init)
    if how == "eager":
        return model, model
    if how == "whole":
        return model, torch.compile(model, backend=backend)  # type: ignore[return-value]
    model.body = torch.compile(model.body, backend=backend)  # type: ignore[assignment]
    return model, model


def _pre(run: nn.Module, **kwargs: object) -> kaisa.KFACPreconditioner:
    return kaisa.KFACPreconditioner(
        run, lr=0.1, factor_update_steps=1, inv_update_steps=2, **kwargs
    )


def test_plain_name_drops_only_the_compile_segments() -> None:
    assert plain_name("_orig_mod.fc1.weight") == "fc1.weight"
    assert plain_name("body._orig_mod.0") == "body.0"
    assert plain_name("_orig_mod") == ""
    assert plain_name("my_orig_mod.x") == "my_orig_mod.x"  # a segment, not a substring


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["whole", "part"])
def test_compiled_models_have_the_eager_names_everywhere(how: str) -> None:
    torch.manual_seed(0)
    init = Net()
    eager = _pre(init)
    _, run = _variant(init, how, "eager")
    compiled = _pre(run)
    assert [layer.name for layer in compiled.layers] == [layer.name for layer in eager.layers]
    assert [layer.name for layer in eager.layers] == ["fc1", "body.0", "body.2", "fc3"]
    assert str(compiled.coverage()) == str(eager.coverage())
    assert "_orig_mod" not in str(compiled.coverage())
    # Patterns see the eager names: skip_layers and per-layer curvature.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skipped = _pre(run, skip_layers=[r"^body\.2$"], curvature={r"^body\.0$": "diagonal"})
    assert [layer.name for layer in skipped.layers] == ["fc1", "body.0", "fc3"]
    assert skipped.layers[1].curvature == ("diagonal", "diagonal")
    raw = {t.parameter: t.reason for t in skipped.coverage().raw()}
    assert raw["body.2.weight"] == "skip_layers matched '^body\\\\.2$' (on 'body.2')"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("first", "then"), [("eager", "whole"), ("whole", "eager"), ("part", "whole")]
)
def test_a_checkpoint_moves_between_eager_and_compiled_runs_bit_identically(
    first: str, then: str, backend: str
) -> None:
    torch.manual_seed(0)
    init = Net()
    reference, run = _variant(init, "eager", backend)
    pre = _pre(run)
    _train(run, pre, range(4))
    # Two steps one way, checkpoint, two more the other way.
    model, run = _variant(init, first, backend)
    pre = _pre(run)
    _train(run, pre, range(2))
    # (torch's own state_dict keeps a compiled submodule's '_orig_mod.': dropped here.)
    model_state = {plain_name(k): v.clone() for k, v in model.state_dict().items()}
    pre_state = copy.deepcopy(pre.state_dict())
    assert not any("_orig_mod" in name for name in pre_state["layers"])
    resumed, run = _variant(init, then, backend)
    resumed.load_state_dict(model_state)
    pre = _pre(run)
    pre.load_state_dict(pre_state)
    _train(run, pre, range(2, 4))
    assert pre.steps == 4
    for name, want in reference.state_dict().items():
        got = resumed.state_dict()[name]
        assert torch.equal(got, want), (name, (got - want).abs().max())
    moved = (reference.fc1.weight - init.fc1.weight).abs().max()
    assert moved > 1e-3  # the steps did something


@pytest.mark.timeout(120)
def test_kaisa_adds_at_most_one_graph_break_per_layer() -> None:
    torch.manual_seed(0)
    model = Net()
    x, _ = _batch(0)
    torch._dynamo.reset()
    plain = torch._dynamo.explain(model)(x)
    assert plain.graph_break_count == 0
    pre = _pre(model)
    torch._dynamo.reset()
    hooked = torch._dynamo.explain(model)(x)
    pre.discard_captures()  # the explained forward has no backward
    # Each capture hook is one opaque call (torch.compiler.disable): the graph
    # breaks there and resumes after it, so the rest of the model stays compiled.
    assert 0 < hooked.graph_break_count <= len(pre.layers)
    assert all("disable" in str(r.reason) for r in hooked.break_reasons)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_run_takes_the_eager_steps_with_factor_and_inverse_intervals(
    backend: str,
) -> None:
    torch.manual_seed(0)
    init = Net()
    finals = []
    for how in ("eager", "whole"):
        model, run = _variant(init, how, backend)
        pre = kaisa.KFACPreconditioner(run, lr=0.1, factor_update_steps=2, inv_update_steps=3)
        _train(run, pre, range(7))
        finals.append(model.state_dict())
        assert [layer.block.updates for layer in pre.layers] == [4, 4, 4, 4]
    for name, want in finals[0].items():
        assert torch.equal(finals[1][name], want), name
