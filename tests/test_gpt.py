"""The byte-level GPT of ``kaisa.models``: shapes, causality, tying, initialisation, kaisa."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.models import GPT, MODEL_NAMES, build_model


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _small(**kwargs: object) -> GPT:
    options: dict[str, object] = {"d_model": 32, "n_layer": 2, "n_head": 4, "context": 16}
    options.update(kwargs)
    return GPT(**options)  # type: ignore[arg-type]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_default_size_and_layout() -> None:
    """d 128, 3 layers, 4 heads, context 64, vocabulary 256: about 0.67 M parameters."""
    d, layers, vocab, ctx = 128, 3, 256, 64
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    untied = vocab * d + ctx * d + layers * block + 2 * d + d * vocab
    assert untied == 668_800
    assert n_params(GPT()) == untied
    assert n_params(GPT(tied_head=True)) == untied - d * vocab == 636_032
    assert n_params(GPT(fused_qkv=False)) == untied  # three d x d Linears = one d x 3d
    model = GPT()
    names = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for i in range(layers):
        assert {f"blocks.{i}.attn.qkv", f"blocks.{i}.attn.proj"} <= names
        assert {f"blocks.{i}.mlp.fc", f"blocks.{i}.mlp.proj"} <= names
    assert "head" in names and model.head.bias is None
    assert isinstance(model.tok_embed, nn.Embedding) and isinstance(model.pos_embed, nn.Embedding)
    assert not any(isinstance(m, (nn.Dropout, nn.MultiheadAttention)) for m in model.modules())
    assert "gpt" in MODEL_NAMES and isinstance(build_model("gpt"), GPT)


@pytest.mark.parametrize("fused", [True, False])
def test_shapes_and_gradients(fused: bool) -> None:
    model = _small(fused_qkv=fused)
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256)
    assert model(idx[:, :5]).shape == (3, 5, 256)  # shorter than the context
    F.cross_entropy(logits.reshape(-1, 256), idx.reshape(-1)).backward()
    assert all(p.grad is not None for p in model.parameters())
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if fused:
        assert "blocks.0.attn.qkv" in linears and "blocks.0.attn.q" not in linears
    else:
        assert {"blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v"} <= linears


@pytest.mark.parametrize("fused", [True, False])
def test_causal_a_later_token_never_changes_earlier_logits(fused: bool) -> None:
    torch.manual_seed(0)
    model = _small(fused_qkv=fused).eval()
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        base = model(idx)
        for t in (0, 7, 15):
            changed = idx.clone()
            changed[:, t] = (changed[:, t] + 1) % 256
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
            assert not torch.allclose(out[:, t], base[:, t])  # its own position does change


def test_fused_and_separate_projections_compute_the_same_function() -> None:
    """Copying the fused qkv rows into q, k, v gives the same logits."""
    torch.manual_seed(0)
    fused = _small().eval()
    separate = _small(fused_qkv=False).eval()
    state = {}
    for name, value in fused.state_dict().items():
        if ".attn.qkv." in name:
            for part, rows in zip("qkv", value.chunk(3, dim=0), strict=True):
                state[name.replace(".qkv.", f".{part}.")] = rows
        else:
            state[name] = value
    separate.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(separate(idx), fused(idx))


def test_tied_head_shares_the_embedding_parameter() -> None:
    tied = _small(tied_head=True)
    assert tied.head.weight is tied.tok_embed.weight
    assert sum(p is tied.tok_embed.weight for p in tied.parameters()) == 1  # listed once
    untied = _small()
    assert untied.head.weight is not untied.tok_embed.weight
    assert not torch.equal(untied.head.weight, untied.tok_embed.weight)
    idx = torch.randint(0, 256, (2, 8))
    tied(idx).sum().backward()
    assert tied.tok_embed.weight.grad is not None
    assert tied.head.weight.grad is tied.tok_embed.weight.grad


def test_gpt2_initialisation_and_seed() -> None:
    torch.manual_seed(0)
    model = GPT(n_layer=4)
    std = {n: float(p.detach().std()) for n, p in model.named_parameters() if p.ndim == 2}
    residual = 0.02 / math.sqrt(2 * 4)
    for name, value in std.items():
        expected = residual if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else 0.02
        assert value == pytest.approx(expected, rel=0.1), name
    biases = [b.detach() for n, b in model.named_parameters() if n.endswith("bias")]
    assert all(float(b.abs().max()) == 0 for b in biases)
    ln = model.blocks[0].ln1  # type: ignore[index]
    assert torch.equal(ln.weight, torch.ones(128)) and torch.equal(ln.bias, torch.zeros(128))
    torch.manual_seed(1)
    a = GPT()
    torch.manual_seed(1)
    b = GPT()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    torch.manual_seed(2)
    assert not torch.equal(GPT().tok_embed.weight, a.tok_embed.weight)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 30, "n_head": 4}, "divisible"),
        ({"d_model": 0}, "d_model"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_head": -1}, "n_head"),
        ({"context": 0}, "context"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"d_model": 12.0}, "d_model"),
        ({"n_layer": True}, "n_layer"),
        ({"fused_qkv": 1}, "fused_qkv"),
        ({"tied_head": "yes"}, "tied_head"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPT(**kwargs)  # type: ignore[arg-type]


def test_bad_inputs_raise() -> None:
    model = _small()
    with pytest.raises(ValueError, match="context=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(N, T\)"):
        model(torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(1, 4))


def test_kaisa_registers_every_linear_and_both_embeddings() -> None:
    model = GPT()
    pre = kaisa.KFACPreconditioner(model, lr=0.1)
    names = {layer.name for layer in pre.layers}
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert names == linears | {"tok_embed", "pos_embed"}
    coverage = pre.coverage()
    raw = {t.parameter for t in coverage.raw()}
    # Only the LayerNorms' affine parameters stay raw (a documented choice).
    assert raw == {n for n, _ in model.named_parameters() if ".ln" in n or n.startswith("ln_f")}
    kinds = {t.parameter: t.kind for t in coverage}
    assert kinds["tok_embed.weight"].startswith("kronecker (embedding")
    assert kinds["blocks.0.attn.qkv.weight"].startswith("kronecker (linear)")
    pre.remove_hooks()


def test_kaisa_preconditions_the_tied_embedding_with_both_uses_curvature() -> None:
    """A tied head: both uses registered, the shared weight preconditioned, no warning."""
    model = GPT(tied_head=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    names = {layer.name for layer in pre.layers}
    assert {"tok_embed", "head", "pos_embed", "blocks.2.mlp.proj"} <= names
    coverage = {t.parameter: t for t in pre.coverage()}
    tied = coverage["tok_embed.weight"]
    assert tied.kind.startswith("kronecker (shared by tok_embed, head: summed curvature)")
    assert set(tied.blocks) == {"tok_embed", "head"}
    assert "head.weight" not in coverage  # the same Parameter, listed once under the embedding
    assert all(".ln" in t.parameter or t.parameter.startswith("ln_f") for t in pre.coverage().raw())
    pre.remove_hooks()


@pytest.mark.parametrize("tied", [False, True])
def test_a_few_steps_with_kaisa_stay_finite_and_learn(tied: bool) -> None:
    torch.manual_seed(0)
    model = _small(tied_head=tied)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2, lr=3e-3)
    windows = (torch.arange(16 * 17) % 7).view(16, 17)  # a pattern learnt in a few steps
    x, y = windows[:, :-1], windows[:, 1:]
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        pre.step()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
