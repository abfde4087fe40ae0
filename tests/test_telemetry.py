"""Phase timers: device synchronisation, profiler ranges, and compiled models."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import kaisa
from kaisa.telemetry import Telemetry


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
    )


def train(model: nn.Module, pre: kaisa.KFACPreconditioner, steps: int) -> list[torch.Tensor]:
    """``steps`` preconditioned steps on fixed data; the last step's gradients."""
    x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model.zero_grad()
        model(x).square().mean().backward()
        pre.step()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """A pretend accelerator: each ``torch.accelerator.synchronize`` call is recorded."""
    calls: list[object] = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_synchronize_waits_for_the_accelerator_at_each_phase_boundary(
    accelerator: list[object],
) -> None:
    telemetry = Telemetry(synchronize=True)
    with telemetry.timer("capture"):
        accelerator.append("inside")
    assert accelerator == [None, "inside", None]
    assert telemetry.phase_seconds["capture"] > 0.0
    accelerator.clear()
    with telemetry.timer("capture", torch.device("cpu")):  # nothing to wait for
        pass
    with Telemetry().timer("capture"):  # off by default
        pass
    assert accelerator == []


def test_synchronize_set_on_a_preconditioner_takes_effect(accelerator: list[object]) -> None:
    model = small_cnn()
    pre = kaisa.KFACPreconditioner.with_reference_defaults(
        model, lr=0.1, factor_update_steps=1, inv_update_steps=1
    )
    train(model, pre, 1)
    assert accelerator == []
    pre.telemetry.synchronize = True
    train(model, pre, 1)
    assert accelerator and len(accelerator) % 2 == 0  # before and after every phase


def test_synchronize_without_an_accelerator_only_times() -> None:
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    telemetry = Telemetry(synchronize=True)
    with telemetry.timer("precondition"):
        pass
    assert telemetry.phase_seconds["precondition"] > 0.0


def test_every_phase_is_a_profiler_range() -> None:
    model = small_cnn()
    pre = kaisa.KFACPreconditioner.with_reference_defaults(
        model, lr=0.1, factor_update_steps=1, inv_update_steps=1
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        train(model, pre, 1)
    names = {event.name for event in profile.events()}
    timed = {phase for phase, seconds in pre.telemetry.phase_seconds.items() if seconds > 0}
    assert {"capture", "factor_products", "decomposition", "precondition"} <= timed
    assert {f"kaisa.{phase}" for phase in timed} <= names


@pytest.fixture
def dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.usefixtures("dynamo")
def test_a_timer_traced_by_dynamo_breaks_no_graph() -> None:
    telemetry = Telemetry(synchronize=True)

    def timed(x: torch.Tensor) -> torch.Tensor:
        with telemetry.timer("capture"):
            y = x * 2
        return y + 1

    explanation = torch._dynamo.explain(timed)(torch.randn(3))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    assert telemetry.phase_seconds["capture"] == 0.0  # traced, not timed


@pytest.mark.usefixtures("dynamo")
def test_a_compiled_model_is_preconditioned_and_the_timers_break_no_graph() -> None:
    """``torch.compile`` traces the capture hooks; their timers do not break its graphs.

    The hooks' own side effects (the tensor hooks that collect ``δ``) still
    break the graph where Dynamo cannot keep them in it; the timers never do.
    """
    model = small_cnn()
    twin = copy.deepcopy(model)
    options = dict(factor_update_steps=1, inv_update_steps=1, kl_clip=None)
    eager = kaisa.KFACPreconditioner.with_reference_defaults(model, **options)
    expected = train(model, eager, 2)

    compiled_pre = kaisa.KFACPreconditioner.with_reference_defaults(twin, **options)
    compiled = torch.compile(twin, backend="aot_eager")
    got = train(compiled, compiled_pre, 2)  # type: ignore[arg-type]

    assert counters["stats"]["unique_graphs"] > 0  # the forward was compiled
    reasons = "\n".join(counters["graph_break"])
    for timer_trace in ("perf_counter", "telemetry", "generator", "ContextWrapping"):
        assert timer_trace not in reasons
    assert [layer.block.updates for layer in compiled_pre.layers] == [2, 2]
    for mine, theirs in zip(compiled_pre.layers, eager.layers, strict=True):
        torch.testing.assert_close(mine.block.a, theirs.block.a)
        torch.testing.assert_close(mine.block.g, theirs.block.g)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert compiled_pre.telemetry.phase_seconds["precondition"] > 0.0
