"""nn.MultiheadAttention as four Linear blocks (issue 16, item 1).

The convention under test: kaisa on a model with ``nn.MultiheadAttention``
takes exactly the steps it takes on the same attention written with four
``nn.Linear`` modules (float64), for self- and cross-attention, either
``batch_first``, masks, ``need_weights``, ``kdim``/``vdim``, no bias,
``add_bias_kv`` and ``add_zero_attn``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa

E, HEADS, L_Q, L_KV, N = 8, 2, 5, 6, 4


class FourLinearAttention(nn.Module):
    """The same attention with Q, K, V and output projections as ``nn.Linear`` modules."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        e = mha.embed_dim
        bias = mha.in_proj_bias is not None
        self.mha_like = mha
        self.q = nn.Linear(e, e, bias=bias)
        self.k = nn.Linear(mha.kdim, e, bias=bias)
        self.v = nn.Linear(mha.vdim, e, bias=bias)
        self.out = nn.Linear(e, e, bias=mha.out_proj.bias is not None)
        with torch.no_grad():
            for i, (name, lin) in enumerate((("q", self.q), ("k", self.k), ("v", self.v))):
                weight = (
                    mha.in_proj_weight[i * e : (i + 1) * e]
                    if mha.in_proj_weight is not None
                    else getattr(mha, f"{name}_proj_weight")
                )
                lin.weight.copy_(weight)
                if bias:
                    lin.bias.copy_(mha.in_proj_bias[i * e : (i + 1) * e])
            self.out.weight.copy_(mha.out_proj.weight)
            if self.out.bias is not None:
                self.out.bias.copy_(mha.out_proj.bias)
        self.bias_k = None if mha.bias_k is None else nn.Parameter(mha.bias_k.detach().clone())
        self.bias_v = None if mha.bias_v is None else nn.Parameter(mha.bias_v.detach().clone())
        self.add_zero_attn = mha.add_zero_attn
        self.batch_first = mha.batch_first
        self.embed_dim, self.num_heads = e, mha.num_heads

    def forward(self, query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
        q, k, v = self.q(query), self.k(key), self.v(value)
        if self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        eye = torch.eye(self.embed_dim, dtype=q.dtype)
        context, weights = F.multi_head_attention_forward(
            q,
            k,
            v,
            self.embed_dim,
            self.num_heads,
            None,
            None,
            self.bias_k,
            self.bias_v,
            self.add_zero_attn,
            0.0,
            eye,
            None,
            training=self.training,
            use_separate_proj_weight=True,
            q_proj_weight=eye,
            k_proj_weight=eye,
            v_proj_weight=eye,
            **kwargs,
        )
        if self.batch_first:
            context = context.transpose(0, 1)
        return self.out(context), weights


class Net(nn.Module):
    def __init__(self, attention: nn.Module, cross: bool, kdim: int) -> None:
        super().__init__()
        self.attention = attention
        # The keys and values of cross-attention.
        self.memory = nn.Linear(3, kdim) if cross else None
        self.head = nn.Linear(E, 3)
        self.cross = cross

    def forward(self, x: torch.Tensor, memory: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.memory is not None:
            kv = self.memory(memory)
            out, _ = self.attention(x, kv, kv, **kwargs)
        else:
            out, _ = self.attention(x, x, x, **kwargs)
        return self.head(out.mean(dim=1 if self.attention.batch_first else 0))


CASES = {
    "self": {},
    "self_seq_first": {"batch_first": False},
    "cross": {"cross": True},
    "cross_kdim": {"cross": True, "kdim": 5, "vdim": 5},
    "no_bias": {"bias": False},
    "causal_mask_no_weights": {"mask": "causal", "need_weights": False},
    "padding_mask_weights": {"mask": "padding", "need_weights": True},
    "both_masks_per_head_weights": {
        "mask": "both",
        "need_weights": True,
        "average_attn_weights": False,
    },
    "is_causal": {"mask": "is_causal", "need_weights": False},
    "add_bias_kv": {"add_bias_kv": True},
    "add_zero_attn": {"add_zero_attn": True, "cross": True},
}


def build(case: dict[str, Any]) -> tuple[Net, Net, dict[str, Any], int]:
    torch.manual_seed(0)
    batch_first = case.get("batch_first", True)
    cross = case.get("cross", False)
    kdim = case.get("kdim", E)
    mha = nn.MultiheadAttention(
        E,
        HEADS,
        bias=case.get("bias", True),
        add_bias_kv=case.get("add_bias_kv", False),
        add_zero_attn=case.get("add_zero_attn", False),
        kdim=case.get("kdim"),
        vdim=case.get("vdim"),
        batch_first=batch_first,
    )
    net = Net(mha, cross, kdim).double()
    ref = Net(FourLinearAttention(copy.deepcopy(mha)), cross, kdim).double()
    if net.memory is not None:
        ref.memory.load_state_dict(net.memory.state_dict())
    ref.head.load_state_dict(net.head.state_dict())
    kwargs: dict[str, Any] = {}
    length = L_KV if cross else L_Q
    mask = case.get("mask")
    if mask in ("causal", "both", "is_causal"):
        kwargs["attn_mask"] = torch.triu(torch.ones(L_Q, length, dtype=torch.bool), 1)
    if mask == "is_causal":
        kwargs["is_causal"] = True
    if mask in ("padding", "both"):
        padding = torch.zeros(N, length, dtype=torch.bool)
        padding[1, -2:] = True
        padding[3, -1] = True
        kwargs["key_padding_mask"] = padding
    for name in ("need_weights", "average_attn_weights"):
        if name in case:
            kwargs[name] = case[name]
    return net, ref, kwargs, length


def data(step: int, batch_first: bool, length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(N, L_Q, E, generator=g, dtype=torch.float64)
    memory = torch.randn(N, length, 3, generator=g, dtype=torch.float64)
    if not batch_first:
        x, memory = x.transpose(0, 1), memory.transpose(0, 1)
    y = torch.randint(0, 3, (N,), generator=g)
    return x, memory, y


def mha_params(net: Net) -> dict[str, torch.Tensor]:
    """The reference's parameters in nn.MultiheadAttention's layout."""
    att = net.attention
    assert isinstance(att, FourLinearAttention)
    params = {
        "head.weight": net.head.weight,
        "head.bias": net.head.bias,
        "attention.out_proj.weight": att.out.weight,
    }
    if net.memory is not None:
        params["memory.weight"] = net.memory.weight
    if att.out.bias is not None:
        params["attention.out_proj.bias"] = att.out.bias
    if att.mha_like.in_proj_weight is not None:
        params["attention.in_proj_weight"] = torch.cat([att.q.weight, att.k.weight, att.v.weight])
    else:
        for name in "qkv":
            params[f"attention.{name}_proj_weight"] = getattr(att, name).weight
    if att.q.bias is not None:
        params["attention.in_proj_bias"] = torch.cat([att.q.bias, att.k.bias, att.v.bias])
    if att.bias_k is not None:
        params["attention.bias_k"], params["attention.bias_v"] = att.bias_k, att.bias_v
    return params


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_takes_the_steps_of_four_linear_layers(name: str) -> None:
    case = CASES[name]
    net, ref, kwargs, length = build(case)
    options = dict(
        factor_update_steps=1,
        inv_update_steps=1,
        curvature="exact",
        kl_clip=None,
        inv_dtype=torch.float64,
    )
    pre = kaisa.KFACPreconditioner(net, **options)
    pre_ref = kaisa.KFACPreconditioner(ref, skip_layers=["mha_like"], **options)
    names = [layer.name for layer in pre.layers]
    assert [n for n in names if n.startswith("attention")] == [
        "attention.q",
        "attention.k",
        "attention.v",
        "attention.out_proj",
    ]
    assert len(pre_ref.layers) == len(pre.layers)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    batch_first = case.get("batch_first", True)
    for step in range(3):
        x, memory, y = data(step, batch_first, length)
        for model, p, o in ((net, pre, opt), (ref, pre_ref, opt_ref)):
            o.zero_grad()
            F.cross_entropy(model(x, memory, **kwargs), y).backward()
            p.step()
            o.step()
        if step == 0:
            for layer in pre.layers:
                assert layer.block.updates == 1, layer.name
    state = dict(net.named_parameters())
    for key, expected in mha_params(ref).items():
        torch.testing.assert_close(state[key], expected, rtol=1e-10, atol=1e-12, msg=key)
    # The preconditioner really changed the step (the comparison is not vacuous).
    plain = build(case)[0]
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        x, memory, y = data(step, batch_first, length)
        plain_opt.zero_grad()
        F.cross_entropy(plain(x, memory, **kwargs), y).backward()
        plain_opt.step()
    assert not torch.allclose(
        plain.attention.out_proj.weight, net.attention.out_proj.weight, atol=1e-6
    )


def test_the_forward_is_torchs_own_bit_for_bit() -> None:
    net, _, kwargs, length = build({"mask": "both", "need_weights": True})
    x, memory, _ = data(0, True, length)
    expected = net(x, memory, **kwargs)
    kaisa.KFACPreconditioner(net, lr=0.1)
    torch.testing.assert_close(net(x, memory, **kwargs), expected, rtol=0, atol=0)


def test_bias_k_and_bias_v_keep_their_raw_gradients() -> None:
    net, _, kwargs, length = build({"add_bias_kv": True})
    pre = kaisa.KFACPreconditioner(net, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    raw = {t.parameter: t.reason for t in pre.coverage().raw()}
    assert set(raw) == {"attention.bias_k", "attention.bias_v"}
    x, memory, y = data(0, True, length)
    F.cross_entropy(net(x, memory, **kwargs), y).backward()
    grads = (net.attention.bias_k.grad.clone(), net.attention.bias_v.grad.clone())
    pre.step()
    assert torch.equal(net.attention.bias_k.grad, grads[0])
    assert torch.equal(net.attention.bias_v.grad, grads[1])


def encoder(batch_first: bool = True) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


def test_transformer_encoder_training_captures_every_projection() -> None:
    model = encoder()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_update_steps=1)
    x = torch.randn(N, L_Q, E)
    padding = torch.zeros(N, L_Q, dtype=torch.bool)
    padding[0, -2:] = True
    model(x, src_key_padding_mask=padding).sum().backward()
    assert all(layer.micro_batches == 1 for layer in pre.layers)
    assert len(pre.layers) == 2 * 6  # q, k, v, out_proj, linear1, linear2 per layer
    pre.step()
    assert all(layer.block.updates == 1 and not layer.dormant for layer in pre.layers)


def test_evaluation_and_its_fast_paths_capture_nothing() -> None:
    model = encoder()
    pre = kaisa.KFACPreconditioner(model, lr=0.1)
    model.eval()
    x = torch.randn(N, L_Q, E)
    padding = torch.zeros(N, L_Q, dtype=torch.bool)
    padding[0, -2:] = True  # the nested-tensor fast path
    with torch.no_grad():
        expected = model(x, src_key_padding_mask=padding)
    model(x, src_key_padding_mask=padding)  # grad enabled, eval mode
    assert pre.memory_usage()["captures"] == 0
    assert all(layer.pending_passes == 0 for layer in pre.layers)
    pre.remove_hooks()
    with torch.no_grad():
        torch.testing.assert_close(model(x, src_key_padding_mask=padding), expected)


def test_remove_hooks_restores_plain_attention() -> None:
    net, _, _, length = build({})
    pre = kaisa.KFACPreconditioner(net, lr=0.1)
    pre.remove_hooks()
    attention = net.attention
    assert not attention._forward_hooks and not attention._forward_pre_hooks
    x, memory, _ = data(0, True, length)
    net(x, memory).sum().backward()
    assert pre.memory_usage()["captures"] == 0


def test_an_exception_inside_attention_leaves_no_mode_behind() -> None:
    net, _, _, _ = build({})
    kaisa.KFACPreconditioner(net, lr=0.1)
    bad = torch.randn(N, L_Q, E + 1, dtype=torch.float64)
    with pytest.raises((RuntimeError, AssertionError)):
        net.attention(bad, bad, bad)
    from torch.overrides import _get_current_function_mode_stack

    assert _get_current_function_mode_stack() == []
