"""Convolutions padded as TensorFlow's 'SAME' for each input (timm's ``Conv2dSame``).

timm's ``tf_*`` models pad each strided convolution's input by how large it
is, unevenly where it is odd (the odd row and column after), then convolve
without padding. kaisa takes that class (by module and class name, after a
probe input shows it computes that) as the convolution of its padded input:
its factor sums must equal those of an ``nn.Conv2d`` without padding on the
input padded by hand, on every path (the patch matrix, shifted products,
'reduce', grouped and depthwise), and a model of them must take the steps of
the same model written as ``nn.ZeroPad2d`` + ``nn.Conv2d`` (float64). One
that computes something else is left raw with the reason.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.layers import registry
from kaisa.layers._conv_geometry import ConvGeometry
from kaisa.layers.conv import (
    Conv2dHandler,
    GroupedConv2dHandler,
    same_conv2d_handler,
    same_conv2d_refusal,
)
from kaisa.layers.probe import check_factory


def tf_same_pads(n: int, k: int, s: int, d: int) -> tuple[int, int]:
    """TensorFlow's 'SAME' padding along one axis of ``n``: (before, after)."""
    out = math.ceil(n / s)
    total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
    return total // 2, total - total // 2


class Conv2dSame(nn.Conv2d):
    """timm's ``timm.layers.conv2d_same.Conv2dSame`` as it computes (timm is not
    installable beside the pinned torch: it needs torchvision)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["padding"] = 0
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        top, bottom = tf_same_pads(x.shape[-2], kh, sh, dh)
        left, right = tf_same_pads(x.shape[-1], kw, sw, dw)
        x = F.pad(x, (left, right, top, bottom))
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


Conv2dSame.__module__ = "timm.layers.conv2d_same"
Conv2dSame.__qualname__ = "Conv2dSame"


class SymmetricSame(Conv2dSame):
    """Named like timm's class, but padding one on every side: not 'SAME' for stride 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, 1, self.dilation, self.groups)


SymmetricSame.__module__ = "timm.layers.conv2d_same"
SymmetricSame.__qualname__ = "Conv2dSame"


@pytest.mark.parametrize("n", range(1, 12))
@pytest.mark.parametrize(("k", "s", "d"), [(3, 2, 1), (5, 2, 1), (3, 1, 2), (4, 1, 1), (1, 2, 1)])
def test_the_padding_is_tensorflows_same(n: int, k: int, s: int, d: int) -> None:
    """⌈n / s⌉ outputs along each axis, the padding TensorFlow's rule gives, odd one after."""
    conv = nn.Conv2d(2, 3, k, stride=s, dilation=d)
    geometry = ConvGeometry.of(conv, same=True)
    assert geometry.same_padding(n, n + 1) == (
        *tf_same_pads(n + 1, k, s, d),
        *tf_same_pads(n, k, s, d),
    )
    x = torch.randn(1, 2, n, n + 1)
    out = conv(geometry.pad_same(x))
    assert out.shape[-2:] == (math.ceil(n / s), math.ceil((n + 1) / s))
    assert ConvGeometry.of(conv).pad_same(x) is x  # not a 'SAME' convolution: as it is


def test_hand_values() -> None:
    """Five inputs, kernel 3, stride 2: one each side; six: the one after."""
    geometry = ConvGeometry.of(nn.Conv2d(1, 1, 3, stride=2), same=True)
    assert geometry.same_padding(5, 6) == (0, 1, 1, 1)


#: (C_in, C_out, groups, kernel, stride, dilation, bias, input size)
CASES = [
    (3, 5, 1, 3, 2, 1, True, (9, 10)),  # the patch matrix
    (12, 6, 1, 4, 1, 1, True, (7, 8)),  # stride 1, even kernel: shifted products
    (6, 6, 6, 3, 2, 1, False, (8, 9)),  # depthwise
    (6, 9, 3, 5, 2, 1, True, (11, 6)),  # grouped
    (4, 4, 1, 3, 1, 2, True, (7, 7)),  # dilated
]


def _ids(case: tuple[object, ...]) -> str:
    c_in, c_out, groups, k, s, d, bias, size = case
    return f"{c_in}-{c_out}-g{groups}-k{k}-s{s}-d{d}-{'b' if bias else 'nb'}-{size}"


def _pair(
    case: tuple[int, int, int, int, int, int, bool, tuple[int, int]],
) -> tuple[nn.Conv2d, nn.Conv2d]:
    c_in, c_out, groups, k, s, d, bias, _ = case
    torch.manual_seed(0)
    same = Conv2dSame(c_in, c_out, k, stride=s, dilation=d, groups=groups, bias=bias).double()
    plain = nn.Conv2d(c_in, c_out, k, stride=s, dilation=d, groups=groups, bias=bias).double()
    plain.load_state_dict(same.state_dict())
    return same, plain


def _padded(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    top, bottom = tf_same_pads(x.shape[-2], kh, sh, dh)
    left, right = tf_same_pads(x.shape[-1], kw, sw, dw)
    return F.pad(x, (left, right, top, bottom))


@pytest.mark.parametrize("estimator", ["expand", "reduce"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_factor_sums_are_the_plain_convolutions_of_the_padded_input(
    case: tuple[int, int, int, int, int, int, bool, tuple[int, int]], estimator: str
) -> None:
    same, plain = _pair(case)
    handler = same_conv2d_handler(same, conv_estimator=estimator)  # type: ignore[arg-type]
    assert handler is not None and handler.geometry.same
    assert isinstance(handler, GroupedConv2dHandler if same.groups > 1 else Conv2dHandler)
    reference = (GroupedConv2dHandler if plain.groups > 1 else Conv2dHandler)(
        plain,
        estimator=estimator,  # type: ignore[arg-type]
    )
    x = torch.randn(4, same.in_channels, *case[-1], dtype=torch.float64)
    grad_out = torch.randn_like(same(x))
    padded = _padded(x, same)
    assert grad_out.shape == plain(padded).shape
    for got, want in (
        (handler.a_sum(x), reference.a_sum(padded)),
        (handler.a_moments(x), reference.a_moments(padded)),
        (handler.g_sum(grad_out), reference.g_sum(grad_out)),
        (handler.patch_means(x), reference.patch_means(padded)),
    ):
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
        assert got[1] == want[1]
    if estimator == "expand" and case[4] == 1 and case[3] > 1:  # the shifted path applies
        torch.testing.assert_close(handler.shifted_sum(x)[0], handler.patch_sum(x)[0])


def test_the_handler_keeps_the_contract_on_its_probe() -> None:
    """The registration check (:mod:`kaisa.layers.probe`): one input, one output row
    (ungrouped: a grouped convolution's groups are rows of ``A`` by design)."""
    for case in CASES:
        same, _ = _pair(case)
        if same.groups == 1:
            assert check_factory(same_conv2d_handler, same)


class Net(nn.Module):
    """A strided 'SAME' stem, a depthwise 'SAME' convolution, a head."""

    def __init__(self, make: type[nn.Conv2d]) -> None:
        super().__init__()
        self.stem = make(3, 6, 3, stride=2)
        self.dw = make(6, 6, 3, stride=2, groups=6, bias=False)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dw(self.stem(x).tanh()).tanh().mean((2, 3)))


class PaddedNet(nn.Module):
    """:class:`Net` for one input size, its padding written as ``nn.ZeroPad2d``."""

    def __init__(self, size: tuple[int, int]) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, stride=2)
        self.dw = nn.Conv2d(6, 6, 3, stride=2, groups=6, bias=False)
        self.head = nn.Linear(6, 4)
        h, w = size
        self.pad_stem = nn.ZeroPad2d((*tf_same_pads(w, 3, 2, 1), *tf_same_pads(h, 3, 2, 1)))
        h, w = math.ceil(h / 2), math.ceil(w / 2)
        self.pad_dw = nn.ZeroPad2d((*tf_same_pads(w, 3, 2, 1), *tf_same_pads(h, 3, 2, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(self.pad_stem(x)).tanh()
        return self.head(self.dw(self.pad_dw(x)).tanh().mean((2, 3)))


@pytest.mark.parametrize("correction", ["off", "ekfac"])
def test_a_model_of_them_takes_the_steps_of_explicit_padding(correction: str) -> None:
    size = (9, 10)
    torch.manual_seed(0)
    net, ref = Net(Conv2dSame).double(), PaddedNet(size).double()
    ref.load_state_dict(net.state_dict())
    common = dict(factor_update_steps=1, inv_update_steps=1, inv_dtype=torch.float64, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left raw, nothing warned
        pres = [
            kaisa.KFACPreconditioner(
                m, curvature="exact", eigenvalue_correction=correction, **common
            )
            for m in (net, ref)
        ]
    assert [layer.name for layer in pres[0].layers] == ["stem", "dw", "head"]
    assert not pres[0].coverage().raw()
    opts = [torch.optim.SGD(m.parameters(), lr=0.2) for m in (net, ref)]
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(6, 3, *size, generator=gen, dtype=torch.float64)
        y = torch.arange(6) % 4
        for model, pre, opt in zip((net, ref), pres, opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
    for name, param in net.named_parameters():
        torch.testing.assert_close(param, ref.get_parameter(name), rtol=1e-10, atol=1e-12)


def test_one_that_is_not_same_padding_is_left_raw_with_the_reason() -> None:
    torch.manual_seed(0)
    odd = SymmetricSame(3, 4, 3, stride=2)
    reason = same_conv2d_refusal(odd)
    assert reason is not None and "TensorFlow's 'SAME'" in reason
    assert same_conv2d_handler(odd) is None
    model = nn.Sequential(odd, nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(1, 3, 8, 8))
    with pytest.warns(
        UserWarning,
        match="its forward is not the convolution of its input padded as TensorFlow's 'SAME'",
    ):
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    raw = {t.parameter for t in pre.coverage().raw()}
    assert raw == {"0.weight", "0.bias"}


def test_padding_of_its_own_is_refused() -> None:
    conv = Conv2dSame(3, 4, 3, stride=2)
    conv.padding = (1, 1)
    assert "padding=0" in str(same_conv2d_refusal(conv))
    with pytest.raises(ValueError, match="padding=0"):
        ConvGeometry.of(conv, same=True)


def test_it_is_matched_by_name_and_nothing_else_is() -> None:
    assert registry.handler_for(Conv2dSame(3, 4, 3, stride=2)) is not None
    plain = nn.Conv2d(3, 4, 3, stride=2)
    handler = registry.handler_for(plain)
    assert isinstance(handler, Conv2dHandler) and not handler.geometry.same
