"""Cost of one conv factor step: 'expand' from shifted products, from the patch matrix, 'reduce'.

``Conv2dHandler`` computes the 'expand' ``āᵀā`` of a unit-stride, zero-padded
convolution from shifted products of the input (``shifted_sum``) instead of
the patch matrix (``patch_sum``, still used for the other convolutions). Both
run here on the inputs of GapCNN's six convolutions (batch 128, 28x28 images,
channels_last as the demo trains), interleaved with the cheaper 'reduce'
estimator for scale, and the median over repeats of the time for all six is
reported per method: the ``A`` sums, the ``G`` sums of the same estimator
(equal for all 'expand' rows), and their total, with the machine's load.
``expand, a_sum`` is what the preconditioner runs: the shifted products for
the convolutions with enough input channels, the patch matrix for the first.
Nothing is asserted; the two 'expand' results are checked to agree.

    python benchmarks/conv_expand.py --threads 2 --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from conv_reduce import GAP_CNN_CONVS
from torch import nn

from kaisa.layers.conv import Conv2dHandler

Case = tuple[Conv2dHandler, Conv2dHandler, torch.Tensor, torch.Tensor]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--batch-size", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cases: list[Case] = []
    for cin, cout, side in GAP_CNN_CONVS:
        conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        x = torch.randn(args.batch_size, cin, side, side)
        delta = torch.randn(args.batch_size, cout, side, side)
        x, delta = (t.contiguous(memory_format=torch.channels_last) for t in (x, delta))
        expand = Conv2dHandler(conv, estimator="expand")
        torch.testing.assert_close(
            expand.shifted_sum(x)[0], expand.patch_sum(x)[0], rtol=1e-4, atol=1e-6
        )
        cases.append((expand, Conv2dHandler(conv, estimator="reduce"), x, delta))
    a_methods: dict[str, Callable[[Case], object]] = {
        "expand, shifted products": lambda c: c[0].shifted_sum(c[2]),
        "expand, patch matrix": lambda c: c[0].patch_sum(c[2]),
        "expand, a_sum": lambda c: c[0].a_sum(c[2]),
        "reduce": lambda c: c[1].a_sum(c[2]),
    }
    g_methods: dict[str, Callable[[Case], object]] = {
        "expand, shifted products": lambda c: c[0].g_sum(c[3]),
        "expand, patch matrix": lambda c: c[0].g_sum(c[3]),
        "expand, a_sum": lambda c: c[0].g_sum(c[3]),
        "reduce": lambda c: c[1].g_sum(c[3]),
    }
    load_before = os.getloadavg()
    a_times: dict[str, list[float]] = {name: [] for name in a_methods}
    g_times: dict[str, list[float]] = {name: [] for name in a_methods}
    for _ in range(args.repeats):
        for name in a_methods:
            for methods, times in ((a_methods, a_times), (g_methods, g_times)):
                start = time.perf_counter()
                for case in cases:
                    methods[name](case)
                times[name].append(time.perf_counter() - start)
    load_after = os.getloadavg()
    print(
        f"GapCNN's 6 convs, batch {args.batch_size}, channels_last, {args.threads} thread(s), "
        f"median of {args.repeats}, load {load_before[0]:.2f} -> {load_after[0]:.2f}:"
    )
    print(f"  {'':26s} {'A ms':>8s} {'G ms':>8s} {'A+G ms':>8s}")
    total = {}
    for name in a_methods:
        a_ms = statistics.median(a_times[name]) * 1e3
        g_ms = statistics.median(g_times[name]) * 1e3
        total[name] = a_ms + g_ms
        print(f"  {name:26s} {a_ms:8.2f} {g_ms:8.2f} {a_ms + g_ms:8.2f}")
    shifted, patch = total["expand, shifted products"], total["expand, patch matrix"]
    print(f"  expand A+G, shifted / patch matrix: {shifted / patch:.3f}")
    print(f"  expand (shifted) / reduce, A+G: {shifted / total['reduce']:.1f}x")
    print(
        "  a_sum takes the shifted products from SHIFTED_MIN_CHANNELS input channels on "
        "(here all but the first conv)"
    )


if __name__ == "__main__":
    main()
