"""First and second moments of the factor rows (the 'kvec' and 'diagonal' captures).

Checked against the rows themselves: ``F.unfold`` patches with a ones column,
scaled as spec §3 prescribes, for every padding mode and estimator.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa.layers.conv import Conv2dHandler
from kaisa.layers.linear import LinearHandler


def _moments(rows: torch.Tensor) -> torch.Tensor:
    return torch.stack([rows.sum(0), rows.square().sum(0)])


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular", "replicate"])
@pytest.mark.parametrize("estimator", ["expand", "reduce"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_moments_equal_the_patch_rows(padding_mode: str, estimator: str, bias: bool) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1, padding_mode=padding_mode, bias=bias).double()
    handler = Conv2dHandler(conv, estimator=estimator)  # type: ignore[arg-type]
    x = torch.randn(4, 3, 9, 9, dtype=torch.float64)
    got, rows = handler.a_moments(x)
    mode = "constant" if padding_mode == "zeros" else padding_mode
    patches = F.unfold(F.pad(x, (1, 1, 1, 1), mode=mode), 3, stride=2).transpose(1, 2)
    positions = patches.shape[1]
    if bias:
        patches = torch.cat([patches, torch.ones(4, positions, 1, dtype=x.dtype)], dim=-1)
    expected = _moments(patches.reshape(4 * positions, -1) / positions)
    assert rows == 4 * positions
    torch.testing.assert_close(got, expected)
    delta = torch.randn(4, 5, 5, 5, dtype=torch.float64)
    got_g, rows_g = handler.g_moments(delta)
    assert rows_g == 4 * 25
    torch.testing.assert_close(got_g, _moments(delta.permute(0, 2, 3, 1).reshape(-1, 5) / 25))


def test_moments_match_the_gram_diagonal_and_accumulate() -> None:
    torch.manual_seed(1)
    handler = LinearHandler(nn.Linear(6, 3).double())
    x = torch.randn(2, 7, 6, dtype=torch.float64)
    first, rows = handler.a_moments(x)
    rows_x = torch.cat([x.reshape(-1, 6), torch.ones(14, 1, dtype=x.dtype)], dim=1)
    torch.testing.assert_close(first, _moments(rows_x))
    gram, _ = handler.a_sum(x)
    torch.testing.assert_close(first[1], gram.diagonal())
    torch.testing.assert_close(first[0], gram[-1])  # the ones column holds the row sums
    twice, _ = handler.a_moments(x, first.clone())
    torch.testing.assert_close(twice, 2 * first)
    delta = torch.randn(14, 3, dtype=torch.float64)
    got, rows_g = handler.g_moments(delta)
    assert (rows, rows_g) == (14, 14)
    torch.testing.assert_close(got, _moments(delta))
