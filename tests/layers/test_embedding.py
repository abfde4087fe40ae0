"""nn.Embedding: a Linear on one-hot rows with a diagonal A (issue 16, item 2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.layers import EmbeddingHandler

VOCAB, DIM = 7, 3


def tokens(seed: int, shape: tuple[int, ...] = (4, 5)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_captures_are_those_of_a_linear_on_one_hot_rows() -> None:
    emb = nn.Embedding(VOCAB, DIM).double()
    handler = EmbeddingHandler(emb)
    idx = tokens(0)
    onehot = F.one_hot(idx, VOCAB).double().reshape(-1, VOCAB)
    a, rows = handler.a_sum(idx, torch.zeros(VOCAB, VOCAB, dtype=torch.float64))
    assert rows == idx.numel()
    torch.testing.assert_close(a, onehot.t() @ onehot)
    moments, rows = handler.a_moments(idx)
    assert rows == idx.numel()
    torch.testing.assert_close(moments[0].double(), onehot.sum(0))
    torch.testing.assert_close(moments[1].double(), onehot.square().sum(0))
    # Two calls add up like one call on both.
    handler.a_moments(tokens(1), moments)
    both = F.one_hot(torch.cat([idx.reshape(-1), tokens(1).reshape(-1)]), VOCAB).double()
    torch.testing.assert_close(moments[0].double(), both.sum(0))
    delta = torch.randn(4, 5, DIM, dtype=torch.float64)
    g, rows = handler.g_sum(delta)
    flat = delta.reshape(-1, DIM)
    torch.testing.assert_close(g, flat.t() @ flat)
    assert rows == 20


def test_gradient_matrix_is_the_table_transposed_and_obeys_the_kfac_identity() -> None:
    emb = nn.Embedding(VOCAB, DIM).double()
    handler = EmbeddingHandler(emb)
    idx = tokens(2)
    out = emb(idx)
    delta = torch.randn_like(out)
    out.backward(delta)
    onehot = F.one_hot(idx, VOCAB).double().reshape(-1, VOCAB)
    grad = handler.grad_matrix()
    assert grad is not None and grad.shape == (DIM, VOCAB) and grad.is_contiguous()
    torch.testing.assert_close(grad, delta.reshape(-1, DIM).t() @ onehot)
    new = torch.randn(DIM, VOCAB, dtype=torch.float64)
    handler.set_grad_matrix(new)
    torch.testing.assert_close(emb.weight.grad, new.t())


class EmbedNet(nn.Module):
    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.head = nn.Linear(DIM, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx).tanh().mean(1))


class OneHotNet(nn.Module):
    def __init__(self, source: EmbedNet) -> None:
        super().__init__()
        self.lin = nn.Linear(VOCAB, DIM, bias=False)
        self.head = nn.Linear(DIM, 2)
        with torch.no_grad():
            self.lin.weight.copy_(source.emb.weight.t())
        self.head.load_state_dict(source.head.state_dict())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(idx, VOCAB).to(self.lin.weight.dtype)
        return self.head(self.lin(onehot).tanh().mean(1))


@pytest.mark.parametrize("g_side", ["exact", "kvec"])
def test_embedding_takes_the_steps_of_a_one_hot_linear_with_diagonal_a(g_side: str) -> None:
    torch.manual_seed(0)
    net = EmbedNet().double()
    ref = OneHotNet(net).double()
    common = dict(factor_update_steps=1, inv_update_steps=1, inv_dtype=torch.float64, lr=0.1)
    common["profile"] = "general"  # both models alike (the reference has no embedding)
    pre = kaisa.KFACPreconditioner(
        net, curvature={"emb": ("auto", g_side), "head": "exact"}, **common
    )
    pre_ref = kaisa.KFACPreconditioner(
        ref, curvature={"lin": ("diagonal", g_side), "head": "exact"}, **common
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (net, ref)]
    for step in range(4):
        idx, y = tokens(10 + step), torch.randint(0, 2, (4,))
        for model, p, o in zip((net, ref), (pre, pre_ref), opts, strict=True):
            o.zero_grad()
            F.cross_entropy(model(idx), y).backward()
            p.step()
            o.step()
    assert [str(s) for s in pre.layers[0].block.specs] == ["diagonal", g_side]
    torch.testing.assert_close(net.emb.weight, ref.lin.weight.t(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(net.head.weight, ref.head.weight, rtol=1e-10, atol=1e-12)


def test_the_automatic_choice_keeps_the_embedding_a_diagonal_and_never_forms_its_gram() -> None:
    torch.manual_seed(0)
    net = EmbedNet()
    pre = kaisa.KFACPreconditioner(net, lr=0.1)
    assert pre.layers[0].capture_keys[0] == ("a", "moments")  # no VOCAB² gram while pending
    F.cross_entropy(net(tokens(3)), torch.randint(0, 2, (4,))).backward()
    pre.step()
    assert pre.curvature_choice is not None
    assert pre.curvature_choice.specs["emb"][0] == "diagonal"


def test_the_padding_row_never_moves() -> None:
    torch.manual_seed(0)
    net = EmbedNet(padding_idx=0)
    pre = kaisa.KFACPreconditioner(net, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    before = net.emb.weight.detach().clone()
    for step in range(3):
        idx = tokens(20 + step)
        idx[:, 0] = 0  # the padding token in every sequence
        opt.zero_grad()
        F.cross_entropy(net(idx), torch.randint(0, 2, (4,))).backward()
        pre.step()
        assert torch.equal(net.emb.weight.grad[0], torch.zeros(DIM))
        opt.step()
    assert torch.equal(net.emb.weight[0], before[0])
    assert not torch.equal(net.emb.weight[1:], before[1:])


def test_a_sparse_embedding_is_left_raw_with_a_warning() -> None:
    net = EmbedNet()
    net.emb = nn.Embedding(VOCAB, DIM, sparse=True)
    with pytest.warns(UserWarning, match=r"'emb' \(Embedding\(7, 3, sparse=True\)\): sparse"):
        pre = kaisa.KFACPreconditioner(net, lr=0.1)
    assert [layer.name for layer in pre.layers] == ["head"]
    raw = {t.parameter: t.reason for t in pre.coverage().raw()}
    assert "sparse" in raw["emb.weight"]
