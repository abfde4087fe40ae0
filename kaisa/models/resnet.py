"""CIFAR-style residual networks (He et al. 2016, section 4.2).

The ``6n + 2`` family: a 3x3 stem convolution with 16 channels, three stages of
``n`` basic blocks with 16, 32 and 64 channels (the second and third stages
halve the spatial size in their first block), global average pooling and one
linear classifier. ResNet-20 is ``n = 3``, ResNet-32 is ``n = 5``.

Shortcuts use **option A** of the paper: where a block changes the shape, the
identity is subsampled with stride 2 and the new channels are zero-padded. It
has no parameters, so the only layers K-FAC sees are the 3x3 convolutions and
the classifier, and ResNet-20 has the paper's 0.27M parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BasicBlock", "CifarResNet", "PadShortcut", "cifar_resnet", "resnet20", "resnet32"]

_STAGE_CHANNELS = (16, 32, 64)


class PadShortcut(nn.Module):
    """Parameter-free option-A shortcut: strided subsampling plus zero channels.

    Maps ``(N, in_channels, H, W)`` to ``(N, out_channels, ceil(H / stride),
    ceil(W / stride))``; the extra channels (split evenly before and after the
    originals) are zero.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        if out_channels < in_channels:
            raise ValueError(
                f"out_channels must be >= in_channels for a padding shortcut, "
                f"got {out_channels} < {in_channels}"
            )
        self.stride = stride
        extra = out_channels - in_channels
        self.pad_before = extra // 2
        self.pad_after = extra - extra // 2

    def forward(self, x: Tensor) -> Tensor:
        """``(N, C_in, H, W)`` to ``(N, C_out, ceil(H/s), ceil(W/s))``."""
        x = x[:, :, :: self.stride, :: self.stride]
        # F.pad pads the last dimensions first: (W, W, H, H, C, C).
        return F.pad(x, (0, 0, 0, 0, self.pad_before, self.pad_after))

    def extra_repr(self) -> str:
        return f"stride={self.stride}, pad=({self.pad_before}, {self.pad_after})"


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and ReLU plus a shortcut.

    ``(N, in_channels, H, W)`` to ``(N, out_channels, H / stride, W / stride)``.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(
            in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False
        )
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(
            out_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False
        )
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU(inplace=True)
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = PadShortcut(in_channels, out_channels, stride)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """``(N, C_in, H, W)`` to ``(N, C_out, H / stride, W / stride)``."""
        out: Tensor = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + self.shortcut(x)
        result: Tensor = self.relu2(out)
        return result


class CifarResNet(nn.Module):
    """ResNet of depth ``6 * blocks_per_stage + 2`` for small (e.g. 32x32) images.

    Input ``(N, in_channels, H, W)``, output logits ``(N, num_classes)``. Any
    ``H, W`` of at least 4 works; the CIFAR recipe uses 32x32.
    """

    def __init__(self, blocks_per_stage: int, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        if blocks_per_stage < 1:
            raise ValueError(f"blocks_per_stage must be >= 1, got {blocks_per_stage}")
        _check_positive("num_classes", num_classes)
        _check_positive("in_channels", in_channels)
        self.depth = 6 * blocks_per_stage + 2
        c0 = _STAGE_CHANNELS[0]
        self.conv1 = nn.Conv2d(in_channels, c0, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c0)
        self.relu = nn.ReLU(inplace=True)
        stages: list[nn.Sequential] = []
        prev = c0
        for i, channels in enumerate(_STAGE_CHANNELS):
            blocks: list[nn.Module] = []
            for j in range(blocks_per_stage):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(BasicBlock(prev, channels, stride))
                prev = channels
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Images ``(N, C, H, W)`` to logits ``(N, num_classes)``."""
        out: Tensor = self.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = torch.flatten(self.pool(out), 1)
        logits: Tensor = self.fc(out)
        return logits


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def cifar_resnet(depth: int, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """CIFAR ResNet of the given ``depth`` (20, 32, 44, 56, 110, ...).

    Raises ``ValueError`` unless ``depth = 6n + 2`` with ``n >= 1``.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
        raise ValueError(f"depth must be 6n + 2 with n >= 1 (8, 14, 20, 32, ...), got {depth!r}")
    return CifarResNet((depth - 2) // 6, num_classes=num_classes, in_channels=in_channels)


def resnet20(num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """ResNet-20 (0.27M parameters with 10 classes)."""
    return cifar_resnet(20, num_classes=num_classes, in_channels=in_channels)


def resnet32(num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """ResNet-32 (0.46M parameters with 10 classes)."""
    return cifar_resnet(32, num_classes=num_classes, in_channels=in_channels)
