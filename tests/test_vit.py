"""Shapes, argument checking, gradients, eval/train agreement and training of ``ViT``."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa.models import MODEL_NAMES, ViT, build_model


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


def tiny_vit(**kwargs: object) -> ViT:
    """A ViT small enough for fast tests: 8x8 images, 4x4 patches, d_model 16."""
    options: dict[str, object] = {
        "image_size": 8,
        "patch": 4,
        "d_model": 16,
        "num_heads": 2,
        "num_layers": 2,
    }
    options.update(kwargs)
    model = ViT(**options)  # type: ignore[arg-type]
    return model


def test_default_output_shape_and_parameter_count() -> None:
    torch.manual_seed(0)
    model = ViT()
    out = model(torch.randn(3, 1, 28, 28))
    assert out.shape == (3, 10)
    assert model.num_patches == 16
    assert model.pos_embed.shape == (1, 17, 64)
    assert model.cls_token.shape == (1, 1, 64)
    d, hidden = 64, 128
    per_layer = (
        (3 * d * d + 3 * d)  # attention in_proj (q, k, v fused)
        + (d * d + d)  # attention out_proj
        + (d * hidden + hidden)  # MLP linear1
        + (hidden * d + d)  # MLP linear2
        + 2 * 2 * d  # norm1, norm2
    )
    expected = (
        (1 * 7 * 7 * d + d)  # patch embedding
        + d  # class token
        + 17 * d  # position embedding
        + 2 * per_layer
        + 2 * d  # final LayerNorm
        + (d * 10 + 10)  # head
    )
    assert expected == 72_074
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize(
    ("kwargs", "x_shape", "out_shape"),
    [
        ({}, (2, 1, 8, 8), (2, 10)),
        ({"in_channels": 3, "num_classes": 5}, (4, 3, 8, 8), (4, 5)),
        ({"image_size": 12, "patch": 3, "num_layers": 1, "mlp_ratio": 4}, (1, 1, 12, 12), (1, 10)),
        ({"patch": 8, "num_heads": 4, "d_model": 8}, (2, 1, 8, 8), (2, 10)),  # one patch
        ({"dropout": 0.1}, (5, 1, 8, 8), (5, 10)),
    ],
)
def test_output_shape(
    kwargs: dict[str, object], x_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    model = tiny_vit(**kwargs)
    out = model(torch.randn(*x_shape))
    assert out.shape == out_shape
    assert torch.isfinite(out).all()


def test_build_model_knows_vit() -> None:
    assert "vit" in MODEL_NAMES
    model = build_model("vit", in_channels=1, num_classes=10)
    assert isinstance(model, ViT)


def test_uses_stock_multihead_attention() -> None:
    model = tiny_vit(num_layers=3)
    attention = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    assert len(attention) == 3
    assert all(m.batch_first for m in attention)
    layers = [m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    assert len(layers) == 3
    assert all(layer.norm_first for layer in layers)
    assert isinstance(model.encoder, nn.TransformerEncoder)
    assert isinstance(model.patch_embed, nn.Conv2d)
    assert model.patch_embed.kernel_size == (4, 4) and model.patch_embed.stride == (4, 4)
    assert sum(isinstance(m, nn.LayerNorm) for m in model.modules()) == 2 * 3 + 1


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"image_size": 0}, "image_size"),
        ({"patch": 0}, "patch"),
        ({"patch": 2.0}, "patch"),
        ({"in_channels": -1}, "in_channels"),
        ({"num_classes": 0}, "num_classes"),
        ({"d_model": 0}, "d_model"),
        ({"num_heads": 0}, "num_heads"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_layers": True}, "num_layers"),
        ({"mlp_ratio": 0}, "mlp_ratio"),
        ({"mlp_ratio": 1.5}, "mlp_ratio"),
        ({"d_model": 30, "num_heads": 4}, "d_model must be divisible by num_heads"),
        ({"patch": 5}, "patch must divide image_size"),
        ({"image_size": 28, "patch": 6}, "patch must divide image_size"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"dropout": float("nan")}, "dropout"),
        ({"dropout": "0.1"}, "dropout"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        ViT(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "x_shape",
    [(2, 1, 28, 28), (2, 3, 8, 8), (2, 1, 12, 12), (1, 8, 8)],
)
def test_wrong_input_shape_raises(x_shape: tuple[int, ...]) -> None:
    model = tiny_vit()
    with pytest.raises(ValueError, match=r"x must have shape \(N, 1, 8, 8\)"):
        model(torch.randn(*x_shape))


def test_gradients_reach_every_parameter() -> None:
    torch.manual_seed(0)
    model = tiny_vit(in_channels=2, num_classes=3)
    x = torch.randn(4, 2, 8, 8)
    labels = torch.tensor([0, 1, 2, 1])
    F.cross_entropy(model(x), labels).backward()
    names = [name for name, _ in model.named_parameters()]
    assert {"cls_token", "pos_embed", "patch_embed.weight", "head.weight"} <= set(names)
    assert any("self_attn.in_proj_weight" in n for n in names)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eval_fast_path_matches_training_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In eval mode without autograd, nn.TransformerEncoderLayer runs PyTorch's fused
    # kernel; in training mode it runs its sub-modules. With dropout 0 they agree.
    torch.manual_seed(0)
    model = tiny_vit(dropout=0.0).to(dtype)
    x = torch.randn(6, 1, 8, 8, dtype=dtype)
    fused_calls = 0
    fused = torch._transformer_encoder_layer_fwd

    def counting_fused(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal fused_calls
        fused_calls += 1
        return fused(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting_fused)
    with torch.no_grad():
        train_out = model.train()(x)
        assert fused_calls == 0
        eval_out = model.eval()(x)
    assert fused_calls == 2  # one per encoder layer: the fast path was really taken
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(eval_out, train_out, rtol=tol, atol=tol)


def test_dropout_makes_training_mode_stochastic() -> None:
    torch.manual_seed(0)
    model = tiny_vit(dropout=0.5).train()
    x = torch.randn(3, 1, 8, 8)
    assert not torch.equal(model(x), model(x))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "build",
    [lambda: ViT(image_size=14, patch=7, d_model=32, num_heads=4), lambda: tiny_vit()],
)
def test_memorises_a_random_batch(build: Callable[[], ViT]) -> None:
    torch.manual_seed(0)
    model = build()
    size = model.image_size
    x = torch.randn(32, 1, size, size)
    labels = torch.randint(0, 10, (32,))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = F.cross_entropy(model(x), labels).item()
    assert all(math.isfinite(v) for v in losses)
    assert final <= 0.5 * losses[0], (losses[0], final)
