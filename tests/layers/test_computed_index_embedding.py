"""Embeddings that compute the indices they look up (learned position embeddings).

HuggingFace's OPT, BART (and the models copied from them) hold their learned
positions in an ``nn.Embedding`` subclass whose ``forward`` takes the token
ids or the attention mask and looks up the positions it derives (offset by
2). kaisa reads each lookup's indices from its autograd node: such a model
must take the steps of the same model whose positions are a plain
``nn.Embedding`` called on those positions (float64, K-FAC and EKFAC). A
subclass whose output is not a lookup of its table captures nothing, its
gradient stays raw, and the warning says why.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.bart.modeling_bart import BartLearnedPositionalEmbedding
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding
from transformers.models.whisper.modeling_whisper import WhisperPositionalEmbedding

import kaisa
from kaisa.layers.embedding import ComputedIndexEmbeddingHandler, lookup_indices

VOCAB, DIM, POSITIONS = 11, 6, 12


class BroadcastPositions(nn.Embedding):
    """Looks up each position once and broadcasts the rows over the batch."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        positions = torch.arange(ids.shape[-1], device=ids.device) + 2
        return super().forward(positions).expand(*ids.shape, -1)


class Transformed(nn.Embedding):
    """A lookup changed after it is made: not a lookup of the table."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(ids) * 2.0 + 1.0


class Indexed(nn.Embedding):
    """Whisper's positions: the table indexed directly, no lookup."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.weight[: ids.shape[-1]]


class TwoArguments(nn.Embedding):
    """A forward the probe cannot call, whose output turns out transformed as it runs."""

    def forward(self, ids: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        return super().forward(ids) * scale


class ScaleBy2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = TwoArguments(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids, 2.0))


def _positions(kind: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What each kind looks up, computed by hand (the reference model's indices)."""
    if kind == "opt":  # the count of attended tokens so far, minus 1, plus the offset 2
        return (torch.cumsum(mask, 1) * mask - 1) + 2
    return (torch.arange(ids.shape[1]) + 2).expand_as(ids)  # BART's and broadcast's


class Net(nn.Module):
    """Token and position embeddings, an MLP, a head; ``kind``: which position embedding."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.tokens = nn.Embedding(VOCAB, DIM)
        if kind == "opt":
            self.positions: nn.Embedding = OPTLearnedPositionalEmbedding(POSITIONS, DIM)
        elif kind == "bart":
            self.positions = BartLearnedPositionalEmbedding(POSITIONS, DIM)
        elif kind == "broadcast":
            self.positions = BroadcastPositions(POSITIONS + 2, DIM)
        else:  # the reference: a plain table given the positions
            self.positions = nn.Embedding(POSITIONS + 2, DIM)
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.head = nn.Linear(2 * DIM, VOCAB)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, reference: str = "") -> torch.Tensor:
        if self.kind == "plain":
            pos = self.positions(_positions(reference, ids, mask))
        elif self.kind == "opt":
            pos = self.positions(mask)
        else:
            pos = self.positions(ids)
        return self.head(F.gelu(self.fc(self.tokens(ids) + pos)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (4, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: OPT's positions start after it
    mask[3, :1] = 0
    return ids, mask, torch.randint(0, VOCAB, (4, 9), generator=gen)


@pytest.mark.parametrize("correction", ["off", "ekfac"])
@pytest.mark.parametrize("kind", ["opt", "bart", "broadcast"])
def test_it_takes_the_steps_of_a_plain_table_given_the_positions(
    kind: str, correction: str
) -> None:
    net, ref = Net(kind).double(), Net("plain").double()
    ref.load_state_dict(net.state_dict())
    common = dict(factor_update_steps=1, inv_update_steps=1, inv_dtype=torch.float64, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing raw, nothing warned
        pres = [
            kaisa.KFACPreconditioner(
                m, curvature="exact", eigenvalue_correction=correction, **common
            )
            for m in (net, ref)
        ]
        assert isinstance(pres[0].layers[1].handler, ComputedIndexEmbeddingHandler)
        assert pres[0].layers[1].name == "positions"
        assert not pres[0].coverage().raw()
        opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (net, ref)]
        for step in range(4):
            ids, mask, target = _batch(step)
            for model, pre, opt in zip((net, ref), pres, opts, strict=True):
                opt.zero_grad()
                out = model(ids, mask, kind)
                F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1)).backward()
                pre.step()
                opt.step()
    assert pres[0].layers[1].block.updates == 4
    for name, param in net.named_parameters():
        torch.testing.assert_close(param, ref.get_parameter(name), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "make", [Transformed, Indexed, WhisperPositionalEmbedding], ids=["scaled", "indexed", "whisper"]
)
def test_one_a_probe_shows_is_no_lookup_is_left_raw_with_the_reason(make: type) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(make(VOCAB, DIM), nn.Linear(DIM, VOCAB))
    with pytest.warns(UserWarning, match=r"forward\(\) returned something other than a lookup"):
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    assert [layer.name for layer in pre.layers] == ["1"]
    assert {t.parameter for t in pre.coverage().raw()} == {"0.weight"}


def test_one_that_turns_out_no_lookup_as_it_runs_stays_raw_and_the_warning_says_why() -> None:
    torch.manual_seed(0)
    model = ScaleBy2().double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the probe cannot call it: taken
        pre = kaisa.KFACPreconditioner(model, curvature="exact", lr=0.1)
    assert [layer.name for layer in pre.layers] == ["emb", "head"]
    ids = torch.randint(0, VOCAB, (4, 5))
    model(ids).sum().backward()
    raw_grad = model.emb.weight.grad.clone()  # type: ignore[union-attr]
    with pytest.warns(RuntimeWarning, match=r"TwoArguments.forward\(\) returned something other"):
        pre.step()
    torch.testing.assert_close(model.emb.weight.grad, raw_grad, rtol=0, atol=0)
    assert {t.parameter for t in pre.coverage().raw()} == {"emb.weight"}


def test_the_indices_are_read_only_from_a_lookup_of_the_table_itself() -> None:
    table = nn.Embedding(VOCAB, DIM, padding_idx=3)
    other = nn.Embedding(VOCAB, DIM, padding_idx=3)
    ids = torch.randint(0, VOCAB, (2, 5))
    assert torch.equal(lookup_indices(table(ids), table), ids)  # type: ignore[arg-type]
    row = table(ids[0])
    broadcast = lookup_indices(row.expand(3, 5, DIM), table)
    assert broadcast is not None and torch.equal(broadcast, ids[0].expand(3, 5))
    assert lookup_indices(table(ids), other) is None  # another table's lookup
    assert lookup_indices(F.embedding(ids, table.weight), table) is None  # no padding row
    assert lookup_indices(F.embedding(ids, table.weight, 3, scale_grad_by_freq=True), table) is None
    assert lookup_indices(table(ids) * 2, table) is None
    assert lookup_indices(table(ids)[:, :2], table) is None
    with torch.no_grad():
        assert lookup_indices(table(ids), table) is None  # no autograd node


class CheckpointedNet(nn.Module):
    """BART's positions inside a block run under activation checkpointing (``mode``) or not."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = BartLearnedPositionalEmbedding(POSITIONS, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def block(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(h + self.positions(ids)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)
        if self.mode == "plain":
            return self.block(h, ids)
        from torch.utils.checkpoint import checkpoint

        out = checkpoint(self.block, h, ids, use_reentrant=self.mode == "reentrant")
        assert isinstance(out, torch.Tensor)
        return out


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_under_activation_checkpointing_it_takes_the_plain_runs_steps(mode: str) -> None:
    """Reading the saved indices in the forward hook works whether the block's
    activations are kept, recomputed in backward (reentrant), or packed by saved-tensor
    hooks (non-reentrant)."""
    weights = []
    for kind in ("plain", mode):
        net = CheckpointedNet(kind).double()
        pre = kaisa.KFACPreconditioner(
            net, curvature="exact", factor_update_steps=1, inv_update_steps=1, lr=0.1,
            inv_dtype=torch.float64,
        )  # fmt: skip
        opt = torch.optim.SGD(net.parameters(), lr=0.3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in range(3):
                ids, _, target = _batch(step)
                opt.zero_grad()
                F.cross_entropy(net(ids).reshape(-1, VOCAB), target.reshape(-1)).backward()
                pre.step()
                opt.step()
        assert pre.layers[1].name == "positions" and pre.layers[1].block.updates == 3
        weights.append([p.detach().clone() for p in net.parameters()])
    for got, want in zip(weights[1], weights[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
