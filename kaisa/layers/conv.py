"""``nn.Conv2d`` (groups = 1): factors from im2col patches (spec §3, Conv2d).

With ``P`` the ``(N·T, C_in·kh·kw)`` patch matrix (``T = H_out·W_out``),
``ā = [P | 1] / T`` and ``A_batch = āᵀā / (N·T)``; ``δ`` is reshaped to
``(N·T, C_out)`` and divided by ``T``, ``G_batch = δᵀδ / (N·T)``.

The patch matrix is the largest temporary of K-FAC on a CNN (for a 16-channel
3×3 layer at 32×32 and batch 128 it is 75 MB in float32), so it is built a
slice of the batch at a time, bounded by ``max_patch_bytes``, and never
concatenated with the column of ones. Each slice is stored transposed,
``(C_in·kh·kw, rows)``: its copy then reads and writes runs of output
positions (contiguous in the input) instead of gathering ``kw`` elements at a
time, and the product ``PᵀP`` runs on the transposed view without a copy.
Slices are small enough (4 MB) to stay in cache between the copy and the
product, and never so small that the product is dominated by re-reading the
``(C_in·kh·kw)²`` accumulator.

``δᵀδ`` of an output gradient with more positions than channels is summed over
samples with one batched product over the ``(C_out, T)`` sample blocks, which
avoids copying ``δ`` into row-major order.

``estimator='reduce'`` is the cheaper estimator (KFAC-reduce, Eschenhagen et
al., 2023): the rows of one sample are averaged over the ``T`` output
positions *before* the outer product, ``ā_n = mean_t ā_nt`` and
``δ̄_n = mean_t δ_nt / T``, giving ``A = Σ_n ā_n ā_nᵀ / N`` and
``G = Σ_n δ̄_n δ̄_nᵀ / N``. When a sample's rows do not vary over positions it
equals the default ('expand'), so damping values carry over; it costs ``N``
rows instead of ``N·T`` and never builds the patch matrix (the position means
of the patches are two small products with 0/1 selection matrices).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kaisa.layers.base import LayerHandler, gram, gram_with_ones

ConvEstimator = Literal["expand", "reduce"]

#: Upper bound on the bytes of one slice of the patch matrix (unless a single
#: sample, or the accumulator ``(C_in·kh·kw)²``, is larger).
DEFAULT_MAX_PATCH_BYTES = 4 * 2**20


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    return (int(value[0]), int(value[1]))


def explicit_padding(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    """Padding of ``conv`` as ``(left, right, top, bottom)``, resolving 'same' and 'valid'."""
    kh, kw = _pair(conv.kernel_size)
    dh, dw = _pair(conv.dilation)
    if conv.padding == "valid":
        return (0, 0, 0, 0)
    if conv.padding == "same":
        total_h, total_w = dh * (kh - 1), dw * (kw - 1)
        return (total_w // 2, total_w - total_w // 2, total_h // 2, total_h - total_h // 2)
    assert not isinstance(conv.padding, str)
    ph, pw = _pair(conv.padding)
    return (pw, pw, ph, ph)


def _selection(
    size: int, pad: int, kernel: int, dilation: int, stride: int, out: int, like: torch.Tensor
) -> torch.Tensor:
    """``S[k, i] = 1`` when input index ``i`` is read by kernel offset ``k`` at some output.

    Input index ``i`` sits at ``i + pad`` in the padded input; offset ``k``
    reads the padded indices ``k·dilation + stride·t`` for ``t < out``.
    """
    shift = torch.arange(size, device=like.device) + pad
    shift = shift.unsqueeze(0) - torch.arange(kernel, device=like.device).unsqueeze(1) * dilation
    hit = (shift >= 0) & (shift % stride == 0) & (shift < stride * out)
    return hit.to(like.dtype)


class Conv2dHandler(LayerHandler):
    """A ``groups == 1`` 2-D convolution with any stride, padding mode and dilation."""

    module: nn.Conv2d

    def __init__(
        self,
        module: nn.Conv2d,
        max_patch_bytes: int = DEFAULT_MAX_PATCH_BYTES,
        estimator: ConvEstimator = "expand",
    ) -> None:
        if module.groups != 1:
            raise ValueError(f"Conv2dHandler supports groups=1 only, got groups={module.groups}")
        if estimator not in ("expand", "reduce"):
            raise ValueError(f"estimator must be 'expand' or 'reduce'; got {estimator!r}")
        super().__init__(module)
        self.estimator = estimator
        kh, kw = _pair(module.kernel_size)
        self.a_size = module.in_channels * kh * kw + (1 if module.bias is not None else 0)
        self.g_size = module.out_channels
        self.max_patch_bytes = max_patch_bytes
        self._padding = explicit_padding(module)
        self._pad_mode = "constant" if module.padding_mode == "zeros" else module.padding_mode

    def patches(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The patch matrix ``P`` of ``x`` (``(n·T, C_in·kh·kw)``) and ``T``.

        ``P`` is the transposed view of a contiguous ``(C_in·kh·kw, n·T)``
        tensor (see :meth:`patch_columns`); matrix products take it as it is.
        """
        columns, positions = self.patch_columns(x)
        return columns.t(), positions

    def patch_columns(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``Pᵀ``, the patch matrix of ``x`` transposed (``(C_in·kh·kw, n·T)``), and ``T``.

        The columns are read from a strided view of the padded input and copied
        once. In this order the copy moves runs of output positions, which are
        contiguous in the input for unit stride; row-major ``P`` (and ``F.unfold``
        followed by a transpose) gathers ``kw`` elements at a time and costs
        more on CPU.
        """
        conv = self.module
        kh, kw = _pair(conv.kernel_size)
        sh, sw = _pair(conv.stride)
        dh, dw = _pair(conv.dilation)
        if any(self._padding):
            x = F.pad(x, self._padding, mode=self._pad_mode)
        x = x.contiguous()
        n, c, h, w = x.shape
        h_out = (h - dh * (kh - 1) - 1) // sh + 1
        w_out = (w - dw * (kw - 1) - 1) // sw + 1
        s_n, s_c, s_h, s_w = x.stride()
        view = x.as_strided(
            (c, kh, kw, n, h_out, w_out),
            (s_c, s_h * dh, s_w * dw, s_n, s_h * sh, s_w * sw),
        )
        return view.reshape(c * kh * kw, n * h_out * w_out), h_out * w_out

    def patch_means(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Per-sample means of the patch rows (``(n, C_in·kh·kw)``) and ``T``.

        The mean of column (channel, ky, kx) is the sum of ``x`` over the rows
        ``ky·dh + sh·t`` and the columns ``kx·dw + sw·t`` of the padded input,
        divided by ``T``; as 0/1 selection matrices ``M`` (``kh × H``) and
        ``N`` (``kw × W``) that is ``M x Nᵀ`` for every (sample, channel): two
        small matrix products that read the input once, for any stride and
        dilation. Zero padding contributes nothing, so it is folded into the
        selection matrices instead of being copied; other padding modes pad
        first. The patch matrix itself is never built. A channels-last input
        is summed in its own memory order (batched products per sample), so
        it is never copied into the contiguous layout.
        """
        conv = self.module
        kh, kw = _pair(conv.kernel_size)
        sh, sw = _pair(conv.stride)
        dh, dw = _pair(conv.dilation)
        left, right, top, bottom = self._padding
        if self._pad_mode != "constant" and any(self._padding):
            x = F.pad(x, self._padding, mode=self._pad_mode)
            left = right = top = bottom = 0
        n, c, h, w = x.shape
        h_out = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
        w_out = (w + left + right - dw * (kw - 1) - 1) // sw + 1
        rows = _selection(h, top, kh, dh, sh, h_out, x)  # (kh, h)
        cols = _selection(w, left, kw, dw, sw, w_out, x)  # (kw, w)
        positions = h_out * w_out
        if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
            # Channels-last input, read in its own (n, h, w, c) order: reshaping
            # it as below would first copy it, which costs more than the products.
            # Sum over h per sample, then over w per (sample, ky), channels last.
            nhwc = x.permute(0, 2, 3, 1)
            by_row = torch.matmul(rows, nhwc.reshape(n, h, w * c))  # (n, kh, w·c)
            sums = torch.matmul(cols, by_row.reshape(n * kh, w, c))  # (n·kh, kw, c)
            means = sums.reshape(n, kh, kw, c).permute(0, 3, 1, 2).reshape(n, c * kh * kw)
            return means.div_(positions), positions
        # Both products keep the long (n·c·h) dimension last: a skinny product
        # with the (w, kw) matrix on the right runs several times slower on CPU.
        by_column = cols @ x.reshape(n * c * h, w).t()  # (kw, n·c·h)
        sums = rows @ by_column.reshape(kw * n * c, h).t()  # (kh, kw·n·c)
        means = sums.reshape(kh, kw, n, c).permute(2, 3, 0, 1).reshape(n, c * kh * kw)
        return means.div_(positions), positions

    def a_sum(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        if x.dim() == 3:
            x = x.unsqueeze(0)
        n = x.shape[0]
        if self.estimator == "reduce":
            means, positions = self.patch_means(x)
            scale = 1.0 / positions**2
            out = gram_with_ones(means, out, scale) if self.has_bias else gram(means, out, scale)
            return out, n
        chunk = self._samples_per_slice(x)
        rows = 0
        for start in range(0, n, chunk):
            p, positions = self.patches(x[start : start + chunk])
            scale = 1.0 / positions**2
            out = gram_with_ones(p, out, scale) if self.has_bias else gram(p, out, scale)
            rows += p.shape[0]
        assert out is not None
        return out, rows

    def g_sum(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        if grad_output.dim() == 3:
            grad_output = grad_output.unsqueeze(0)
        n, c, h, w = grad_output.shape
        positions = h * w
        scale = 1.0 / positions**2
        if self.estimator == "reduce":
            return gram(grad_output.mean(dim=(2, 3)), out, scale), n
        if positions >= c and grad_output.is_contiguous():
            return self._sample_block_gram(grad_output.reshape(n, c, positions), out, scale), (
                n * positions
            )
        rows = grad_output.permute(0, 2, 3, 1).reshape(n * positions, c)
        return gram(rows, out, scale), n * positions

    def _sample_block_gram(
        self, blocks: torch.Tensor, out: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """``scale · Σ_n B_n B_nᵀ`` of ``(n, c, T)`` blocks, accumulated into ``out``.

        Equals ``scale · RᵀR`` for ``R``, the ``(n·T, c)`` rows of the blocks,
        without copying them into that order: one batched product per slice of
        samples (bounded by ``max_patch_bytes`` of ``(c, c)`` products), summed
        in at least float32.
        """
        n, c, _ = blocks.shape
        per_sample = c * c * blocks.element_size()
        chunk = max(1, min(n, self.max_patch_bytes // per_sample))
        for start in range(0, n, chunk):
            part = blocks[start : start + chunk]
            products = torch.bmm(part, part.transpose(1, 2))
            total = products.sum(dim=0, dtype=torch.promote_types(blocks.dtype, torch.float32))
            out = total.mul_(scale) if out is None else out.add_(total, alpha=scale)
        assert out is not None
        return out

    def _samples_per_slice(self, x: torch.Tensor) -> int:
        """Samples per slice of the patch matrix.

        At most ``max_patch_bytes`` of patches, but at least one sample and at
        least ``C_in·kh·kw`` rows, so that each product does more work than
        re-reading the ``(C_in·kh·kw)²`` accumulator it adds into.
        """
        conv = self.module
        kh, kw = _pair(conv.kernel_size)
        sh, sw = _pair(conv.stride)
        dh, dw = _pair(conv.dilation)
        left, right, top, bottom = self._padding
        h_out = (x.shape[-2] + top + bottom - dh * (kh - 1) - 1) // sh + 1
        w_out = (x.shape[-1] + left + right - dw * (kw - 1) - 1) // sw + 1
        positions = max(1, h_out * w_out)
        columns = conv.in_channels * kh * kw
        by_bytes = self.max_patch_bytes // (positions * columns * x.element_size())
        by_rows = -(-columns // positions)
        return max(1, min(x.shape[0], max(by_bytes, by_rows)))
