"""Subclasses that compute something else are never taken for their parent (issue 29, item 3).

A subclass of a registered class that overrides ``forward`` (a
weight-standardised convolution) is left raw with one warning naming it and
the reason, unless a handler is registered for the subclass itself (an
``nn.Embedding`` subclass, such as a learned positional embedding that
computes its positions, is read from its lookups instead); subclasses that keep the
parent's ``forward`` are preconditioned as before. Norm-like modules of any
library are reported as the documented norm choice, and grouped
convolutions are listed in one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.layers import registry

NORM = "normalisation layer: affine parameters are left raw (a documented choice)"


@pytest.fixture(autouse=True)
def _restore_registry() -> Iterator[None]:
    saved, unchecked = dict(registry._REGISTRY), set(registry._UNCHECKED)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)
    registry._UNCHECKED.clear()
    registry._UNCHECKED.update(unchecked)


class LearnedPositions(nn.Embedding):
    """BART's learned positional embedding: looks up positions (offset by 2), not its input."""

    def __init__(self, positions: int, d: int) -> None:
        super().__init__(positions + 2, d)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device) + 2
        return super().forward(positions).expand(*input_ids.shape, -1)


class ScaledStdConv2d(nn.Conv2d):
    """timm's weight-standardised convolution: the weight is normalised in forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class OwnConvForward(nn.Conv2d):
    """Keeps forward, replaces the convolution it calls."""

    def _conv_forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return super()._conv_forward(x, weight * 2.0, bias)


class Renamed(nn.Linear):
    """A subclass that keeps nn.Linear's forward: still an nn.Linear to kaisa."""


class Logged(nn.Linear):
    """Overrides forward but computes nn.Linear's function: preconditioned once registered."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


class LlamaRMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class T5LayerNorm(LlamaRMSNorm):
    pass


class LayerNorm2d(nn.LayerNorm):
    """timm's channels-first LayerNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.permute(0, 2, 3, 1)
        return super().forward(x).permute(0, 3, 1, 2)


class Seq2SeqLike(nn.Module):
    """Token and learned positional embeddings, a norm, an MLP and a head."""

    def __init__(self, vocab: int = 13, d: int = 8, positions: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.embed_positions = LearnedPositions(positions, d)
        self.norm = LlamaRMSNorm(d)
        self.fc = Renamed(d, 2 * d)
        self.out = nn.Linear(2 * d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids) + self.embed_positions(ids)
        return self.out(F.gelu(self.fc(self.norm(h))))


def _messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_a_positional_embedding_that_computes_its_positions_is_preconditioned_quietly() -> None:
    """Its lookups are read as they run (tests/layers/test_computed_index_embedding.py
    checks the steps); before, kaisa counted the token ids as positions and crashed."""
    model = Seq2SeqLike()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    assert _messages(caught) == []
    assert {layer.name for layer in pre.layers} == {"embed_tokens", "embed_positions", "fc", "out"}
    raw = {t.parameter: t.reason for t in pre.coverage().raw()}
    assert raw == {"norm.weight": NORM}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 13, (3, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(model(ids).reshape(-1, 13), ids.reshape(-1)).backward()
            pre.step()
            optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert {t.parameter for t in pre.coverage().raw()} == {"norm.weight"}


def test_weight_standardised_and_own_conv_forward_convolutions_are_left_raw() -> None:
    model = nn.Sequential(
        ScaledStdConv2d(3, 4, 3),
        OwnConvForward(4, 4, 3),
        nn.Conv2d(4, 4, 1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    text = "\n".join(_messages(caught))
    assert "ScaledStdConv2d overrides nn.Conv2d.forward()" in text
    assert "OwnConvForward overrides nn.Conv2d._conv_forward()" in text
    assert [layer.name for layer in pre.layers] == ["2", "4"]


def test_subclasses_that_keep_forward_are_preconditioned_as_before() -> None:
    model = nn.Sequential(Renamed(4, 5), nn.ReLU(), nn.Linear(5, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    assert [layer.name for layer in pre.layers] == ["0", "2"]
    assert pre.layers[0].kind == "kronecker (linear)"


def test_a_handler_registered_for_the_subclass_itself_preconditions_it() -> None:
    model = nn.Sequential(Logged(4, 5), nn.ReLU(), nn.Linear(5, 2))
    with pytest.warns(UserWarning, match="Logged overrides nn.Linear.forward"):
        before = kaisa.KFACPreconditioner(model, lr=0.1)
    assert [layer.name for layer in before.layers] == ["2"]
    before.remove_hooks()
    kaisa.register_handler(Logged, registry._linear, example=Logged(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    assert [layer.name for layer in pre.layers] == ["0", "2"]
    assert registry.handler_for(Logged(2, 2)) is not None


def test_norm_like_modules_are_reported_as_the_norm_choice_without_a_warning() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        LayerNorm2d(4),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 8),
        LlamaRMSNorm(8),
        T5LayerNorm(8),
        nn.Linear(8, 2),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    raw = {t.parameter: t.reason for t in pre.coverage().raw()}
    assert raw == {
        "1.weight": NORM,
        "1.bias": NORM,
        "4.weight": NORM,
        "5.weight": NORM,
    }
    assert "no handler" not in str(pre.coverage())


def test_grouped_convolutions_are_preconditioned_without_a_warning() -> None:
    model = nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.Conv2d(8, 16, 1),
        nn.Conv2d(16, 16, 3, padding=1, groups=16),
        nn.Conv2d(16, 16, 3, padding=1, groups=4),
        nn.Flatten(),
        nn.Linear(16 * 4, 2),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    assert _messages(caught) == []
    assert [layer.name for layer in pre.layers] == ["0", "1", "2", "3", "5"]
    assert pre.coverage().raw() == []
    kinds = {t.parameter: t.kind for t in pre.coverage()}
    assert kinds["3.weight"].startswith("kronecker (grouped convolution)")


def test_a_warning_about_many_modules_names_the_first_and_counts_the_rest() -> None:
    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(*[Doubled(4, 4) for _ in range(11)], nn.Linear(4, 2))
    named = r"skipping 11 modules: '0', '1', .*'7', and 3 more: Doubled"
    with pytest.warns(UserWarning, match=named):
        kaisa.KFACPreconditioner(model, lr=0.1)


def test_a_parametrized_weight_is_left_raw_instead_of_crashing() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    torch.nn.utils.parametrizations.orthogonal(model[0])
    with pytest.warns(UserWarning, match="not a parameter of the model but computed from one"):
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    assert [layer.name for layer in pre.layers] == ["2"]
