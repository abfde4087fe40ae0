"""Accumulation, schedules, resume, AMP scaling, unused layers, numerical failures."""

from __future__ import annotations

import copy
import io
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa

D = torch.float64


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.conv(x)).flatten(1))


def data(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, 4, generator=gen, dtype=D), torch.randint(0, 3, (n,), generator=gen)


def test_accumulation_equals_one_big_batch() -> None:
    """k micro-batches of size B give the factors of one batch of k·B."""
    model = Net().double()
    big = copy.deepcopy(model)
    x, y = data(12)
    pre_big = kaisa.KFACPreconditioner(big, lr=0.1, factor_decay=0.0, inv_dtype=D)
    F.cross_entropy(big(x), y).backward()
    pre_big.step()
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, factor_decay=0.0, inv_dtype=D, accumulation_steps=3
    )
    for xs, ys in zip(x.chunk(3), y.chunk(3), strict=True):
        (F.cross_entropy(model(xs), ys) / 3).backward()
    pre.step()
    for a, b in zip(pre.layers, pre_big.layers, strict=True):
        torch.testing.assert_close(a.block.a, b.block.a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a.block.g, b.block.g, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(model.fc.weight.grad, big.fc.weight.grad, rtol=1e-9, atol=1e-12)


def test_schedules_are_read_at_the_step() -> None:
    seen: dict[str, list[int]] = {"damping": [], "lr": []}

    def damping(step: int) -> float:
        seen["damping"].append(step)
        return 0.1 if step < 2 else 0.01

    def lr(step: int) -> float:
        seen["lr"].append(step)
        return 0.1 / (1 + step)

    model = Net().double()
    # Identity-initialised factors (the reference defaults): with the same batch at
    # every step, 'first_batch' would leave the factors unchanged at step 1.
    pre = kaisa.KFACPreconditioner.with_reference_defaults(
        model,
        factor_update_steps=lambda step: 1 if step < 2 else 3,
        inv_update_steps=2,
        damping=damping,
        lr=lr,
        kl_clip=1e-6,
        compute_eigenvalue_outer_product=False,
        inv_dtype=D,
    )
    x, y = data()
    history = []
    for step in range(5):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert pre.hyperparameter("damping") == damping(step)
        pre.step()
        history.append(pre.layers[0].block.a.clone())
    assert set(seen["damping"]) == set(range(5))
    assert set(seen["lr"]) == set(range(5))
    # Factors change at steps 0, 1 (interval 1) and 3 (interval 3), not at 2 or 4.
    assert not torch.equal(history[0], history[1])
    assert torch.equal(history[1], history[2])
    assert not torch.equal(history[2], history[3])
    assert torch.equal(history[3], history[4])


def test_schedule_returning_a_bad_value_names_it() -> None:
    pre = kaisa.KFACPreconditioner(Net().double(), lr=0.1, damping=lambda step: -1.0)
    x, y = data()
    F.cross_entropy(pre.model(x), y).backward()
    with pytest.raises(ValueError, match=r"damping must be .* at step 0"):
        pre.step()


def test_a_bad_schedule_value_changes_nothing() -> None:
    """Damping 1e-40 at step 1 (a singular factor would give inf/NaN): refused, state kept."""
    pre = kaisa.KFACPreconditioner(
        Net().double(),
        lr=0.1,
        damping=lambda step: 0.03 if step == 0 else 1e-40,
        factor_update_steps=1,
        inv_update_steps=1,
    )
    x, y = data()
    F.cross_entropy(pre.model(x), y).backward()
    pre.step()
    pre.model.zero_grad()
    F.cross_entropy(pre.model(x), y).backward()
    before = copy.deepcopy(pre.state_dict())
    held = pre.memory_usage()["captures"]
    grads = [p.grad.clone() for p in pre.model.parameters()]
    with pytest.raises(ValueError, match=r"damping must be a number >= 1e-12 .* at step 1"):
        pre.step()
    assert pre.steps == 1 and pre.memory_usage()["captures"] == held > 0
    after = pre.state_dict()
    for name, layer in before["layers"].items():
        assert torch.equal(layer["a"], after["layers"][name]["a"])
        assert torch.equal(layer["g"], after["layers"][name]["g"])
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, pre.model.parameters(), strict=True))


def train(
    model: nn.Module, opt: torch.optim.Optimizer, pre: kaisa.KFACPreconditioner, steps: range
) -> None:
    for step in steps:
        x, y = data(8, seed=step)
        x = x.to(next(model.parameters()).dtype)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()


@pytest.mark.parametrize(
    ("method", "relative"), [("eigen", False), ("inverse", False), ("eigen", True)]
)
def test_resume_is_bit_identical(method: str, relative: bool) -> None:
    options: dict[str, Any] = dict(
        factor_update_steps=2, inv_update_steps=3, compute_method=method, kl_clip=1e-3, lr=0.1
    )
    if relative:
        options.update(damping_mode="relative", factor_init="first_batch")
    torch.manual_seed(1)
    model = Net()
    resumed_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = kaisa.KFACPreconditioner(model, **options)
    train(model, opt, pre, range(10))

    opt2 = torch.optim.SGD(resumed_model.parameters(), lr=0.1, momentum=0.9)
    pre2 = kaisa.KFACPreconditioner(resumed_model, **options)
    train(resumed_model, opt2, pre2, range(5))
    buffer = io.BytesIO()
    torch.save(
        {"model": resumed_model.state_dict(), "opt": opt2.state_dict(), "pre": pre2.state_dict()},
        buffer,
    )
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    fresh = Net()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_pre = kaisa.KFACPreconditioner(fresh, **options)
    fresh.load_state_dict(checkpoint["model"])
    fresh_opt.load_state_dict(checkpoint["opt"])
    fresh_pre.load_state_dict(checkpoint["pre"])
    assert fresh_pre.steps == 5
    train(fresh, fresh_opt, fresh_pre, range(5, 10))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_rejects_other_layers() -> None:
    pre = kaisa.KFACPreconditioner(Net(), lr=0.1)
    other = kaisa.KFACPreconditioner(nn.Sequential(nn.Linear(2, 2)), lr=0.1)
    with pytest.raises(ValueError, match="do not match"):
        pre.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="not a KFACPreconditioner state dict"):
        pre.load_state_dict({"x": 1})


def test_grad_scaler_unscales_captured_gradients() -> None:
    model = Net().double()
    scaled = copy.deepcopy(model)
    x, y = data()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_decay=0.0, inv_dtype=D)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    scale = 1024.0
    pre_s = kaisa.KFACPreconditioner(
        scaled, lr=0.1, factor_decay=0.0, inv_dtype=D, grad_scaler=lambda: scale
    )
    (F.cross_entropy(scaled(x), y) * scale).backward()
    for p in scaled.parameters():  # what GradScaler.unscale_ does before step()
        p.grad.div_(scale)
    pre_s.step()
    for a, b in zip(pre.layers, pre_s.layers, strict=True):
        torch.testing.assert_close(a.block.g, b.block.g, rtol=1e-12, atol=1e-16)
    torch.testing.assert_close(model.fc.weight.grad, scaled.fc.weight.grad)


@pytest.mark.parametrize("exponent", [64, 80])
def test_a_huge_finite_loss_scale_leaves_g_as_without_scaling(exponent: int) -> None:
    """Float32 G at a loss scale of 2^64 (the squared scale overflows) and 2^80 (δᵀδ would)."""
    model = Net()
    scaled = copy.deepcopy(model)
    x, y = data()
    x = x.float()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_decay=0.0, factor_update_steps=1)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    scale = 2.0**exponent
    pre_s = kaisa.KFACPreconditioner(
        scaled, lr=0.1, factor_decay=0.0, factor_update_steps=1, grad_scaler=lambda: scale
    )
    (F.cross_entropy(scaled(x), y) * scale).backward()
    for p in scaled.parameters():
        p.grad.div_(scale)
    pre_s.step()
    assert pre_s.telemetry.skipped_factor_updates == 0
    for a, b in zip(pre.layers, pre_s.layers, strict=True):
        assert b.block.g.abs().sum() > 0
        torch.testing.assert_close(a.block.g, b.block.g, rtol=1e-5, atol=1e-12)


def test_kl_clipping_holds_when_lr_squared_overflows() -> None:
    from kaisa.curvature.linalg import kl_clip_scale

    p, g = torch.ones(3, dtype=D), torch.full((3,), 2.0, dtype=D)
    for lr in (0.1, 1e100, 1e200):
        expected = math.sqrt(1e-3 / 6.0) / lr  # sqrt(κ / (lr² Σ P∇)), exactly
        assert kl_clip_scale([(p, g)], lr, 1e-3) == pytest.approx(expected, rel=1e-12)
    assert kl_clip_scale([(p, g)], 0.0, 1e-3) == 1.0


def test_a_bias_frozen_after_registration_is_not_moved() -> None:
    model = Net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    model.fc.bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    frozen = model.fc.bias.detach().clone()
    x, y = data()
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x.float()), y).backward()
        pre.step()
        assert model.fc.bias.grad is None
        opt.step()
    assert torch.equal(model.fc.bias, frozen)


def test_a_weight_frozen_after_registration_with_a_stale_gradient_is_not_written() -> None:
    """zero_grad(set_to_none=False) leaves zeros in a weight frozen later: kaisa keeps them."""
    model = Net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    x, y = data()
    F.cross_entropy(model(x.float()), y).backward()
    pre.step()
    model.zero_grad(set_to_none=False)
    model.fc.weight.requires_grad_(False)
    F.cross_entropy(model(x.float()), y).backward()
    raw_bias = model.fc.bias.grad.clone()
    pre.step()
    assert torch.equal(model.fc.weight.grad, torch.zeros_like(model.fc.weight))
    assert torch.equal(model.fc.bias.grad, raw_bias)  # its layer is left raw


def test_grad_scaler_object_is_read() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    model = Net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, grad_scaler=scaler)
    reader = pre.loss_scale.reader()
    assert reader is not None and reader() == 64.0


def test_overflow_step_does_not_reach_factors() -> None:
    model = Net().double()
    # Factor updates at every step (the reference defaults), so step 1 would fold.
    pre = kaisa.KFACPreconditioner.with_reference_defaults(model, lr=0.1, inv_dtype=D)
    x, y = data()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    a_before = [layer.block.a.clone() for layer in pre.layers]
    g_before = [layer.block.g.clone() for layer in pre.layers]
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    model.fc.weight.grad[0, 0] = float("inf")  # what an AMP overflow leaves behind
    pre.step()
    assert pre.telemetry.skipped_factor_updates == 1
    for layer, a, g in zip(pre.layers, a_before, g_before, strict=True):
        assert torch.equal(layer.block.a, a) and torch.equal(layer.block.g, g)
    # The next finite step proceeds normally.
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    assert not torch.equal(pre.layers[0].block.a, a_before[0])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_large_finite_factors_are_not_mistaken_for_overflow() -> None:
    """Finite factors whose float32 sum overflows are still folded in."""
    model = nn.Sequential(nn.Linear(8, 3))
    # Exact curvature: A is the full gram, whose sum overflows float32.
    pre = kaisa.KFACPreconditioner.with_reference_defaults(model, lr=0.1, factor_decay=0.0)
    x = torch.full((4, 8), 4e18)
    F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
    pre.step()
    a = pre.layers[0].block.a
    assert torch.isfinite(a).all() and not torch.isfinite(a.sum())
    assert pre.telemetry.skipped_factor_updates == 0
    torch.testing.assert_close(a[0, 0], torch.tensor(1.6e37), rtol=1e-5, atol=0.0)


def test_layer_with_all_zero_inputs_is_not_folded() -> None:
    """A zero ``A`` (its trace is 0) means nothing was captured: factors stay as they were."""
    model = nn.Sequential(nn.Linear(4, 3, bias=False))
    pre = kaisa.KFACPreconditioner.with_reference_defaults(model, lr=0.1, factor_decay=0.0)
    F.cross_entropy(model(torch.zeros(5, 4)), torch.zeros(5, dtype=torch.long)).backward()
    pre.step()
    block = pre.layers[0].block
    assert block.updates == 0
    assert torch.equal(block.a, torch.eye(4)) and torch.equal(block.g, torch.eye(3))


def test_nan_input_leaves_factors_and_state_intact() -> None:
    model = Net().double()
    # Factor updates at every step (the reference defaults): step 1 captures the NaN.
    pre = kaisa.KFACPreconditioner.with_reference_defaults(model, lr=0.1, inv_dtype=D)
    x, y = data()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    state = copy.deepcopy(pre.state_dict())
    model.zero_grad()
    x_bad = x.clone()
    x_bad[0, 0, 0, 0] = float("nan")
    F.cross_entropy(model(x_bad), y).backward()
    pre.step()
    for layer in pre.layers:
        saved = state["layers"][layer.name]
        assert torch.equal(layer.block.a, saved["a"]) and torch.equal(layer.block.g, saved["g"])


def test_a_layer_used_outside_its_module_call_is_reported_and_left_raw() -> None:
    """A registered layer whose weight is used functionally captures nothing."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = F.linear(x, self.inner.weight, self.inner.bias).tanh()
            return self.head(hidden)

    model = Functional()
    pre = kaisa.KFACPreconditioner(model, kl_clip=None, factor_update_steps=1)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    for step in range(3):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw_inner = model.inner.weight.grad.clone()
        raw_head = model.head.weight.grad.clone()
        if step == 0:
            with pytest.warns(RuntimeWarning, match="'inner' captured nothing") as caught:
                pre.step()
            assert sum("captured nothing" in str(w.message) for w in caught) == 1
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # reported once only
                pre.step()
        assert torch.equal(model.inner.weight.grad, raw_inner)
        assert not torch.equal(model.head.weight.grad, raw_head)
    inner = next(layer for layer in pre.layers if layer.name == "inner")
    # Dormant: raw gradient, factors kept (it never captured: the identity's).
    assert inner.dormant and inner.block.updates == 0
    treatments = {t.parameter: t for t in pre.coverage()}
    assert treatments["inner.weight"].kind == "raw"
    assert "captured nothing" in treatments["inner.weight"].reason
    # Once it captures again it is preconditioned again.
    model.forward = lambda x: model.head(model.inner(x).tanh())  # type: ignore[method-assign]
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw_inner = model.inner.weight.grad.clone()
    pre.step()
    inner = next(layer for layer in pre.layers if layer.name == "inner")
    assert not inner.dormant
    assert not torch.equal(model.inner.weight.grad, raw_inner)


def test_eval_mode_and_no_grad_forward_capture_nothing() -> None:
    model = Net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1)
    x, _y = data(4)
    with torch.no_grad():
        model(x.float())
    model.eval()
    model(x.float()).sum().backward()
    assert pre.memory_usage()["captures"] == 0
    model.train()
    model(x.float()).sum().backward()
    assert pre.memory_usage()["captures"] > 0


def test_memory_usage_by_category() -> None:
    model = Net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, compute_eigenvalue_outer_product=True)
    usage = pre.memory_usage()
    a_conv, g_conv, a_fc, g_fc = 2 * 9 + 1, 4, 64 + 1, 3
    factors = 4 * (a_conv**2 + g_conv**2 + a_fc**2 + g_fc**2)
    assert usage["factors"] == factors
    second = 4 * sum(a * a + g * g + a + g + a * g for a, g in ((a_conv, g_conv), (a_fc, g_fc)))
    assert usage["second_order"] == second
    assert usage["captures"] == 0
    assert usage["total"] == factors + second
    assert usage["captures_peak"] == 0


def test_decomposition_failure_keeps_model_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Exact curvature decomposed at every step (the reference defaults).
    pre = kaisa.KFACPreconditioner.with_reference_defaults(model, lr=0.1)
    train(model, opt, pre, range(2))

    def broken(*_: object, **__: object) -> None:
        raise torch.linalg.LinAlgError("forced")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.warns(RuntimeWarning, match="could not be decomposed"):
        train(model, opt, pre, range(2, 4))
    assert pre.telemetry.failed_decompositions > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_remove_hooks() -> None:
    model = Net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1)
    pre.remove_hooks()
    model(data(2)[0].float())
    assert pre.memory_usage()["captures"] == 0


@pytest.mark.parametrize("estimator", ["expand", "reduce"])
def test_channels_last_model_trains_like_a_contiguous_one(estimator: str) -> None:
    """Memory format is a layout, not maths: the same steps give the same weights."""
    torch.manual_seed(0)
    contiguous = Net().to(D)
    models = [contiguous, copy.deepcopy(contiguous).to(memory_format=torch.channels_last)]
    weights = []
    for index, model in enumerate(models):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pre = kaisa.KFACPreconditioner(
            model,
            lr=0.1,
            factor_update_steps=1,
            inv_update_steps=2,
            conv_factor_estimator=estimator,
            inv_dtype=D,
        )
        for step in range(4):
            x, y = data(8, seed=step)
            if index == 1:
                x = x.contiguous(memory_format=torch.channels_last)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
        if index == 1:
            assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(weights[0], weights[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def factors_of_one_pass(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> list[tuple[torch.Tensor, ...]]:
    model = copy.deepcopy(model)
    model.zero_grad()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_decay=0.0, curvature="exact", inv_dtype=D)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return [(layer.block.a.clone(), layer.block.g.clone()) for layer in pre.layers]


def test_a_forward_without_backward_leaves_no_trace_in_the_factors() -> None:
    model = Net().double()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_decay=0.0, curvature="exact", inv_dtype=D)
    x0, _ = data(seed=1)
    x, y = data(seed=2)
    expected = factors_of_one_pass(model, x, y)
    model(x0 * 100.0)  # never backpropagated
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match="without a backward pass"):
        pre.step()
    for layer, (a, g) in zip(pre.layers, expected, strict=True):
        torch.testing.assert_close(layer.block.a, a)
        torch.testing.assert_close(layer.block.g, g)


@pytest.mark.parametrize("in_hook", [True, False])
def test_a_pass_beyond_accumulation_steps_begins_a_new_iteration(in_hook: bool) -> None:
    """Issue 30: the earlier pass is discarded with a warning, never a step() refused."""
    model = Net().double()
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, curvature="exact", accumulation_steps=1, update_factors_in_hook=in_hook
    )
    x0, _ = data(seed=1)
    x, y = data(seed=3)
    expected = factors_of_one_pass(model, x, y)
    F.cross_entropy(model(x0), y).backward()
    with pytest.warns(RuntimeWarning, match="after 1 forward/backward pass.* discarded"):
        F.cross_entropy(model(x), y).backward()
    pre.step()
    assert pre.steps == 1
    for layer, (a, g) in zip(pre.layers, expected, strict=True):
        torch.testing.assert_close(layer.block.a, a)
        torch.testing.assert_close(layer.block.g, g)


def test_fewer_passes_than_accumulation_steps_warn() -> None:
    model = Net().double()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, accumulation_steps=3)
    x, y = data(seed=3)
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(
        RuntimeWarning, match=r"1 forward/backward pass\(es\) .* accumulation_steps=3"
    ):
        pre.step()
    assert all(layer.block.updates == 1 for layer in pre.layers)


def test_a_deep_copy_of_the_model_does_not_capture_into_the_preconditioner() -> None:
    model = Net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, factor_update_steps=1)
    twin = copy.deepcopy(model)
    x, y = data()
    F.cross_entropy(twin(x.float()), y).backward()
    assert pre.memory_usage()["captures"] == 0
    assert all(layer.micro_batches == 0 for layer in pre.layers)


def test_an_outlier_batch_is_not_folded_and_a_lasting_scale_is_taken_in() -> None:
    from kaisa.curvature.block import OUTLIER_PATIENCE

    model = Net().double()
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, factor_update_steps=1, inv_update_steps=1, curvature="exact", inv_dtype=D
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(scale: float, seed: int) -> None:
        x, y = data(seed=seed)
        opt.zero_grad()
        F.cross_entropy(model(x * scale), y).backward()
        pre.step()
        opt.step()

    for seed in range(3):
        step(1.0, seed)
    conv = pre.layers[0].block
    clean = conv.a.diagonal().sum().item()
    step(1e6, 10)  # one batch of inputs x 1e6: held back
    assert conv.a.diagonal().sum().item() == pytest.approx(clean)
    assert conv.outliers == 1 and pre.telemetry.outlier_factor_updates == 0
    with pytest.warns(RuntimeWarning, match="outlier batch"):
        step(1.0, 11)  # back to the average's scale: the held batch was an outlier
    assert pre.telemetry.outlier_factor_updates == len(pre.layers)  # both layers took it
    assert conv.a.diagonal().sum().item() < 10 * clean  # the spike never entered
    # A lasting change of scale: held OUTLIER_PATIENCE times, then taken in.
    for k in range(OUTLIER_PATIENCE):
        step(1e3, 20 + k)
        assert conv.a.diagonal().sum().item() < 10 * clean
    step(1e3, 30)
    assert conv.a.diagonal().sum().item() > 1e3 * clean
    assert conv.outliers == 0
    state = pre.state_dict()
    assert state["layers"][pre.layers[0].name]["outliers"] == 0


def test_a_scale_still_climbing_after_a_held_batch_is_taken_in_without_a_warning() -> None:
    """As attention starts to learn, its factors jump over the outlier ratio in one
    update and stay far above the old average in the next (HuggingFace BERT: x1600-9800,
    then x110-700): the scale changed, so the second batch restarts the average and
    nothing is reported as an outlier batch. Here the loss is scaled: G by its square."""
    from kaisa.curvature.block import OUTLIER_RATIO, RESCALE_RATIO

    model = Net().double()
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, factor_update_steps=1, inv_update_steps=1, curvature="exact", inv_dtype=D
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: only G's scale moves

    def step(loss_scale: float, seed: int) -> None:
        x, y = data(seed=seed)
        opt.zero_grad()
        (loss_scale * F.cross_entropy(model(x), y)).backward()
        pre.step()
        opt.step()

    def g_traces() -> list[float]:
        return [layer.block.g.diagonal().sum().item() for layer in pre.layers]

    for seed in range(3):
        step(1.0, seed)
    clean = g_traces()
    step(OUTLIER_RATIO**0.5 * 3, 10)  # G x ~9000: held on every layer
    assert g_traces() == pytest.approx(clean)
    assert all(layer.block.outliers == 1 for layer in pre.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no outlier warning
        step(RESCALE_RATIO**0.5 * 3, 11)  # G x ~300: still far beyond the old average
    assert pre.telemetry.outlier_factor_updates == 0
    assert all(layer.block.outliers == 0 for layer in pre.layers)
    # Each average restarted from that batch: over RESCALE_RATIO x where it was.
    assert all(now > RESCALE_RATIO * before for now, before in zip(g_traces(), clean, strict=True))


def test_a_forgotten_unscale_is_reported_once() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    pre = kaisa.KFACPreconditioner(model, lr=0.1, grad_scaler=scaler)
    x, y = data()

    def iteration(unscale: bool) -> None:
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x.float()), y)).backward()
        if unscale:
            scaler.unscale_(opt)
        pre.step()
        scaler.step(opt)
        scaler.update()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        iteration(unscale=True)  # the documented order: silent
    with pytest.warns(RuntimeWarning, match=r"call scaler.unscale_\(optimizer\)") as caught:
        iteration(unscale=False)
        iteration(unscale=False)
    assert sum("unscale_" in str(w.message) for w in caught) == 1
