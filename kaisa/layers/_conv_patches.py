"""The patch matrix of a convolution and its per-sample means (private to :mod:`kaisa.layers.conv`).

``P`` is the ``(N·T, C_in·kh·kw)`` patch matrix of an input ``(N, C_in, H, W)``
(``T = H_out·W_out`` output positions) for a :class:`ConvGeometry`.

'expand' ``PᵀP`` (:func:`patch_gram`) for the convolutions the shifted
products do not cover (strided, other padding modes, 1×1 kernels, few input
channels). The patch matrix is the largest temporary of K-FAC on a CNN (for a
16-channel 3×3 layer at 32×32 and batch 128 it is 75 MB in float32), so it is
built a slice of the batch at a time, bounded by ``max_bytes``, and never
concatenated with the column of ones. Each slice is stored transposed,
``(C_in·kh·kw, rows)``: its copy then reads and writes runs of output
positions (contiguous in the input) instead of gathering ``kw`` elements at a
time, and the product ``PᵀP`` runs on the transposed view without a copy.
Slices are small enough (4 MB) to stay in cache between the copy and the
product, and never so small that the product is dominated by re-reading the
``(C_in·kh·kw)²`` accumulator.

The per-sample means of the patch rows (:func:`patch_means`, for 'reduce',
the moments and the shifted products' bias border) never build the patch
matrix: they are two small products with 0/1 selection matrices.
"""

from __future__ import annotations

import torch

from kaisa.layers._conv_geometry import ConvGeometry
from kaisa.layers.base import gram, gram_with_ones


def patch_columns(x: torch.Tensor, geometry: ConvGeometry) -> tuple[torch.Tensor, int]:
    """``Pᵀ``, the patch matrix of ``x`` transposed (``(C_in·kh·kw, n·T)``), and ``T``.

    The columns are read from a strided view of the padded input and copied
    once. In this order the copy moves runs of output positions, which are
    contiguous in the input for unit stride; row-major ``P`` (and ``F.unfold``
    followed by a transpose) gathers ``kw`` elements at a time and costs
    more on CPU.
    """
    kh, kw = geometry.kernel
    sh, sw = geometry.stride
    dh, dw = geometry.dilation
    h_out, w_out = geometry.output_size(x.shape[-2], x.shape[-1])
    if geometry.padded:
        x = geometry.pad(x)
    x = x.contiguous()
    n, c, _, _ = x.shape
    s_n, s_c, s_h, s_w = x.stride()
    view = x.as_strided(
        (c, kh, kw, n, h_out, w_out),
        (s_c, s_h * dh, s_w * dw, s_n, s_h * sh, s_w * sw),
    )
    return view.reshape(c * kh * kw, n * h_out * w_out), h_out * w_out


def patch_gram(
    x: torch.Tensor,
    geometry: ConvGeometry,
    out: torch.Tensor | None,
    *,
    bias: bool,
    max_bytes: int,
) -> tuple[torch.Tensor, int]:
    """'expand' ``āᵀā / T²`` of ``x`` (added into ``out``) and its row count ``n·T``.

    ``ā = [p | 1]`` with ``bias``, else ``p``. Any stride, padding mode and
    dilation; the patch matrix is built a slice of samples at a time
    (:func:`_samples_per_slice`, bounded by ``max_bytes``).
    """
    chunk = _samples_per_slice(x, geometry, max_bytes)
    rows = 0
    for start in range(0, x.shape[0], chunk):
        columns, positions = patch_columns(x[start : start + chunk], geometry)
        p = columns.t()
        scale = 1.0 / positions**2
        out = gram_with_ones(p, out, scale) if bias else gram(p, out, scale)
        rows += p.shape[0]
    assert out is not None
    return out, rows


def _samples_per_slice(x: torch.Tensor, geometry: ConvGeometry, max_bytes: int) -> int:
    """Samples per slice of the patch matrix of a ``(N, C, H, W)`` input.

    At most ``max_bytes`` of patches, but at least one sample and at least
    ``C_in·kh·kw`` rows, so that each product does more work than re-reading
    the ``(C_in·kh·kw)²`` accumulator it adds into.
    """
    h_out, w_out = geometry.output_size(x.shape[-2], x.shape[-1])
    positions = max(1, h_out * w_out)
    columns = geometry.columns
    by_bytes = max_bytes // (positions * columns * x.element_size())
    by_rows = -(-columns // positions)
    return max(1, min(x.shape[0], max(by_bytes, by_rows)))


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


def patch_means(x: torch.Tensor, geometry: ConvGeometry) -> tuple[torch.Tensor, int]:
    """Per-sample means of the patch rows of ``x`` (``(n, C_in·kh·kw)``) and ``T``.

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
    kh, kw = geometry.kernel
    sh, sw = geometry.stride
    dh, dw = geometry.dilation
    h_out, w_out = geometry.output_size(x.shape[-2], x.shape[-1])
    left, _, top, _ = geometry.padding
    if geometry.pad_mode != "constant" and geometry.padded:
        x = geometry.pad(x)
        left = top = 0
    n, c, h, w = x.shape
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
