"""'expand' ``PᵀP`` from shifted products of the input (private to :mod:`kaisa.layers.conv`).

For unit stride and zero padding (the common case), ``PᵀP`` is assembled
from shifted products of the input itself and the patch matrix ``P`` is never
built: the block pairing two kernel offsets is the sum of ``x[u] x[u + d]ᵀ``
over input positions, which blocks with the same displacement ``d`` share up
to narrow border strips (:class:`ShiftPlan`). A 3×3 kernel then costs 13
products with ``C_in`` columns instead of one with ``9·C_in`` (what that saves
on GapCNN's convolutions: ``benchmarks/conv_expand.py``,
``benchmarks/README.md``).
"""

from __future__ import annotations

import torch

from kaisa.layers._conv_geometry import ConvGeometry
from kaisa.layers._conv_patches import patch_means
from kaisa.layers.base import accumulator_dtype, add_ones_border


def covers(geometry: ConvGeometry) -> bool:
    """Whether shifted products apply: unit stride, zero padding, a kernel larger than 1×1.

    (A 1×1 kernel has nothing to share.)
    """
    kh, kw = geometry.kernel
    return geometry.stride == (1, 1) and geometry.pad_mode == "constant" and kh * kw > 1


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


class ShiftPlan:
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

    def __init__(self, geometry: ConvGeometry, h: int, w: int) -> None:
        kh, kw = geometry.kernel
        dh, dw = geometry.dilation
        left, _, top, _ = geometry.padding
        h_out, w_out = geometry.output_size(h, w)
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


class ShiftedProducts:
    """'expand' ``āᵀā / T²`` of one convolution from shifted products, with a plan per input size.

    Only for a geometry that :func:`covers`.
    """

    def __init__(self, geometry: ConvGeometry) -> None:
        assert covers(geometry)
        self.geometry = geometry
        self._plans: dict[tuple[int, int], ShiftPlan] = {}

    def plan(self, h: int, w: int) -> ShiftPlan:
        """The (cached) plan for ``h × w`` inputs."""
        plan = self._plans.get((h, w))
        if plan is None:
            plan = self._plans[(h, w)] = ShiftPlan(self.geometry, h, w)
        return plan

    def gram(
        self, x: torch.Tensor, out: torch.Tensor | None, *, bias: bool, max_bytes: int
    ) -> tuple[torch.Tensor, int]:
        """'expand' ``āᵀā / T²`` of ``x`` (added into ``out``) and its row count ``n·T``.

        The same sum as :func:`kaisa.layers._conv_patches.patch_gram`'s
        without building the patch matrix; its one temporary is a zero-guarded
        copy of the input, a slice of samples at a time (``max_bytes``). With
        ``bias``, the last row and column are the patch sums (``T`` times the
        patch means summed over samples) and the corner is ``n·T``.
        """
        plan = self.plan(x.shape[-2], x.shape[-1])
        dtype = accumulator_dtype(x)
        scale = 1.0 / plan.positions**2
        ptp = plan.gram(x, dtype, max_bytes)
        d = ptp.shape[0]
        if out is None:
            size = d + 1 if bias else d
            out = x.new_zeros(size, size, dtype=dtype)
        out[:d, :d].add_(ptp, alpha=scale)
        if bias:
            means, positions = patch_means(x, self.geometry)
            sums = means.sum(dim=0, dtype=out.dtype).mul_(positions)
            add_ones_border(out, sums, x.shape[0] * positions, scale)
        return out, x.shape[0] * plan.positions
