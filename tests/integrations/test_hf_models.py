"""HuggingFace models built tiny from their configurations, trained with kaisa's defaults.

GPT-2, BERT, Llama (tied and untied), Gemma (its scaled token embedding
tied to the head), Falcon (its own ``FalconLinear``), T5, BART and OPT (learned
positions looked up by ``forward`` itself), ConvNeXt (depthwise convolutions) and
ViT: each is listed by
``coverage()``, trains a few steps with finite losses and weights, and has
at least 99% of the elements of its trainable parameters of two or more
dimensions preconditioned, not counting those a construction warning names
(module or parameter, and reason): every raw one is named. What stays raw
is pinned per model, so a change shows. After training no layer is left
raw for having captured nothing (T5's and BART's ``shared`` embedding holds
the weight its encoder, decoder and head use, but never runs itself).
``benchmarks/hf_coverage_survey.py`` gives the same shares at published sizes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import kaisa

hf = pytest.importorskip("transformers")

VOCAB = 97


def _tokens(model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _images(model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "labels": torch.tensor([1, 3])}


def _llama(tied: bool) -> nn.Module:
    config = hf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    return hf.LlamaForCausalLM(config)


def _train_finitely(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    pre: kaisa.KFACPreconditioner,
    batch: dict[str, torch.Tensor],
) -> None:
    """Three steps of ``model`` on ``batch``: finite losses, finite weights."""
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        pre.step()
        optimizer.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())


#: name -> (build, inputs, the ≥2-D parameters left raw today)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], Any], set[str]]] = {
    "gpt2": (
        lambda: hf.GPT2LMHeadModel(
            hf.GPT2Config(
                vocab_size=VOCAB,
                n_positions=32,
                n_embd=32,
                n_layer=2,
                n_head=4,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        _tokens,
        set(),
    ),
    "bert": (
        lambda: hf.BertForMaskedLM(
            hf.BertConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=32,
            )
        ),
        _tokens,
        set(),
    ),
    "llama-tied": (lambda: _llama(True), _tokens, {"model.embed_tokens.weight"}),
    "llama-untied": (lambda: _llama(False), _tokens, set()),
    "gemma": (
        lambda: hf.GemmaForCausalLM(
            hf.GemmaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                intermediate_size=64,
                pad_token_id=0,
            )
        ),
        _tokens,
        set(),
    ),
    "falcon": (
        lambda: hf.FalconForCausalLM(
            hf.FalconConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        _tokens,
        set(),
    ),
    "t5": (
        lambda: hf.T5ForConditionalGeneration(
            hf.T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        ),
        _tokens,
        set(),
    ),
    "bart": (
        lambda: hf.BartForConditionalGeneration(
            hf.BartConfig(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=32,
            )
        ),
        _tokens,
        set(),  # its learned positions too (read from their lookups)
    ),
    "opt": (
        lambda: hf.OPTForCausalLM(
            hf.OPTConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                ffn_dim=64,
                max_position_embeddings=32,
                word_embed_proj_dim=32,
            )
        ),
        _tokens,
        set(),
    ),
    "convnext": (
        # Depthwise 7 × 7 convolutions (groups = channels) in every block.
        lambda: hf.ConvNextForImageClassification(
            hf.ConvNextConfig(
                num_channels=3,
                hidden_sizes=[8, 16],
                depths=[1, 1],
                num_stages=2,
                image_size=16,
                patch_size=2,
                num_labels=5,
            )
        ),
        _images,
        set(),
    ),
    "vit": (
        lambda: hf.ViTForImageClassification(
            hf.ViTConfig(
                image_size=16,
                patch_size=4,
                num_channels=3,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                num_labels=5,
            )
        ),
        _images,
        # Free tensors of ViTEmbeddings, not layers: named in the construction warning.
        {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings"},
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_tiny_hf_model_trains_and_is_preconditioned_but_for_what_a_warning_names(
    name: str,
) -> None:
    build, inputs, raw_today = MODELS[name]
    torch.manual_seed(0)
    model = build()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = kaisa.KFACPreconditioner(model, optimizer=optimizer)
    messages = [str(w.message) for w in caught if "kaisa" in str(w.message)]
    # Token models take the language-model profile (EKFAC, 5/5, ...), images 'general'.
    image = name in ("convnext", "vit")
    assert pre.options.profile == ("general" if image else "language-model")
    assert pre.options.eigenvalue_correction == ("off" if image else "ekfac")
    coverage = pre.coverage()
    listing = str(coverage)
    params = dict(model.named_parameters())
    assert {t.parameter for t in coverage} == set(params)  # every parameter listed
    matrices = [t for t in coverage if params[t.parameter].ndim >= 2]
    raw = {t.parameter: t.reason for t in matrices if t.kind == "raw"}
    # Raw: preconditioned later (tied weights) or named with a reason; pinned.
    assert set(raw) <= raw_today, f"newly raw: {set(raw) - raw_today}"

    def warned(parameter: str) -> bool:  # the warning names the module or the parameter
        module = parameter.rsplit(".", 1)[0]
        return any(f"'{module}'" in m or f"'{parameter}'" in m for m in messages)

    for parameter, reason in raw.items():
        assert reason and parameter in listing
        assert warned(parameter), (parameter, messages)
    counted = [t for t in matrices if not (t.kind == "raw" and warned(t.parameter))]
    share = sum(params[t.parameter].numel() for t in counted if t.kind != "raw") / sum(
        params[t.parameter].numel() for t in counted
    )
    assert share >= 0.99, (name, share, raw)
    _train_finitely(model, optimizer, pre, inputs(model))
    assert sum(layer.block.updates >= 1 for layer in pre.layers) >= len(pre.layers) - 2
    assert pre.steps == 3
    idle = [t.parameter for t in pre.coverage() if "captured nothing" in t.reason]
    assert not idle, idle


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tied", [False, True])
def test_the_language_model_configuration_corrects_every_llama_layer(tied: bool) -> None:
    # docs/language-models.md's configuration on the architecture people train
    # today (SwiGLU, RMSNorm, rotary positions, grouped K/V): every layer is
    # preconditioned and corrected, the tied embedding and head included, with
    # no warning, and it trains finitely.
    torch.manual_seed(0)
    model = _llama(tied)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = kaisa.KFACPreconditioner(
            model,
            optimizer=optimizer,
            curvature="exact",
            factor_update_steps=5,
            inv_update_steps=10,
            eigenvalue_correction="ekfac",
        )
    assert not [str(w.message) for w in caught if "kaisa" in str(w.message)]
    # 2 blocks × (q, k, v, o, gate, up, down), the head and the embedding.
    assert len(pre.layers) == 2 * 7 + 2
    assert all(layer.corrected for layer in pre.layers)
    assert all(t.kind != "raw" for t in pre.coverage() if "norm" not in t.parameter)
    _train_finitely(model, optimizer, pre, _tokens(model))
