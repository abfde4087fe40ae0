"""The layers HuggingFace writes its own way: scaled embeddings, Falcon's Linear, shared holders.

* A ``*ScaledWordEmbedding`` (Gemma's, BART's, …) returns ``embed_scale ·
  W[i]``. kaisa takes it for the plain lookup followed by a multiplication
  by ``embed_scale`` outside the module, whose steps it must take (float64),
  tied head or not; one that is not that product is left raw with a reason.
* ``FalconLinear`` and timm's ``Linear`` compute ``x Wᵀ + b`` themselves: the steps of
  ``nn.Linear``.
* An encoder-decoder's ``shared`` embedding is a module that holds the
  weight its encoder, decoder and head use but never runs itself. The
  summed curvature of the uses that run must precondition the weight, with
  the steps of the same model without the idle holder.
* BERT's, RoBERTa's and ALBERT's MLM heads keep their decoder's bias as their
  own ``bias`` too: an alias a parent holds is the layer's alone, so the
  embedding tied to the decoder is preconditioned, with the steps of the
  model without the alias; one held by a module beside the layer is not.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.bart.modeling_bart import BartScaledWordEmbedding
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

import kaisa
from kaisa.layers import registry
from kaisa.layers.embedding import ScaledEmbeddingHandler

VOCAB, DIM, SCALE = 11, 4, 2.5
COMMON = dict(factor_update_steps=1, inv_update_steps=1, inv_dtype=torch.float64, lr=0.1)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(seed))


def _scaled(kind: str) -> nn.Embedding:
    if kind == "bart":
        return BartScaledWordEmbedding(VOCAB, DIM, padding_idx=1, embed_scale=SCALE)
    return GemmaTextScaledWordEmbedding(VOCAB, DIM, padding_idx=1, embed_scale=SCALE)


class ScaledNet(nn.Module):
    """A scaled lookup, a nonlinearity, and a head over the vocabulary (tied or not)."""

    def __init__(self, emb: nn.Embedding, tied: bool) -> None:
        super().__init__()
        self.emb = emb
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.outside = 1.0  # the reference multiplies here instead

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head((self.emb(idx) * self.outside).tanh())


def _pair(kind: str, tied: bool) -> tuple[ScaledNet, ScaledNet]:
    torch.manual_seed(0)
    net = ScaledNet(_scaled(kind), tied).double()
    ref = ScaledNet(nn.Embedding(VOCAB, DIM, padding_idx=1), tied).double()
    ref.load_state_dict(net.state_dict(), strict=False)
    ref.outside = SCALE
    return net, ref


def _train(models: tuple[nn.Module, ...], curvature: object, steps: int = 4) -> list[object]:
    pres = [kaisa.KFACPreconditioner(m, curvature=curvature, **COMMON) for m in models]
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in models]
    for step in range(steps):
        idx = tokens(step)
        for model, pre, opt in zip(models, pres, opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
            pre.step()
            opt.step()
    return pres


@pytest.mark.parametrize("kind", ["bart", "gemma"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("g_side", ["exact", "kvec"])
def test_a_scaled_embedding_takes_the_steps_of_the_lookup_scaled_outside_it(
    kind: str, tied: bool, g_side: str
) -> None:
    net, ref = _pair(kind, tied)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left raw or warned about
        pres = _train((net, ref), {"emb": ("diagonal", g_side), "head": "exact"})
    assert isinstance(pres[0].layers[0].handler, ScaledEmbeddingHandler)
    assert pres[0].layers[0].handler.scale == SCALE
    assert all(t.kind != "raw" for t in pres[0].coverage())
    torch.testing.assert_close(net.emb.weight, ref.emb.weight, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(net.head.weight, ref.head.weight, rtol=1e-10, atol=1e-12)
    # And the steps are not those of a handler that forgot the scale.
    assert not torch.allclose(net.emb.weight, _pair(kind, tied)[0].emb.weight)


def test_the_scale_of_a_tensor_buffer_is_read_in_the_tables_dtype() -> None:
    emb = GemmaTextScaledWordEmbedding(VOCAB, DIM, padding_idx=0, embed_scale=55.4256).bfloat16()
    handler = registry.handler_for(emb)
    assert isinstance(handler, ScaledEmbeddingHandler)
    assert handler.scale == float(torch.tensor(55.4256).bfloat16())  # what forward multiplies by


class Fake(nn.Embedding):
    """Named like HuggingFace's scaled embeddings, but adds its scale instead."""

    def __init__(self) -> None:
        super().__init__(VOCAB, DIM)
        self.embed_scale = SCALE

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids) + self.embed_scale


Fake.__module__ = "transformers.models.fake.modeling_fake"
Fake.__qualname__ = "FakeScaledWordEmbedding"


class NoScale(nn.Embedding):
    """Named like them, with no numeric ``embed_scale``."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids)


NoScale.__module__ = "transformers.models.fake.modeling_fake"
NoScale.__qualname__ = "NoScaleScaledWordEmbedding"


@pytest.mark.parametrize(
    ("make", "why"),
    [(Fake, "not the table's rows times embed_scale=2.5"), (NoScale, "no numeric embed_scale")],
)
def test_a_scaled_embedding_that_is_not_the_product_is_left_raw_with_the_reason(
    make: type[nn.Embedding], why: str
) -> None:
    net = ScaledNet(make() if make is Fake else make(VOCAB, DIM), tied=False)
    with pytest.warns(UserWarning, match=why):
        pre = kaisa.KFACPreconditioner(net, lr=0.1)
    assert [layer.name for layer in pre.layers] == ["head"]
    (entry,) = [t for t in pre.coverage() if t.parameter == "emb.weight"]
    assert entry.kind == "raw" and why in entry.reason


def test_a_scaled_embedding_on_the_meta_device_is_surveyed_and_read_once_materialised() -> None:
    with torch.device("meta"):
        emb = GemmaTextScaledWordEmbedding(VOCAB, DIM, padding_idx=0, embed_scale=SCALE)
    handler = registry.handler_for(emb)
    assert isinstance(handler, ScaledEmbeddingHandler)
    assert "scale=unread" in repr(handler)
    emb.to_empty(device="cpu")
    emb.embed_scale = torch.tensor(SCALE)
    assert handler.scale == SCALE


class FalconNet(nn.Module):
    def __init__(self, make: type[nn.Linear]) -> None:
        super().__init__()
        self.fc = make(5, 6)
        self.out = make(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(x).tanh())


class TimmLinear(nn.Linear):
    """timm's ``timm.layers.linear.Linear`` as it computes outside TorchScript (timm
    is not installable beside the pinned torch: it needs torchvision)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias)


TimmLinear.__module__ = "timm.layers.linear"
TimmLinear.__qualname__ = "Linear"


@pytest.mark.parametrize("make", [FalconLinear, TimmLinear], ids=["falcon", "timm"])
def test_a_linear_known_by_name_takes_the_steps_of_nn_linear(make: type[nn.Linear]) -> None:
    torch.manual_seed(0)
    net = FalconNet(make).double()
    ref = FalconNet(nn.Linear).double()
    ref.load_state_dict(net.state_dict())
    pres = [kaisa.KFACPreconditioner(m, curvature="exact", **COMMON) for m in (net, ref)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (net, ref)]
    for step in range(4):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        y = torch.arange(8) % 3
        for model, pre, opt in zip((net, ref), pres, opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
    assert [layer.name for layer in pres[0].layers] == ["fc", "out"]
    for name, param in net.named_parameters():
        torch.testing.assert_close(param, ref.get_parameter(name), rtol=1e-10, atol=1e-12)


class EncoderDecoder(nn.Module):
    """T5's and BART's shape: the weight of ``shared`` is also the encoder's, the
    decoder's and the head's; ``shared`` itself never runs (``holder=False``: no such module)."""

    def __init__(self, holder: bool, head_bias: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        if holder:
            self.shared = nn.Embedding(VOCAB, DIM)
        self.enc = nn.Embedding(VOCAB, DIM)
        self.dec = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=head_bias)
        weight = self.shared.weight if holder else self.enc.weight
        self.enc.weight = self.dec.weight = self.head.weight = weight
        with torch.no_grad():
            weight.copy_(torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(1)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        memory = self.mix(self.enc(idx).tanh()).mean(1, keepdim=True)
        return self.head((self.dec(idx) + memory).tanh())


@pytest.mark.parametrize("g_side", ["exact", "kvec"])
def test_a_shared_weight_whose_holder_never_runs_takes_the_steps_of_its_running_uses(
    g_side: str,
) -> None:
    net, ref = EncoderDecoder(holder=True).double(), EncoderDecoder(holder=False).double()
    ref.load_state_dict({k: v for k, v in net.state_dict().items() if k != "shared.weight"})
    curvature = {"shared|enc|dec": ("diagonal", g_side), ".*": "exact"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "captured nothing, yet has a gradient"
        pres = _train((net, ref), curvature, steps=5)
    assert pres[0].layers[0].name == "shared"  # the owner, which never runs
    assert not pres[0].layers[0].dormant  # the owner preconditions the weight
    (entry,) = [t for t in pres[0].coverage() if t.parameter == "shared.weight"]
    assert entry.kind != "raw" and "summed curvature" in entry.kind
    for name, param in ref.named_parameters():
        torch.testing.assert_close(param, net.get_parameter(name), rtol=1e-9, atol=1e-11)
    assert not torch.equal(net.enc.weight, EncoderDecoder(holder=True).double().enc.weight)


class MLMHead(nn.Module):
    """BERT's MLM head: the decoder's bias is also the head's own ``bias`` (an alias)."""

    def __init__(self, alias: bool) -> None:
        super().__init__()
        self.decoder = nn.Linear(DIM, VOCAB)
        if alias:
            self.bias = self.decoder.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)


class MaskedLM(nn.Module):
    """An embedding tied to the MLM head's decoder, which has a bias."""

    def __init__(self, alias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = MLMHead(alias)
        self.head.decoder.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.emb(idx)).tanh())


def test_a_bias_a_parent_keeps_as_an_alias_leaves_the_tie_preconditioned() -> None:
    net, ref = MaskedLM(alias=True).double(), MaskedLM(alias=False).double()
    ref.load_state_dict({k: v for k, v in net.state_dict().items() if k != "head.bias"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither "shares a parameter" nor a free parameter
        pres = _train((net, ref), {"emb": ("diagonal", "exact"), ".*": "exact"})
    treated = {t.parameter: t for t in pres[0].coverage()}
    assert "summed curvature" in treated["emb.weight"].kind
    assert treated["head.bias"].blocks == ("head.decoder",)
    for name, param in ref.named_parameters():
        torch.testing.assert_close(param, net.get_parameter(name), rtol=1e-10, atol=1e-12)


class SiblingAlias(MaskedLM):
    """The decoder's bias also held by a module beside it (not its parent): a use kaisa
    cannot see, so the tie stays raw, with the warning."""

    def __init__(self) -> None:
        super().__init__(alias=False)
        self.other = nn.Module()
        self.other.bias = self.head.decoder.bias


def test_a_bias_held_by_a_module_beside_the_layer_still_leaves_the_tie_raw() -> None:
    with pytest.warns(UserWarning, match="shares a parameter"):
        pre = kaisa.KFACPreconditioner(SiblingAlias(), lr=0.1)
    treated = {t.parameter: t for t in pre.coverage()}
    assert treated["emb.weight"].kind == "raw"


def test_an_idle_holder_that_is_not_the_owner_leaves_the_weight_listed_preconditioned() -> None:
    # The head has a bias, so it owns the tie; the idle holder is one of its other uses.
    net, ref = EncoderDecoder(True, head_bias=True), EncoderDecoder(False, head_bias=True)
    net, ref = net.double(), ref.double()
    ref.load_state_dict({k: v for k, v in net.state_dict().items() if k != "shared.weight"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pres = _train((net, ref), {"shared|enc|dec": ("diagonal", "exact"), ".*": "exact"})
    shared = next(layer for layer in pres[0].layers if layer.name == "shared")
    assert shared.dormant  # it never ran
    (entry,) = [t for t in pres[0].coverage() if t.parameter == "shared.weight"]
    assert entry.kind != "raw" and "summed curvature" in entry.kind
    for name, param in ref.named_parameters():
        torch.testing.assert_close(param, net.get_parameter(name), rtol=1e-9, atol=1e-11)
