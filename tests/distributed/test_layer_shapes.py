"""Factor sides of written-down architectures and of real modules."""

from __future__ import annotations

import torch
from torch import nn

from kaisa.cli.shapes import module_layer_shapes
from kaisa.distributed.layer_shapes import (
    SHAPE_MODELS,
    bert_base_shapes,
    bert_large_shapes,
    conv2d_shape,
    resnet50_shapes,
)
from kaisa.distributed.plan import LayerShape


def weight_and_bias_elements(layers: list[LayerShape]) -> int:
    """A K-FAC layer's weight and bias together are ``g × a`` numbers."""
    return sum(layer.a_size * layer.g_size for layer in layers)


def test_resnet50_matches_the_published_parameter_count() -> None:
    layers = resnet50_shapes()
    assert len(layers) == 54  # 1 stem + 16 blocks x 3 + 4 downsamples + fc
    assert layers[0] == LayerShape("conv1", 3 * 7 * 7, 64)
    assert layers[-1] == LayerShape("fc", 2048 + 1, 1000)
    assert LayerShape("layer4.2.conv2", 512 * 9, 512) in layers
    assert LayerShape("layer1.0.downsample.0", 64, 256) in layers
    # Every conv is followed by a BatchNorm of C_out channels (weight and bias).
    batchnorm = 2 * sum(layer.g_size for layer in layers if layer.name != "fc")
    assert weight_and_bias_elements(layers) + batchnorm == 25_557_032


def test_bert_matches_the_published_parameter_counts() -> None:
    vocab, positions, token_types = 30522, 512, 2
    for layers, hidden, depth, total in [
        (bert_large_shapes(), 1024, 24, 335_141_888),
        (bert_base_shapes(), 768, 12, 109_482_240),
    ]:
        assert len(layers) == 6 * depth + 1
        embeddings = (vocab + positions + token_types) * hidden + 2 * hidden
        layer_norms = depth * 2 * 2 * hidden
        assert weight_and_bias_elements(layers) + embeddings + layer_norms == total
    large = {layer.name: layer for layer in bert_large_shapes()}
    assert large["encoder.layer.0.attention.self.query"] == LayerShape(
        "encoder.layer.0.attention.self.query", 1025, 1024
    )
    assert large["encoder.layer.23.intermediate.dense"].a_size == 1025
    assert large["encoder.layer.23.intermediate.dense"].g_size == 4096
    assert large["encoder.layer.23.output.dense"].a_size == 4097
    assert large["encoder.layer.23.output.dense"].g_size == 1024
    assert len(bert_large_shapes(include_pooler=False)) == 144


def test_shape_models_table() -> None:
    assert set(SHAPE_MODELS) == {"resnet50", "bert-large", "bert-base"}
    for build in SHAPE_MODELS.values():
        layers = build()
        assert len({layer.name for layer in layers}) == len(layers)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=(3, 5), bias=True)
        self.depthwise = nn.Conv2d(8, 8, kernel_size=3, groups=8)
        self.norm = nn.BatchNorm2d(8)
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Sequential(nn.Linear(16, 7, bias=False), nn.ReLU(), nn.Linear(7, 2))


def test_module_layer_shapes() -> None:
    assert module_layer_shapes(Toy()) == [
        LayerShape("conv", 3 * 3 * 5 + 1, 8),
        LayerShape("depthwise", 1 * 3 * 3 + 1, 8, "exact", "diagonal"),  # one channel a group
        LayerShape("embed", 10, 4, "diagonal", "exact"),
        LayerShape("head.0", 16, 7),
        LayerShape("head.2", 8, 2),
    ]


def test_module_layer_shapes_skip_layers() -> None:
    assert [s.name for s in module_layer_shapes(Toy(), skip_layers=["Conv2d"])] == [
        "embed",
        "head.0",
        "head.2",
    ]
    assert [s.name for s in module_layer_shapes(Toy(), skip_layers=[r"^head\.2$"])] == [
        "conv",
        "depthwise",
        "embed",
        "head.0",
    ]


def test_module_layer_shapes_root_layer() -> None:
    assert module_layer_shapes(nn.Linear(3, 4)) == [LayerShape("Linear", 4, 4)]


def test_module_layer_shapes_of_resnet20() -> None:
    from kaisa.models import resnet20

    torch.manual_seed(0)
    model = resnet20()
    layers = module_layer_shapes(model)
    assert len(layers) == 20
    assert layers[0] == LayerShape("conv1", 27, 16)
    batchnorm = sum(
        p.numel() for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()
    )
    assert weight_and_bias_elements(layers) + batchnorm == sum(
        p.numel() for p in model.parameters()
    )


def test_transformer_layer_kinds_are_counted_with_their_sizes() -> None:
    """Attention as four blocks, an embedding with its diagonal A (issue 16, item 8)."""
    from kaisa.models import ViT

    model = nn.Sequential(nn.Embedding(50, 8), nn.MultiheadAttention(8, 2, kdim=4, vdim=6))
    shapes = module_layer_shapes(model)
    assert shapes == [
        LayerShape("0", 50, 8, "diagonal", "exact"),
        LayerShape("1.q", 9, 8),
        LayerShape("1.k", 5, 8),
        LayerShape("1.v", 7, 8),
        LayerShape("1.out_proj", 9, 8),
    ]
    vit = [s.name for s in module_layer_shapes(ViT())]
    assert vit[0] == "patch_embed" and vit[-1] == "head"
    assert "encoder.layers.1.self_attn.v" in vit and len(vit) == 2 + 2 * 6


def test_a_grouped_conv2d_shape_is_what_the_registry_reads_off_the_module() -> None:
    for c_in, c_out, groups, bias in ((8, 8, 8, False), (16, 32, 4, True), (6, 9, 1, True)):
        module = nn.Sequential(nn.Conv2d(c_in, c_out, 3, groups=groups, bias=bias))
        (read,) = module_layer_shapes(module)
        assert conv2d_shape("0", c_in, c_out, 3, bias=bias, groups=groups) == read
