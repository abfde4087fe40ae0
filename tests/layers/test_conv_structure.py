"""How the convolution handlers are put together: one geometry, one class per estimator.

The factors themselves are checked against dense references in
``test_factors.py``, ``test_conv1d.py`` and ``test_moments.py``.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.layers import _conv_shifted, conv, registry
from kaisa.layers.conv import (
    Conv1dHandler,
    Conv1dReduceHandler,
    Conv2dHandler,
    Conv2dReduceHandler,
    ConvGeometry,
    conv1d_handler,
    conv2d_handler,
)


@pytest.mark.parametrize(
    ("expand", "reduce", "factory", "module"),
    [
        (Conv2dHandler, Conv2dReduceHandler, conv2d_handler, nn.Conv2d(3, 4, 3)),
        (Conv1dHandler, Conv1dReduceHandler, conv1d_handler, nn.Conv1d(3, 4, 3)),
    ],
    ids=["2d", "1d"],
)
def test_reduce_is_its_own_handler_class(
    expand: type[Conv2dHandler] | type[Conv1dHandler],
    reduce: type[Conv2dReduceHandler] | type[Conv1dReduceHandler],
    factory: object,
    module: nn.Conv1d | nn.Conv2d,
) -> None:
    assert callable(factory)
    made = factory(module, conv_estimator="reduce")
    assert type(made) is reduce and made.estimator == "reduce"
    assert type(factory(module)) is expand and expand.estimator == "expand"
    # The constructor's estimator picks the class; the reduce class is the layer's kind.
    via_constructor = expand(module, estimator="reduce")
    assert type(via_constructor) is reduce and isinstance(via_constructor, expand)
    assert type(reduce(module)) is reduce
    with pytest.raises(ValueError, match="is the 'reduce' estimator"):
        reduce(module, estimator="expand")
    assert type(copy.deepcopy(via_constructor)) is reduce
    # Its sums have their own code: nothing of the 'expand' choice runs.
    assert "a_sum" in vars(conv._ReduceEstimator) and "g_sum" in vars(conv._ReduceEstimator)


def test_the_factories_decide_on_grouped_convolutions() -> None:
    for grouped in (nn.Conv2d(4, 4, 3, groups=2), nn.Conv1d(4, 4, 3, groups=4)):
        factory = conv2d_handler if isinstance(grouped, nn.Conv2d) else conv1d_handler
        expand = (
            conv.GroupedConv2dHandler if factory is conv2d_handler else conv.GroupedConv1dHandler
        )
        assert type(factory(grouped)) is expand
        assert type(factory(grouped, conv_estimator="reduce")) is conv._REDUCE_VARIANTS[expand]
        assert type(registry.handler_for(grouped)) is expand
    assert type(registry.handler_for(nn.Conv2d(4, 4, 3))) is conv.Conv2dHandler
    with pytest.raises(ValueError, match=r"groups=1 only.*GroupedConv2dHandler"):
        conv.Conv2dHandler(nn.Conv2d(4, 4, 3, groups=2))


GEOMETRIES = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=4, padding="same"),
    dict(kernel_size=3, padding="valid", stride=3),
    dict(kernel_size=1, stride=2),
]


@pytest.mark.parametrize("case", GEOMETRIES, ids=str)
@pytest.mark.parametrize("size", [(7, 9), (5, 6)], ids=str)
def test_the_one_output_size_is_the_convolution_s(
    case: dict[str, object], size: tuple[int, int]
) -> None:
    module = nn.Conv2d(2, 3, **case)  # type: ignore[arg-type]
    x = torch.randn(2, 2, *size)
    geometry = ConvGeometry.of(module)
    assert geometry.output_size(*size) == tuple(module(x).shape[-2:])
    left, right, top, bottom = geometry.padding
    assert tuple(geometry.pad(x).shape[-2:]) == (size[0] + top + bottom, size[1] + left + right)


@pytest.mark.parametrize(("estimator", "c_in"), [("expand", 2), ("expand", 12), ("reduce", 2)])
def test_the_geometry_is_read_once_per_layer(
    estimator: str, c_in: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Constructed once; every algorithm (patches, shifted products, means) reads it."""
    reads: list[nn.Module] = []
    original = ConvGeometry.of.__func__  # type: ignore[attr-defined]

    def counted(
        cls: type[ConvGeometry], module: nn.Conv1d | nn.Conv2d, **options: bool
    ) -> ConvGeometry:
        reads.append(module)
        return original(cls, module, **options)  # type: ignore[no-any-return]

    monkeypatch.setattr(ConvGeometry, "of", classmethod(counted))
    module = nn.Conv2d(c_in, 3, 3, padding=1).double()
    handler = Conv2dHandler(module, estimator=estimator)  # type: ignore[arg-type]
    x = torch.randn(2, c_in, 5, 6, dtype=torch.float64)
    delta = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    for size in ((5, 6), (5, 6), (4, 4)):
        inp = torch.randn(2, c_in, *size, dtype=torch.float64)
        handler.a_sum(inp)
        handler.a_moments(inp)
    handler.patch_sum(x)
    handler.g_sum(delta)
    handler.g_moments(delta)
    if estimator == "expand":
        handler.shifted_sum(x)
    assert reads == [module]
    if estimator == "expand":  # one shift plan per input size that took shifted products
        assert handler._shifted is not None
        sizes = {(5, 6), (4, 4)} if c_in >= conv.SHIFTED_MIN_CHANNELS else {(5, 6)}
        assert set(handler._shifted._plans) == sizes


def test_a_shift_plan_takes_the_output_size_from_the_geometry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = nn.Conv2d(12, 3, 3, padding="same", dilation=2).double()
    handler = Conv2dHandler(module)
    asked: list[tuple[int, int]] = []
    output_size = ConvGeometry.output_size

    def recorded(self: ConvGeometry, h: int, w: int) -> tuple[int, int]:
        asked.append((h, w))
        return output_size(self, h, w)

    monkeypatch.setattr(ConvGeometry, "output_size", recorded)
    x = torch.randn(2, 12, 7, 5, dtype=torch.float64)
    _, rows = handler.a_sum(x)
    assert asked and set(asked) == {(7, 5)}
    assert rows == 2 * module(x).shape[-2] * module(x).shape[-1]
    assert isinstance(handler._shifted, _conv_shifted.ShiftedProducts)


def test_the_factor_sums_of_both_algorithms_agree_with_unfold() -> None:
    """'expand' from the patch matrix and from shifted products, against ``F.unfold``."""
    for c_in, bias in itertools.product((3, 12), (True, False)):
        module = nn.Conv2d(c_in, 2, 3, padding=1, bias=bias).double()
        handler = kaisa.layers.Conv2dHandler(module)
        x = torch.randn(3, c_in, 5, 4, dtype=torch.float64)
        rows = F.unfold(x, 3, padding=1).transpose(1, 2).reshape(3 * 20, -1)
        if bias:
            rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
        expected = rows.T @ rows / 20**2
        torch.testing.assert_close(handler.patch_sum(x)[0], expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(handler.shifted_sum(x)[0], expected, rtol=1e-12, atol=1e-12)
