"""Shapes, sizes, determinism and argument checking of ``kaisa.models``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from kaisa.models import (
    MODEL_NAMES,
    BasicBlock,
    GapCNN,
    SmallCNN,
    TransformerClassifier,
    build_model,
    cifar_resnet,
    resnet20,
    resnet32,
)


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def conv_params(c_in: int, c_out: int, k: int, bias: bool = True) -> int:
    return c_out * c_in * k * k + (c_out if bias else 0)


def linear_params(d_in: int, d_out: int) -> int:
    return d_in * d_out + d_out


@pytest.mark.parametrize(
    ("name", "kwargs", "x", "out_shape"),
    [
        ("resnet20", {}, torch.randn(2, 3, 32, 32), (2, 10)),
        ("resnet32", {"num_classes": 7, "in_channels": 1}, torch.randn(2, 1, 32, 32), (2, 7)),
        ("small_cnn", {}, torch.randn(3, 1, 28, 28), (3, 10)),
        ("small_cnn", {"in_channels": 3, "num_classes": 5}, torch.randn(1, 3, 28, 28), (1, 5)),
        ("gap_cnn", {}, torch.randn(3, 1, 28, 28), (3, 10)),
        (
            "gap_cnn",
            {"width": 8, "convs_per_stage": 2, "batch_norm": False, "hidden": 16},
            torch.randn(2, 1, 28, 28),
            (2, 10),
        ),
        ("transformer", {}, torch.randint(0, 1000, (2, 16)), (2, 2)),
        ("gpt", {}, torch.randint(0, 256, (2, 64)), (2, 64, 256)),
        (
            "gpt",
            {"tied_head": True, "fused_qkv": False},
            torch.randint(0, 256, (3, 5)),
            (3, 5, 256),
        ),
        (
            "transformer",
            {"vocab_size": 50, "num_classes": 3, "d_model": 32, "num_heads": 2, "max_len": 8},
            torch.randint(0, 50, (4, 8)),
            (4, 3),
        ),
    ],
)
def test_output_shapes(
    name: str, kwargs: dict[str, object], x: torch.Tensor, out_shape: tuple[int, ...]
) -> None:
    model = build_model(name, **kwargs)
    out = model(x)
    assert out.shape == out_shape
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_resnet_sizes() -> None:
    # He et al. 2016, Table 6: ResNet-20 has 0.27M parameters, ResNet-32 0.46M.
    assert n_params(resnet20()) == 269_722
    assert n_params(resnet32()) == 464_154
    model = resnet20()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    # Option-A shortcuts have no parameters: 1 stem conv + 2 per block.
    assert len(convs) == 1 + 2 * 9
    assert len(linears) == 1
    assert cifar_resnet(56).depth == 56


def test_resnet_downsampling_shortcut_zero_pads() -> None:
    model = resnet20().eval()
    block = model.layer2[0]
    assert isinstance(block, BasicBlock)
    x = torch.randn(1, 16, 8, 8)
    out = block.shortcut(x)
    assert out.shape == (1, 32, 4, 4)
    assert torch.equal(out[:, 8:24], x[:, :, ::2, ::2])
    assert out[:, :8].abs().sum() == 0 and out[:, 24:].abs().sum() == 0


def test_small_cnn_exact_parameter_count() -> None:
    expected = (
        conv_params(1, 32, 3)
        + conv_params(32, 64, 3)
        + linear_params(64 * 7 * 7, 128)
        + linear_params(128, 10)
    )
    assert expected == 421_642
    assert n_params(SmallCNN()) == expected
    layers = [m for m in SmallCNN().modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert [type(m) for m in layers] == [nn.Conv2d, nn.Conv2d, nn.Linear, nn.Linear]
    assert isinstance(layers[2], nn.Linear) and layers[2].in_features == 3136


def test_gap_cnn_width_and_head() -> None:
    default = GapCNN()
    linears = [m for m in default.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 10)]
    convs = [m for m in default.modules() if isinstance(m, nn.Conv2d)]
    assert [m.out_channels for m in convs] == [16, 16, 32, 32, 64, 64]
    wide = GapCNN(width=32, convs_per_stage=1, hidden=128)
    linears = [m for m in wide.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(128, 128), (128, 10)]
    assert n_params(GapCNN(width=8)) < n_params(default) < n_params(GapCNN(width=32))
    # The widest Kronecker factor is the last conv's input: 9 * 4w (no bias under BatchNorm).
    assert max(m.in_channels * 9 for m in convs) == 576


def test_transformer_uses_explicit_linear_projections() -> None:
    model = TransformerClassifier(d_model=32, num_heads=4, num_layers=3)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    names = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for i in range(3):
        assert {f"blocks.{i}.attn.{p}" for p in ("q", "k", "v", "out")} <= names


def test_transformer_padding_mask_ignores_padding() -> None:
    torch.manual_seed(0)
    model = TransformerClassifier(vocab_size=20, d_model=16, num_heads=2, max_len=8).eval()
    tokens = torch.randint(0, 20, (1, 5))
    padded = torch.cat([tokens, torch.randint(0, 20, (1, 3))], dim=1)
    mask = torch.tensor([[False] * 5 + [True] * 3])
    with torch.no_grad():
        torch.testing.assert_close(model(padded, mask), model(tokens))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_deterministic_under_seed(name: str) -> None:
    tokens = name in ("transformer", "gpt")
    x = torch.randint(0, 100, (2, 8)) if tokens else torch.randn(2, 1, 28, 28)
    if name.startswith("resnet"):
        x = torch.randn(2, 3, 32, 32)
    outputs = []
    for _ in range(2):
        torch.manual_seed(1234)
        model = build_model(name)
        outputs.append(model(x))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    torch.manual_seed(4321)
    assert not torch.equal(build_model(name)(x), outputs[0])


@pytest.mark.parametrize("depth", [0, 7, 9, 21, -4, 20.0, True])
def test_bad_depth_raises(depth: int) -> None:
    with pytest.raises(ValueError, match="depth"):
        cifar_resnet(depth)


def test_unknown_name_lists_allowed() -> None:
    with pytest.raises(ValueError, match="name") as info:
        build_model("resnet18")
    for allowed in MODEL_NAMES:
        assert repr(allowed) in str(info.value)


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: SmallCNN(num_classes=0), "num_classes"),
        (lambda: GapCNN(width=0), "width"),
        (lambda: GapCNN(hidden=0), "hidden"),
        (lambda: resnet20(in_channels=0), "in_channels"),
        (lambda: TransformerClassifier(d_model=30, num_heads=4), "divisible"),
        (lambda: TransformerClassifier(num_layers=0), "num_layers"),
        (lambda: TransformerClassifier(dropout=1.0), "dropout"),
        (lambda: build_model("gpt", d_model=100, n_head=3), "divisible"),
        (lambda: build_model("gpt", context=0), "context"),
    ],
)
def test_bad_arguments_raise(build: Callable[[], nn.Module], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        build()


def test_transformer_rejects_too_long_sequence() -> None:
    model = TransformerClassifier(max_len=4)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 5, dtype=torch.long))
