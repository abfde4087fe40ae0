"""Cost of the 'reduce' conv estimator's patch means: selection products against strided means.

``Conv2dHandler.patch_means`` computes the per-sample position means of the
patches as two small products with 0/1 selection matrices. The method it
replaced took one strided mean of the padded input per kernel offset; it is
written out here as the reference. Both run on the inputs of GapCNN's six
convolutions (batch 128, 28x28 images), interleaved, and the median over
repeats of the time for all six is reported with their ratio and the load.

The same inputs in ``torch.channels_last`` (as the demo trains) are timed
both ways ``patch_means`` has handled them: copied into the contiguous layout
first (what reshaping them did until the channels-last path) and summed in
their own memory order (the channels-last path). Nothing is asserted; all
results are checked to agree.

    python benchmarks/conv_reduce.py --threads 2 --repeats 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from kaisa.layers.conv import Conv2dHandler

# (in channels, out channels, side) of GapCNN's convolutions at the default width.
GAP_CNN_CONVS = [(1, 16, 28), (16, 16, 28), (16, 32, 14), (32, 32, 14), (32, 64, 7), (64, 64, 7)]


def strided_means(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The previous method: one strided mean of the padded input per kernel offset."""
    pad = conv.padding if isinstance(conv.padding, tuple) else (0, 0)
    x = F.pad(x, (pad[1], pad[1], pad[0], pad[0]))
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    dh, dw = conv.dilation
    h_out = (x.shape[-2] - dh * (kh - 1) - 1) // sh + 1
    w_out = (x.shape[-1] - dw * (kw - 1) - 1) // sw + 1
    columns = [
        x[:, :, ky * dh : ky * dh + sh * (h_out - 1) + 1 : sh,
          kx * dw : kx * dw + sw * (w_out - 1) + 1 : sw].mean(dim=(2, 3))
        for ky in range(kh)
        for kx in range(kw)
    ]  # fmt: skip
    return torch.stack(columns, dim=2).reshape(x.shape[0], -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cases = []
    for cin, cout, side in GAP_CNN_CONVS:
        conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        x = torch.randn(args.batch_size, cin, side, side)
        handler = Conv2dHandler(conv, estimator="reduce")
        x_last = x.contiguous(memory_format=torch.channels_last)
        expected = strided_means(conv, x)
        torch.testing.assert_close(handler.patch_means(x)[0], expected)
        torch.testing.assert_close(handler.patch_means(x_last)[0], expected)
        cases.append((conv, handler, x, x_last))
    methods = {
        "strided means": lambda conv, handler, x, x_last: strided_means(conv, x),
        "selection products": lambda conv, handler, x, x_last: handler.patch_means(x),
        "channels_last, copied first": lambda conv, handler, x, x_last: handler.patch_means(
            x_last.contiguous()
        ),
        "channels_last, in place": lambda conv, handler, x, x_last: handler.patch_means(x_last),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, method in methods.items():
            start = time.perf_counter()
            for case in cases:
                method(*case)
            times[name].append(time.perf_counter() - start)
    load = os.getloadavg()
    median = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    print(f"GapCNN's 6 convs, batch {args.batch_size}, {args.threads} thread(s), "
          f"median of {args.repeats}, load {load[0]:.2f}:")  # fmt: skip
    for name, ms in median.items():
        print(f"  {name:28s} {ms:7.2f} ms")
    old, new = median["strided means"], median["selection products"]
    print(f"  selection products / strided means: {new / old:.3f}")
    old, new = median["channels_last, copied first"], median["channels_last, in place"]
    print(f"  channels_last in place / copied first: {new / old:.3f}")


if __name__ == "__main__":
    main()
