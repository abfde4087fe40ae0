"""A Linear its parent applies itself: timm's EVA and BEiT attention.

Their ``forward`` calls ``F.linear(x, self.qkv.weight, cat(q_bias, k_bias,
v_bias))`` and never the ``qkv`` module, so a hook on it sees nothing.
kaisa watches the attention (the host) and captures each ``F.linear`` call
on that weight: the model must take the steps of the same attention written
to call ``self.qkv(x)`` and add the bias after it (float64, K-FAC and EKFAC),
whichever way the host applies the layer, with the biases left to the
optimizer; the mode it watches with is gone when the host's ``forward``
ends, raising or not, and never entered in evaluation.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.layers import registry
from kaisa.layers.linear import HostedLinearHandler

DIM, HEADS, TOKENS = 8, 2, 5


def _stack() -> int:
    """How many torch-function modes are active."""
    return int(torch._C._len_torch_function_stack())


class EvaAttention(nn.Module):
    """timm's ``EvaAttention`` as it applies its projection: ``how`` is 'functional'
    (``F.linear`` on ``qkv.weight``, timm's default), 'separate' (``self.qkv(x)`` then
    the bias, timm's ``qkv_bias_separate``) or 'reference' (the same, under a class
    name kaisa does not know: its ``qkv`` is registered as any ``nn.Linear``)."""

    def __init__(self, how: str = "functional", fail: bool = False) -> None:
        super().__init__()
        self.how, self.fail = how, fail
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.q_bias = nn.Parameter(torch.randn(DIM) * 0.1)
        self.register_buffer("k_bias", torch.zeros(DIM), persistent=False)
        self.v_bias = nn.Parameter(torch.randn(DIM) * 0.1)
        self.proj = nn.Linear(DIM, DIM)
        self.modes_seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes_seen.append(_stack())
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        if self.how == "functional":
            qkv = F.linear(x, weight=self.qkv.weight, bias=bias)
        else:
            qkv = self.qkv(x) + bias
        if self.fail:
            raise RuntimeError("the host failed")
        b, t, _ = x.shape
        q, k, v = qkv.reshape(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, t, DIM))


EvaAttention.__module__ = "timm.models.eva"
EvaAttention.__qualname__ = "EvaAttention"


class PlainAttention(EvaAttention):
    """The reference: a class kaisa does not know by name."""


PlainAttention.__module__ = __name__
PlainAttention.__qualname__ = "PlainAttention"


class BeitAttention(EvaAttention):
    pass


BeitAttention.__module__ = "timm.models.beit"
BeitAttention.__qualname__ = "Attention"


class Net(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, DIM)
        self.attn = attn
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.attn(self.embed(x))).mean(1))


def _nets(how: str) -> tuple[Net, Net]:
    torch.manual_seed(1)
    net = Net(EvaAttention(how)).double()
    torch.manual_seed(1)
    ref = Net(PlainAttention("reference")).double()
    ref.load_state_dict(net.state_dict())
    return net, ref


@pytest.mark.parametrize("correction", ["off", "ekfac"])
@pytest.mark.parametrize("how", ["functional", "separate"])
def test_it_takes_the_steps_of_the_attention_that_calls_its_layer(
    how: str, correction: str
) -> None:
    net, ref = _nets(how)
    common = dict(factor_update_steps=1, inv_update_steps=1, inv_dtype=torch.float64, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing raw that matters, nothing warned
        pres = [
            kaisa.KFACPreconditioner(
                m, curvature="exact", eigenvalue_correction=correction, **common
            )
            for m in (net, ref)
        ]
        names = [layer.name for layer in pres[0].layers]
        assert names == [layer.name for layer in pres[1].layers]
        assert names == ["embed", "attn.qkv", "attn.proj", "head"]
        assert isinstance(pres[0].layers[1].handler, HostedLinearHandler)
        opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (net, ref)]
        for step in range(4):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(6, TOKENS, 3, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 4, (6,), generator=gen)
            for model, pre, opt in zip((net, ref), pres, opts, strict=True):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                pre.step()
                opt.step()
    assert pres[0].layers[1].block.updates == 4
    for name, param in net.named_parameters():
        torch.testing.assert_close(param, ref.get_parameter(name), rtol=1e-10, atol=1e-12)
    raw = {t.parameter: t.reason for t in pres[0].coverage().raw()}
    assert set(raw) == {"attn.q_bias", "attn.v_bias"}
    assert all("free parameter of EvaAttention" in reason for reason in raw.values())
    assert net.attn.modes_seen[-1] == 1  # the mode is on inside the host's forward


def test_the_mode_is_gone_after_the_host_raises_and_off_in_evaluation() -> None:
    net = Net(EvaAttention("functional", fail=True))
    pre = kaisa.KFACPreconditioner(net, lr=0.1)
    x = torch.randn(2, TOKENS, 3)
    with pytest.raises(RuntimeError, match="the host failed"):
        net(x)
    assert _stack() == 0
    net.attn.fail = False  # type: ignore[assignment]
    net(x).sum().backward()
    assert _stack() == 0 and net.attn.modes_seen[-1] == 1
    net.eval()
    net(x)
    with torch.no_grad():
        net.train()
        net(x)
    assert net.attn.modes_seen[-2:] == [0, 0] and _stack() == 0
    pre.remove_hooks()
    net(x)
    assert net.attn.modes_seen[-1] == 0


def test_beit_attention_is_known_by_name_too_and_a_split_projection_is_not_taken() -> None:
    made = registry.handler_for(BeitAttention())
    assert isinstance(made, HostedLinearHandler) and made.host is not made.module
    split = EvaAttention()
    del split.qkv  # EVA with separate q, k, v projections has no qkv layer
    assert registry.handler_for(split) is None


def test_skip_layers_leaves_it_raw_by_its_block_name() -> None:
    net = Net(EvaAttention("functional"))
    pre = kaisa.KFACPreconditioner(net, lr=0.1, skip_layers=[r"attn\.qkv$"])
    assert [layer.name for layer in pre.layers] == ["embed", "attn.proj", "head"]
    raw = {t.parameter: t.reason for t in pre.coverage().raw()}
    assert raw["attn.qkv.weight"] == "skip_layers matched 'attn\\\\.qkv$' (on 'attn.qkv')"
