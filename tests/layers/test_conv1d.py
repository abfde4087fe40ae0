"""``nn.Conv1d`` (groups = 1) against dense float64 references and the equivalent Conv2d.

The reference patches are built by explicit loops over (sample, output
position) and checked twice: they reproduce the convolution's output
(``P Wᵀ + b``), and their columns are ``F.unfold``'s on the one-row view.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.layers import registry
from kaisa.layers.conv import (
    SHIFTED_MIN_CHANNELS,
    Conv1dHandler,
    Conv2dHandler,
    ConvEstimator,
    conv1d_handler,
)

PADDING_MODES = ["zeros", "reflect", "replicate", "circular"]
ESTIMATORS: list[ConvEstimator] = ["expand", "reduce"]

#: Stride, dilation and padding (int, 'same' with odd and even totals, 'valid').
CASES = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=2, stride=3, padding=2, dilation=2),
    dict(kernel_size=4, padding="same"),
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=3, padding="valid", dilation=3),
    dict(kernel_size=1, stride=2),
]

C_IN, C_OUT, N, L = 2, 3, 3, 11


def case_id(case: dict[str, object]) -> str:
    return ",".join(f"{k}={v}" for k, v in case.items())


def make_conv(
    case: dict[str, object], padding_mode: str = "zeros", bias: bool = True, c_in: int = C_IN
) -> nn.Conv1d:
    torch.manual_seed(0)
    return nn.Conv1d(c_in, C_OUT, padding_mode=padding_mode, bias=bias, **case).double()  # type: ignore[arg-type]


def equivalent_conv2d(conv: nn.Conv1d) -> nn.Conv2d:
    """The ``nn.Conv2d`` of kernel ``(1, k)`` that computes ``conv`` on ``x.unsqueeze(2)``."""
    padding = conv.padding if isinstance(conv.padding, str) else (0, conv.padding[0])
    conv2d = nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        (1, conv.kernel_size[0]),
        stride=(1, conv.stride[0]),
        padding=padding,
        dilation=(1, conv.dilation[0]),
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
    ).double()
    with torch.no_grad():
        conv2d.weight.copy_(conv.weight.unsqueeze(2))
        if conv.bias is not None:
            assert conv2d.bias is not None
            conv2d.bias.copy_(conv.bias)
    return conv2d


def naive_patches(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """Patch rows by explicit loops: rows (sample, output position), columns (channel, offset)."""
    (k,), (s,), (d,) = conv.kernel_size, conv.stride, conv.dilation
    if conv.padding == "same":
        total = d * (k - 1)
        pads = (total // 2, total - total // 2)
    elif conv.padding == "valid":
        pads = (0, 0)
    else:
        assert not isinstance(conv.padding, str)
        pads = (conv.padding[0], conv.padding[0])
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, pads, mode=mode)
    n, c, length = xp.shape
    positions = (length - d * (k - 1) - 1) // s + 1
    rows = []
    for i in range(n):
        for t in range(positions):
            rows.append(
                torch.stack([xp[i, ch, t * s + j * d] for ch in range(c) for j in range(k)])
            )
    return torch.stack(rows)


def with_ones(rows: torch.Tensor, bias: bool) -> torch.Tensor:
    if not bias:
        return rows
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1)


def delta_rows(delta: torch.Tensor) -> torch.Tensor:
    """``(N, C_out, T)`` output gradient as ``(N·T, C_out)`` rows, sample-major."""
    return delta.permute(0, 2, 1).reshape(-1, delta.shape[1])


def moments(rows: torch.Tensor) -> torch.Tensor:
    return torch.stack([rows.sum(0), rows.square().sum(0)])


def inputs(conv: nn.Conv1d, n: int = N, length: int = L) -> tuple[torch.Tensor, torch.Tensor]:
    """A random input and a random output gradient of the right shape."""
    x = torch.randn(n, conv.in_channels, length, dtype=torch.float64)
    positions = conv(x).shape[-1]
    return x, torch.randn(n, conv.out_channels, positions, dtype=torch.float64)


def all_cases(test: object) -> object:
    for decorator in (
        pytest.mark.parametrize("estimator", ESTIMATORS),
        pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"]),
        pytest.mark.parametrize("padding_mode", PADDING_MODES),
        pytest.mark.parametrize("case", CASES, ids=case_id),
    ):
        test = decorator(test)
    return test


@pytest.mark.parametrize("padding_mode", PADDING_MODES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_patches_are_the_convolutions(case: dict[str, object], padding_mode: str) -> None:
    """The looped patches reproduce the output and are ``F.unfold``'s on the one-row view."""
    conv = make_conv(case, padding_mode)
    x, _ = inputs(conv)
    patches = naive_patches(conv, x)
    y = conv(x).detach()
    assert conv.bias is not None
    recon = patches @ conv.weight.reshape(C_OUT, -1).T + conv.bias
    torch.testing.assert_close(recon, delta_rows(y), rtol=1e-12, atol=1e-12)
    conv2d = equivalent_conv2d(conv)
    torch.testing.assert_close(conv2d(x.unsqueeze(2)).squeeze(2), y, rtol=1e-12, atol=1e-12)
    left, right, _, _ = conv2d._reversed_padding_repeated_twice
    mode = "constant" if padding_mode == "zeros" else padding_mode
    padded = F.pad(x, (left, right), mode=mode).unsqueeze(2)
    unfolded = F.unfold(
        padded, (1, conv.kernel_size[0]), dilation=(1, conv.dilation[0]), stride=(1, conv.stride[0])
    )
    torch.testing.assert_close(unfolded.transpose(1, 2).reshape(patches.shape), patches)


@all_cases
def test_sums_equal_dense_reference(
    case: dict[str, object], padding_mode: str, bias: bool, estimator: ConvEstimator
) -> None:
    """``a_sum``/``g_sum``: ``āᵀā`` and ``δᵀδ`` of the spec §3 rows for either estimator."""
    conv = make_conv(case, padding_mode, bias)
    handler = Conv1dHandler(conv, estimator=estimator)
    x, delta = inputs(conv)
    positions = delta.shape[-1]
    a_bar = with_ones(naive_patches(conv, x), bias) / positions
    d_bar = delta_rows(delta) / positions
    if estimator == "reduce":  # one row per sample: the mean over positions
        a_bar = a_bar.reshape(N, positions, -1).mean(1)
        d_bar = d_bar.reshape(N, positions, -1).mean(1)
    a_sum, a_rows = handler.a_sum(x)
    g_sum, g_rows = handler.g_sum(delta)
    assert a_rows == g_rows == a_bar.shape[0] == (N if estimator == "reduce" else N * positions)
    assert a_sum.shape == (handler.a_size, handler.a_size)
    assert handler.a_size == C_IN * conv.kernel_size[0] + bias
    torch.testing.assert_close(a_sum, a_bar.T @ a_bar, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_sum, d_bar.T @ d_bar, rtol=1e-12, atol=1e-14)


@all_cases
def test_moments_equal_dense_reference(
    case: dict[str, object], padding_mode: str, bias: bool, estimator: ConvEstimator
) -> None:
    """``a_moments``/``g_moments``: first and second moments of the ``N·T`` rows."""
    conv = make_conv(case, padding_mode, bias)
    handler = Conv1dHandler(conv, estimator=estimator)
    x, delta = inputs(conv)
    positions = delta.shape[-1]
    a_bar = with_ones(naive_patches(conv, x), bias) / positions
    a_mom, a_rows = handler.a_moments(x)
    g_mom, g_rows = handler.g_moments(delta)
    assert a_rows == g_rows == N * positions
    torch.testing.assert_close(a_mom, moments(a_bar), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        g_mom, moments(delta_rows(delta) / positions), rtol=1e-12, atol=1e-14
    )


@all_cases
def test_equals_conv2d_handler_on_equivalent_conv2d(
    case: dict[str, object], padding_mode: str, bias: bool, estimator: ConvEstimator
) -> None:
    """Bit for bit what Conv2dHandler gives for the ``(1, k)`` Conv2d on ``x.unsqueeze(2)``."""
    conv = make_conv(case, padding_mode, bias)
    one = Conv1dHandler(conv, estimator=estimator)
    two = Conv2dHandler(equivalent_conv2d(conv), estimator=estimator)
    assert (one.a_size, one.g_size) == (two.a_size, two.g_size)
    x, delta = inputs(conv)
    for name, arg, arg2d in (
        ("a_sum", x, x.unsqueeze(2)),
        ("a_moments", x, x.unsqueeze(2)),
        ("g_sum", delta, delta.unsqueeze(2)),
        ("g_moments", delta, delta.unsqueeze(2)),
    ):
        got, rows = getattr(one, name)(arg)
        expected, rows2d = getattr(two, name)(arg2d)
        assert rows == rows2d, name
        assert torch.equal(got, expected), name
    for which in ("a", "g"):
        for capture in ("gram", "moments"):
            assert one.capture_work(which, capture, 100.0) == two.capture_work(
                which, capture, 100.0
            )
    assert one.training_work(100.0) == two.training_work(100.0)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize(
    "case",
    [
        dict(kernel_size=3, padding=1),
        dict(kernel_size=4, padding="same"),
        dict(kernel_size=3, padding="same", dilation=2),
        dict(kernel_size=5, padding=0),
        dict(kernel_size=2, padding=3),  # padding wider than the kernel reaches
    ],
    ids=case_id,
)
def test_shifted_products_equal_dense_reference(
    case: dict[str, object], bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``SHIFTED_MIN_CHANNELS`` channels, 'expand' takes shifted products, also in 1-D."""
    conv = make_conv(case, bias=bias, c_in=SHIFTED_MIN_CHANNELS)
    x, delta = inputs(conv, n=4, length=9)
    positions = delta.shape[-1]
    a_bar = with_ones(naive_patches(conv, x), bias) / positions
    expected = a_bar.T @ a_bar
    for max_shift_bytes in (1, 2**20):  # one sample per slice, and the whole batch
        handler = Conv1dHandler(conv, max_shift_bytes=max_shift_bytes)
        got, rows = handler.shifted_sum(x)
        assert rows == 4 * positions
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-13)
    monkeypatch.setattr(handler, "patch_sum", lambda *a, **k: pytest.fail("patch_sum was called"))
    got, rows = handler.a_sum(x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-13)
    two = Conv2dHandler(equivalent_conv2d(conv))
    assert torch.equal(got, two.a_sum(x.unsqueeze(2))[0])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("padding_mode", PADDING_MODES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_grad_matrix_is_the_sum_of_delta_patch_products(
    case: dict[str, object], padding_mode: str, bias: bool
) -> None:
    """After a backward, ``grad_matrix = T² · Σ_t δ̄_t ā_tᵀ`` over the rows of the factors.

    ``ā = [p | 1] / T`` and ``δ̄ = δ / T`` are the rows whose grams ``a_sum`` and
    ``g_sum`` return (checked here too), so ``Σ_t δ_t [p_t | 1]ᵀ``, the
    gradient, is ``T²`` times their cross product; its columns follow the
    weight ``(C_out, C_in, k)`` flattened, then the bias.
    """
    conv = make_conv(case, padding_mode, bias)
    handler = Conv1dHandler(conv)
    x, _ = inputs(conv)
    assert handler.grad_matrix() is None  # no backward yet
    y = conv(x)
    y.retain_grad()
    (y**2).sum().div(N).backward()
    assert y.grad is not None
    delta = y.grad
    positions = delta.shape[-1]
    a_bar = with_ones(naive_patches(conv, x), bias) / positions
    d_bar = delta_rows(delta) / positions
    grad = handler.grad_matrix()
    assert grad is not None
    assert grad.shape == (handler.g_size, handler.a_size)
    torch.testing.assert_close(grad, positions**2 * d_bar.T @ a_bar, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(handler.a_sum(x)[0], a_bar.T @ a_bar, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(handler.g_sum(delta)[0], d_bar.T @ d_bar, rtol=1e-12, atol=1e-14)
    # Column c·k + j is the weight (·, c, j); the bias is last.
    k = conv.kernel_size[0]
    assert conv.weight.grad is not None
    for c in range(C_IN):
        for j in range(k):
            assert torch.equal(grad[:, c * k + j], conv.weight.grad[:, c, j])
    if bias:
        assert conv.bias is not None and conv.bias.grad is not None
        assert torch.equal(grad[:, -1], conv.bias.grad)
    # The same matrix as the equivalent Conv2d's, after the same backward.
    conv2d = equivalent_conv2d(conv)
    (conv2d(x.unsqueeze(2)) ** 2).sum().div(N).backward()
    grad2d = Conv2dHandler(conv2d).grad_matrix()
    assert grad2d is not None
    torch.testing.assert_close(grad, grad2d, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_set_grad_matrix_round_trips(bias: bool) -> None:
    conv = make_conv(dict(kernel_size=3, padding=1, dilation=2), bias=bias)
    handler = Conv1dHandler(conv)
    conv(torch.randn(2, C_IN, L, dtype=torch.float64)).sum().backward()
    before = handler.grad_matrix()
    assert before is not None
    handler.set_grad_matrix(before.clone())  # writing the matrix back changes nothing
    after = handler.grad_matrix()
    assert after is not None and torch.equal(after, before)
    matrix = torch.randn(handler.g_size, handler.a_size, dtype=torch.float64)
    handler.set_grad_matrix(matrix)
    got = handler.grad_matrix()
    assert got is not None and torch.equal(got, matrix)
    assert conv.weight.grad is not None
    assert torch.equal(conv.weight.grad, matrix[:, : C_IN * 3].reshape(C_OUT, C_IN, 3))
    if bias:
        assert conv.bias is not None and conv.bias.grad is not None
        assert torch.equal(conv.bias.grad, matrix[:, -1])


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize(
    "case",
    [dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2, padding=1)],
    ids=case_id,
)
def test_accumulating_two_calls_equals_one_call_on_the_concatenated_batch(
    case: dict[str, object], bias: bool, estimator: ConvEstimator
) -> None:
    conv = make_conv(case, "reflect", bias)
    handler = Conv1dHandler(conv, estimator=estimator)
    x1, d1 = inputs(conv, n=2)
    x2, d2 = inputs(conv, n=3)
    for name, first, second in (
        ("a_sum", x1, x2),
        ("a_moments", x1, x2),
        ("g_sum", d1, d2),
        ("g_moments", d1, d2),
    ):
        method = getattr(handler, name)
        out, rows1 = method(first)
        total, rows2 = method(second, out)
        assert total is out, name  # added in place
        whole, rows = method(torch.cat([first, second]))
        assert rows1 + rows2 == rows, name
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14)


def test_input_layouts() -> None:
    """Unbatched, transposed ``(N, L, C)`` (channels-last view) and one-row inputs agree."""
    conv = make_conv(dict(kernel_size=3, padding=1))
    x, delta = inputs(conv)
    for estimator in ESTIMATORS:
        handler = Conv1dHandler(conv, estimator=estimator)
        a_sum, rows = handler.a_sum(x)
        a_mom, _ = handler.a_moments(x)
        transposed = x.transpose(1, 2).contiguous().transpose(1, 2)
        assert not transposed.is_contiguous()
        for other in (transposed, x.unsqueeze(2)):
            torch.testing.assert_close(handler.a_sum(other)[0], a_sum, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(handler.a_moments(other)[0], a_mom, rtol=1e-12, atol=1e-14)
        single, single_rows = handler.a_sum(x[0])
        assert single_rows == rows // N
        torch.testing.assert_close(single, handler.a_sum(x[:1])[0], rtol=0, atol=0)
        g_single, _ = handler.g_sum(delta[0])
        torch.testing.assert_close(g_single, handler.g_sum(delta[:1])[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"\(N, C, L\)"):
        handler.a_sum(x.unsqueeze(2).expand(N, C_IN, 2, L))
    with pytest.raises(ValueError, match=r"\(N, C, L\)"):
        handler.a_sum(x[0, 0])


def test_factory_and_constructor_checks() -> None:
    grouped = nn.Conv1d(4, 4, 3, groups=2)
    assert type(conv1d_handler(grouped)).__name__ == "GroupedConv1dHandler"
    with pytest.raises(ValueError, match="groups=1 only"):
        Conv1dHandler(grouped)
    conv = nn.Conv1d(4, 6, 5, bias=False)
    handler = conv1d_handler(conv, conv_estimator="reduce", unrelated_option=1)
    assert isinstance(handler, Conv1dHandler)
    assert handler.module is conv and handler.estimator == "reduce"
    assert (handler.a_size, handler.g_size) == (4 * 5, 6)
    assert handler.parameters() == [conv.weight]
    default = conv1d_handler(nn.Conv1d(4, 6, 5))
    assert isinstance(default, Conv1dHandler) and default.estimator == "expand"
    assert default.a_size == 4 * 5 + 1
    with pytest.raises(TypeError, match=r"nn\.Conv1d"):
        Conv1dHandler(nn.Conv2d(4, 6, 5))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Conv2d"):
        Conv2dHandler(conv)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="estimator"):
        Conv1dHandler(conv, estimator="mean")  # type: ignore[arg-type]


def test_preconditioner_factors_once_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered with :func:`conv1d_handler`, the captured factors are the dense ones."""
    monkeypatch.setitem(registry._REGISTRY, nn.Conv1d, conv1d_handler)
    conv = make_conv(dict(kernel_size=3, stride=2, padding=1), "circular")
    x, _ = inputs(conv)
    pre = kaisa.KFACPreconditioner.with_reference_defaults(
        conv, factor_decay=0.0, inv_dtype=torch.float64, kl_clip=None
    )
    assert len(pre.layers) == 1 and isinstance(pre.layers[0].handler, Conv1dHandler)
    y = conv(x)
    y.retain_grad()
    (y**2).sum().div(N).backward()
    pre.step()
    assert y.grad is not None
    positions = y.shape[-1]
    a_bar = with_ones(naive_patches(conv, x), True) / positions
    d_bar = delta_rows(y.grad) / positions
    block = pre.layers[0].block
    rows = N * positions
    torch.testing.assert_close(block.a, a_bar.T @ a_bar / rows, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.g, d_bar.T @ d_bar / rows, rtol=1e-12, atol=1e-12)
