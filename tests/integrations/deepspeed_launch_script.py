"""Run by ``test_deepspeed.test_deepspeed_launcher_on_cpu`` under the ``deepspeed`` launcher.

Each process trains the test's model with kaisa on ZeRO-0 and on ZeRO-2 and
rank 0 writes the largest difference of the final weights (and what the
launcher gave it) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_deepspeed import _distance, _setup, _train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the launcher
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ds = _setup(rank, world_size)
    import torch.distributed as dist

    zero0 = _train(ds, rank, 0)
    zero2 = _train(ds, rank, 2)
    if rank == 0:
        result = {
            "world_size": dist.get_world_size(),
            "steps": zero2["steps"],
            "clipped": zero2["clipped"],
            "max_difference": _distance(zero2["weights"], zero0["weights"]),
        }
        args.out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
