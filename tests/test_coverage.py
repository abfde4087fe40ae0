"""Coverage of every trainable parameter, shared parameters, and layer kinds (issue 16)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa


class TiedLM(nn.Module):
    """Embedding, a batch-first encoder, and a head tied to the embedding."""

    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.embed(idx))))


def test_a_tied_parameter_is_preconditioned_with_the_curvature_of_both_uses() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, lr=0.1)
    names = [layer.name for layer in pre.layers]
    assert "embed" in names and "head" in names
    assert "encoder.layers.0.self_attn.q" in names
    by_name = {t.parameter: t for t in pre.coverage()}
    assert by_name["embed.weight"].kind.startswith("kronecker (shared by head, embed")
    assert by_name["head.bias"].blocks == ("head",)
    idx = torch.randint(0, 11, (3, 5))
    F.cross_entropy(model(idx).reshape(-1, 11), idx.reshape(-1)).backward()
    tied = model.embed.weight.grad.clone()
    pre.step()
    assert not torch.equal(model.embed.weight.grad, tied)
    assert torch.isfinite(model.embed.weight.grad).all()


def test_a_tied_parameter_with_two_biases_is_left_raw_with_a_warning_naming_it() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    model.back = nn.Linear(8, 11)
    model.back.weight = model.embed.weight  # the same (11, 8) weight, with a second bias
    with pytest.warns(UserWarning, match="shares a parameter") as caught:
        pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    text = " ".join(str(w.message) for w in caught)
    assert "'embed'" in text and "'head'" in text
    names = [layer.name for layer in pre.layers]
    assert "embed" not in names and "head" not in names and "back" not in names
    raw = {t.parameter: t.reason for t in pre.coverage().raw()}
    assert raw["embed.weight"] == "shared by back, embed, head"
    assert raw["head.bias"] == "its layer's other parameter is shared by back, embed, head"
    idx = torch.randint(0, 11, (3, 5))
    F.cross_entropy(model(idx).reshape(-1, 11), idx.reshape(-1)).backward()
    tied = model.embed.weight.grad.clone()
    pre.step()
    assert torch.equal(model.embed.weight.grad, tied)


def test_coverage_lists_every_trainable_parameter_with_its_treatment() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    model.head.weight = nn.Parameter(torch.randn(11, 8))  # untied
    model.head.bias.requires_grad_(False)
    pre = kaisa.KFACPreconditioner(model, lr=0.1, skip_layers=[r"linear2"])
    coverage = pre.coverage()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [t.parameter for t in coverage] == trainable
    by_name = {t.parameter: t for t in coverage}
    assert by_name["embed.weight"].kind.startswith("kronecker (embedding")
    assert by_name["embed.weight"].blocks == ("embed",)
    in_proj = by_name["encoder.layers.0.self_attn.in_proj_weight"]
    assert in_proj.blocks == tuple(f"encoder.layers.0.self_attn.{r}" for r in "qkv")
    assert "normalisation" in by_name["norm.weight"].reason
    assert "normalisation" in by_name["encoder.layers.0.norm1.bias"].reason
    assert by_name["encoder.layers.0.linear2.weight"].reason == (
        "skip_layers matched 'linear2' (on 'encoder.layers.0.linear2')"
    )
    assert by_name["head.weight"].reason == "its layer's other parameter is frozen"
    assert "head.bias" not in by_name  # frozen: not trainable
    table = str(coverage)
    assert all(name in table for name in trainable)
    kept = sum(t.kind != "raw" for t in coverage)
    assert table.endswith(f"{kept} of {len(trainable)} trainable parameters preconditioned")
    # Once the automatic choice is made, the representations show.
    idx = torch.randint(0, 11, (3, 5))
    F.cross_entropy(model(idx).reshape(-1, 11), idx.reshape(-1)).backward()
    pre.step()
    assert "A/G diagonal/" in {t.parameter: t for t in pre.coverage()}["embed.weight"].kind


def test_a_layer_called_twice_gathers_curvature_from_both_calls() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_update_steps=1, curvature="exact")
    assert [layer.name for layer in pre.layers] == ["0"]
    model(torch.randn(6, 4)).sum().backward()
    layer = pre.layers[0]
    assert layer.captured_rows[("a", "gram")] == 12 and layer.captured_rows[("g", "gram")] == 12
    assert not pre.coverage().raw()


def test_conv1d_is_registered() -> None:
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 9, 2))
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    assert [layer.name for layer in pre.layers] == ["0", "2"]
    F.cross_entropy(model(torch.randn(5, 3, 9)), torch.randint(0, 2, (5,))).backward()
    raw = model[0].weight.grad.clone()
    pre.step()
    assert pre.layers[0].block.updates == 1
    assert not torch.equal(model[0].weight.grad, raw)


def test_a_grouped_conv1d_is_preconditioned() -> None:
    model = nn.Sequential(nn.Conv1d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(4, 2))
    pre = kaisa.KFACPreconditioner(model, lr=0.1)
    assert [layer.name for layer in pre.layers] == ["0", "2"]
    assert pre.coverage().raw() == []


def test_skip_layers_on_a_container_leaves_everything_inside_it_raw() -> None:
    """The reference implementation's issue #53: skipping 'Block' registered its children."""
    torch.manual_seed(0)
    model = TiedLM()
    model.head.weight = nn.Parameter(torch.randn(11, 8))
    pre = kaisa.KFACPreconditioner(model, lr=0.1, skip_layers=["TransformerEncoderLayer"])
    assert [layer.name for layer in pre.layers] == ["embed", "head"]
    raw = {t.parameter: t.reason for t in pre.coverage().raw()}
    inside = [n for n, _ in model.named_parameters() if n.startswith("encoder.layers.0.")]
    assert inside and all(
        raw[n] == "skip_layers matched 'TransformerEncoderLayer' (on 'encoder.layers.0')"
        for n in inside
    )


def test_every_weight_matrix_of_a_standard_transformer_is_preconditioned() -> None:
    """An untied language model from nn.Embedding and nn.TransformerEncoder."""
    torch.manual_seed(0)
    model = TiedLM()
    model.head.weight = nn.Parameter(torch.randn(11, 8))
    pre = kaisa.KFACPreconditioner(model, lr=0.1)
    coverage = pre.coverage()
    matrices = {n for n, p in model.named_parameters() if p.ndim >= 2}
    assert matrices == {
        "embed.weight",
        "encoder.layers.0.self_attn.in_proj_weight",
        "encoder.layers.0.self_attn.out_proj.weight",
        "encoder.layers.0.linear1.weight",
        "encoder.layers.0.linear2.weight",
        "head.weight",
    }
    assert all(t.kind != "raw" for t in coverage if t.parameter in matrices)
    # Only the norms' scale-and-shift parameters are left raw, each with its reason.
    assert {t.parameter for t in coverage.raw()} == {
        f"{norm}.{p}"
        for norm in ("encoder.layers.0.norm1", "encoder.layers.0.norm2", "norm")
        for p in ("weight", "bias")
    }


def test_layers_is_a_read_only_view_of_the_registered_layers() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Embedding(5, 3))
    pre = kaisa.KFACPreconditioner(model, lr=0.1)
    view = pre.layers
    assert [layer.name for layer in view] == ["0", "2"]
    assert view[0].module is model[0] and view[0].kind == "kronecker (linear)"
    assert (view[0].a_size, view[0].g_size) == (5, 6)
    assert view[1].curvature[0] == "diagonal"  # an embedding's A
    assert all(layer.grad_worker and not layer.dormant for layer in view)
    assert isinstance(view, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view[0].name = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        pre.layers = ()  # type: ignore[misc]


class Embeddings(nn.Module):
    """A patch projection with free tensors of its own (a class token, positions, a gate)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(4, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.positions = nn.Parameter(torch.zeros(1, 4, d))
        self.gate = nn.Parameter(torch.ones(d))  # 1-D: listed, not warned about

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x) * self.gate
        return torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1)[:, :4] + self.positions


class Bilinear(nn.Module):
    """A layer kaisa has no handler for: its weight is a raw matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(8, 8) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.kernel


def _constructed(model: nn.Module) -> tuple[kaisa.KFACPreconditioner, list[str]]:
    with pytest.warns(UserWarning) as caught:
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    return pre, [str(w.message) for w in caught if "kaisa" in str(w.message)]


def test_raw_matrices_of_modules_kaisa_lacks_are_named_in_one_warning_with_their_reason() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Embeddings(), Bilinear(), nn.Linear(8, 3))
    pre, messages = _constructed(model)
    named = [m for m in messages if "belong to no layer kaisa handles" in m]
    assert len(named) == 1, messages
    message = named[0]
    free = "a free parameter of Embeddings, not a layer kaisa handles"
    assert f"'0.cls_token' (1x1x8, {free})" in message
    assert f"'0.positions' (1x4x8, {free})" in message
    assert "'1.kernel' (8x8, no handler for Bilinear)" in message
    assert message.startswith("kaisa: 3 parameters of two or more dimensions")
    assert "0.gate" not in message and "0.proj" not in message
    raw = {t.parameter: t.reason for t in pre.coverage().raw()}
    assert raw == {
        "0.cls_token": free,
        "0.positions": free,
        "0.gate": free,
        "1.kernel": raw["1.kernel"],
    }
    assert raw["1.kernel"] == "no handler for Bilinear"
    # It still trains: the free tensors keep their raw gradients.
    x = torch.randn(5, 4, 4)
    model(x).sum().backward()
    before = model[0].cls_token.grad.clone()  # type: ignore[union-attr]
    pre.step()
    assert torch.equal(model[0].cls_token.grad, before)


def test_many_unhandled_matrices_are_one_warning_that_counts_the_rest() -> None:
    model = nn.Sequential(*[Bilinear() for _ in range(10)], nn.Linear(8, 3))
    _, messages = _constructed(model)
    named = [m for m in messages if "belong to no layer kaisa handles" in m]
    assert len(named) == 1 and "kaisa: 10 parameters" in named[0]
    assert "'7.kernel'" in named[0] and "'8.kernel'" not in named[0] and "and 2 more" in named[0]


def test_norms_skipped_and_registered_layers_are_not_in_the_unhandled_warning() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), Bilinear(), nn.Linear(8, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kaisa.KFACPreconditioner(model, lr=0.1, skip_layers=[r"^2$"])
    assert [str(w.message) for w in caught] == []  # the user skipped it: nothing to say
    _, messages = _constructed(model)  # not skipped: named
    assert any("'2.kernel' (8x8, no handler for Bilinear)" in m for m in messages)
