"""Kronecker factors captured by the hooks against dense float64 definitions (spec §3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa


def capture(model: nn.Module, x: torch.Tensor, **options: object) -> kaisa.KFACPreconditioner:
    """One factor update with decay 0, so the blocks hold exactly the batch factors.

    Spec §3's factors are full grams: exact curvature (the reference defaults),
    not the automatic choice, which may hold a side as moments.
    """
    pre = kaisa.KFACPreconditioner.with_reference_defaults(
        model, factor_decay=0.0, inv_dtype=torch.float64, kl_clip=None, **options
    )
    out = model(x)
    (out**2).sum().div(out.shape[0]).backward()
    pre.step()
    return pre


def output_grads(module: nn.Module, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """``δ = ∂L/∂y`` of every call of ``module`` for the loss used in :func:`capture`."""
    grads: list[torch.Tensor] = []

    def hook(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: grads.append(g.detach().clone()))

    handle = module.register_forward_hook(hook)
    out = model(x)
    (out**2).sum().div(out.shape[0]).backward()
    handle.remove()
    model.zero_grad()
    return grads[::-1]  # hooks fire in reverse call order


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 5)])
def test_linear_factors(bias: bool, shape: tuple[int, ...]) -> None:
    layer = nn.Linear(5, 3, bias=bias).double()
    x = torch.randn(*shape, dtype=torch.float64)
    (delta,) = output_grads(layer, layer, x)
    rows_x = x.reshape(-1, 5)
    if bias:
        rows_x = torch.cat([rows_x, torch.ones(rows_x.shape[0], 1, dtype=torch.float64)], 1)
    rows_d = delta.reshape(-1, 3)
    a_ref = rows_x.T @ rows_x / rows_x.shape[0]
    g_ref = rows_d.T @ rows_d / rows_d.shape[0]
    block = capture(layer, x).layers[0].block
    torch.testing.assert_close(block.a, a_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.g, g_ref, rtol=1e-12, atol=1e-12)


def naive_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """im2col by explicit loops: rows (sample, out_y, out_x), columns (c, ky, kx)."""
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    dh, dw = conv.dilation
    if conv.padding == "same":
        th, tw = dh * (kh - 1), dw * (kw - 1)
        pads = (tw // 2, tw - tw // 2, th // 2, th - th // 2)
    elif conv.padding == "valid":
        pads = (0, 0, 0, 0)
    else:
        ph, pw = conv.padding  # type: ignore[misc]
        pads = (pw, pw, ph, ph)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, pads, mode=mode)
    n, c, h, w = xp.shape
    h_out = (h - dh * (kh - 1) - 1) // sh + 1
    w_out = (w - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for i in range(n):
        for oy in range(h_out):
            for ox in range(w_out):
                patch = [
                    xp[i, ch, oy * sh + ky * dh, ox * sw + kx * dw]
                    for ch in range(c)
                    for ky in range(kh)
                    for kx in range(kw)
                ]
                rows.append(torch.stack(patch))
    return torch.stack(rows)


CONV_CASES = [
    dict(kernel_size=3, stride=1, padding=1),
    dict(kernel_size=3, stride=2, padding=1, bias=False),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=4, padding="same"),
    dict(kernel_size=3, padding="valid", bias=False),
    dict(kernel_size=3, padding=2, padding_mode="reflect"),
    dict(kernel_size=3, padding=1, padding_mode="replicate", stride=2),
    dict(kernel_size=3, padding=1, padding_mode="circular"),
]


@pytest.mark.parametrize(
    "case", CONV_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
def test_conv2d_factors(case: dict[str, object]) -> None:
    conv = nn.Conv2d(2, 3, **case).double()  # type: ignore[arg-type]
    x = torch.randn(2, 2, 7, 6, dtype=torch.float64)
    (delta,) = output_grads(conv, conv, x)
    patches = naive_patches(conv, x)
    n, c_out, h_out, w_out = delta.shape
    positions = h_out * w_out
    assert patches.shape[0] == n * positions
    # The reference patches really are the convolution's: P Wᵀ (+ b) reproduces it.
    recon = patches @ conv.weight.reshape(3, -1).T
    if conv.bias is not None:
        recon = recon + conv.bias
    expected = conv(x).detach().permute(0, 2, 3, 1).reshape(-1, 3)
    torch.testing.assert_close(recon, expected)
    a_bar = patches
    if conv.bias is not None:
        a_bar = torch.cat([a_bar, torch.ones(a_bar.shape[0], 1, dtype=torch.float64)], 1)
    a_bar = a_bar / positions
    a_ref = a_bar.T @ a_bar / (n * positions)
    d = delta.permute(0, 2, 3, 1).reshape(-1, c_out) / positions
    g_ref = d.T @ d / (n * positions)
    block = capture(conv, x).layers[0].block
    torch.testing.assert_close(block.a, a_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.g, g_ref, rtol=1e-12, atol=1e-12)


def test_conv_patch_slicing_matches_whole_batch() -> None:
    """Building the patch matrix a slice of the batch at a time changes nothing."""
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64)
    whole = capture(conv, x).layers[0]
    sliced_conv = nn.Conv2d(3, 4, 3, padding=1).double()
    sliced_conv.load_state_dict(conv.state_dict())
    pre = kaisa.KFACPreconditioner.with_reference_defaults(
        sliced_conv, factor_decay=0.0, kl_clip=None
    )
    handler = pre.layers[0].handler
    assert isinstance(handler, kaisa.layers.Conv2dHandler)
    handler.max_patch_bytes = 1  # one sample per slice
    out = sliced_conv(x)
    (out**2).sum().div(5).backward()
    pre.step()
    torch.testing.assert_close(pre.layers[0].block.a, whole.block.a, rtol=1e-12, atol=1e-12)


def test_weight_sharing_uses_rows_of_every_call() -> None:
    """A module called twice contributes the rows of both calls (spec §3)."""
    shared = nn.Linear(4, 4).double()

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(torch.tanh(self.shared(x)))

    model = Twice()
    x = torch.randn(6, 4, dtype=torch.float64)
    deltas = output_grads(shared, model, x)
    with torch.no_grad():
        inputs = [x, torch.tanh(shared(x))]
    rows_x = torch.cat([torch.cat([i, torch.ones(6, 1, dtype=torch.float64)], 1) for i in inputs])
    rows_d = torch.cat(deltas)
    pre = capture(model, x)
    assert len(pre.layers) == 1
    torch.testing.assert_close(pre.layers[0].block.a, rows_x.T @ rows_x / 12)
    torch.testing.assert_close(pre.layers[0].block.g, rows_d.T @ rows_d / 12)


def test_inplace_activation_after_layer_sees_pre_activation_gradient() -> None:
    layer = nn.Linear(4, 5).double()
    model = nn.Sequential(layer, nn.ReLU(inplace=True))
    x = torch.randn(8, 4, dtype=torch.float64)
    (delta,) = output_grads(layer, model, x)
    pre = capture(model, x)
    torch.testing.assert_close(pre.layers[0].block.g, delta.T @ delta / 8)


@pytest.mark.parametrize(
    "case", CONV_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
def test_conv2d_reduce_estimator(case: dict[str, object]) -> None:
    """'reduce': rows averaged over output positions before the outer product."""
    conv = nn.Conv2d(2, 3, **case).double()  # type: ignore[arg-type]
    x = torch.randn(3, 2, 7, 6, dtype=torch.float64)
    (delta,) = output_grads(conv, conv, x)
    n, c_out, h_out, w_out = delta.shape
    positions = h_out * w_out
    patches = naive_patches(conv, x)
    if conv.bias is not None:
        patches = torch.cat([patches, torch.ones(patches.shape[0], 1, dtype=torch.float64)], 1)
    a_bar = (patches / positions).reshape(n, positions, -1).mean(1)
    d_bar = (delta / positions).permute(0, 2, 3, 1).reshape(n, positions, c_out).mean(1)
    block = capture(conv, x, conv_factor_estimator="reduce").layers[0].block
    torch.testing.assert_close(block.a, a_bar.T @ a_bar / n, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(block.g, d_bar.T @ d_bar / n, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "case",
    [
        dict(kernel_size=2, stride=3, padding=1),
        dict(kernel_size=3, stride=2, dilation=2),
        *CONV_CASES,
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_patch_means_equal_naive_patch_means(case: dict[str, object]) -> None:
    """Position means of the patches, contiguous and channels-last (its own code path)."""
    from kaisa.layers.conv import Conv2dHandler

    conv = nn.Conv2d(3, 2, **case).double()  # type: ignore[arg-type]
    x = torch.randn(4, 3, 9, 8, dtype=torch.float64)
    patches = naive_patches(conv, x)
    h_out, w_out = conv(x).shape[-2:]
    positions = h_out * w_out
    expected = patches.reshape(4, positions, -1).mean(1)
    handler = Conv2dHandler(conv, estimator="reduce")
    channels_last = x.to(memory_format=torch.channels_last)
    assert not channels_last.is_contiguous()
    for inp in (x, channels_last):
        means, t = handler.patch_means(inp)
        assert t == positions
        torch.testing.assert_close(means, expected, rtol=1e-12, atol=1e-14)


def test_reduce_equals_expand_when_rows_do_not_vary_over_positions() -> None:
    """Constant input and a 1×1 conv: both estimators agree, so damping carries over."""
    conv = nn.Conv2d(2, 3, 1).double()
    x = torch.randn(4, 2, 1, 1, dtype=torch.float64).expand(4, 2, 5, 5).contiguous()
    expand = capture(conv, x).layers[0].block
    reduce = capture(conv, x, conv_factor_estimator="reduce").layers[0].block
    torch.testing.assert_close(reduce.a, expand.a, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(reduce.g, expand.g, rtol=1e-12, atol=1e-14)


def test_bfloat16_products_accumulate_in_float32() -> None:
    """factor_product_dtype=bfloat16: products in bf16, factors in float32, close to exact."""
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(4, 3, 8, 8)
    conv64 = nn.Conv2d(3, 4, 3, padding=1).double()
    conv64.load_state_dict(conv.state_dict())
    exact = capture(conv64, x.double()).layers[0].block
    fast = capture(conv, x, factor_product_dtype=torch.bfloat16).layers[0].block
    assert fast.a.dtype == fast.g.dtype == torch.float32
    for got, ref in ((fast.a, exact.a), (fast.g, exact.g)):
        rel = (got.double() - ref).norm() / ref.norm()
        assert rel < 1e-2, rel


@pytest.mark.parametrize("max_patch_bytes", [1, 2**20])
@pytest.mark.parametrize(
    ("c_out", "size", "channels_last"),
    [(3, 6, False), (8, 3, False), (3, 6, True)],
    ids=["positions>=channels", "positions<channels", "channels_last"],
)
def test_conv_sums_match_row_major_products(
    max_patch_bytes: int, c_out: int, size: int, channels_last: bool
) -> None:
    """``a_sum``/``g_sum`` equal the products of the row-major matrices, in any slicing."""
    conv = nn.Conv2d(2, c_out, 3, padding=1).double()
    handler = kaisa.layers.Conv2dHandler(conv, max_patch_bytes=max_patch_bytes)
    x = torch.randn(5, 2, size, size, dtype=torch.float64)
    delta = torch.randn(5, c_out, size, size, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        delta = delta.contiguous(memory_format=torch.channels_last)
    positions = size * size
    patches = naive_patches(conv, x)
    patches = torch.cat([patches, torch.ones(patches.shape[0], 1, dtype=torch.float64)], 1)
    rows = delta.permute(0, 2, 3, 1).reshape(-1, c_out)
    a_sum, a_rows = handler.a_sum(x)
    g_sum, g_rows = handler.g_sum(delta)
    assert a_rows == g_rows == 5 * positions
    torch.testing.assert_close(a_sum, patches.T @ patches / positions**2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_sum, rows.T @ rows / positions**2, rtol=1e-12, atol=1e-12)
    # Accumulating into an existing sum adds.
    g_twice, _ = handler.g_sum(delta, g_sum.clone())
    torch.testing.assert_close(g_twice, 2 * g_sum, rtol=1e-12, atol=1e-12)
    a_twice, _ = handler.a_sum(x, a_sum.clone())
    torch.testing.assert_close(a_twice, 2 * a_sum, rtol=1e-12, atol=1e-12)


SHIFTED_CASES = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, padding=1, bias=False),
    dict(kernel_size=5, padding=2),
    dict(kernel_size=(4, 2), padding="same"),  # asymmetric padding
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=(3, 5), padding=(0, 1), dilation=(2, 1)),
    dict(kernel_size=3, padding="valid", bias=False),
    dict(kernel_size=(1, 3), padding=(0, 3)),  # padding wider than the kernel reaches
    dict(kernel_size=2, padding=0),
]


def _valid_sizes(case: dict[str, object]) -> list[tuple[int, int]]:
    """The test's input sizes that the convolution accepts (a non-empty output)."""
    conv = nn.Conv2d(1, 1, **case)  # type: ignore[arg-type]
    sizes = []
    for size in [(7, 6), (2, 3), (1, 1)]:
        try:
            conv(torch.zeros(1, 1, *size))
        except RuntimeError:
            continue
        sizes.append(size)
    return sizes


@pytest.mark.parametrize(
    ("case", "size"),
    [(case, size) for case in SHIFTED_CASES for size in _valid_sizes(case)],
    ids=lambda v: (
        ",".join(f"{k}={w}" for k, w in v.items()) if isinstance(v, dict) else f"{v[0]}x{v[1]}"
    ),
)
def test_shifted_expand_sum_equals_patch_matrix_product(
    case: dict[str, object], size: tuple[int, int]
) -> None:
    """'expand' from shifted products against the naive patch matrix, in every layout.

    Small images (1x1, 2x3) leave some pairs of kernel offsets without a
    common position; a one-sample slice budget forces the sample slices.
    """
    from kaisa.layers.conv import Conv2dHandler

    conv = nn.Conv2d(3, 2, **case).double()  # type: ignore[arg-type]
    x = torch.randn(4, 3, *size, dtype=torch.float64)
    h_out, w_out = conv(x).shape[-2:]
    positions = h_out * w_out
    patches = naive_patches(conv, x)
    if conv.bias is not None:
        patches = torch.cat([patches, torch.ones(patches.shape[0], 1, dtype=torch.float64)], 1)
    expected = patches.T @ patches / positions**2
    for max_shift_bytes in (1, 2**20):
        handler = Conv2dHandler(conv, max_shift_bytes=max_shift_bytes)
        for inp in (x, x.contiguous(memory_format=torch.channels_last)):
            got, rows = handler.shifted_sum(inp)
            assert rows == 4 * positions
            # Each lower block is its upper block transposed, bit for bit.
            k = conv.kernel_size[0] * conv.kernel_size[1]
            blocks = got[: 3 * k, : 3 * k].reshape(3, k, 3, k)
            for i in range(k):
                for j in range(i + 1, k):
                    assert torch.equal(blocks[:, j, :, i], blocks[:, i, :, j].T)
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
            # a_sum (here the patch matrix: few channels) agrees and adds into a sum.
            twice, _ = handler.a_sum(inp, got.clone())
            torch.testing.assert_close(twice, 2 * expected, rtol=1e-12, atol=1e-12)


def test_shifted_sum_rejects_the_convolutions_it_does_not_cover() -> None:
    from kaisa.layers.conv import Conv2dHandler

    for conv in (
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
        nn.Conv2d(2, 3, 1),
    ):
        handler = Conv2dHandler(conv)
        with pytest.raises(ValueError, match="shifted_sum needs stride 1"):
            handler.shifted_sum(torch.randn(2, 2, 5, 5))
        # a_sum takes the patch matrix instead.
        torch.testing.assert_close(
            handler.a_sum(torch.ones(2, 2, 5, 5))[0], handler.patch_sum(torch.ones(2, 2, 5, 5))[0]
        )


@pytest.mark.parametrize("channels_above", [True, False], ids=["shifted", "patch matrix"])
def test_a_sum_picks_the_shifted_products_from_enough_channels(
    channels_above: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``SHIFTED_MIN_CHANNELS`` input channels on, 'expand' uses shifted products."""
    from kaisa.layers.conv import SHIFTED_MIN_CHANNELS, Conv2dHandler

    c_in = SHIFTED_MIN_CHANNELS if channels_above else SHIFTED_MIN_CHANNELS - 1
    conv = nn.Conv2d(c_in, 2, 3, padding=1).double()
    x = torch.randn(3, c_in, 5, 4, dtype=torch.float64)
    patches = naive_patches(conv, x)
    patches = torch.cat([patches, torch.ones(patches.shape[0], 1, dtype=torch.float64)], 1)
    handler = Conv2dHandler(conv)
    unused = "patch_sum" if channels_above else "shifted_sum"
    monkeypatch.setattr(handler, unused, lambda *a, **k: pytest.fail(f"{unused} was called"))
    got, rows = handler.a_sum(x)
    assert rows == 3 * 20
    torch.testing.assert_close(got, patches.T @ patches / 20**2, rtol=1e-12, atol=1e-12)
