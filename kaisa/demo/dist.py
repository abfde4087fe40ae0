"""The ``--nproc N`` path: the same comparison in N processes through torchrun and gloo.

The parent (``kaisa demo --nproc N``) writes the configuration to
``OUT/config.json`` and starts
``python -m torch.distributed.run --standalone --nproc-per-node N --module
kaisa.demo.dist OUT/config.json``. Every worker joins a gloo process group,
wraps the model in ``DistributedDataParallel``, trains on its slice of each
global batch with ``threads`` threads, and KAISA distributes the K-FAC work
with the configured gradient-worker fraction. Rank 0 writes the outputs and
prints the table. A worker that fails writes one line to
``OUT/worker-error-RANK.txt``, which the parent reports.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

from kaisa.demo.config import DemoConfig
from kaisa.demo.data import DatasetError, load_fashion_mnist

__all__ = ["launch", "worker_main"]

LOG_NAME = "torchrun.log"


def launch(config: DemoConfig) -> tuple[int, str | None]:
    """Run ``config`` under torchrun; the exit code and a one-line error, if any."""
    out = Path(config.out_dir)
    config_path = out / "config.json"
    config_path.write_text(json.dumps(config.to_json(), indent=2) + "\n")
    for old in out.glob("worker-error-*.txt"):
        old.unlink()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(config.nproc),
        "--module",
        "kaisa.demo.dist",
        str(config_path),
    ]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(config.threads)
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
    config = DemoConfig.from_json(json.loads(Path(args[0]).read_text()))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        _run(config, rank, world)
    except Exception as exc:  # reported as one line by the parent
        line = f"rank {rank}: {type(exc).__name__}: {exc}".replace("\n", " ")
        Path(config.out_dir, f"worker-error-{rank}.txt").write_text(line + "\n")
        raise
    return 0


def _run(config: DemoConfig, rank: int, world: int) -> None:
    from kaisa.demo.compare import machine_info, run_comparison, summarize
    from kaisa.demo.report import format_table, write_outputs
    from kaisa.demo.train import DistContext

    torch.set_num_threads(config.threads)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = DistContext(rank, world)
        before = machine_info()
        start = time.perf_counter()
        try:
            data = load_fashion_mnist(config.data_dir)
        except DatasetError as exc:
            raise RuntimeError(str(exc)) from None
        runs = run_comparison(config, data, ctx)
        if ctx.is_main:
            results = summarize(config, runs, before, time.perf_counter() - start)
            paths = write_outputs(runs, results, Path(config.out_dir))
            print()
            print(format_table(results))
            for p in paths:
                print(f"wrote {p}")
        # The models (DDP reducers), preconditioners and their hooks form
        # reference cycles; collect them while the process group is alive.
        # Left to the interpreter's teardown, gloo work they still hold can
        # be destroyed after the group, which aborts the process (SIGABRT,
        # "terminate called without an active exception"; seen once in CI).
        del runs
        gc.collect()
        tdist.barrier()
    finally:
        gc.collect()
        tdist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(worker_main())
