"""``nn.Conv2d`` and ``nn.Conv1d``: factors from im2col patches (spec §3, Conv2d).

With ``P`` the ``(N·T, C_in·kh·kw)`` patch matrix (``T = H_out·W_out``),
``ā = [P | 1] / T`` and ``A_batch = āᵀā / (N·T)``; ``δ`` is reshaped to
``(N·T, C_out)`` and divided by ``T``, ``G_batch = δᵀδ / (N·T)``.
``nn.Conv1d`` (:class:`Conv1dHandler`) is the same computation on
its input viewed as one row of pixels, ``(N, C_in, 1, L)``, with a ``(1, k)``
kernel, so everything below holds for it with ``kh = 1``.

The kernel, stride, dilation, padding and output size of a layer are read
once, into its :class:`ConvGeometry`; the algorithms take them from there.
The default estimator ('expand', :class:`Conv2dHandler`,
:class:`Conv1dHandler`) computes ``PᵀP`` one of two ways:

- shifted products of the input, where they apply (unit stride, zero
  padding, a kernel larger than 1×1) and from ``SHIFTED_MIN_CHANNELS`` input
  channels on (:mod:`kaisa.layers._conv_shifted`);
- otherwise the patch matrix, a bounded slice of the batch at a time
  (:mod:`kaisa.layers._conv_patches`).

``δᵀδ`` of an output gradient with more positions than channels is summed over
samples with one batched product over the ``(C_out, T)`` sample blocks, which
avoids copying ``δ`` into row-major order.

``estimator='reduce'`` (:class:`Conv2dReduceHandler`,
:class:`Conv1dReduceHandler`) is the cheaper estimator (KFAC-reduce,
Eschenhagen et al., 2023): the rows of one sample are averaged over the ``T``
output positions *before* the outer product, ``ā_n = mean_t ā_nt`` and
``δ̄_n = mean_t δ_nt / T``, giving ``A = Σ_n ā_n ā_nᵀ / N`` and
``G = Σ_n δ̄_n δ̄_nᵀ / N``. When a sample's rows do not vary over positions it
equals the default ('expand'), so damping values carry over; it costs ``N``
rows instead of ``N·T`` and never builds the patch matrix (the position means
of the patches are two small products with 0/1 selection matrices).

**Grouped convolutions** (``groups = g > 1``: ResNeXt, RegNet, and the
depthwise convolutions of MobileNet, EfficientNet, ConvNeXt;
:class:`GroupedConv2dHandler`, :class:`GroupedConv1dHandler`). Group ``j``
maps its ``C_in / g`` input channels to its ``C_out / g`` outputs with its own
weight rows, so its Fisher block is ``G_j ⊗ A_j`` and the layer's is
block-diagonal over the groups. kaisa holds ``G`` as the ``C_out × C_out``
block-diagonal matrix of the ``G_j`` (the output gradient's gram with the
products across groups left out), and one ``A`` for every group: the mean
``Ā = mean_j A_j`` of the groups' patch factors, each group's patches rows of
one ``(C_in / g)·kh·kw``-column patch matrix. The solve
``G⁻¹ ∇ Ā⁻¹`` of the ``(C_out, (C_in / g)·kh·kw)`` weight matrix then
preconditions each group's rows by ``G_j⁻¹ · Ā⁻¹``: exactly K-FAC per group
where the groups' inputs have the same second moments, and otherwise
``A_j`` shared as K-FAC shares it over positions. A depthwise ``3 × 3``
convolution of ``C`` channels is a ``10 × 10`` ``Ā`` (with its bias) and a
diagonal ``G``, which it holds as its diagonal unless told otherwise.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Literal, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from kaisa.choices import CONV_ESTIMATORS
from kaisa.engines.base import is_dtensor
from kaisa.layers import _conv_patches as patches
from kaisa.layers._conv_geometry import ConvGeometry
from kaisa.layers._conv_shifted import ShiftedProducts, covers
from kaisa.layers.base import (
    LayerHandler,
    accumulator_dtype,
    draw_rows,
    gram,
    gram_with_ones,
    probe_refusal,
)
from kaisa.validation import one_of

__all__ = [
    "DEFAULT_MAX_PATCH_BYTES",
    "DEFAULT_MAX_SHIFT_BYTES",
    "SHIFTED_MIN_CHANNELS",
    "Conv1dHandler",
    "Conv1dReduceHandler",
    "Conv2dHandler",
    "Conv2dReduceHandler",
    "ConvEstimator",
    "ConvGeometry",
    "GroupedConv1dHandler",
    "GroupedConv1dReduceHandler",
    "GroupedConv2dHandler",
    "GroupedConv2dReduceHandler",
    "conv1d_handler",
    "conv2d_handler",
    "same_conv2d_handler",
    "same_conv2d_refusal",
]

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
#: one product) costs less. The timings behind the threshold
#: (``benchmarks/conv_expand.py``): ``benchmarks/README.md``, and the dated run
#: in ``benchmarks/LOG.md``.
SHIFTED_MIN_CHANNELS = 12

_Handler = TypeVar("_Handler", bound="_ConvHandler")


class _ConvHandler(LayerHandler):
    """A convolution read off its :class:`ConvGeometry`; 'expand' factors.

    Every method takes the layer's own input and output-gradient shapes and
    first views them as a batch of 2-D maps ``(N, C, H, W)``
    (:meth:`_batched`); the subclasses say how. The ``A`` side's methods take
    the input as :meth:`_a_batched` views it (a grouped convolution's groups
    as samples). The 'reduce' subclasses (:class:`_ReduceEstimator`) replace
    the factor sums; the grouped ones (:class:`_Grouped`) take ``groups > 1``.

    ``estimator='reduce'`` given to an 'expand' class constructs its 'reduce'
    variant instead (``Conv2dHandler(conv, estimator='reduce')`` is a
    :class:`Conv2dReduceHandler`); ``None`` means the class's own.
    """

    kind = "kronecker (convolution)"
    #: The estimator of this class's factor sums.
    estimator: ClassVar[ConvEstimator] = "expand"

    module: nn.Conv1d | nn.Conv2d
    _module_type: ClassVar[type[nn.Conv1d] | type[nn.Conv2d]]
    #: Whether this class takes ``groups > 1``.
    _grouped: ClassVar[bool] = False

    def __new__(
        cls: type[_Handler],
        module: nn.Conv1d | nn.Conv2d | None = None,
        max_patch_bytes: int = DEFAULT_MAX_PATCH_BYTES,
        estimator: ConvEstimator | None = None,
        max_shift_bytes: int = DEFAULT_MAX_SHIFT_BYTES,
        *,
        same_padding: bool = False,
    ) -> _Handler:
        # Any case, as __init__'s check (one_of) accepts; a bad value is refused there.
        wants_reduce = isinstance(estimator, str) and estimator.lower() == "reduce"
        if wants_reduce and cls.estimator != "reduce":
            variant = _REDUCE_VARIANTS.get(cls)
            if variant is None:
                raise TypeError(
                    f"{cls.__name__} has no 'reduce' variant; derive from one of "
                    f"{sorted(c.__name__ for c in _REDUCE_VARIANTS.values())}"
                )
            return cast(_Handler, super().__new__(variant))
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Conv1d | nn.Conv2d,
        max_patch_bytes: int = DEFAULT_MAX_PATCH_BYTES,
        estimator: ConvEstimator | None = None,
        max_shift_bytes: int = DEFAULT_MAX_SHIFT_BYTES,
        *,
        same_padding: bool = False,
    ) -> None:
        name = type(self).__name__
        if not isinstance(module, self._module_type):
            raise TypeError(f"{name} needs an nn.{self._module_type.__name__}, got {module!r}")
        if module.groups != 1 and not self._grouped:
            raise ValueError(
                f"{name} supports groups=1 only, got groups={module.groups} "
                f"(use Grouped{name} or conv{'1' if name.startswith('Conv1d') else '2'}d_handler)"
            )
        if (
            estimator is not None
            and one_of("estimator", estimator, CONV_ESTIMATORS) != self.estimator
        ):
            raise ValueError(f"{name} is the {self.estimator!r} estimator; got {estimator!r}")
        super().__init__(module)
        self.geometry = ConvGeometry.of(module, same=same_padding)
        if module.groups > 1 and module.out_channels == module.groups:
            # One output a group (depthwise): G is diagonal, held as its diagonal.
            self.default_sides = (None, "diagonal")
        self.a_size = self.geometry.columns + (1 if module.bias is not None else 0)
        self.g_size = self.geometry.out_channels
        self.max_patch_bytes = max_patch_bytes
        self.max_shift_bytes = max_shift_bytes
        self._shifted = ShiftedProducts(self.geometry) if covers(self.geometry) else None
        #: Whether 'expand' ``a_sum`` takes the shifted products (else the patch matrix).
        self._prefers_shifted = (
            self._shifted is not None and self.geometry.in_channels >= SHIFTED_MIN_CHANNELS
        )

    @abstractmethod
    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        """An input or output gradient ``t`` as a batch of 2-D maps ``(N, C, H, W)``.

        A ``(N, C, H, W)`` tensor is returned as it is, so the methods can pass
        their converted tensors to one another.
        """

    def _a_batched(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the ``A`` side's sums take it: :meth:`_batched`, padded first where
        the layer pads each input (``same_padding``; see :class:`_Grouped` too)."""
        return self.geometry.pad_same(self._batched(x))

    def sample_rows(
        self, which: str, t: torch.Tensor, keep: float, generator: torch.Generator
    ) -> torch.Tensor:
        """Whole examples: a ``keep`` share of the batch, every position of each."""
        batched = self._batched(t)
        chosen = draw_rows(batched.shape[0], keep, generator, batched.device)
        return batched if chosen is None else batched.index_select(0, chosen)

    def probe_input(self, generator: torch.Generator) -> tuple[torch.Tensor, ...] | None:
        """One sample whose output has one position (one row), or ``None`` if padding forbids it.

        The smallest input size with a ``1 × 1`` output (the registration
        check of :mod:`kaisa.layers.probe` needs a single row); with more
        padding than the kernel spans (or reflecting padding of a kernel
        larger than 1) every input has several output positions: ``None``.
        """
        g = self.geometry
        sizes = []
        for dim in (0, 1):
            if g.same:  # ⌈1 / s⌉ = 1 output position along every axis
                sizes.append(1)
                continue
            reach = g.dilation[dim] * (g.kernel[dim] - 1) + g.stride[dim] + 1
            # F.pad's non-zero modes need more input than padding.
            least = 1 if g.pad_mode == "constant" else max(g.padding[2 - 2 * dim :][:2]) + 1
            fits = [
                n
                for n in range(least, reach + 1)
                if g.output_size(*((n, 1) if dim == 0 else (1, n)))[dim] == 1
            ]
            if not fits:
                return None
            sizes.append(fits[0])
        shape = (1, self.module.in_channels, *sizes)
        x = torch.randn(shape, generator=generator, dtype=torch.float64).to(self.weight)
        return (x.squeeze(2) if isinstance(self.module, nn.Conv1d) else x,)

    def patch_means(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Per-sample means of the patch rows (``(n, C_in·kh·kw)``) and ``T``.

        Two small products with 0/1 selection matrices; the patch matrix
        itself is never built (see :func:`kaisa.layers._conv_patches.patch_means`).
        """
        return patches.patch_means(self._a_batched(x), self.geometry)

    def a_sum(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        if self._prefers_shifted:
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
        return patches.patch_gram(
            self._a_batched(x),
            self.geometry,
            out,
            bias=self.has_bias,
            max_bytes=self.max_patch_bytes,
        )

    def shifted_sum(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """'expand' ``āᵀā / T²`` and its row count ``n·T`` from shifted products.

        The same sum as :meth:`patch_sum`'s without building the patch matrix
        (see :class:`kaisa.layers._conv_shifted.ShiftPlan`); its one temporary
        is a zero-guarded copy of the input, a slice of samples at a time
        (``max_shift_bytes``). Unit stride and zero padding only
        (``ValueError`` otherwise).
        """
        if self._shifted is None:
            raise ValueError(
                "shifted_sum needs stride 1, padding_mode='zeros' and a kernel larger than "
                f"1x1; got {self.module!r} (use patch_sum)"
            )
        return self._shifted.gram(
            self._a_batched(x), out, bias=self.has_bias, max_bytes=self.max_shift_bytes
        )

    def g_sum(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        grad_output = self._batched(grad_output)
        n, c, h, w = grad_output.shape
        positions = h * w
        scale = 1.0 / positions**2
        if positions >= c and grad_output.is_contiguous():
            blocks = grad_output.reshape(n, c, positions)
            total = _sample_block_gram(blocks, out, scale, self.max_patch_bytes)
        else:
            rows = grad_output.permute(0, 2, 3, 1).reshape(n * positions, c)
            total = gram(rows, out, scale)
        return self._g_kept(total), n * positions

    def _g_kept(self, total: torch.Tensor) -> torch.Tensor:
        """The ``G`` sum as the layer holds it (all of it; grouped: :class:`_Grouped`)."""
        return total

    def capture_work(self, which: str, capture: str, rows: float) -> float:
        """As :meth:`LayerHandler.capture_work`, for the 'expand' products.

        With shifted products (unit stride, zero padding, at least
        ``SHIFTED_MIN_CHANNELS`` input channels) 'expand' needs about
        ``((2kh − 1)(2kw − 1) + 1) / 2`` products of ``C_in`` columns per row
        (13 for 3×3, ``k`` for a 1-D kernel of ``k``) instead of one of
        ``kh·kw·C_in``.
        """
        if which == "a" and capture == "gram" and self._prefers_shifted:
            c_in = self.geometry.in_channels
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
        means, positions = self.patch_means(x)  # Σ_T p / T per sample (per group's sample)
        squares, _ = self.patch_means(x * x)  # Σ_T p² / T per sample
        n = means.shape[0]
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
    blocks: torch.Tensor, out: torch.Tensor | None, scale: float, max_bytes: int
) -> torch.Tensor:
    """``scale · Σ_n B_n B_nᵀ`` of ``(n, c, T)`` blocks, accumulated into ``out``.

    Equals ``scale · RᵀR`` for ``R``, the ``(n·T, c)`` rows of the blocks,
    without copying them into that order: one batched product per slice of
    samples (bounded by ``max_bytes`` of ``(c, c)`` products), summed in at
    least float32.
    """
    n, c, _ = blocks.shape
    per_sample = c * c * blocks.element_size()
    chunk = max(1, min(n, max_bytes // per_sample))
    for start in range(0, n, chunk):
        part = blocks[start : start + chunk]
        products = torch.bmm(part, part.transpose(1, 2))
        total = products.sum(dim=0, dtype=torch.promote_types(blocks.dtype, torch.float32))
        out = total.mul_(scale) if out is None else out.add_(total, alpha=scale)
    assert out is not None
    return out


class _ReduceEstimator(_ConvHandler):
    """The 'reduce' factor sums: one row per sample, its patches averaged over positions."""

    estimator: ClassVar[ConvEstimator] = "reduce"

    def a_sum(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        means, positions = self.patch_means(x)
        scale = 1.0 / positions**2
        out = gram_with_ones(means, out, scale) if self.has_bias else gram(means, out, scale)
        return out, means.shape[0]

    def g_sum(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        grad_output = self._batched(grad_output)
        n, _, h, w = grad_output.shape
        return self._g_kept(gram(grad_output.mean(dim=(2, 3)), out, 1.0 / (h * w) ** 2)), n

    def capture_work(self, which: str, capture: str, rows: float) -> float:
        """Plain products (:meth:`LayerHandler.capture_work`): ``rows`` are already per sample."""
        return LayerHandler.capture_work(self, which, capture, rows)


class Conv2dHandler(_ConvHandler):
    """A ``groups == 1`` 2-D convolution with any stride, padding mode and dilation
    (:class:`GroupedConv2dHandler` for ``groups > 1``).

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


class Conv2dReduceHandler(_ReduceEstimator, Conv2dHandler):
    """:class:`Conv2dHandler` with the 'reduce' estimator."""


class Conv1dReduceHandler(_ReduceEstimator, Conv1dHandler):
    """:class:`Conv1dHandler` with the 'reduce' estimator."""


class _Grouped(_ConvHandler):
    """A grouped convolution (see the module's docstring): one ``Ā`` over the groups,
    ``G`` block-diagonal by group.

    The ``A`` side's sums take the input's groups as samples,
    ``(N, C_in, H, W) → (N·g, C_in / g, H, W)``, so their rows are every
    group's patches and their row count ``N·g·T`` (a mean over groups); the
    ``G`` side's gram leaves out the products of outputs of different groups.
    """

    kind = "kronecker (grouped convolution)"
    _grouped = True

    def _a_batched(self, x: torch.Tensor) -> torch.Tensor:
        x = super()._a_batched(x)
        n, c, h, w = x.shape
        groups = self.module.groups
        return x if groups == 1 else x.reshape(n * groups, c // groups, h, w)

    def _group_mask(self, out: torch.Tensor) -> torch.Tensor:
        """``(C_out, C_out)``: 1 where two outputs share a group, else 0."""
        groups, c = self.module.groups, self.g_size
        mask = getattr(self, "_mask", None)
        if mask is None or mask.device != out.device or mask.dtype != out.dtype:
            group = torch.arange(c, device=out.device) // (c // groups)
            mask = (group[:, None] == group[None, :]).to(out.dtype)
            self._mask = mask
        return mask

    def _g_kept(self, total: torch.Tensor) -> torch.Tensor:
        return total.mul_(self._group_mask(total)) if self.module.groups > 1 else total

    def training_work(self, rows: float) -> float:
        """As :meth:`LayerHandler.training_work`, with ``rows`` the ``A`` side's (``N·g·T``)."""
        return super().training_work(rows / self.module.groups)


class GroupedConv2dHandler(_Grouped, Conv2dHandler):
    """A grouped 2-D convolution (``groups ≥ 1``; depthwise included), 'expand' factors."""


class GroupedConv1dHandler(_Grouped, Conv1dHandler):
    """A grouped 1-D convolution (``groups ≥ 1``; depthwise included), 'expand' factors."""


class GroupedConv2dReduceHandler(_ReduceEstimator, GroupedConv2dHandler):
    """:class:`GroupedConv2dHandler` with the 'reduce' estimator."""


class GroupedConv1dReduceHandler(_ReduceEstimator, GroupedConv1dHandler):
    """:class:`GroupedConv1dHandler` with the 'reduce' estimator."""


#: The 'reduce' class of each 'expand' class.
_REDUCE_VARIANTS: dict[type[_ConvHandler], type[_ConvHandler]] = {
    Conv2dHandler: Conv2dReduceHandler,
    Conv1dHandler: Conv1dReduceHandler,
    GroupedConv2dHandler: GroupedConv2dReduceHandler,
    GroupedConv1dHandler: GroupedConv1dReduceHandler,
}


def conv2d_handler(
    module: nn.Module, conv_estimator: ConvEstimator = "expand", **_: object
) -> Conv2dHandler:
    """Handler factory for ``nn.Conv2d`` (``register_handler(nn.Conv2d, conv2d_handler)``).

    A :class:`Conv2dHandler` or :class:`Conv2dReduceHandler` by
    ``conv_estimator``; their grouped classes for ``groups > 1``.
    """
    assert isinstance(module, nn.Conv2d)
    if module.groups > 1:
        return GroupedConv2dHandler(module, estimator=conv_estimator)
    return Conv2dHandler(module, estimator=conv_estimator)


def conv1d_handler(
    module: nn.Module, conv_estimator: ConvEstimator = "expand", **_: object
) -> Conv1dHandler:
    """Handler factory for ``nn.Conv1d`` (``register_handler(nn.Conv1d, conv1d_handler)``).

    As :func:`conv2d_handler`: a :class:`Conv1dHandler` or
    :class:`Conv1dReduceHandler`, their grouped classes for ``groups > 1``.
    """
    assert isinstance(module, nn.Conv1d)
    if module.groups > 1:
        return GroupedConv1dHandler(module, estimator=conv_estimator)
    return Conv1dHandler(module, estimator=conv_estimator)


def same_conv2d_refusal(module: nn.Module) -> str | None:
    """Why ``module`` is not taken for a 2-D convolution padded as TensorFlow's ``'SAME'``
    for each input (``None``: it is).

    It must be an ``nn.Conv2d`` without padding of its own whose ``forward``,
    called directly (no hooks, no gradients) on a probe input whose ``'SAME'``
    padding is uneven, gives ``F.conv2d`` of that input padded as
    :meth:`ConvGeometry.same_padding` says. A weight on the meta device or
    sharded is taken on its class's name.
    """
    if not isinstance(module, nn.Conv2d):
        return f"{type(module).__name__} is not an nn.Conv2d"
    try:
        geometry = ConvGeometry.of(module, same=True)
    except ValueError as err:
        return str(err)
    weight = module.weight
    if weight.is_meta or is_dtensor(weight):
        return None
    # s·(k−1)·d + 2 inputs along each axis: several outputs, and padding (uneven
    # for a stride of 2) wherever the kernel reaches past the stride.
    sizes = [
        s * (k - 1) * d + 2
        for k, s, d in zip(geometry.kernel, geometry.stride, geometry.dilation, strict=True)
    ]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, module.in_channels, *sizes, generator=gen, dtype=torch.float64)
    x = x.to(device=weight.device, dtype=weight.dtype)
    return probe_refusal(
        module,
        x,
        lambda t: F.conv2d(
            geometry.pad_same(t),
            weight,
            module.bias,
            module.stride,
            0,
            module.dilation,
            module.groups,
        ),
        "the convolution of its input padded as TensorFlow's 'SAME'",
    )


def same_conv2d_handler(
    module: nn.Module, conv_estimator: ConvEstimator = "expand", **_: object
) -> Conv2dHandler | None:
    """Handler factory for a convolution that pads each input as TensorFlow's ``'SAME'``
    (timm's ``Conv2dSame``, in its ``tf_*`` models: the padding depends on the input's
    size, uneven where it is odd). As :func:`conv2d_handler`, with ``same_padding``;
    ``None`` (left raw, with :func:`same_conv2d_refusal`'s reason) when the module does
    not compute that convolution.
    """
    if same_conv2d_refusal(module) is not None:
        return None
    assert isinstance(module, nn.Conv2d)
    cls = GroupedConv2dHandler if module.groups > 1 else Conv2dHandler
    return cls(module, estimator=conv_estimator, same_padding=True)
