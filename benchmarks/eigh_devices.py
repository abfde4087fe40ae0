"""How long one symmetric eigendecomposition takes on the CPU and on a CUDA GPU.

K-FAC's refresh is one ``torch.linalg.eigh`` per exact side; the sizes here
are the gpt workload's sides (128 + 1, 3 x 128, 4 x 128 + 1 ...). Each size
is a damped random Gram matrix of full rank, in float32 (kaisa's default
``inv_dtype``); the time is the median of ``--repeats`` calls after
``--warmup`` (CUDA synchronised around each call), on the CPU with
``--threads`` threads and on every CUDA device present. Prints a table and,
with ``--json``, writes the numbers.

    python benchmarks/eigh_devices.py [--sizes 129,256,384,513] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def _matrix(n: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4 * n, n, generator=g)
    return (x.t() @ x / (4 * n) + 1e-3 * torch.eye(n)).to(device)


def time_eigh(n: int, device: str, repeats: int, warmup: int) -> float:
    """Median seconds of one ``eigh`` of an ``n x n`` float32 matrix on ``device``."""
    m = _matrix(n, device)
    cuda = device.startswith("cuda")
    times = []
    for i in range(warmup + repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.linalg.eigh(m)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="129,256,384,513")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    rows = {d: {n: time_eigh(n, d, args.repeats, args.warmup) for n in sizes} for d in devices}
    print(f"eigh, float32, median of {args.repeats} (ms); CPU with {args.threads} thread(s)")
    print("device   " + "".join(f"{n:>9}" for n in sizes))
    for d, row in rows.items():
        print(f"{d:<9}" + "".join(f"{1000 * row[n]:9.2f}" for n in sizes))
    if args.json:
        record = {
            "torch": torch.__version__,
            "threads": args.threads,
            "load_average": os.getloadavg(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "ms": {d: {str(n): 1000 * t for n, t in row.items()} for d, row in rows.items()},
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
