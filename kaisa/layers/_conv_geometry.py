"""The geometry of a convolution (one group's), as the 2-D convolution kaisa computes.

Kernel, stride, dilation, resolved padding and the output size are read off
the module here once; the factor algorithms (:mod:`kaisa.layers._conv_patches`,
:mod:`kaisa.layers._conv_shifted`) and the handlers (:mod:`kaisa.layers.conv`)
take them from a :class:`ConvGeometry`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    return (int(value[0]), int(value[1]))


def _one_row(value: int | tuple[int, ...], row: int) -> tuple[int, int]:
    """A 1-D convolution's ``value`` as the 2-D pair ``(row, value)``."""
    return (row, value if isinstance(value, int) else int(value[0]))


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution as the 2-D convolution the handlers compute.

    ``nn.Conv2d`` as it is; ``nn.Conv1d`` as the 2-D convolution of its input
    viewed as one row, ``(N, C_in, 1, L)``: kernel ``(1, k)``, stride
    ``(1, s)``, dilation ``(1, d)`` and padding on the columns only. A grouped
    convolution (``groups = g``) as the convolution of one group's input
    channels, ``C_in / g``: the columns of its weight's rows.

    Attributes:
        in_channels: ``C_in / groups``, the input channels each output sees.
        out_channels: ``C_out``.
        kernel: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        dilation: ``(dh, dw)``.
        padding: ``(left, right, top, bottom)`` (``F.pad``'s order), with
            ``'same'`` and ``'valid'`` resolved.
        pad_mode: the ``F.pad`` mode of the padding (``'constant'`` for zeros).
        same: TensorFlow's ``'SAME'`` padding, computed for each input's size
            (timm's ``Conv2dSame``; :meth:`same_padding`): the input is zero-padded
            by :meth:`pad_same` first, and ``padding``, all zero, describes the
            convolution of the padded input.
    """

    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int, int, int]
    pad_mode: str
    same: bool = False

    @classmethod
    def of(cls, conv: nn.Conv1d | nn.Conv2d, *, same: bool = False) -> ConvGeometry:
        """The 2-D geometry of ``conv``; ``same``: it pads each input as TensorFlow's
        ``'SAME'`` does before a convolution without padding (``ValueError`` if
        ``conv`` has padding of its own)."""
        if isinstance(conv, nn.Conv1d):
            kernel, stride = _one_row(conv.kernel_size, 1), _one_row(conv.stride, 1)
            dilation = _one_row(conv.dilation, 1)
            pads = conv.padding if isinstance(conv.padding, str) else _one_row(conv.padding, 0)
        else:
            kernel, stride, dilation = (
                _pair(conv.kernel_size),
                _pair(conv.stride),
                _pair(conv.dilation),
            )
            pads = conv.padding if isinstance(conv.padding, str) else _pair(conv.padding)
        if pads == "valid":
            padding = (0, 0, 0, 0)
        elif pads == "same":
            total_h = dilation[0] * (kernel[0] - 1)
            total_w = dilation[1] * (kernel[1] - 1)
            padding = (total_w // 2, total_w - total_w // 2, total_h // 2, total_h - total_h // 2)
        else:
            assert not isinstance(pads, str)
            ph, pw = pads
            padding = (pw, pw, ph, ph)
        if same and (any(padding) or conv.padding_mode != "zeros"):
            raise ValueError(
                "a convolution padded as TensorFlow's 'SAME' for each input must have "
                f"padding=0 and padding_mode='zeros' itself; got {conv!r}"
            )
        return cls(
            in_channels=conv.in_channels // conv.groups,
            out_channels=conv.out_channels,
            kernel=kernel,
            stride=stride,
            dilation=dilation,
            padding=padding,
            pad_mode="constant" if conv.padding_mode == "zeros" else conv.padding_mode,
            same=same,
        )

    @property
    def columns(self) -> int:
        """Columns of the patch matrix, ``C_in·kh·kw``."""
        return self.in_channels * self.kernel[0] * self.kernel[1]

    @property
    def padded(self) -> bool:
        """Whether the convolution pads its input at all."""
        return any(self.padding)

    def same_padding(self, h: int, w: int) -> tuple[int, int, int, int]:
        """TensorFlow's ``'SAME'`` padding of an ``h × w`` input, in ``F.pad``'s order.

        Along each axis of size ``n`` the output has ``⌈n / s⌉`` positions; the
        padding that gives them, ``max((⌈n / s⌉ − 1)·s + (k − 1)·d + 1 − n, 0)``,
        is split with the odd one after (right, bottom).
        """
        totals = []
        for n, k, s, d in zip((h, w), self.kernel, self.stride, self.dilation, strict=True):
            totals.append(max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0))
        th, tw = totals
        return (tw // 2, tw - tw // 2, th // 2, th - th // 2)

    def pad_same(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``(N, C, H, W)``) as a :attr:`same` convolution sees it (itself otherwise)."""
        if not self.same:
            return x
        padding = self.same_padding(x.shape[-2], x.shape[-1])
        return F.pad(x, padding) if any(padding) else x

    def output_size(self, h: int, w: int) -> tuple[int, int]:
        """``(H_out, W_out)`` for an ``h × w`` input, before :attr:`padding` (after
        :meth:`pad_same`)."""
        left, right, top, bottom = self.padding
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        h_out = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
        w_out = (w + left + right - dw * (kw - 1) - 1) // sw + 1
        return h_out, w_out

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``(N, C, H, W)``) padded as the convolution pads it."""
        return F.pad(x, self.padding, mode=self.pad_mode)
