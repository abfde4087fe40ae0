"""Run a function in ``N`` gloo (or NCCL) processes on localhost, for the multi-process tests.

:func:`run_distributed` starts ``world_size`` processes, each of which joins a
gloo process group (rendezvous through a ``TCPStore`` the parent hosts on a
port the OS picks, so there is no race for a free port), calls
``fn(rank, world_size, *args)`` and sends the return value back to the parent
(saved with ``torch.save`` in a scratch directory). It returns the per-rank
results in rank order.

Failure is loud and bounded:

* if any rank raises, the call raises :class:`DistributedTestError` with that
  rank's traceback as soon as the failure is seen (the other ranks, possibly
  stuck in a collective, are killed);
* if the processes have not all finished within ``timeout`` seconds, the call
  raises :class:`DistributedTestError` naming the ranks still running;
* no process outlives the call: whatever is still alive is killed in a
  ``finally``.

Children come from a fork server that has already imported torch, so a start
costs a fork rather than a fresh interpreter and a torch import; each uses one
intra-op thread (the test machines have few cores). ``fn`` must be a
module-level function (it is pickled by reference).
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = 120.0
_HOST = "127.0.0.1"


class DistributedTestError(AssertionError):
    """A rank failed, or the processes did not finish in time."""


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "kaisa"])  # type: ignore[attr-defined]
    return ctx


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    workdir: str,
    timeout: float,
    args: tuple[Any, ...],
    backend: str = "gloo",
) -> None:
    out = Path(workdir)
    try:
        torch.set_num_threads(1)
        if os.path.exists("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.TCPStore(
            _HOST,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world_size, *args)
        # Without a barrier, a rank that leaves early can make gloo abort the others.
        dist.barrier()
        dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.pt.tmp")
        os.replace(out / f"rank{rank}.pt.tmp", out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        # Skip interpreter teardown: a half-torn-down process group can hang there.
        os._exit(1)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    backend: str = "gloo",
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, one process per rank.

    ``backend`` is the process group's (``"nccl"`` for CUDA tensors, one GPU per rank).

    Raises :class:`DistributedTestError` with the failing rank's traceback if
    a rank raises or dies, or if the run takes longer than ``timeout`` seconds.
    """
    ctx = _context()
    store = dist.TCPStore(
        _HOST,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    processes: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kaisa-dist-") as workdir:
        try:
            for rank in range(world_size):
                proc = ctx.Process(  # type: ignore[attr-defined]
                    target=_child,
                    args=(fn, rank, world_size, store.port, workdir, timeout, args, backend),
                    name=f"kaisa-rank{rank}",
                    daemon=True,
                )
                proc.start()
                processes.append(proc)
            _wait(processes, Path(workdir), time.monotonic() + timeout, timeout)
            return [
                torch.load(Path(workdir) / f"rank{rank}.pt", weights_only=False)
                for rank in range(world_size)
            ]
        finally:
            for proc in processes:
                if proc.is_alive():
                    proc.kill()
            for proc in processes:
                proc.join(timeout=10)
            del store


def average_gradients(model: torch.nn.Module, world_size: int) -> None:
    """Every parameter's gradient summed over the ranks and divided by ``world_size``.

    What DDP does, by hand: for tests that train without a DDP wrapper. Every
    parameter must have a gradient.
    """
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)


def _wait(processes: list[Any], workdir: Path, deadline: float, timeout: float) -> None:
    """Wait for every process to exit 0; raise on the first failure or at the deadline."""
    running = dict(enumerate(processes))
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedTestError(
                f"ranks {sorted(running)} still running after {timeout:g} s "
                f"(world size {len(processes)}); killed"
            )
        ready = multiprocessing.connection.wait(
            [p.sentinel for p in running.values()], timeout=min(remaining, 1.0)
        )
        for rank, proc in list(running.items()):
            if proc.sentinel not in ready:
                continue
            proc.join()
            del running[rank]
            if proc.exitcode != 0:
                raise DistributedTestError(_failure(rank, proc.exitcode, workdir))


def _failure(rank: int, exitcode: int | None, workdir: Path) -> str:
    """The message for a failed run: the failing rank's traceback, and any other rank's."""
    errors = sorted(workdir.glob("rank*.err"))
    if not errors:
        return (
            f"rank {rank} died with exit code {exitcode} and left no traceback (a native "
            "abort, e.g. a gloo collective mismatch: see the captured stderr)"
        )
    return "\n".join(f"--- {path.stem} raised:\n{path.read_text()}" for path in errors)
