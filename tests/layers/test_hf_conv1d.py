"""HuggingFace's ``Conv1D`` is preconditioned out of the box, exactly as ``nn.Linear`` (issue 29).

``transformers.pytorch_utils.Conv1D`` stores its weight ``(in, out)`` and
computes ``y = x W + b``. kaisa knows the class by name (it never imports
transformers itself) and takes, on a GPT-2-style block written with
``Conv1D``, the steps it takes on the same block written with ``nn.Linear``
holding ``Wᵀ`` (float64). transformers is a test dependency (the
``transformers`` extra, installed by ``make test``).
"""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

import kaisa
from kaisa.layers import TransposedLinearHandler, registry
from kaisa.layers.probe import check_factory

D, HEADS, VOCAB, T = 16, 4, 23, 7


def _conv1d(d_in: int, d_out: int) -> nn.Module:
    return Conv1D(d_out, d_in)


def _linear(d_in: int, d_out: int) -> nn.Module:
    return nn.Linear(d_in, d_out)


class Block(nn.Module):
    """A GPT-2 block: causal self-attention (one fused QKV projection) and an MLP, pre-norm."""

    def __init__(self, make: type[nn.Module] | object) -> None:
        super().__init__()
        assert callable(make)
        self.ln_1 = nn.LayerNorm(D)
        self.c_attn = make(D, 3 * D)
        self.c_proj = make(D, D)
        self.ln_2 = nn.LayerNorm(D)
        self.c_fc = make(D, 4 * D)
        self.mlp_proj = make(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=-1)
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(context.transpose(1, 2).reshape(b, t, D))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, make: object) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(T, D)
        self.blocks = nn.Sequential(Block(make), Block(make))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)  # untied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos))))


def _pair() -> tuple[TinyGPT, TinyGPT]:
    torch.manual_seed(0)
    hf = TinyGPT(_conv1d).double()
    plain = TinyGPT(_linear).double()
    with torch.no_grad():
        for name, module in hf.named_modules():
            twin = plain.get_submodule(name)
            if isinstance(module, Conv1D):
                twin.weight.copy_(module.weight.t())
                twin.bias.copy_(module.bias)
            elif not name or list(module.children()):
                continue
            else:
                twin.load_state_dict(module.state_dict())
    return hf, plain


def _as_linear(model: TinyGPT) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, a Conv1D's weight transposed to nn.Linear's (out, in)."""
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        transposed = isinstance(owner, Conv1D) and name.endswith(".weight")
        grads[name] = (p.grad.t() if transposed else p.grad).detach().clone()
    return grads


def _steps(model: TinyGPT, steps: int = 4) -> list[tuple[dict[str, torch.Tensor], ...]]:
    """Each step's raw and preconditioned gradients."""
    gen = torch.Generator().manual_seed(5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pre = kaisa.KFACPreconditioner(
        model,
        lr=0.05,
        curvature="exact",
        factor_update_steps=1,
        inv_update_steps=2,
        inv_dtype=torch.float64,  # (float32 eigenbases of rank-deficient factors differ by 1e-6)
        profile="general",  # the same options on both models (the reference has no embedding)
    )
    grads = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (3, T), generator=gen)
        optimizer.zero_grad()
        logits = model(idx)
        F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1)).backward()
        raw = _as_linear(model)
        pre.step()
        grads.append((raw, _as_linear(model)))
        optimizer.step()
    pre.remove_hooks()
    return grads


def test_conv1d_takes_the_steps_of_nn_linear_with_the_weight_transposed() -> None:
    hf, plain = _pair()
    pre = kaisa.KFACPreconditioner(hf, lr=0.1)
    kinds = {t.parameter: t.kind for t in pre.coverage()}
    assert kinds["blocks.0.c_attn.weight"].startswith("kronecker (linear, (in, out) weight)")
    assert kinds["blocks.1.mlp_proj.bias"].startswith("kronecker (linear, (in, out) weight)")
    assert len(pre.layers) == 2 * 4 + 3
    pre.remove_hooks()
    got, want = _steps(hf), _steps(plain)
    for (raw, g), (_, w) in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=1e-10, atol=1e-13, msg=name)
        # Preconditioning changed the Conv1D gradients (not two raw gradients agreeing).
        change = (g["blocks.0.c_fc.weight"] - raw["blocks.0.c_fc.weight"]).norm()
        assert change > 0.1 * raw["blocks.0.c_fc.weight"].norm()


def test_conv1d_keeps_the_handler_contract_and_a_reshaping_handler_would_not() -> None:
    layer = Conv1D(5, 3)
    assert check_factory(registry._BY_NAME[("transformers.pytorch_utils", "Conv1D")], layer)

    class Reshaping(TransposedLinearHandler):
        weight_layout = "out_in"

    try:
        check_factory(lambda m, **_: Reshaping(m), layer)
    except ValueError as error:
        assert "weight_layout" in str(error)
    else:
        raise AssertionError("the reshaping handler was not refused")


def test_a_gpt2_built_from_a_config_has_every_conv1d_preconditioned() -> None:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.train()
    pre = kaisa.KFACPreconditioner(model, lr=0.01)
    coverage = pre.coverage()
    conv = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(conv) == 8
    assert {layer.name for layer in pre.layers} >= set(conv) | {"transformer.wpe", "lm_head"}
    params = dict(model.named_parameters())
    matrices = {t.parameter: t for t in coverage if params[t.parameter].ndim >= 2}
    assert [n for n, t in matrices.items() if t.kind == "raw"] == []
    # The embedding tied to lm_head: the summed curvature of both uses.
    assert matrices["transformer.wte.weight"].kind.startswith(
        "kronecker (shared by transformer.wte, lm_head: summed curvature)"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 97, (2, 16))
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        pre.step()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert pre.layers[0].block.updates >= 1


def test_importing_kaisa_and_surveying_a_model_never_imports_transformers() -> None:
    code = (
        "import sys, torch, kaisa\n"
        "from kaisa.layers import survey\n"
        "survey(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Conv1d(4, 4, 1)))\n"
        "kaisa.KFACPreconditioner(torch.nn.Linear(3, 4), lr=0.1)\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
