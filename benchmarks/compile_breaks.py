"""Graph breaks and step time of a ``torch.compile`` d model with and without kaisa.

For each model (kaisa's ``GPT`` and ``GapCNN``, a tiny HuggingFace
``LlamaForCausalLM`` when transformers is installed) and each arm:

* ``plain``: the compiled model, no preconditioner;
* ``kaisa``: the compiled model with a ``KFACPreconditioner`` on it (its
  capture hooks run inside the compiled forward);

it reports the graphs and graph breaks of the compiled training forward
(``torch._dynamo.explain`` on a factor-update step, where the hooks capture;
the backward graphs follow the forward's), then the median milliseconds of a
whole compiled training step (forward, backward, ``preconditioner.step()``
for ``kaisa``, SGD) and of the same step run eagerly. ``kaisa`` runs
factors and inverses at the defaults' intervals (the automatic choice), so
its median mixes factor-update steps and plain ones. Everything runs in
this process, one thread by default; nothing is asserted.

Examples::

    PYTHONPATH=. python benchmarks/compile_breaks.py
    PYTHONPATH=. python benchmarks/compile_breaks.py --backend aot_eager --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import format_table, load_average, machine_info, set_threads, write_json
from torch import nn

import kaisa
from kaisa.models import GPT, GapCNN

RESULTS = Path(__file__).resolve().parent / "results" / "compile_breaks.json"

Batch = tuple[torch.Tensor, torch.Tensor]


def _gpt() -> tuple[nn.Module, Batch, Callable[[Any, Batch], torch.Tensor]]:
    model = GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4, context=16)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    return (
        model,
        (idx[:, :-1], idx[:, 1:]),
        lambda out, b: F.cross_entropy(out.flatten(0, 1), b[1].flatten()),
    )


def _gapcnn() -> tuple[nn.Module, Batch, Callable[[Any, Batch], torch.Tensor]]:
    model = GapCNN(width=8)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 28, 28, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    return model, (x, y), lambda out, b: F.cross_entropy(out, b[1])


def _llama() -> tuple[nn.Module, Batch, Callable[[Any, Batch], torch.Tensor]] | None:
    try:
        import transformers as hf
    except ImportError:
        return None
    config = hf.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = hf.LlamaForCausalLM(config)
    idx = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    return model, (idx, idx), lambda out, b: out.loss


def _forward(run: nn.Module, batch: Batch) -> Any:
    if isinstance(run, GPT) or isinstance(getattr(run, "_orig_mod", None), GPT):
        return run(batch[0])
    if type(batch[0]) is torch.Tensor and batch[0].dtype == torch.long:
        return run(input_ids=batch[0], labels=batch[1])
    return run(batch[0])


def _explain(model: nn.Module, batch: Batch) -> dict[str, Any]:
    torch._dynamo.reset()
    result = torch._dynamo.explain(lambda b: _forward(model, b))(batch)
    reasons = sorted({str(r.reason).splitlines()[0][:160] for r in result.break_reasons})
    return {
        "graphs": result.graph_count,
        "graph_breaks": result.graph_break_count,
        "reasons": reasons,
    }


def _time(step: Callable[[], None], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(name: str, build: Callable[[], Any], arm: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model, batch, loss_of = build()
    model.train()
    pre = None
    if arm == "kaisa":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pre = kaisa.KFACPreconditioner(model, lr=0.01)
    row: dict[str, Any] = {"model": name, "arm": arm}
    row.update(_explain(model, batch))
    if pre is not None:
        pre.discard_captures()  # the explained forward has no backward
    torch._dynamo.reset()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for compiled in (False, True):
        run = torch.compile(model, backend=args.backend) if compiled else model

        def step(run: nn.Module = run) -> None:
            optimizer.zero_grad()
            loss_of(_forward(run, batch), batch).backward()
            if pre is not None:
                pre.step()
            optimizer.step()

        start = time.perf_counter()
        step()  # compiles
        row["compile_s" if compiled else "first_eager_s"] = time.perf_counter() - start
        row["compiled_ms" if compiled else "eager_ms"] = _time(step, args.steps, args.warmup)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="gpt,llama,gapcnn")
    parser.add_argument("--json", default=str(RESULTS))
    args = parser.parse_args()
    set_threads(args.threads)
    builders: dict[str, Callable[[], Any]] = {"gpt": _gpt, "gapcnn": _gapcnn, "llama": _llama}
    rows = []
    load_before = load_average()
    for name in args.models.split(","):
        if name == "llama" and _llama() is None:
            print("transformers not installed: llama skipped")
            continue
        for arm in ("plain", "kaisa"):
            rows.append(measure(name, builders[name], arm, args))
            r = rows[-1]
            print(
                f"{name:7s} {arm:6s} graphs {r['graphs']:3d} breaks {r['graph_breaks']:3d} "
                f"eager {r['eager_ms']:7.2f} ms compiled {r['compiled_ms']:7.2f} ms",
                flush=True,
            )
    headers = ("model", "arm", "graphs", "breaks", "eager ms", "compiled ms")
    table = [
        (
            r["model"],
            r["arm"],
            str(r["graphs"]),
            str(r["graph_breaks"]),
            f"{r['eager_ms']:.2f}",
            f"{r['compiled_ms']:.2f}",
        )
        for r in rows
    ]
    print(format_table(headers, table))
    for r in rows:
        if r["reasons"]:
            print(f"{r['model']} {r['arm']}: " + " | ".join(r["reasons"]))
    write_json(
        args.json,
        {
            "command": " ".join(["python", *sys.argv]),
            "backend": args.backend,
            "threads": args.threads,
            "steps": args.steps,
            "machine": machine_info(),
            "load_before": load_before,
            "load_after": load_average(),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
