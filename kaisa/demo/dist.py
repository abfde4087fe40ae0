"""The ``--nproc N`` path: the same suite in N processes through torchrun and gloo.

The parent (``kaisa demo --nproc N``) writes the suite's configuration to
``OUT/config.json`` and starts
``python -m torch.distributed.run --standalone --nproc-per-node N --module
kaisa.demo.dist OUT/config.json``. Every worker joins a gloo process group,
wraps each model in ``DistributedDataParallel`` (every arm, whatever its
optimizer, steps on the averaged gradients), trains on its slice of each
global batch with ``threads`` threads, and KAISA distributes the K-FAC work
(the library's default gradient-worker fraction unless
``--grad-worker-fraction`` is given). Rank 0 writes the outputs and prints
the tables. A worker that fails writes one line to
``OUT/worker-error-RANK.txt``, which the parent reports.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from kaisa.demo.config import SuiteConfig
from kaisa.demo.data import DatasetError
from kaisa.demo.datasets import load_suite_data

__all__ = ["launch", "worker_main"]

LOG_NAME = "torchrun.log"


def launch(suite: SuiteConfig) -> tuple[int, str | None]:
    """Run ``suite`` under torchrun; the exit code and a one-line error, if any."""
    out = Path(suite.out_dir)
    config_path = out / "config.json"
    config_path.write_text(json.dumps(suite.to_json(), indent=2) + "\n")
    for old in out.glob("worker-error-*.txt"):
        old.unlink()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(suite.nproc),
        "--module",
        "kaisa.demo.dist",
        str(config_path),
    ]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(suite.workloads[0].threads)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    log_path = out / LOG_NAME
    with log_path.open("w") as log:
        code = subprocess.call(cmd, env=env, stdin=subprocess.DEVNULL, stderr=log)
    if code == 0:
        return 0, None
    errors = sorted(out.glob("worker-error-*.txt"))
    if errors:
        message = errors[0].read_text().strip().splitlines()[0]
    else:
        message = f"torchrun exited with code {code}"
    return code or 1, f"{message} (log: {log_path})"


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of one worker process (started by torchrun)."""
    args = sys.argv[1:] if argv is None else argv
    suite = SuiteConfig.from_json(json.loads(Path(args[0]).read_text()))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        _run(suite, rank, world)
    except Exception as exc:  # reported as one line by the parent
        line = f"rank {rank}: {type(exc).__name__}: {exc}".replace("\n", " ")
        Path(suite.out_dir, f"worker-error-{rank}.txt").write_text(line + "\n")
        raise
    return 0


def _run(suite: SuiteConfig, rank: int, world: int) -> None:
    from kaisa.demo.suite import run_suite
    from kaisa.demo.train import DistContext

    torch.set_num_threads(suite.workloads[0].threads)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = DistContext(rank, world)
        try:
            data = load_suite_data(suite.workloads)
        except DatasetError as exc:
            raise RuntimeError(str(exc)) from None
        # run_suite drops each workload's models (DDP reducers), preconditioners
        # and hooks, which form reference cycles, and collects them while the
        # process group is alive. Left to the interpreter's teardown, gloo work
        # they still hold can be destroyed after the group, which aborts the
        # process (SIGABRT, "terminate called without an active exception";
        # seen once in CI).
        run_suite(suite, data, ctx)
        gc.collect()
        tdist.barrier()
    finally:
        gc.collect()
        tdist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(worker_main())
