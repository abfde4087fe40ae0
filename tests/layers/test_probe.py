"""The handler contract is checked against autograd (kaisa.layers.probe, issue 29 item 1).

``register_handler`` probes a new handler once: one input row through the
module, a random output gradient back, and the handler's gradient matrix must
be ``δ āᵀ`` of the rows its factor sums add up. A handler that reshapes an
``(in, out)`` weight where it must transpose it is refused at registration
(with ``example=``) or at the first model that uses it (without), with a
message naming the handler and what is off. kaisa's own handlers pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from script_loader import load_script
from torch import nn

import kaisa
from kaisa.layers import HandlerContractError, LayerHandler, TransposedLinearHandler, registry
from kaisa.layers.base import last_dim_gram
from kaisa.layers.probe import check_factory


def _example() -> ModuleType:
    return load_script("examples/custom_layer.py", "custom_layer_example_probe")


EX = _example()


@pytest.fixture(autouse=True)
def _restore_registry() -> Iterator[None]:
    """Registrations made by a test are undone after it."""
    saved, unchecked = dict(registry._REGISTRY), set(registry._UNCHECKED)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)
    registry._UNCHECKED.clear()
    registry._UNCHECKED.update(unchecked)


class InOut(nn.Module):
    """``y = x W + b`` with ``W`` stored ``(in, out)`` (HuggingFace's Conv1D, written here)."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out))
        self.bias = nn.Parameter(torch.randn(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class Reshaping(TransposedLinearHandler):
    """The mistake of issue 29: the (in, out) weight reshaped to (out, in), not transposed."""

    weight_layout = "out_in"


class ReadsTransposedWritesReshaped(TransposedLinearHandler):
    """Reads the gradient right, writes it back as if it were stored (out, in)."""

    def set_grad_matrix(self, matrix: torch.Tensor) -> None:
        self.grads.write(self.weight, slice(None), matrix[:, :-1])
        assert self.module.bias is not None
        self.grads.write(self.module.bias, slice(None), matrix[:, -1])


class BiasFirst(TransposedLinearHandler):
    """Puts the ones column first in A while the gradient matrix has the bias last."""

    def a_sum(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        rows = x.reshape(-1, x.shape[-1])
        rows = torch.cat([torch.ones_like(rows[:, :1]), rows], dim=1)
        return last_dim_gram(rows, out)


def _factory(cls: type[LayerHandler]) -> registry.HandlerFactory:
    return lambda module, **_: cls(module)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "module",
    [
        nn.Linear(5, 3),
        nn.Linear(5, 3, bias=False),
        nn.Conv2d(3, 4, 3),
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Conv2d(3, 4, (2, 3), stride=2, dilation=(1, 2)),
        nn.Conv2d(3, 4, 4, padding="same", bias=False),
        nn.Conv2d(3, 4, 1, padding_mode="reflect"),
        nn.Conv1d(3, 4, 3, padding=1),
        nn.Embedding(7, 3),
        nn.Embedding(7, 3, padding_idx=0),
    ],
    ids=repr,
)
@pytest.mark.parametrize("estimator", ["expand", "reduce"])
def test_kaisas_own_handlers_keep_the_contract(module: nn.Module, estimator: str) -> None:
    _, factory = registry._registered(module)
    assert factory is not None
    assert check_factory(factory, module, {"conv_estimator": estimator})


def test_the_transposed_linear_handler_keeps_the_contract() -> None:
    for module in (InOut(5, 3), InOut(4, 4, bias=False)):
        assert check_factory(_factory(TransposedLinearHandler), module)


def test_a_handler_that_reshapes_where_it_must_transpose_is_refused_at_registration() -> None:
    # Square and without a bias too: there the reshape even has the right shape.
    for example in (InOut(5, 3), InOut(4, 4, bias=False)):
        with pytest.raises(HandlerContractError) as caught:
            kaisa.register_handler(InOut, _factory(Reshaping), example=example)
        message = str(caught.value)
        assert message.startswith("kaisa: Reshaping for InOut is refused")
        assert "not the gradient autograd computed" in message
        assert "weight_layout" in message and "transposed" in message and "'in_out'" in message
        assert InOut not in registry._REGISTRY  # refused: not registered


def test_a_handler_that_writes_back_otherwise_than_it_reads_is_refused() -> None:
    with pytest.raises(HandlerContractError, match="set_grad_matrix then grad_matrix"):
        kaisa.register_handler(InOut, _factory(ReadsTransposedWritesReshaped), example=InOut(5, 3))


def test_a_handler_with_the_ones_column_in_the_wrong_place_is_refused() -> None:
    with pytest.raises(HandlerContractError, match="columns do not match A from a_sum"):
        kaisa.register_handler(InOut, _factory(BiasFirst), example=InOut(5, 3))


def test_without_an_example_the_first_model_using_the_handler_is_refused() -> None:
    kaisa.register_handler(InOut, _factory(Reshaping))  # nothing to probe yet
    model = nn.Sequential(InOut(5, 6), nn.Tanh(), nn.Linear(6, 2))
    with pytest.raises(HandlerContractError, match="Reshaping for InOut is refused"):
        kaisa.KFACPreconditioner(model, lr=0.1)
    # The model is untouched: no hooks, no gradients from the probe.
    assert all(p.grad is None for p in model.parameters())
    assert not model[0]._forward_hooks


def test_a_good_handler_is_checked_once_on_the_first_module_and_then_used() -> None:
    checked: list[nn.Module] = []

    def factory(module: nn.Module, **_: object) -> LayerHandler:
        checked.append(module)
        return TransposedLinearHandler(module)

    kaisa.register_handler(InOut, factory)
    model = nn.Sequential(InOut(5, 6), nn.Tanh(), InOut(6, 2))
    pre = kaisa.KFACPreconditioner(model, lr=0.1)
    assert [layer.name for layer in pre.layers] == ["0", "2"]
    # One probe (on a copy of the first module), then one handler per module.
    assert len(checked) == 3 and checked[0] is not model[0] and checked[1] is model[0]
    assert InOut not in registry._UNCHECKED
    pre.remove_hooks()
    kaisa.KFACPreconditioner(model, lr=0.1)
    assert len(checked) == 5  # no second probe


def test_the_examples_handler_passes_and_fails_with_the_wrong_layout() -> None:
    kaisa.register_handler(EX.Dense, EX.dense_handler, example=EX.Dense(3, 2))

    class Wrong(EX.DenseHandler):  # type: ignore[name-defined,misc]
        weight_layout = "out_in"

    with pytest.raises(HandlerContractError, match="Wrong for Dense is refused"):
        kaisa.register_handler(EX.Dense, _factory(Wrong), example=EX.Dense(3, 4))


def test_check_false_registers_without_a_probe_and_bad_arguments_are_refused() -> None:
    kaisa.register_handler(InOut, _factory(Reshaping), check=False)
    assert registry._REGISTRY[InOut] is not None and InOut not in registry._UNCHECKED
    with pytest.raises(TypeError, match="example must be an instance of InOut"):
        kaisa.register_handler(InOut, _factory(TransposedLinearHandler), example=nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        kaisa.register_handler(int, _factory(TransposedLinearHandler))  # type: ignore[arg-type]


def test_a_module_the_default_probe_cannot_run_is_refused_with_what_to_do() -> None:
    class TwoInputs(InOut):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x) * scale

    with pytest.raises(HandlerContractError, match="override the handler's probe_input"):
        kaisa.register_handler(
            TwoInputs, _factory(TransposedLinearHandler), example=TwoInputs(3, 2)
        )


def test_a_convolution_padded_beyond_one_output_position_cannot_be_probed() -> None:
    conv = nn.Conv1d(3, 4, 3, padding=2)
    with pytest.raises(HandlerContractError, match="cannot make a probe input of one row"):
        check_factory(registry._REGISTRY[nn.Conv1d], conv)


def test_meta_modules_are_not_probed() -> None:
    with torch.device("meta"):
        module = InOut(5, 3)
    assert not check_factory(_factory(Reshaping), module)
