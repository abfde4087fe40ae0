"""Kronecker-factor sides of real networks, for planning without building them.

A K-FAC layer with input side ``a`` and output side ``g`` has factors
``A`` (``a × a``) and ``G`` (``g × g``):

* ``nn.Linear``: ``a = in_features (+1 with a bias)``, ``g = out_features``;
* ``nn.Conv2d``: ``a = (C_in / groups)·kh·kw (+1 with a bias)``,
  ``g = C_out``.

``resnet50_shapes`` and ``bert_shapes`` write these down for the published
architectures (ResNet-50 as in torchvision, BERT as in the original paper and
Hugging Face naming), so a plan for 1024 ranks needs neither torch nor the
weights. The shapes of an actual ``nn.Module`` are read off it by
:func:`kaisa.cli.shapes.module_layer_shapes` (this package knows shapes, not
module types).
"""

from __future__ import annotations

from collections.abc import Callable

from kaisa.distributed.plan import LayerShape

__all__ = [
    "SHAPE_MODELS",
    "bert_base_shapes",
    "bert_large_shapes",
    "bert_shapes",
    "conv2d_shape",
    "linear_shape",
    "resnet50_shapes",
]


def linear_shape(name: str, in_features: int, out_features: int, bias: bool = True) -> LayerShape:
    """Factor sides of ``nn.Linear(in_features, out_features, bias)``."""
    return LayerShape(name, in_features + int(bias), out_features)


def conv2d_shape(
    name: str,
    in_channels: int,
    out_channels: int,
    kernel_size: int,
    bias: bool = False,
    groups: int = 1,
) -> LayerShape:
    """Factor sides of a square-kernel ``nn.Conv2d`` (one ``A`` shared by its ``groups``;
    a depthwise layer's ``G``, diagonal, held as a diagonal side)."""
    a = in_channels // groups * kernel_size * kernel_size + int(bias)
    depthwise = groups > 1 and out_channels == groups
    return LayerShape(name, a, out_channels, "exact", "diagonal" if depthwise else "exact")


def resnet50_shapes(num_classes: int = 1000) -> list[LayerShape]:
    """The 54 K-FAC layers of torchvision's ResNet-50 (v1.5), named as there.

    Stem ``conv1`` (7×7, 3→64), four stages of 3, 4, 6 and 3 bottlenecks of
    width 64, 128, 256 and 512 (1×1 → 3×3 → 1×1 with expansion 4, the stride
    on the 3×3), a 1×1 ``downsample.0`` on the first block of each stage, and
    ``fc`` (2048 → ``num_classes``). Convolutions have no bias; ``fc`` has one.
    """
    layers = [conv2d_shape("conv1", 3, 64, 7)]
    in_channels = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
        out_channels = 4 * width
        for block in range(blocks):
            prefix = f"layer{stage + 1}.{block}"
            layers += [
                conv2d_shape(f"{prefix}.conv1", in_channels, width, 1),
                conv2d_shape(f"{prefix}.conv2", width, width, 3),
                conv2d_shape(f"{prefix}.conv3", width, out_channels, 1),
            ]
            if block == 0:
                layers.append(conv2d_shape(f"{prefix}.downsample.0", in_channels, out_channels, 1))
            in_channels = out_channels
    layers.append(linear_shape("fc", in_channels, num_classes))
    return layers


def bert_shapes(
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    include_pooler: bool = True,
) -> list[LayerShape]:
    """The Linear layers of a BERT encoder (Hugging Face ``BertModel`` names).

    Per layer: the query, key, value and attention-output projections
    (``hidden → hidden``), the FFN input (``hidden → intermediate``) and
    output (``intermediate → hidden``), all with a bias; then the pooler
    (``hidden → hidden``) if ``include_pooler``. The number of heads does not
    change any factor. Embeddings are not K-FAC layers and the pre-training
    heads are left out (the MLM decoder, tied to the 30522-word embedding,
    would need a 30522² ``G`` factor).
    """
    h, i = hidden_size, intermediate_size
    layers: list[LayerShape] = []
    for n in range(num_layers):
        p = f"encoder.layer.{n}"
        layers += [
            linear_shape(f"{p}.attention.self.query", h, h),
            linear_shape(f"{p}.attention.self.key", h, h),
            linear_shape(f"{p}.attention.self.value", h, h),
            linear_shape(f"{p}.attention.output.dense", h, h),
            linear_shape(f"{p}.intermediate.dense", h, i),
            linear_shape(f"{p}.output.dense", i, h),
        ]
    if include_pooler:
        layers.append(linear_shape("pooler.dense", h, h))
    return layers


def bert_large_shapes(include_pooler: bool = True) -> list[LayerShape]:
    """BERT-Large: 24 layers, hidden 1024, 16 heads, FFN 4096 (145 layers with the pooler)."""
    return bert_shapes(24, 1024, 4096, include_pooler)


def bert_base_shapes(include_pooler: bool = True) -> list[LayerShape]:
    """BERT-Base: 12 layers, hidden 768, 12 heads, FFN 3072 (73 layers with the pooler)."""
    return bert_shapes(12, 768, 3072, include_pooler)


SHAPE_MODELS: dict[str, Callable[[], list[LayerShape]]] = {
    "resnet50": resnet50_shapes,
    "bert-large": bert_large_shapes,
    "bert-base": bert_base_shapes,
}
"""Models whose shapes are written down here (no torch needed), by name."""
