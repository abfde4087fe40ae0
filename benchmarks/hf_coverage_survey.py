"""How much of a published HuggingFace model kaisa preconditions, without weights.

Each model is built from its published configuration on the meta device (no
memory, nothing downloaded: the configurations are written out here) and
surveyed as ``KFACPreconditioner`` would register it
(:func:`kaisa.layers.survey`). For every trainable parameter with at least
two dimensions, the share of its elements that is preconditioned; what is
left raw is listed with kaisa's reason, and whether construction warns about
it::

    PYTHONPATH=. python benchmarks/hf_coverage_survey.py

Needs ``transformers`` (``pip install '.[transformers]'``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import transformers as hf
from torch import nn
from weight_coverage import coverage


def published() -> Iterator[tuple[str, Callable[[], nn.Module]]]:
    """``(name, build)`` for each model, shaped as published (weights not loaded)."""
    yield "gpt2 (124M)", lambda: hf.GPT2LMHeadModel(hf.GPT2Config())
    yield "bert-base-uncased", lambda: hf.BertForMaskedLM(hf.BertConfig())
    llama_1b = dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    yield (
        "Llama-3.2-1B shape (tied)",
        lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**llama_1b, tie_word_embeddings=True)),
    )
    yield (
        "Llama-3.2-1B shape (untied)",
        lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**llama_1b, tie_word_embeddings=False)),
    )
    yield (
        "gemma-2b shape (scaled embedding, tied)",
        lambda: hf.GemmaForCausalLM(
            hf.GemmaConfig(
                vocab_size=256000,
                hidden_size=2048,
                intermediate_size=16384,
                num_hidden_layers=18,
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=256,
            )
        ),
    )
    yield (
        "falcon-7b shape",
        lambda: hf.FalconForCausalLM(
            hf.FalconConfig(
                vocab_size=65024,
                hidden_size=4544,
                num_hidden_layers=32,
                num_attention_heads=71,
                multi_query=True,
                parallel_attn=True,
                bias=False,
            )
        ),
    )
    yield (
        "t5-small",
        lambda: hf.T5ForConditionalGeneration(
            hf.T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8)
        ),
    )
    yield (
        "bart-base",
        lambda: hf.BartForConditionalGeneration(
            hf.BartConfig(
                d_model=768,
                encoder_layers=6,
                decoder_layers=6,
                encoder_attention_heads=12,
                decoder_attention_heads=12,
                encoder_ffn_dim=3072,
                decoder_ffn_dim=3072,
            )
        ),
    )
    # OPTConfig's defaults are opt-125m's shape; learned positions from the mask.
    yield "opt-125m", lambda: hf.OPTForCausalLM(hf.OPTConfig())
    yield (
        "vit-base-patch16-224",
        lambda: hf.ViTForImageClassification(hf.ViTConfig(num_labels=1000)),
    )


def main() -> None:
    rows = []
    for name, build in published():
        with torch.device("meta"):
            model = build()
        share, total, raw = coverage(model)
        rows.append((name, share, total, raw))
    print("| model | ≥2-D elements | preconditioned | raw (elements, reason, warned) |")
    print("| --- | ---: | ---: | --- |")
    for name, share, total, raw in rows:
        listing = "; ".join(
            f"`{r.parameter}` ({r.elements / 1e6:.2f}M, {r.reason.split(':')[0]}, "
            f"{'warned' if r.warned else 'not warned'})"
            for r in raw
        )
        print(f"| {name} | {total / 1e6:.1f}M | {100 * share:.1f}% | {listing or '—'} |")


if __name__ == "__main__":
    main()
