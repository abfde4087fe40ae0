"""``nn.Conv2d`` (groups = 1): factors from im2col patches (spec §3, Conv2d).

With ``P`` the ``(N·T, C_in·kh·kw)`` patch matrix (``T = H_out·W_out``),
``ā = [P | 1] / T`` and ``A_batch = āᵀā / (N·T)``; ``δ`` is reshaped to
``(N·T, C_out)`` and divided by ``T``, ``G_batch = δᵀδ / (N·T)``.
``nn.Conv1d`` (groups = 1, :class:`Conv1dHandler`) is the same computation on
its input viewed as one row of pixels, ``(N, C_in, 1, L)``, with a ``(1, k)``
kernel, so everything below holds for it with ``kh = 1``.

For unit stride and zero padding (the common case), ``PᵀP`` is assembled
from shifted products of the input itself and the patch matrix is never
built: the block pairing two kernel offsets is the sum of ``x[u] x[u + d]ᵀ``
over input positions, which blocks with the same displacement ``d`` share up
to narrow border strips (:class:`_ShiftPlan`). A 3×3 kernel then costs 13
products with ``C_in`` columns instead of one with ``9·C_in``: on GapCNN's
six convolutions 2.3 (2 threads) to 2.8 (1 thread) times faster
(``benchmarks/conv_expand.py``).

Otherwise (strided convolutions, other padding modes, 1×1 kernels, fewer than
``SHIFTED_MIN_CHANNELS`` input channels) the patch matrix is built. It is the
largest temporary of K-FAC on a CNN (for a 16-channel 3×3 layer at 32×32 and
batch 128 it is 75 MB in float32), so it is built a slice of the batch at a
time, bounded by ``max_patch_bytes``, and never concatenated with the column
of ones. Each slice is stored transposed,
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

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from kaisa.layers.base import (
    LayerHandler,
    accumulator_dtype,
    add_ones_border,
    gram,
    gram_with_ones,
)

ConvEstimator = Literal["expand", "reduce"]

#: Upper bound on the bytes of one slice of the patch matrix (unless a single
#: sample, or the accumulator ``(C_in·kh·kw)²``, is larger).
DEFAULT_MAX_PATCH_BYTES = 4 * 2**20

#: Upper bound on the bytes of the zero-guarded input copy that the shifted
#: 'expand' products read (unless one sample is larger); larger inputs are
#: taken a slice of samples at a time.
DEFAULT_MAX_SHIFT_BYTES = 32 * 2**20

#: ``a_sum`` takes the shifted products from this many input channels on. Each
#: of their products reads the whole input for only ``C_in²`` outputs, so with
#: few channels they are bound by memory traffic and the patch matrix (one copy,
#: one product) is faster: batch 128, 2 threads, 3×3 at 28×28 (ms, shifted
#: against patch matrix) C_in 1: 3.2 / 1.1, 8: 10.3 / 9.8, 10: 23.3 / 15.7,
#: 12: 12.8 / 21.5, 16: 9.6 / 28.9; 5×5 at 28×28 C_in 4: 40.6 / 16.8, 16:
#: 43.8 / 186.0.
SHIFTED_MIN_CHANNELS = 12


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    return (int(value[0]), int(value[1]))


def _one_row(value: int | tuple[int, ...], row: int) -> tuple[int, int]:
    """A 1-D convolution's ``value`` as the 2-D pair ``(row, value)``."""
    return (row, value if isinstance(value, int) else int(value[0]))


@dataclass(frozen=True)
class ConvGeometry:
    """A ``groups == 1`` convolution as the 2-D convolution the handlers compute.

    ``nn.Conv2d`` as it is; ``nn.Conv1d`` as the 2-D convolution of its input
    viewed as one row, ``(N, C_in, 1, L)``: kernel ``(1, k)``, stride
    ``(1, s)``, dilation ``(1, d)`` and padding on the columns only.

    Attributes:
        in_channels: ``C_in``.
        out_channels: ``C_out``.
        kernel: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        dilation: ``(dh, dw)``.
        padding: ``(left, right, top, bottom)`` (``F.pad``'s order), with
            ``'same'`` and ``'valid'`` resolved.
        pad_mode: the ``F.pad`` mode of the padding (``'constant'`` for zeros).
    """

    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int, int, int]
    pad_mode: str

    @classmethod
    def of(cls, conv: nn.Conv1d | nn.Conv2d) -> ConvGeometry:
        """The 2-D geometry of ``conv``."""
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
        return cls(
            in_channels=conv.in_channels,
            out_channels=conv.out_channels,
            kernel=kernel,
            stride=stride,
            dilation=dilation,
            padding=padding,
            pad_mode="constant" if conv.padding_mode == "zeros" else conv.padding_mode,
        )

    @property
    def columns(self) -> int:
        """Columns of the patch matrix, ``C_in·kh·kw``."""
        return self.in_channels * self.kernel[0] * self.kernel[1]

    def output_size(self, h: int, w: int) -> tuple[int, int]:
        """``(H_out, W_out)`` for an (unpadded) ``h × w`` input."""
        left, right, top, bottom = self.padding
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        h_out = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
        w_out = (w + left + right - dw * (kw - 1) - 1) // sw + 1
        return h_out, w_out


def explicit_padding(conv: nn.Conv1d | nn.Conv2d) -> tuple[int, int, int, int]:
    """Padding of ``conv`` as ``(left, right, top, bottom)``, resolving 'same' and 'valid'.

    A 1-D convolution pads the columns of its one-row 2-D view only.
    """
    return ConvGeometry.of(conv).padding


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


def _kept_and_dropped(
    size: int, out: int, offset: int, shift: int
) -> list[tuple[tuple[int, int], int]] | None:
    """Input indices ``u`` read by a kernel offset whose partner ``u + shift`` is in range.

    Offset ``offset`` reads ``u = t + offset`` for outputs ``t < out``; both ``u``
    and ``u + shift`` must lie in ``[0, size)``. The kept range is the widest
    range (every ``u`` whose partner is in range) minus at most one run of
    indices at each end: returned as ``[(widest, +1), (dropped run, -1), ...]``
    for inclusion-exclusion, or ``None`` when nothing is kept.
    """
    widest = (max(0, -shift), min(size, size - shift))
    lo, hi = max(offset, widest[0]), min(out + offset, widest[1])
    if hi <= lo:
        return None
    ranges = [(widest, 1)]
    if lo > widest[0]:
        ranges.append(((widest[0], lo), -1))
    if hi < widest[1]:
        ranges.append(((hi, widest[1]), -1))
    return ranges


class _ShiftPlan:
    """How the 'expand' ``PᵀP`` of one input size is assembled from shifted products.

    For unit stride and zero padding, the block of ``PᵀP`` that pairs kernel
    offsets ``k`` and ``j`` is ``Σ_u x[u] x[u + d]ᵀ`` (``C_in × C_in``, summed
    over samples) with ``d = o_j - o_k``, the difference of the offsets' input
    displacements, over the input positions ``u`` that offset ``k`` reads and
    whose partner ``u + d`` lies in the image. Blocks with the same ``d`` differ
    only by the border rows and columns that one offset never reads. So every
    block is ``S(d)`` (the sum over all positions whose partner is in the
    image) minus sums over those border strips, by inclusion-exclusion over
    rows and columns; ``S(d)`` and the strips are shared by all blocks with
    the same ``d``, and ``S(-d) = S(d)ᵀ`` fills the lower blocks. A 3×3 kernel
    then needs 13 products of ``C_in`` columns instead of one product of
    ``9·C_in`` columns (81 blocks), plus border strips (one row or column
    wide for a 3×3 kernel with padding 1).

    ``terms`` lists the distinct products ``(dr, dc, r0, r1, c0, c1)``: the
    sum of ``x[r, c] x[r + dr, c + dc]ᵀ`` over rows ``[r0, r1)`` and columns
    ``[c0, c1)``; ``coefficients[b, t]`` (±1 or 0) combines them into the
    upper block ``b`` (``upper[b] = (k, j)``, ``k <= j``).
    """

    def __init__(
        self,
        h: int,
        w: int,
        kernel: tuple[int, int],
        dilation: tuple[int, int],
        padding: tuple[int, int, int, int],
    ) -> None:
        kh, kw = kernel
        dh, dw = dilation
        left, right, top, bottom = padding
        h_out = h + top + bottom - dh * (kh - 1)
        w_out = w + left + right - dw * (kw - 1)
        offsets = [(a * dh - top, b * dw - left) for a in range(kh) for b in range(kw)]
        self.offsets = offsets
        self.upper = [(k, j) for k in range(len(offsets)) for j in range(k, len(offsets))]
        self.upper_index = (
            torch.tensor([k for k, _ in self.upper]),
            torch.tensor([j for _, j in self.upper]),
        )
        self.positions = h_out * w_out
        index: dict[tuple[int, ...], int] = {}
        entries: list[tuple[int, int, int]] = []  # (block, term, sign)
        for b, (k, j) in enumerate(self.upper):
            dr, dc = offsets[j][0] - offsets[k][0], offsets[j][1] - offsets[k][1]
            rows = _kept_and_dropped(h, h_out, offsets[k][0], dr)
            cols = _kept_and_dropped(w, w_out, offsets[k][1], dc)
            if rows is None or cols is None:
                continue  # the two offsets never read a common pair of positions
            for (r0, r1), row_sign in rows:
                for (c0, c1), col_sign in cols:
                    term = (dr, dc, r0, r1, c0, c1)
                    t = index.setdefault(term, len(index))
                    entries.append((b, t, row_sign * col_sign))
        self.terms = list(index)
        # Terms over every position whose partner is in the image: one product
        # of the whole guarded buffer; the others are border strips.
        self.whole = [
            (r0, r1, c0, c1) == (max(0, -dr), min(h, h - dr), max(0, -dc), min(w, w - dc))
            for dr, dc, r0, r1, c0, c1 in self.terms
        ]
        coefficients = torch.zeros(len(self.upper), max(1, len(self.terms)))
        for b, t, sign in entries:
            coefficients[b, t] += sign
        self.coefficients = coefficients
        # Zero guard bands around every sample wide enough that a displacement
        # from a real position never wraps onto another real position of the
        # flattened (sample, row, column) order.
        self.guard = (-(-dh * (kh - 1) // 2), -(-dw * (kw - 1) // 2))
        self.max_shift = dh * (kh - 1) * (w + 2 * self.guard[1]) + dw * (kw - 1)
        self._on: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}

    def _on_device(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """:attr:`coefficients` in ``dtype`` and the upper blocks' indices, on ``device``."""
        key = (device, dtype)
        if key not in self._on:
            rows, cols = (i.to(device) for i in self.upper_index)
            strict = rows != cols
            self._on[key] = (
                self.coefficients.to(device=device, dtype=dtype),
                rows,
                cols,
                strict,
            )
        return self._on[key]

    def gram(self, x: torch.Tensor, dtype: torch.dtype, max_bytes: int) -> torch.Tensor:
        """``PᵀP`` of ``x`` (``(C_in·kh·kw)²`` in ``dtype``), products in ``x``'s dtype.

        The samples are taken in slices whose zero-guarded copy stays within
        ``max_bytes`` (at least one sample per slice).
        """
        n, c, h, w = x.shape
        gh, gw = self.guard
        per_sample = (h + 2 * gh) * (w + 2 * gw) * c * x.element_size()
        chunk = max(1, min(n, max_bytes // per_sample))
        totals: list[torch.Tensor] = []
        for start in range(0, n, chunk):
            products = self._products(x[start : start + chunk])
            if not totals:
                totals = [p.to(dtype) for p in products]
            else:
                for total, p in zip(totals, products, strict=True):
                    total.add_(p)
        return self._assemble(totals, c, x, dtype)

    def _products(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The products of :attr:`terms` for the samples of ``x``, in ``x``'s dtype."""
        n, c, h, w = x.shape
        gh, gw = self.guard
        hp, wp = h + 2 * gh, w + 2 * gw
        per_sample = hp * wp
        # One zero-guarded copy of the input, channels last, flattened to rows
        # of C_in: only the guard bands and the tail are zeroed.
        flat = x.new_empty(n * per_sample + self.max_shift + wp, c)
        grid = flat[: n * per_sample].view(n, hp, wp, c)
        grid[:, gh : gh + h, gw : gw + w] = x.permute(0, 2, 3, 1)
        for band in (grid[:, :gh], grid[:, gh + h :], grid[:, :, :gw], grid[:, :, gw + w :]):
            band.zero_()
        flat[n * per_sample :].zero_()
        products = []
        whole = n * per_sample
        for (dr, dc, r0, r1, c0, c1), whole_range in zip(self.terms, self.whole, strict=True):
            if whole_range:
                # Every position: the whole buffer against itself, shifted.
                shift = dr * wp + dc
                product = flat[:whole].t() @ flat[shift : shift + whole]
            else:
                # A border strip (rows [r0, r1), columns [c0, c1)): narrow, copied.
                base = grid[:, gh + r0 : gh + r1, gw + c0 : gw + c1]
                part = grid[:, gh + r0 + dr : gh + r1 + dr, gw + c0 + dc : gw + c1 + dc]
                product = torch.einsum("nhwc,nhwd->cd", base, part)
            products.append(product)
        return products

    def _assemble(
        self, products: list[torch.Tensor], c: int, like: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The blocks from the summed products, in the patch columns' order."""
        k = len(self.offsets)
        full = like.new_zeros(k, k, c, c, dtype=dtype)
        if products:
            coefficients, rows, cols, strict = self._on_device(like.device, dtype)
            stacked = torch.stack(products).reshape(len(products), c * c)
            blocks = (coefficients @ stacked).reshape(-1, c, c)
            full[rows, cols] = blocks
            # The lower blocks are the upper ones transposed (bit for bit).
            full[cols[strict], rows[strict]] = blocks[strict].transpose(1, 2)
        # Blocks (k, j) of (C_in, C_in) to the patch columns' (channel, ky, kx) order.
        return full.permute(2, 0, 3, 1).reshape(c * k, c * k)


class _ConvHandler(LayerHandler):
    """The 2-D algorithms of a ``groups == 1`` convolution, read off its :class:`ConvGeometry`.

    Every method takes the layer's own input and output-gradient shapes and
    first views them as a batch of 2-D maps ``(N, C, H, W)``
    (:meth:`_batched`); the subclasses say how.
    """

    kind = "kronecker (convolution)"

    module: nn.Conv1d | nn.Conv2d
    _module_type: ClassVar[type[nn.Conv1d] | type[nn.Conv2d]]

    def __init__(
        self,
        module: nn.Conv1d | nn.Conv2d,
        max_patch_bytes: int = DEFAULT_MAX_PATCH_BYTES,
        estimator: ConvEstimator = "expand",
        max_shift_bytes: int = DEFAULT_MAX_SHIFT_BYTES,
    ) -> None:
        name = type(self).__name__
        if not isinstance(module, self._module_type):
            raise TypeError(f"{name} needs an nn.{self._module_type.__name__}, got {module!r}")
        if module.groups != 1:
            raise ValueError(f"{name} supports groups=1 only, got groups={module.groups}")
        if estimator not in ("expand", "reduce"):
            raise ValueError(f"estimator must be 'expand' or 'reduce'; got {estimator!r}")
        super().__init__(module)
        self.estimator = estimator
        self.geometry = ConvGeometry.of(module)
        kh, kw = self.geometry.kernel
        self.a_size = self.geometry.columns + (1 if module.bias is not None else 0)
        self.g_size = self.geometry.out_channels
        self.max_patch_bytes = max_patch_bytes
        self.max_shift_bytes = max_shift_bytes
        self._padding = self.geometry.padding
        self._pad_mode = self.geometry.pad_mode
        # 'expand' from shifted products (see _ShiftPlan) needs unit stride and
        # zero padding; a 1x1 kernel has nothing to share. Plans by input size.
        self._shifted = (
            self.geometry.stride == (1, 1) and self._pad_mode == "constant" and kh * kw > 1
        )
        self._plans: dict[tuple[int, int], _ShiftPlan] = {}

    @abstractmethod
    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        """An input or output gradient ``t`` as a batch of 2-D maps ``(N, C, H, W)``.

        A ``(N, C, H, W)`` tensor is returned as it is, so the methods can pass
        their converted tensors to one another.
        """

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
        x = self._batched(x)
        kh, kw = self.geometry.kernel
        sh, sw = self.geometry.stride
        dh, dw = self.geometry.dilation
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
        x = self._batched(x)
        kh, kw = self.geometry.kernel
        sh, sw = self.geometry.stride
        dh, dw = self.geometry.dilation
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
        x = self._batched(x)
        n = x.shape[0]
        if self.estimator == "reduce":
            means, positions = self.patch_means(x)
            scale = 1.0 / positions**2
            out = gram_with_ones(means, out, scale) if self.has_bias else gram(means, out, scale)
            return out, n
        if self._shifted and self.geometry.in_channels >= SHIFTED_MIN_CHANNELS:
            return self.shifted_sum(x, out)
        return self.patch_sum(x, out)

    def patch_sum(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """'expand' ``āᵀā / T²`` and its row count ``n·T`` from the patch matrix.

        Any stride, padding mode and dilation; built a slice of samples at a
        time (``max_patch_bytes``). :meth:`a_sum` uses it where
        :meth:`shifted_sum` does not apply.
        """
        x = self._batched(x)
        chunk = self._samples_per_slice(x)
        rows = 0
        for start in range(0, x.shape[0], chunk):
            p, positions = self.patches(x[start : start + chunk])
            scale = 1.0 / positions**2
            out = gram_with_ones(p, out, scale) if self.has_bias else gram(p, out, scale)
            rows += p.shape[0]
        assert out is not None
        return out, rows

    def _plan(self, x: torch.Tensor) -> _ShiftPlan:
        size = (x.shape[-2], x.shape[-1])
        plan = self._plans.get(size)
        if plan is None:
            geometry = self.geometry
            plan = _ShiftPlan(*size, geometry.kernel, geometry.dilation, self._padding)
            self._plans[size] = plan
        return plan

    def shifted_sum(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """'expand' ``āᵀā / T²`` and its row count ``n·T`` from shifted products.

        The same sum as :meth:`patch_sum`'s without building the patch matrix
        (see :class:`_ShiftPlan`); its one temporary is a zero-guarded copy of
        the input, a slice of samples at a time (``max_shift_bytes``). With a
        bias, the last row and column are the patch sums (``T`` times the
        :meth:`patch_means` summed over samples) and the corner is ``n·T``.
        Unit stride and zero padding only (``ValueError`` otherwise).
        """
        if not self._shifted:
            raise ValueError(
                "shifted_sum needs stride 1, padding_mode='zeros' and a kernel larger than "
                f"1x1; got {self.module!r} (use patch_sum)"
            )
        x = self._batched(x)
        plan = self._plan(x)
        dtype = accumulator_dtype(x)
        scale = 1.0 / plan.positions**2
        ptp = plan.gram(x, dtype, self.max_shift_bytes)
        d = ptp.shape[0]
        if out is None:
            out = x.new_zeros(self.a_size, self.a_size, dtype=dtype)
        out[:d, :d].add_(ptp, alpha=scale)
        if self.has_bias:
            means, positions = self.patch_means(x)
            sums = means.sum(dim=0, dtype=out.dtype).mul_(positions)
            add_ones_border(out, sums, x.shape[0] * positions, scale)
        return out, x.shape[0] * plan.positions

    def g_sum(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        grad_output = self._batched(grad_output)
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

    def capture_work(self, which: str, capture: str, rows: float) -> float:
        """As :meth:`LayerHandler.capture_work`, for this layer's estimator.

        'expand' with shifted products (unit stride, zero padding, at least
        ``SHIFTED_MIN_CHANNELS`` input channels) needs about
        ``((2kh − 1)(2kw − 1) + 1) / 2`` products of ``C_in`` columns per row
        (13 for 3×3, ``k`` for a 1-D kernel of ``k``) instead of one of
        ``kh·kw·C_in``; 'reduce' has one gram row per sample (its ``rows`` are
        already per sample).
        """
        if which == "a" and capture == "gram" and self.estimator == "expand":
            c_in = self.geometry.in_channels
            if self._shifted and c_in >= SHIFTED_MIN_CHANNELS:
                kh, kw = self.geometry.kernel
                products = ((2 * kh - 1) * (2 * kw - 1) + 1) / 2
                return rows * (products * c_in**2 + 2.0 * self.a_size)
        return super().capture_work(which, capture, rows)

    def a_moments(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """``[Σ ā; Σ ā²]`` over the ``n·T`` rows ``ā = [p | 1] / T`` (spec §3), for any estimator.

        From :meth:`patch_means` of ``x`` and of ``x²`` (padding copies values
        or adds zeros, so the patches of ``x²`` are the squared patches of
        ``x``); the patch matrix is never built.
        """
        x = self._batched(x)
        x = x.to(accumulator_dtype(x))
        n = x.shape[0]
        means, positions = self.patch_means(x)  # Σ_T p / T per sample
        squares, _ = self.patch_means(x * x)  # Σ_T p² / T per sample
        d = means.shape[1]
        if out is None:
            out = x.new_zeros(2, self.a_size)
        out[0, :d].add_(means.sum(dim=0))
        out[1, :d].add_(squares.sum(dim=0), alpha=1.0 / positions)
        if self.has_bias:  # n·T rows whose ones entry is 1/T
            out[0, d].add_(n)
            out[1, d].add_(n / positions)
        return out, n * positions

    def g_moments(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """``[Σ δ; Σ δ²]`` over the ``n·T`` rows ``δ / T`` (spec §3), for any estimator."""
        grad_output = self._batched(grad_output)
        n, c, h, w = grad_output.shape
        positions = h * w
        rows = grad_output.to(accumulator_dtype(grad_output))
        if out is None:
            out = rows.new_zeros(2, c)
        out[0].add_(rows.sum(dim=(0, 2, 3)), alpha=1.0 / positions)
        out[1].add_(rows.square().sum(dim=(0, 2, 3)), alpha=1.0 / positions**2)
        return out, n * positions

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
        """Samples per slice of the patch matrix of a ``(N, C, H, W)`` input.

        At most ``max_patch_bytes`` of patches, but at least one sample and at
        least ``C_in·kh·kw`` rows, so that each product does more work than
        re-reading the ``(C_in·kh·kw)²`` accumulator it adds into.
        """
        h_out, w_out = self.geometry.output_size(x.shape[-2], x.shape[-1])
        positions = max(1, h_out * w_out)
        columns = self.geometry.columns
        by_bytes = self.max_patch_bytes // (positions * columns * x.element_size())
        by_rows = -(-columns // positions)
        return max(1, min(x.shape[0], max(by_bytes, by_rows)))


class Conv2dHandler(_ConvHandler):
    """A ``groups == 1`` 2-D convolution with any stride, padding mode and dilation.

    Inputs ``(N, C_in, H, W)`` or ``(C_in, H, W)``, output gradients likewise.
    """

    module: nn.Conv2d
    _module_type = nn.Conv2d

    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0) if t.dim() == 3 else t


class Conv1dHandler(_ConvHandler):
    """A ``groups == 1`` 1-D convolution with any stride, padding mode and dilation.

    Computed as the 2-D convolution of the input viewed as one row (see
    :class:`ConvGeometry`): inputs ``(N, C_in, L)`` or ``(C_in, L)`` become
    ``(N, C_in, 1, L)``, output gradients ``(N, C_out, L_out)`` become
    ``(N, C_out, 1, L_out)`` (views, not copies), and every factor equals
    :class:`Conv2dHandler`'s on the equivalent ``nn.Conv2d``. The patch columns
    are ordered (channel, kernel offset), as the weight ``(C_out, C_in, k)``
    flattens in :meth:`grad_matrix`. The methods also take the one-row view
    ``(N, C, 1, L)`` itself.
    """

    module: nn.Conv1d
    _module_type = nn.Conv1d

    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4:
            if t.shape[2] != 1:
                raise ValueError(
                    f"Conv1dHandler takes (N, C, L), (C, L) or (N, C, 1, L); got {tuple(t.shape)}"
                )
            return t
        if t.dim() == 2:
            t = t.unsqueeze(0)
        if t.dim() != 3:
            raise ValueError(
                f"Conv1dHandler takes (N, C, L), (C, L) or (N, C, 1, L); got {tuple(t.shape)}"
            )
        return t.unsqueeze(2)


def conv1d_handler(
    module: nn.Module, conv_estimator: ConvEstimator = "expand", **_: object
) -> Conv1dHandler | None:
    """Handler factory for ``nn.Conv1d`` (``register_handler(nn.Conv1d, conv1d_handler)``).

    ``None`` (skip the module) for a grouped convolution, as for ``nn.Conv2d``.
    """
    assert isinstance(module, nn.Conv1d)
    if module.groups != 1:
        return None
    return Conv1dHandler(module, estimator=conv_estimator)
