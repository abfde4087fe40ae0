"""Steps to a workload's target for one arm, optionally under explicit K-FAC options.

One run per seed, exactly as ``kaisa demo`` runs the arm (same model, data
order, schedule, evaluation cadence, stop at the target), for any arm of the
suite; for the kaisa arms with keyword arguments added to
``kaisa.KFACPreconditioner`` (``--kfac``, JSON) and, optionally, an
early-refresh schedule (``--early-refresh F,I``: factor and inverse
intervals 10, 20, 40, … until they reach ``F`` and ``I``), or a first phase
(``--phase F,I@S``: intervals ``F`` and ``I`` before step ``S``, those of
``--kfac`` from it on). It answers "would
this option (or this learning rate) save steps?" before a full suite run;
steps to the target do not depend on the machine's load (except through the
budget's clock calibration, whose steps are powers of √2), so two probes may
run side by side with one thread each. Nothing is asserted. Results, with
the automatic choice's intervals, clock scale and representations where
there is one, and the commit of the kaisa that ran (``library``; ``-dirty``
when its files differ from it), are printed and appended as JSON lines to
``--out``.

``--lr`` defaults to the demo's own learning rate for the workload and arm
(the sweep file's, else the fallback table's; the row's ``lr_source`` says
which). ``--max-steps N`` ends each run after N steps while keeping the full
budget's learning-rate schedule, so a target reached within N steps is
reached at the same step as in a full run; ``steps`` is ``null`` when it was
not reached (``last`` is the metric's value at the last evaluation, the
stop). Every workload works, the language model (``--workload gpt``, whose
metric is the validation loss in nats per byte, lower is better) included;
``--tied-head`` builds it with its head tied to the token embedding
(``kaisa.models.GPT(tied_head=True)``, 636,032 parameters) instead of the
suite's untied one (the row's ``tied_head`` says so), ``--zero-head`` with
its untied head initialised to zero, as modded-nanogpt initialises its
head (the row's ``zero_head`` says so), and ``--hf-gpt2``
with HuggingFace transformers' ``GPT2LMHeadModel`` of the same shape (d 128,
3 layers, 4 heads, context 64, the 256 bytes; no dropout; its head tied to
``wte`` as GPT-2's is; ``Conv1D`` projections and learned positions; the
row's ``model`` is ``'hf-gpt2'``): a language model as users bring it, not
one written here. ``--hf-llama`` likewise with ``LlamaForCausalLM`` (d 128,
3 layers, 4 heads, SwiGLU MLP 344 wide, RMSNorm, rotary positions, separate
Q/K/V/O projections without biases, an untied head; 659,328 parameters
against the ``gpt`` model's 668,800; ``model`` ``'hf-llama'``), and
``--hf-gemma`` with ``GemmaForCausalLM`` (d 128, 3 layers, 4 heads of 32,
GeGLU MLP 344 wide, RMSNorm, rotary positions, its token embedding scaled
by ``√d`` and tied to the head; 626,560 parameters; ``model`` ``'hf-gemma'``),
and ``--hf-opt`` with ``OPTForCausalLM`` (d 128, 3 layers, 4 heads, ReLU MLP
512 wide, pre-LayerNorm, learned positions looked up by their own
``forward`` from the attention mask, its head tied to the token embedding;
``model`` ``'hf-opt'``), and ``--hf-bert`` with ``BertLMHeadModel`` as a
causal LM (``is_decoder=True``; d 128, 3 post-LayerNorm layers, 4 heads,
GELU MLP 512 wide, learned positions and a token-type embedding, a
transform before the head tied to the token embedding; ``model``
``'hf-bert'``): an encoder's architecture under the workload's objective.

``--behind muon`` (the kaisa arms only) puts kaisa in front of the Muon
arm's optimizer instead of the arm's own: ``torch.optim.Muon`` on the hidden
matrices (momentum 0.95), AdamW on the rest at the workload's ratio of the
rate, exactly as the ``muon`` arm builds it, with ``--lr`` defaulting to
Muon's rate for the workload; the row's ``behind`` says so.

``--demo-args`` hands more of ``kaisa demo``'s own options to the run, as
one string (``'--batch-size 64 --eval-every 25 --eval-every-near 5'``);
the demo checks them as it checks its command line, and the row records
the string with the batch and warm-up that ran. Options the probe sets
itself (the workload, arm, rate, seeds, threads, data and output) are
refused there. ::

    python benchmarks/steps_probe.py --workload vit --arm kaisa-adamw --lr 0.008 \\
        --seeds 0,1 --kfac '{"time_budget": 1.0}'
    python benchmarks/steps_probe.py --workload gap_cnn --arm kaisa-sgd --lr 0.05 \\
        --seeds 0,1,2 --early-refresh 40,100
    python benchmarks/steps_probe.py --workload gpt --arm muon --seeds 0 --max-steps 100
    python benchmarks/steps_probe.py --workload gpt --arm kaisa-adamw --behind muon --seeds 0
    python benchmarks/steps_probe.py --workload gpt --arm muon --lr 0.04 --seeds 0 \\
        --demo-args '--batch-size 64 --eval-every 25 --eval-every-near 5'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import kfac_json, library_commit

import kaisa
from kaisa.demo import train as demo_train
from kaisa.demo.cli import DemoError, build_config, parse_args, positive_int
from kaisa.demo.config import ARM_NAMES, KAISA_ARMS, KfacConfig
from kaisa.demo.datasets import load_dataset


def early_refresh(chosen: int) -> Callable[[int], int]:
    """An interval schedule: 10, 20, 40, … (doubling from step 10) until ``chosen``."""

    def at(step: int) -> int:
        if step < 10 or step >= chosen:
            return chosen
        interval = 10
        while 2 * interval <= step:
            interval *= 2
        return min(interval, chosen)

    return at


def phase(first: int, until: int, then: object) -> Callable[[int], int]:
    """An interval schedule: ``first`` before step ``until``, ``then`` from it on."""
    if not isinstance(then, int):
        raise TypeError("the interval after the phase must be an integer in --kfac")
    after = then

    def at(step: int) -> int:
        return first if step < until else after

    return at


def _gpt_context(flag: str, name: str, context: int | None) -> int:
    """The context of the demo's ``gpt`` model that ``flag`` replaces (``ValueError`` for
    any other model)."""
    if name != "gpt" or context is None:
        raise ValueError(f"{flag} replaces the gpt workload's model only, not {name!r}")
    return context


def tied_gpt(
    name: str, image_shape: tuple[int, int, int] | None = None, *, context: int | None = None
) -> torch.nn.Module:
    """The demo's byte-level GPT, its head tied to its token embedding."""
    from kaisa.demo.text import VOCAB_SIZE
    from kaisa.models import build_model

    context = _gpt_context("--tied-head", name, context)
    return build_model(name, vocab_size=VOCAB_SIZE, context=context, tied_head=True)


def zero_head_gpt(
    name: str, image_shape: tuple[int, int, int] | None = None, *, context: int | None = None
) -> torch.nn.Module:
    """The demo's byte-level GPT, its untied head initialised to zero (as modded-nanogpt's)."""
    from kaisa.demo.text import VOCAB_SIZE
    from kaisa.models import build_model

    context = _gpt_context("--zero-head", name, context)
    model = build_model(name, vocab_size=VOCAB_SIZE, context=context)
    torch.nn.init.zeros_(model.head.weight)
    return model


class HFCausalLM(torch.nn.Module):
    """A transformers causal LM built from ``config`` by ``model_class``, returning its logits."""

    def __init__(self, model_class: str, config: Any) -> None:
        super().__init__()
        import transformers

        self.lm = getattr(transformers, model_class)(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx).logits  # type: ignore[no-any-return]


def _hf_lm(
    flag: str, name: str, context: int | None, model: str, config: str, **options: Any
) -> HFCausalLM:
    """transformers' ``model`` built from its ``config`` class with ``options`` over the
    256 bytes, in place of the demo ``gpt``'s model (``flag`` names the option in errors).

    The context goes to ``n_positions`` when ``options`` has it (GPT-2), else to
    ``max_position_embeddings``.
    """
    context = _gpt_context(flag, name, context)
    import transformers

    from kaisa.demo.text import VOCAB_SIZE

    key = "n_positions" if "n_positions" in options else "max_position_embeddings"
    options[key] = context
    return HFCausalLM(model, getattr(transformers, config)(vocab_size=VOCAB_SIZE, **options))


def hf_gpt2(
    name: str, image_shape: tuple[int, int, int] | None = None, *, context: int | None = None
) -> torch.nn.Module:
    """transformers' GPT-2 LM of the demo ``gpt``'s shape in place of the demo's GPT."""
    return _hf_lm(
        "--hf-gpt2", name, context, "GPT2LMHeadModel", "GPT2Config",
        n_positions=None, n_embd=128, n_layer=3, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def hf_llama(
    name: str, image_shape: tuple[int, int, int] | None = None, *, context: int | None = None
) -> torch.nn.Module:
    """transformers' Llama LM of about the demo ``gpt``'s size in place of the demo's GPT."""
    return _hf_lm(
        "--hf-llama", name, context, "LlamaForCausalLM", "LlamaConfig",
        hidden_size=128,
        intermediate_size=344,  # SwiGLU's three matrices at about the 4x MLP's size
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def hf_gemma(
    name: str, image_shape: tuple[int, int, int] | None = None, *, context: int | None = None
) -> torch.nn.Module:
    """transformers' Gemma LM of about the demo ``gpt``'s size in place of the demo's GPT.

    Its token embedding is a ``GemmaTextScaledWordEmbedding`` (the lookup times
    ``√d``) tied to the head, as Gemma's is.
    """
    return _hf_lm(
        "--hf-gemma", name, context, "GemmaForCausalLM", "GemmaConfig",
        hidden_size=128,
        intermediate_size=344,  # GeGLU's three matrices at about the 4x MLP's size
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        attention_dropout=0.0, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def hf_opt(
    name: str, image_shape: tuple[int, int, int] | None = None, *, context: int | None = None
) -> torch.nn.Module:
    """transformers' OPT LM of about the demo ``gpt``'s size in place of the demo's GPT.

    Its learned positions are an ``OPTLearnedPositionalEmbedding``, whose
    ``forward`` derives the positions from the attention mask (offset by 2),
    and its head is tied to the token embedding, as OPT's is.
    """
    return _hf_lm(
        "--hf-opt", name, context, "OPTForCausalLM", "OPTConfig",
        hidden_size=128, word_embed_proj_dim=128, ffn_dim=512,
        num_hidden_layers=3, num_attention_heads=4,
        dropout=0.0, attention_dropout=0.0, layerdrop=0.0, tie_word_embeddings=True,
        pad_token_id=1, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def hf_bert(
    name: str, image_shape: tuple[int, int, int] | None = None, *, context: int | None = None
) -> torch.nn.Module:
    """transformers' BERT of about the demo ``gpt``'s size, as a causal LM, in place of its GPT.

    BERT's architecture (post-LayerNorm blocks, learned positions, a token-type
    embedding, a transform before the head tied to the token embedding) as
    ``BertLMHeadModel`` with ``is_decoder=True`` runs it, causally masked: the
    workload's objective on an encoder's layers, not masked-token training.
    """
    return _hf_lm(
        "--hf-bert", name, context, "BertLMHeadModel", "BertConfig",
        hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, is_decoder=True,
        pad_token_id=0,
    )  # fmt: skip


#: ``kaisa demo`` options that ``--demo-args`` may not give: the probe sets them
#: (workload, arm, rate, threads, data, output, one process) or loops over them (seeds).
PROBE_SETS = frozenset(
    ("--workload", "--arms", "--lr", "--sgd-lr", "--kaisa-lr", "--seeds", "--threads", "--out",
     "--nproc", "--quick", "--data-dir", "--text-dir", "--stop-at-target")
)  # fmt: skip

#: Optimizers ``--behind`` can put kaisa in front of, as their arms build them.
BEHIND = ("muon",)

#: The models that replace the ``gpt`` workload's: flag, builder and the row's marker.
MODELS: dict[str, tuple[Any, tuple[str, Any]]] = {
    "--tied-head": (tied_gpt, ("tied_head", True)),
    "--zero-head": (zero_head_gpt, ("zero_head", True)),
    "--hf-gpt2": (hf_gpt2, ("model", "hf-gpt2")),
    "--hf-llama": (hf_llama, ("model", "hf-llama")),
    "--hf-gemma": (hf_gemma, ("model", "hf-gemma")),
    "--hf-opt": (hf_opt, ("model", "hf-opt")),
    "--hf-bert": (hf_bert, ("model", "hf-bert")),
}


def main(argv: list[str] | None = None, variant: str | None = None) -> int:
    """Run the probe; ``variant`` (a caller's in-process change) is recorded in each row."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", required=True)
    p.add_argument("--arm", required=True, choices=ARM_NAMES)
    p.add_argument("--lr", type=float, help="peak LR (default: the demo's for the workload/arm)")
    p.add_argument("--seeds", default="0")
    p.add_argument(
        "--kfac",
        default="{}",
        help="JSON keyword arguments for KFACPreconditioner "
        '("torch.NAME" strings become torch attributes: "torch.bfloat16")',
    )
    p.add_argument("--early-refresh", default=None, metavar="F,I")
    p.add_argument(
        "--phase",
        default=None,
        metavar="F,I@S",
        help="factor and inverse intervals F and I before step S, those of --kfac after",
    )
    p.add_argument(
        "--max-steps",
        type=positive_int,
        default=None,
        help="end each run after N steps (same schedule)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST (image workloads)")
    p.add_argument("--text-dir", default=None, help="the fortunes corpus (gpt)")
    p.add_argument(
        "--tied-head", action="store_true", help="gpt only: tie the head to the embedding"
    )
    p.add_argument("--out", type=Path, default=Path("runs/steps_probe.jsonl"))
    p.add_argument(
        "--behind",
        choices=BEHIND,
        default=None,
        help="kaisa arms only: the optimizer kaisa runs in front of (default: the arm's own)",
    )
    p.add_argument(
        "--zero-head", action="store_true", help="gpt only: its untied head initialised to zero"
    )
    p.add_argument(
        "--hf-gpt2", action="store_true", help="gpt only: HuggingFace's GPT-2 of the same shape"
    )
    p.add_argument(
        "--hf-llama", action="store_true", help="gpt only: HuggingFace's Llama of about its size"
    )
    p.add_argument(
        "--hf-gemma", action="store_true", help="gpt only: HuggingFace's Gemma of about its size"
    )
    p.add_argument(
        "--hf-opt", action="store_true", help="gpt only: HuggingFace's OPT of about its size"
    )
    p.add_argument(
        "--hf-bert",
        action="store_true",
        help="gpt only: HuggingFace's BERT of about its size, causally masked",
    )
    p.add_argument(
        "--demo-args",
        default="",
        metavar="ARGS",
        help="more options of kaisa demo for the workload, one string "
        "(for example '--batch-size 64 --warmup-steps 25')",
    )
    args = p.parse_args(argv)
    given = [flag for flag in MODELS if getattr(args, flag[2:].replace("-", "_"))]
    for flag in given:
        if args.workload != "gpt":
            p.error(f"{flag} applies to --workload gpt only, not {args.workload}")
    if len(given) > 1:
        p.error(f"{' and '.join(given)} are {len(given)} models; give one")
    build, marker = MODELS[given[0]] if given else (None, None)
    extra: dict[str, Any] = kfac_json(args.kfac)
    if not isinstance(extra, dict):
        p.error("--kfac must be a JSON object")
    if args.arm not in KAISA_ARMS and (extra or args.early_refresh or args.phase or args.behind):
        p.error(
            "--kfac, --early-refresh, --phase and --behind apply to the kaisa arms only, "
            f"not {args.arm}"
        )
    if args.early_refresh and args.phase:
        p.error("give --early-refresh or --phase, not both")
    try:
        demo_args = shlex.split(args.demo_args)
    except ValueError as exc:
        p.error(f"--demo-args: {exc}")
    for token in demo_args:
        if token.split("=")[0] in PROBE_SETS:
            p.error(
                f"--demo-args may not give {token.split('=')[0]}: the probe sets it itself "
                f"(as it does {', '.join(sorted(PROBE_SETS))})"
            )
    if isinstance(extra.get("curvature"), list):
        extra["curvature"] = tuple(extra["curvature"])
    schedule: dict[str, Any] = {}
    if args.early_refresh:
        f, i = (int(v) for v in args.early_refresh.split(","))
        schedule = {"factor_update_steps": early_refresh(f), "inv_update_steps": early_refresh(i)}
    if args.phase:
        try:
            pair, _, until = args.phase.partition("@")
            f, i = (int(v) for v in pair.split(","))
            schedule = {
                "factor_update_steps": phase(f, int(until), extra.get("factor_update_steps")),
                "inv_update_steps": phase(i, int(until), extra.get("inv_update_steps")),
            }
        except (ValueError, TypeError) as exc:
            p.error(f"--phase: expected F,I@S with --kfac giving both intervals after ({exc})")
    torch.set_num_threads(args.threads)

    made: list[kaisa.KFACPreconditioner] = []  # this seed's, for its telemetry

    def make(model: torch.nn.Module, arm: Any, optimizer: Any) -> kaisa.KFACPreconditioner:
        def current_lr(_step: int) -> float:
            return float(optimizer.param_groups[0]["lr"])

        made[:] = [
            kaisa.KFACPreconditioner(
                model, lr=current_lr, **{**arm.kfac.overrides(), **extra, **schedule}
            )
        ]
        return made[0]

    # The demo's own run with these options (and model): patched for this call only.
    saved = demo_train._make_preconditioner, demo_train.build_demo_model
    try:
        demo_train._make_preconditioner = make  # the demo's run, these options
        if build is not None:
            demo_train.build_demo_model = build
        # Behind another optimizer: that arm as the demo builds it (its rate by
        # default), with kaisa attached below.
        demo_arm = args.behind or args.arm
        argv_demo = ["--workload", args.workload, "--arms", demo_arm,
                     "--threads", str(args.threads), "--no-progress", "--stop-at-target",
                     "--out", "/tmp/steps_probe"]  # fmt: skip
        if args.lr is not None:
            argv_demo += ["--lr", f"{demo_arm}={args.lr!r}"]
        if args.data_dir:
            argv_demo += ["--data-dir", args.data_dir]
        if args.text_dir:
            argv_demo += ["--text-dir", args.text_dir]
        argv_demo += demo_args
        try:
            config = build_config(parse_args(argv_demo)).workloads[0]
        except DemoError as exc:  # the demo's own check of the options, --demo-args' included
            p.error(f"kaisa demo refused the run's options: {exc}")
        config = dataclasses.replace(config, step_limit=args.max_steps)
        arm = config.arms[0]
        if args.behind is not None:
            arm = dataclasses.replace(arm, name=args.arm, kfac=KfacConfig())
        data = load_dataset(config.dataset, config.data_dir)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        library = library_commit()
        for seed in (int(s) for s in args.seeds.split(",")):
            start = time.time()
            result = demo_train.train_arm(data, config, arm, seed, stop_at_target=True)
            hit = result.first_reaching(config.target)
            row = {
                "workload": args.workload,
                "arm": args.arm,
                "lr": arm.lr,
                "lr_source": arm.lr_source,
                "seed": seed,
                "kfac": args.kfac,
                "early_refresh": args.early_refresh,
                "phase": args.phase,
                "behind": args.behind,
                "metric": config.metric,
                "target": config.target,
                "demo_args": args.demo_args or None,
                "batch_size": config.batch_size,
                "warmup_steps": config.warmup_steps,
                "steps": None if hit is None else hit.step,
                "stopped_at": result.steps,
                "last": None if result.final_value is None else round(result.final_value, 4),
                "wall_s": round(time.time() - start, 1),
                # The training clock (no evaluation), and kaisa's share of it.
                "train_s": round(result.train_seconds, 2),
                "kfac_s": round(result.kfac_seconds, 2),
                "library": library,  # the commit of the kaisa that ran
            }
            if marker is not None:
                row[marker[0]] = marker[1]
            if variant is not None:
                row["variant"] = variant
            if made and made[0].options.eigenbasis_tolerance is not None:
                telemetry = made[0].telemetry
                row["side_refreshes"] = telemetry.side_refreshes
                row["kept_eigenbases"] = telemetry.kept_eigenbases
                if made[0].options.adaptive_intervals:  # the intervals' multiplier at the end
                    row["interval_stretch"] = made[0].interval_stretch
                    row["interval_changes"] = telemetry.interval_changes
            if made and made[0].options.stale_refresh:  # refreshes the staleness added
                row["stale_refreshes"] = made[0].telemetry.stale_refreshes
                row["side_refreshes"] = made[0].telemetry.side_refreshes
            choice = result.kfac_choice
            if choice:
                row["intervals"] = [choice["factor_update_steps"], choice["inv_update_steps"]]
                row["time_scale"] = round(float(choice.get("time_scale", 1.0)), 3)
                row["specs"] = choice["specs"]  # each layer's (A, G) representations
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        demo_train._make_preconditioner, demo_train.build_demo_model = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
