"""The iteration (spec §11; issue 30, items 1–3), in one process.

* An iteration is a transaction: however it ends without ``step()`` (a
  skipped batch, an exception in the user's code or in ``step()``, Ctrl-C
  during the backward pass, more passes than ``accumulation_steps``), the next
  one starts clean, with at most one warning, and its factors are those of
  its own passes; ``discard_captures()`` does the same silently.
* Any number of backward passes through one forward: the first output
  gradient of each call enters ``G``; later ones (retain_graph, gradient
  penalties, saliency, ``autograd.grad`` before ``backward``) neither crash
  nor change the factors.
* A layer that captures nothing on a factor-update step keeps its factors and
  second-order state.

Factors are compared with those of a fresh preconditioner that saw only the
passes that count (float64, ``factor_decay=0``: the factors are the batch's).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

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
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(2 * 4 * 4, 8)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.flatten(1)).view(-1, 2, 4)
        h, _ = self.attn(h, h, h)
        return self.fc(h.flatten(1))


def data(seed: int, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, 4, generator=gen, dtype=D), torch.randint(0, 3, (n,), generator=gen)


def make(model: nn.Module, **options: object) -> kaisa.KFACPreconditioner:
    settings: dict[str, object] = {
        "factor_decay": 0.0,
        "curvature": "exact",
        "inv_dtype": D,
        "factor_update_steps": 1,
        "inv_update_steps": 1,
        "lr": 0.1,
    }
    settings.update(options)
    return kaisa.KFACPreconditioner(model, **settings)  # type: ignore[arg-type]


def factors(pre: kaisa.KFACPreconditioner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.block.a.clone(), layer.block.g.clone()) for layer in pre.layers]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def reference(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], **options: object
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Factors after one step over ``batches`` (one pass each), from a copy of ``model``."""
    model = copy.deepcopy(model)
    pre = make(model, accumulation_steps=len(batches), **options)
    for batch in batches:
        (loss_of(model, batch) / len(batches)).backward()
    pre.step()
    return factors(pre)


def assert_factors(
    got: list[tuple[torch.Tensor, ...]], want: list[tuple[torch.Tensor, ...]]
) -> None:
    for (a, g), (a_ref, g_ref) in zip(got, want, strict=True):
        assert torch.equal(a, a_ref)
        assert torch.equal(g, g_ref)


def discard_messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "captures are discarded" in str(w.message)]


# -- 1. an iteration is a transaction ---------------------------------------------------


def _skipped(model: nn.Module, pre: kaisa.KFACPreconditioner, batch: tuple) -> None:
    loss_of(model, batch).backward()
    model.zero_grad()  # the batch is skipped: no step()


def _user_exception(model: nn.Module, pre: kaisa.KFACPreconditioner, batch: tuple) -> None:
    try:
        loss_of(model, batch).backward()
        raise ValueError("the user's code failed between backward() and step()")
    except ValueError:
        model.zero_grad()


def _schedule_raises(model: nn.Module, pre: kaisa.KFACPreconditioner, batch: tuple) -> None:
    loss_of(model, batch).backward()
    BAD_DAMPING[0] = True
    try:
        with pytest.raises(ValueError, match="damping"):
            pre.step()
    finally:
        BAD_DAMPING[0] = False
    model.zero_grad()


def _interrupted_backward(model: nn.Module, pre: kaisa.KFACPreconditioner, batch: tuple) -> None:
    """Ctrl-C between the fc's output gradient and the conv's."""

    def interrupt(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        def boom(_grad: torch.Tensor) -> None:
            raise KeyboardInterrupt

        args[0].register_hook(boom)

    handle = model.fc.register_forward_pre_hook(interrupt)  # type: ignore[union-attr]
    try:
        with pytest.raises(KeyboardInterrupt):
            loss_of(model, batch).backward()
    finally:
        handle.remove()
    model.zero_grad()


def _extra_pass(model: nn.Module, pre: kaisa.KFACPreconditioner, batch: tuple) -> None:
    loss_of(model, batch).backward()  # then the next pass, with no step() between


BAD_DAMPING = [False]

ABANDONED: dict[str, Callable[[nn.Module, kaisa.KFACPreconditioner, tuple], None]] = {
    "skipped batch": _skipped,
    "exception in user code": _user_exception,
    "schedule raises in step()": _schedule_raises,
    "Ctrl-C during backward": _interrupted_backward,
    "extra forward/backward pass": _extra_pass,
}


@pytest.mark.parametrize("in_hook", [True, False])
@pytest.mark.parametrize("how", list(ABANDONED))
def test_an_abandoned_iteration_leaves_nothing_behind(how: str, in_hook: bool) -> None:
    torch.manual_seed(0)
    model = Net().double()
    want = reference(model, [data(2)], update_factors_in_hook=in_hook)
    pre = make(
        model,
        update_factors_in_hook=in_hook,
        damping=lambda step: -1.0 if BAD_DAMPING[0] else 0.03,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ABANDONED[how](model, pre, data(1))
        loss_of(model, data(2)).backward()  # the next iteration begins: the last is dropped
        pre.step()
    assert len(discard_messages(caught)) == 1, [str(w.message) for w in caught]
    assert discard_messages(caught)[0].startswith("kaisa: a training forward began")
    mine = next(w for w in caught if "captures are discarded" in str(w.message))
    assert mine.filename == __file__
    assert pre.steps == 1
    assert_factors(factors(pre), want)
    # Later iterations: stepped or abandoned again, never an error, never another warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            model.zero_grad()
            loss_of(model, data(10 + step)).backward()
            if step % 2 == 0:
                pre.step()
    assert not discard_messages(caught)
    assert pre.steps == 3


def test_a_forward_without_backward_then_a_step_warns_once() -> None:
    """Two layers ran forward with no backward (a NaN loss skipped): one warning, not one each."""
    torch.manual_seed(0)
    model = Net().double()
    want = reference(model, [data(2)])
    pre = make(model)
    loss_of(model, data(1))  # skipped before its backward pass
    loss_of(model, data(2)).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre.step()
    assert [str(w.message) for w in caught] == [
        "kaisa: 2 layer(s) ran forward without a backward pass this step (e.g. 'conv'); "
        "their unfinished captures are dropped"
    ]
    assert_factors(factors(pre), want)


@pytest.mark.parametrize("in_hook", [True, False])
def test_discard_captures_drops_the_iteration_silently(in_hook: bool) -> None:
    torch.manual_seed(0)
    model = Net().double()
    want = reference(model, [data(2)])
    pre = make(model, update_factors_in_hook=in_hook)
    pre.discard_captures()  # nothing pending: nothing to do
    loss_of(model, data(1)).backward()
    assert pre.memory_usage()["captures"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre.discard_captures()
        assert pre.memory_usage()["captures"] == 0
        assert all(layer.micro_batches == 0 for layer in pre.layers)
        model.zero_grad()
        loss_of(model, data(2)).backward()
        pre.step()
    assert pre.steps == 1
    assert_factors(factors(pre), want)


def test_an_abandoned_accumulation_window_is_dropped_whole() -> None:
    """accumulation_steps=2: a window of two passes with no step(), then a full one."""
    torch.manual_seed(0)
    model = Net().double()
    window = [data(3), data(4)]
    want = reference(model, window)
    pre = make(model, accumulation_steps=2)
    for seed in (1, 2):
        (loss_of(model, data(seed)) / 2).backward()
    model.zero_grad()
    with pytest.warns(RuntimeWarning, match="after 2 forward/backward pass"):
        for batch in window:
            (loss_of(model, batch) / 2).backward()
    pre.step()
    assert_factors(factors(pre), want)


def test_a_partial_accumulation_window_is_dropped_by_discard_captures() -> None:
    """Fewer passes than accumulation_steps look like accumulation going on: discard says."""
    torch.manual_seed(0)
    model = Net().double()
    window = [data(3), data(4)]
    want = reference(model, window)
    pre = make(model, accumulation_steps=2)
    (loss_of(model, data(1)) / 2).backward()
    pre.discard_captures()
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in window:
            (loss_of(model, batch) / 2).backward()
        pre.step()
    assert_factors(factors(pre), want)


def test_passes_whose_forwards_run_first_still_count_as_one_iteration() -> None:
    """Two forwards, then one backward through both (two views of a batch): both count."""
    torch.manual_seed(0)
    model = Net().double()
    pre = make(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (loss_of(model, data(1)) + loss_of(model, data(2))).backward()
        pre.step()
    assert all(layer.block.updates == 1 for layer in pre.layers)


# -- 2. several backward passes through one forward -------------------------------------


def _retain_graph(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    out = model(x)
    F.cross_entropy(out, y).backward(retain_graph=True)
    out.pow(2).mean().backward()  # a second loss through the same graph


def _penalty_on_parameters(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = F.cross_entropy(model(x), y)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True)
    (loss + 0.1 * sum(g.pow(2).sum() for g in grads)).backward()


def _penalty_on_inputs(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    x = x.clone().requires_grad_(True)
    loss = F.cross_entropy(model(x), y)
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + 0.1 * grad.pow(2).sum()).backward()


def _saliency(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    x = x.clone().requires_grad_(True)
    loss = F.cross_entropy(model(x), y)
    torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward()


def _head_first(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """``autograd.grad`` of the head's weight only (reaches the head's call alone), then all."""
    loss = F.cross_entropy(model(x), y)
    torch.autograd.grad(loss, model.fc.weight, retain_graph=True)  # type: ignore[arg-type]
    loss.backward()


def _plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()


PATTERNS: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], None]] = {
    "retain_graph, two losses": _retain_graph,
    "gradient penalty on parameters": _penalty_on_parameters,
    "gradient penalty on inputs": _penalty_on_inputs,
    "input saliency": _saliency,
    "autograd.grad of one weight first": _head_first,
}


@pytest.mark.parametrize("in_hook", [True, False])
@pytest.mark.parametrize("model_kind", ["conv", "attention"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_the_first_output_gradient_of_each_call_enters_the_factors(
    pattern: str, model_kind: str, in_hook: bool
) -> None:
    torch.manual_seed(0)
    model = (Net() if model_kind == "conv" else Attention()).double()
    twin = copy.deepcopy(model)
    pre = make(model, update_factors_in_hook=in_hook)
    pre_twin = make(twin, update_factors_in_hook=in_hook)
    for step in range(3):
        x, y = data(step)
        for m, p, run in ((model, pre, PATTERNS[pattern]), (twin, pre_twin, _plain)):
            m.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                run(m, x, y)
                p.step()
        # The factors are those of the loss's own backward pass, step after step.
        assert_factors(factors(pre), factors(pre_twin))
        twin.load_state_dict(model.state_dict())  # (the extra pass changes the gradient)
    assert all(layer.block.updates == 3 for layer in pre.layers)


def test_a_backward_pass_through_a_graph_of_a_finished_iteration_is_ignored() -> None:
    torch.manual_seed(0)
    model = Net().double()
    pre = make(model)
    loss = loss_of(model, data(1))
    loss.backward(retain_graph=True)
    pre.step()
    before = factors(pre)
    loss.backward()  # the old graph again, after step(): its calls are not this iteration's
    assert pre.memory_usage()["captures"] == 0
    model.zero_grad()
    want = reference(model, [data(2)])
    loss_of(model, data(2)).backward()
    pre.step()
    assert not torch.equal(before[0][0], factors(pre)[0][0])
    assert_factors(factors(pre), want)


# -- 3. idle is not forgotten -------------------------------------------------------


class Droppable(nn.Module):
    """A residual block that a LayerDrop-style switch skips."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.drop = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if not self.drop:
            h = h + torch.tanh(self.block(h))
        return self.head(h)


def _state(pre: kaisa.KFACPreconditioner, name: str) -> dict[str, object]:
    layer = next(la for la in pre.layers if la.name == name)
    return {
        "a": layer.block.a.clone(),
        "g": layer.block.g.clone(),
        "updates": layer.block.updates,
        "second_order": {k: [t.clone() for t in v] for k, v in layer.block.second_order.items()},
    }


def _same_state(x: dict[str, object], y: dict[str, object]) -> bool:
    if x["updates"] != y["updates"] or not torch.equal(x["a"], y["a"]):  # type: ignore[arg-type]
        return False
    if not torch.equal(x["g"], y["g"]):  # type: ignore[arg-type]
        return False
    sx, sy = x["second_order"], y["second_order"]
    assert isinstance(sx, dict) and isinstance(sy, dict)
    return sx.keys() == sy.keys() and all(
        all(torch.equal(a, b) for a, b in zip(sx[k], sy[k], strict=True)) for k in sx
    )


def _step(model: nn.Module, pre: kaisa.KFACPreconditioner, seed: int, rows: int = 10) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, 6, generator=gen, dtype=D), torch.randint(0, 3, (rows,), generator=gen)
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    pre.step()


def test_a_block_layerdrop_skips_keeps_its_factors_and_second_order_state() -> None:
    torch.manual_seed(0)
    model = Droppable().double()
    pre = make(model, factor_decay=0.5)
    for seed in range(2):
        _step(model, pre, seed)
    kept = _state(pre, "block")
    model.drop = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report: it did not run
        _step(model, pre, 2)
        _step(model, pre, 3)
    block = next(la for la in pre.layers if la.name == "block")
    assert block.dormant
    assert _same_state(_state(pre, "block"), kept)
    model.drop = False
    fresh = make(copy.deepcopy(model), factor_decay=0.5)
    _step(fresh.model, fresh, 4)
    _step(model, pre, 4)
    block = next(la for la in pre.layers if la.name == "block")
    assert not block.dormant and block.block.updates == 3
    # Folded into the kept running average (decay 0.5), not started afresh.
    batch = _state(fresh, "block")
    for side in ("a", "g"):
        expected = 0.5 * kept[side] + 0.5 * batch[side]  # type: ignore[operator]
        torch.testing.assert_close(_state(pre, "block")[side], expected, rtol=1e-12, atol=0)


def test_step_called_twice_after_one_backward_keeps_curvature_and_gradients() -> None:
    torch.manual_seed(0)
    model = Droppable().double()
    pre = make(model)
    _step(model, pre, 0)
    states = {name: _state(pre, name) for name in ("inp", "block", "head")}
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre.step()  # again, with no new backward pass
    assert all(_same_state(_state(pre, n), s) for n, s in states.items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    _step(model, pre, 1)
    assert all(layer.block.updates == 2 and not layer.dormant for layer in pre.layers)


def test_a_zero_row_batch_keeps_curvature() -> None:
    torch.manual_seed(0)
    model = Droppable().double()
    pre = make(model)
    _step(model, pre, 0)
    states = {name: _state(pre, name) for name in ("inp", "block", "head")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, pre, 1, rows=0)
    assert all(_same_state(_state(pre, n), s) for n, s in states.items())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _step(model, pre, 2)
    assert all(layer.block.updates == 2 and not layer.dormant for layer in pre.layers)


def test_a_layer_frozen_for_a_while_keeps_its_curvature() -> None:
    torch.manual_seed(0)
    model = Droppable().double()
    pre = make(model)
    _step(model, pre, 0)
    kept = _state(pre, "inp")
    model.inp.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in (1, 2):
            _step(model, pre, seed)
    assert _same_state(_state(pre, "inp"), kept)
    model.inp.requires_grad_(True)
    _step(model, pre, 3)
    inp = next(la for la in pre.layers if la.name == "inp")
    assert not inp.dormant and inp.block.updates == 2
