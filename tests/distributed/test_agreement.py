"""Ranks set up differently fail fast at construction, on every rank (spec §10).

Two gloo ranks build preconditioners that differ in one thing each (damping,
KL clip, a layer's shape, the factor interval, the gradient-worker fraction):
every rank must raise :class:`~kaisa.distributed.agreement.RankDisagreementError`
naming the option or layer and both ranks' values, and nothing may hang; ranks
set up alike construct and step. All cases run in one spawned launch (process
start-up dominates the cost). The digest and its comparison are also checked
in one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_distributed
from torch import nn

import kaisa
from kaisa.distributed.agreement import (
    MAX_LISTED,
    RankDisagreementError,
    agreement_digest,
    agreement_timeout,
    check_agreement,
    describe,
    differences,
    header,
)
from kaisa.distributed.plan import LayerShape, make_plan
from kaisa.options import KFACOptions
from kaisa.profiles import PROFILE_DEFAULTS


def _model(width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 2))


#: name -> (rank 0's changes, rank 1's changes, text every rank's error must hold).
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]] = {
    "agree": ({}, {}, ()),
    "damping": (
        {"damping": 0.03},
        {"damping": 0.01},
        ("ranks disagree on damping: rank 0 has 0.03, rank 1 has 0.01",),
    ),
    "kl_clip": (
        {"kl_clip": 0.003},
        {"kl_clip": None},
        ("kl_clip: rank 0 has 0.003, rank 1 has None",),
    ),
    "layer_shape": (
        {},
        {"width": 6},
        (
            "layers[0].g_size (layer '0'): rank 0 has 4, rank 1 has 6",
            "layers[1].a_size (layer '2'): rank 0 has 5, rank 1 has 7",
        ),
    ),
    "factor_update_steps": (
        {"factor_update_steps": 10},
        {"factor_update_steps": 5},
        ("factor_update_steps: rank 0 has 10, rank 1 has 5",),
    ),
    "grad_worker_fraction": (
        {"grad_worker_fraction": 0.5},
        {"grad_worker_fraction": 1.0},
        ("grad_workers per layer (from grad_worker_fraction): rank 0 has 1, rank 1 has 2",),
    ),
    "agree_again": ({}, {}, ()),
}


def _cases(rank: int, world_size: int) -> dict[str, str | None]:
    """Each case's error message on this rank (``None``: constructed and stepped)."""
    out: dict[str, str | None] = {}
    for name, changes in CASES.items():
        kwargs = {
            "factor_update_steps": 1,
            "inv_update_steps": 1,
            "factor_decay": 0.9,
            "curvature": "exact",
            "lr": 0.1,
            **changes[rank],
        }
        model = _model(kwargs.pop("width", 4))
        try:
            precond = kaisa.KFACPreconditioner(model, **kwargs)
        except RankDisagreementError as error:
            out[name] = str(error)
            continue
        torch.manual_seed(1 + rank)
        model(torch.randn(4, 3)).square().sum().backward()
        precond.step()  # the collectives work after an agreeing check
        precond.remove_hooks()
        out[name] = None
    return out


def test_disagreeing_ranks_fail_fast_on_every_rank() -> None:
    results = run_distributed(_cases, 2, timeout=120)
    for name, (_, _, expected) in CASES.items():
        for rank, messages in enumerate(results):
            message = messages[name]
            if not expected:
                assert message is None, f"{name}: rank {rank} raised {message}"
                continue
            assert message is not None, f"{name}: rank {rank} did not raise"
            assert message.startswith("kaisa: ranks disagree on "), message
            for text in expected:
                assert text in message, f"{name}: rank {rank}: {message}"
        if expected:  # every rank reports the same differences
            assert results[0][name] == results[1][name]


# -- one process ---------------------------------------------------------------


def _digest(world_size: int = 2, sizes: tuple[int, ...] = (4,), **kwargs: Any) -> dict[str, object]:
    options = KFACOptions(**{"lr": 0.1, **kwargs})
    layers = [(f"fc{i}", 3 + i, g) for i, g in enumerate(sizes)]
    plan = make_plan(
        [LayerShape(n, a, g) for n, a, g in layers],
        world_size,
        options.grad_worker_fraction,
        options.assignment_strategy,
        options.colocate_factors,
    )
    return agreement_digest(options, plan, layers, factor_dtype=torch.float32)


def test_digest_records_what_must_agree() -> None:
    digest = _digest(sizes=(4, 5), damping=0.01, lr=lambda step: 0.1, kl_clip=None)
    assert digest["world_size"] == 2
    assert digest["grad_workers"] == 2  # comm-opt
    assert digest["damping"] == 0.01
    assert digest["lr"] == "schedule"
    assert digest["kl_clip"] is None
    assert digest["factor_update_steps"] == "auto"
    assert digest["layers"] == 2
    assert (digest["layers[1].name"], digest["layers[1].a_size"], digest["layers[1].g_size"]) == (
        "fc1",
        4,
        5,
    )
    assert digest["factor_dtype"] == "float32"
    assert digest["curvature"] == [[".*", [None, None]]]
    for key in (
        "inv_update_steps",
        "factor_decay",
        "accumulation_steps",
        "compute_method",
        "compute_eigenvalue_outer_product",
        "symmetry_aware",
        "assignment_strategy",
        "colocate_factors",
        "allreduce_bucket_cap_mb",
        "damping_mode",
        "factor_init",
        "time_budget",
        "update_factors_in_hook",
        "eigenbasis_tolerance",
        "adaptive_intervals",
        "factor_sample",
        "inv_dtype",
        "profile",
    ):
        assert key in digest


def test_digest_is_deterministic_and_sensitive() -> None:
    base = _digest()
    assert header(base).tolist() == header(_digest()).tolist()
    assert header(base).shape == (3,) and header(base).dtype == torch.int64
    # Two schedules are compared by their values at step 0 (later steps: ScheduleCheck).
    assert header(_digest(lr=lambda s: 0.1)).tolist() == header(_digest(lr=lambda s: 0.1)).tolist()
    assert header(_digest(lr=lambda s: 0.1)).tolist() != header(_digest(lr=lambda s: 0.2)).tolist()
    assert _digest(lr=lambda s: 0.1 / (s - 0))["lr (at step 0)"] == float("inf")  # (raises)
    for other in (
        _digest(damping=0.01),
        _digest(lr=lambda s: 0.1),
        _digest(kl_clip=None),
        _digest(sizes=(5,)),
        _digest(sizes=(4, 4)),
        _digest(grad_worker_fraction=0.5),
        _digest(world_size=4),
        _digest(factor_update_steps=5),
        _digest(curvature="diagonal"),
        _digest(compute_method="inverse"),
        _digest(eigenbasis_tolerance=0.1),
        _digest(factor_sample=0.5),
    ):
        assert header(other).tolist() != header(base).tolist()
        assert differences([base, other])
    # The profile alone makes a difference (a rank whose model has no embedding,
    # say), named as such beside the options it set.
    profiled = _digest(profile="language-model")
    named = dict(differences([base, profiled]))
    assert "profile" in named and "eigenvalue_correction" in named
    # The same options given explicitly under the other profile still differ by it.
    explicit = _digest(profile="general", **PROFILE_DEFAULTS["language-model"])
    assert dict(differences([explicit, profiled])).keys() == {"profile"}
    # adaptive_intervals alone makes a difference.
    tolerant = _digest(eigenbasis_tolerance=0.05)
    adaptive = _digest(eigenbasis_tolerance=0.05, adaptive_intervals=True)
    assert header(adaptive).tolist() != header(tolerant).tolist()
    assert differences([tolerant, adaptive])
    # The same tolerance given as an int and as a float is the same option.
    same = _digest(eigenbasis_tolerance=0), _digest(eigenbasis_tolerance=0.0)
    assert header(same[0]).tolist() == header(same[1]).tolist()


def test_describe_names_every_difference() -> None:
    a, b = _digest(sizes=(4,)), _digest(sizes=(4, 6), damping=0.01)
    assert describe([a, a]) is None
    message = describe([a, b, a])
    assert message is not None
    assert "damping: rank 0 has 0.03, rank 1 has 0.01, rank 2 has 0.03" in message
    assert "layers: rank 0 has 1, rank 1 has 2, rank 2 has 1" in message
    assert "layers[1].g_size (layer 'fc1'): rank 0 has <absent>, rank 1 has 6" in message
    many = _digest(sizes=tuple(range(1, 20)))
    capped = describe([_digest(sizes=tuple(range(2, 21))), many])
    assert capped is not None and "more differences" in capped
    assert capped.count("rank 0 has") == MAX_LISTED


def test_check_is_a_no_op_without_a_process_group() -> None:
    check_agreement(_digest())


def test_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAISA_AGREEMENT_TIMEOUT_S", raising=False)
    assert agreement_timeout() == 300.0
    monkeypatch.setenv("KAISA_AGREEMENT_TIMEOUT_S", "2.5")
    assert agreement_timeout() == 2.5
    monkeypatch.setenv("KAISA_AGREEMENT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="KAISA_AGREEMENT_TIMEOUT_S"):
        agreement_timeout()


def _silent_peer(rank: int, world_size: int) -> tuple[str, float] | str:
    import os
    import time

    from kaisa.distributed.comm import CollectiveTimeoutError

    os.environ["KAISA_COLLECTIVE_TIMEOUT_S"] = "2"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_update_steps=1)
    model(torch.randn(3, 4)).sum().backward()
    if rank == 1:
        time.sleep(8.0)  # alive, but never calls step()
        return "silent"
    start = time.monotonic()
    try:
        pre.step()
    except CollectiveTimeoutError as error:
        return str(error), time.monotonic() - start
    return "step() returned"


def test_a_silent_peer_is_an_error_after_kaisas_timeout_not_a_hang() -> None:
    """A rank alive but never in step(): the others fail within KAISA_COLLECTIVE_TIMEOUT_S."""
    first, second = run_distributed(_silent_peer, 2, timeout=60)
    assert second == "silent"
    assert isinstance(first, tuple), first
    message, seconds = first
    assert "a peer has not reached step()" in message and "KAISA_COLLECTIVE_TIMEOUT_S" in message
    assert 1.5 < seconds < 7.0  # the 2 s timeout, not the process group's 30 minutes


def test_collective_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kaisa.distributed.comm import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, collective_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout() == DEFAULT_TIMEOUT_S == 600.0
    monkeypatch.setenv(TIMEOUT_ENV, "12.5")
    assert collective_timeout() == 12.5
    for bad in ("0", "-3", "soon", "inf", "nan"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"{TIMEOUT_ENV} must be a number of seconds > 0"):
            collective_timeout()
