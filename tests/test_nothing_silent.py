"""Nothing silent (issue 30, item 4), in one process.

* The model left in evaluation mode while gradients exist: one warning that
  names the cause and the fix (``model.train()``); an evaluation loop between
  training steps says nothing.
* A second preconditioner on the same layers (a notebook cell run twice)
  takes over from the first, with a warning naming it and ``remove_hooks()``:
  the gradient is preconditioned once, and the first refuses ``step()``.
* Preconditioners dropped without ``remove_hooks()`` do not live on through
  their hooks: the hooks hold them weakly and are removed when they are
  collected.
* The model changed after construction (a registered layer replaced or
  removed, a module with parameters added) is reported at the next
  ``step()``, once per change.

(On several ranks, one rank in evaluation mode: ``tests/distributed/test_eval_mode.py``.)
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=gen), torch.randint(0, 3, (6,), generator=gen)


def make(net: nn.Module, **options: object) -> kaisa.KFACPreconditioner:
    settings: dict[str, object] = {
        "curvature": "exact",
        "factor_update_steps": 1,
        "inv_update_steps": 1,
        "lr": 0.1,
    }
    settings.update(options)
    return kaisa.KFACPreconditioner(net, **settings)  # type: ignore[arg-type]


def backward(net: nn.Module, seed: int = 0) -> None:
    x, y = batch(seed)
    F.cross_entropy(net(x), y).backward()


def hooks(net: nn.Module) -> int:
    """Forward and forward-pre hooks on every module of ``net``."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())


def messages(caught: list[warnings.WarningMessage], text: str) -> list[str]:
    return [str(w.message) for w in caught if text in str(w.message)]


# -- evaluation mode -----------------------------------------------------------------


def test_eval_mode_with_gradients_warns_once() -> None:
    net = model()
    pre = make(net)
    net.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            net.zero_grad()
            backward(net, step)
            raw = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
            pre.step()
            # Nothing was captured: the gradients stay raw.
            assert all(torch.equal(p.grad, r) for p, r in zip(net.parameters(), raw, strict=True))
    found = messages(caught, "evaluation mode")
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "model.train()" in found[0]
    # Back in training mode, kaisa preconditions again.
    net.train()
    net.zero_grad()
    backward(net)
    raw = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    pre.step()
    assert not torch.equal(net[0].weight.grad, raw[0])


def test_eval_mode_of_the_registered_layers_is_reported_too() -> None:
    """A wrapper whose own flag says training while every registered layer evaluates."""
    net = model()
    wrapper = nn.Sequential(net)
    pre = make(wrapper)
    net.eval()
    with pytest.warns(RuntimeWarning, match=r"evaluation mode.*model\.train\(\)"):
        backward(wrapper)
        pre.step()


def test_evaluation_between_training_steps_is_silent() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    pre = make(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            optimizer.zero_grad()
            backward(net, step)
            pre.step()
            optimizer.step()
            net.eval()
            with torch.no_grad():
                net(batch(10 + step)[0])
            net.train()
        # step() with no forward at all in training mode (twice after one backward).
        pre.step()


# -- a second preconditioner on the same model ----------------------------------------


def test_second_preconditioner_takes_over() -> None:
    net = model()
    reference = copy.deepcopy(net)
    single = make(reference)
    backward(reference)
    single.step()

    first = make(net)
    alone = hooks(net)
    with pytest.warns(UserWarning, match=r"already preconditioned by KFACPreconditioner") as rec:
        second = make(net)
    text = str(rec[0].message)
    assert "remove_hooks()" in text and "'0'" in text
    assert hooks(net) == alone  # the first one's hooks are gone
    backward(net)
    second.step()
    # Preconditioned once: as a single preconditioner does.
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"replaced by a newer KFACPreconditioner"):
        first.step()


def test_second_preconditioner_after_remove_hooks_is_silent() -> None:
    net = model()
    first = make(net)
    first.remove_hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = make(net)
    backward(net)
    second.step()


def test_preconditioners_on_disjoint_layers_coexist() -> None:
    net = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        front = make(net, skip_layers=["^2$"])
        back = make(net[2])
    backward(net)
    front.step()
    back.step()
    assert [layer.name for layer in front.layers] == ["0"]


# -- dropped preconditioners ------------------------------------------------------------


def test_dropped_preconditioners_are_collected_with_their_hooks() -> None:
    net = model()
    baseline = hooks(net)
    refs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (each takes over from the one before)
        for step in range(30):
            pre = make(net)
            backward(net, step)
            pre.step()
            refs.append(weakref.ref(pre))
            del pre
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0
    assert hooks(net) == baseline


def test_a_dropped_preconditioner_leaves_nothing_behind() -> None:
    """Without a second one to take over: its hooks go when it is collected."""
    net = model()
    baseline = hooks(net)
    pre = make(net)
    assert hooks(net) > baseline
    backward(net)
    pre.step()
    ref = weakref.ref(pre)
    del pre
    gc.collect()
    assert ref() is None
    assert hooks(net) == baseline
    backward(net)  # the model still trains, with nothing of kaisa attached


# -- the model changed after construction ----------------------------------------------


def test_replaced_layer_is_reported_once() -> None:
    net = model()
    pre = make(net)
    backward(net)
    pre.step()
    net[2] = nn.Linear(8, 3)
    with pytest.warns(UserWarning, match=r"model changed") as rec:
        net.zero_grad()
        backward(net, 1)
        pre.step()
    text = " ".join(messages(list(rec), "model changed"))
    assert "'2'" in text and "replaced or removed" in text and "added" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net.zero_grad()
        backward(net, 2)
        pre.step()


def test_added_module_is_reported() -> None:
    net = model()
    pre = make(net, factor_update_steps=5)
    backward(net)
    pre.step()
    net.add_module("extra", nn.Linear(3, 3))
    with pytest.warns(UserWarning, match=r"model changed.*'extra' \(Linear\)"):
        net.zero_grad()
        backward(net, 1)
        pre.step()


def test_removed_layer_is_reported() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))
    pre = make(net)
    backward(net)
    pre.step()
    del net[2]
    with pytest.warns(UserWarning, match=r"model changed.*'2' \(Linear\).*replaced or removed"):
        net.zero_grad()
        backward(net, 1)
        pre.step()
