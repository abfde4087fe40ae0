"""Grouped and depthwise convolutions against dense float64 references.

A grouped convolution's ``A`` is the mean over its groups of each group's
patch factor (the rows of all groups' ``(C_in / g)·kh·kw``-column patch
matrices), and its ``G`` the output gradient's gram with the products of
outputs in different groups left out (block-diagonal): checked against
``F.unfold`` per group for both estimators, Conv1d and Conv2d, strides,
dilations, padding modes, channel multipliers and the shifted-products path.
Where every group sees the same input, that is exactly K-FAC per group: a
grouped convolution then takes the steps of its groups as separate
convolutions (float64).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.layers import conv

#: (conv type, C_in, C_out, groups, kernel, options)
CASES = [
    (nn.Conv2d, 6, 9, 3, 3, {"padding": 1}),
    (nn.Conv2d, 8, 8, 8, 3, {"stride": 2, "padding": 1, "bias": False}),  # depthwise
    (nn.Conv2d, 4, 12, 4, 3, {"padding": 1}),  # depthwise, channel multiplier 3
    (nn.Conv2d, 24, 24, 2, 3, {"padding": 1}),  # 12 channels a group: shifted products
    (nn.Conv2d, 6, 6, 3, 3, {"dilation": 2, "padding": 2, "padding_mode": "reflect"}),
    (nn.Conv2d, 8, 16, 4, 1, {}),
    (nn.Conv1d, 6, 4, 2, 3, {"padding": 1}),
    (nn.Conv1d, 5, 5, 5, 5, {"stride": 2, "bias": False}),
]


def _ids(case: tuple[object, ...]) -> str:
    kind, c_in, c_out, groups, k, opts = case
    extra = ",".join(f"{key}={value}" for key, value in opts.items())  # type: ignore[attr-defined]
    return f"{kind.__name__}-{c_in}-{c_out}-g{groups}-k{k}-{extra}"  # type: ignore[attr-defined]


def _rows(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every group's patches, ``(N·g, T, (C_in / g)·kh·kw)``, and ``T``."""
    if isinstance(module, nn.Conv1d):
        module2d = nn.Conv2d(
            module.in_channels,
            module.out_channels,
            (1, module.kernel_size[0]),
            stride=(1, module.stride[0]),
            padding=(0, module.padding[0]),  # type: ignore[index]
            dilation=(1, module.dilation[0]),
            groups=module.groups,
            padding_mode=module.padding_mode,
        )
        return _rows(module2d, x.unsqueeze(2))
    assert isinstance(module, nn.Conv2d)
    ph, pw = module.padding  # type: ignore[misc]
    if module.padding_mode != "zeros":
        x = F.pad(x, (pw, pw, ph, ph), mode=module.padding_mode)
        ph = pw = 0
    cols = F.unfold(x, module.kernel_size, module.dilation, (ph, pw), module.stride)
    n, _, t = cols.shape
    g = module.groups
    per_group = cols.reshape(n, g, -1, t).permute(0, 1, 3, 2)  # (N, g, T, C_in/g·kh·kw)
    return per_group.reshape(n * g, t, -1), t


def _mask(c_out: int, groups: int) -> torch.Tensor:
    group = torch.arange(c_out) // (c_out // groups)
    return (group[:, None] == group[None, :]).double()


def _reference(
    module: nn.Conv1d | nn.Conv2d, x: torch.Tensor, dy: torch.Tensor, estimator: str
) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """``(ΣāᵀĀ, rows, ΣδᵀΔ, rows)`` of spec §3's rows, by unfold per group."""
    rows, t = _rows(module, x)
    delta = dy.reshape(dy.shape[0], dy.shape[1], -1).transpose(1, 2)  # (N, T, C_out)
    if estimator == "reduce":
        rows, delta = rows.mean(1, keepdim=True), delta.mean(1, keepdim=True)
    a = rows.reshape(-1, rows.shape[-1])
    if module.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
    a = a / t
    d = delta.reshape(-1, delta.shape[-1]) / t
    g = (d.t() @ d) * _mask(module.out_channels, module.groups)
    return a.t() @ a, a.shape[0], g, d.shape[0]


@pytest.mark.parametrize("estimator", ["expand", "reduce"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_factor_sums_match_unfold_per_group(
    case: tuple[type[nn.Module], int, int, int, int, dict[str, object]], estimator: str
) -> None:
    kind, c_in, c_out, groups, k, opts = case
    torch.manual_seed(0)
    module = kind(c_in, c_out, k, groups=groups, **opts).double()
    factory = conv.conv2d_handler if kind is nn.Conv2d else conv.conv1d_handler
    handler = factory(module, conv_estimator=estimator)
    assert isinstance(handler, conv._Grouped) and handler.estimator == estimator
    # A weight row's columns: (C_in / g)·kh·kw, and the bias's.
    assert handler.a_size == module.weight[0].numel() + (module.bias is not None)
    x = torch.randn(3, c_in, *([9, 8] if kind is nn.Conv2d else [11]), dtype=torch.float64)
    dy = torch.randn_like(module(x))
    want_a, rows_a, want_g, rows_g = _reference(module, x, dy, estimator)
    got_a, got_rows_a = handler.a_sum(x)
    got_g, got_rows_g = handler.g_sum(dy)
    torch.testing.assert_close(got_a, want_a, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-12)
    assert (got_rows_a, got_rows_g) == (rows_a, rows_g)
    # The moments are the grams' diagonals and the rows' sums ('expand' rows).
    if estimator == "expand":
        moments, m_rows = handler.a_moments(x)
        torch.testing.assert_close(moments[1], want_a.diagonal(), rtol=1e-10, atol=1e-12)
        assert m_rows == rows_a
        g_moments, _ = handler.g_moments(dy)
        torch.testing.assert_close(g_moments[1], want_g.diagonal(), rtol=1e-10, atol=1e-12)
    # Accumulating a second call keeps G block-diagonal.
    twice, _ = handler.g_sum(dy, got_g.clone())
    torch.testing.assert_close(twice, 2 * want_g, rtol=1e-10, atol=1e-12)


def test_the_gradient_matrix_is_the_weight_rows_with_the_bias_column() -> None:
    module = nn.Conv2d(6, 9, 3, groups=3).double()
    handler = conv.conv2d_handler(module)
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    module(x).square().sum().backward()
    assert module.weight.grad is not None and module.bias is not None
    matrix = handler.grad_matrix()
    assert matrix is not None and matrix.shape == (9, 2 * 9 + 1)
    torch.testing.assert_close(matrix[:, :-1], module.weight.grad.reshape(9, -1))
    torch.testing.assert_close(matrix[:, -1], module.bias.grad)


class Separate(nn.Module):
    """``groups`` convolutions of ``c`` channels each on the same input, concatenated."""

    def __init__(self, groups: int, c: int, out: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, out, 3, padding=1) for _ in range(groups))
        self.head = nn.Linear(groups * out * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([c(x) for c in self.convs], dim=1)
        return self.head(torch.tanh(y).flatten(1))


class Together(nn.Module):
    """The same as one grouped convolution of the input repeated ``groups`` times."""

    def __init__(self, groups: int, c: int, out: int) -> None:
        super().__init__()
        self.groups = groups
        self.conv = nn.Conv2d(groups * c, groups * out, 3, padding=1, groups=groups)
        self.head = nn.Linear(groups * out * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x.repeat(1, self.groups, 1, 1))
        return self.head(torch.tanh(y).flatten(1))


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_groups_that_see_the_same_input_take_the_steps_of_separate_convolutions(
    compute_method: str,
) -> None:
    groups, c, out = 3, 2, 2
    torch.manual_seed(0)
    together = Together(groups, c, out).double()
    separate = Separate(groups, c, out).double()
    with torch.no_grad():
        for j, part in enumerate(separate.convs):
            part.weight.copy_(together.conv.weight[j * out : (j + 1) * out])
            part.bias.copy_(together.conv.bias[j * out : (j + 1) * out])  # type: ignore[index]
        separate.head.load_state_dict(together.head.state_dict())
    options = dict(
        factor_update_steps=1,
        inv_update_steps=1,
        inv_dtype=torch.float64,
        lr=0.1,
        curvature="exact",
        damping_mode="absolute",
        damping=0.01,
        compute_method=compute_method,
    )
    models = (together, separate)
    pres = [kaisa.KFACPreconditioner(m, **options) for m in models]  # type: ignore[arg-type]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(5, c, 4, 4, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (5,), generator=g)
        for model, pre, opt in zip(models, pres, opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
    for j, part in enumerate(separate.convs):
        torch.testing.assert_close(
            together.conv.weight[j * out : (j + 1) * out], part.weight, rtol=1e-9, atol=1e-11
        )
        torch.testing.assert_close(
            together.conv.bias[j * out : (j + 1) * out],  # type: ignore[index]
            part.bias,
            rtol=1e-9,
            atol=1e-11,
        )
    torch.testing.assert_close(together.head.weight, separate.head.weight, rtol=1e-9, atol=1e-11)


def test_a_depthwise_separable_network_learns_in_float32() -> None:
    """MobileNet's block (depthwise 3 × 3, pointwise 1 × 1): every layer is
    preconditioned, no warning, and 40 steps on a repeated batch at least halve the loss."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = kaisa.KFACPreconditioner(model, optimizer=optimizer)
    assert pre.coverage().raw() == []
    x = torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.arange(32) % 10
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        pre.step()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_depthwise_convolution_holds_its_diagonal_g_as_a_diagonal_side() -> None:
    """One output a group: ``G`` is diagonal, so it is held as a diagonal side (no
    eigendecomposition of a ``C × C`` diagonal matrix) unless the user fixes it; a
    channel multiplier leaves ``G`` to the choice."""
    assert conv.conv2d_handler(nn.Conv2d(4, 4, 3, groups=4)).default_sides == (None, "diagonal")
    assert conv.conv2d_handler(nn.Conv2d(4, 8, 3, groups=4)).default_sides == (None, None)
    assert conv.conv2d_handler(nn.Conv2d(4, 4, 3)).default_sides == (None, None)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.Flatten(), nn.Linear(4, 2))
    pre = kaisa.KFACPreconditioner(model, lr=0.1, curvature={"0": ("exact", "auto")})
    assert pre.layers[0].curvature == ("exact", "diagonal")
    fixed = kaisa.KFACPreconditioner(model, lr=0.1, curvature="exact")
    assert fixed.layers[0].curvature == ("exact", "exact")
