"""Checkpoints that are wrong, from other options, or from before representations.

:meth:`kaisa.KFACPreconditioner.load_state_dict` checks everything before it
changes anything: a table of bad checkpoints (a wrong shape in a later layer,
bad counters, missing keys, wrong types, NaN or Inf in factors and
second-order tensors, wrong second-order tensor counts and shapes, finite
but wrong second-order state such as negated eigenvalues or eigenvalue
products and bases that are not orthonormal, malformed curvature choices and
options, unknown format versions) must each raise with
a message naming the problem and leave the preconditioner bit-identical, so
that its next step equals that of a preconditioner that never saw the load.
A checkpoint written with another compute method, damping mode or outer
product is converted: the next step equals a fresh computation from the same
factors (and a dense float64 reference). A mixed-representation
preconditioner round-trips bit-identically; a format-1 checkpoint (no
``"format"``) loads into all-exact layers only.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.checkpoint import STATE_FORMAT
from kaisa.curvature.costs import SideSpec
from kaisa.curvature.representations import checkpoint_shapes, make_side


class Net(nn.Module):
    """Three layers: A sides 7, 9, 9 (with bias), G sides 8, 8, 3."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=gen, dtype=torch.float64).to(dtype)
    return x, torch.randint(0, 3, (16,), generator=gen)


def run(
    model: nn.Module, pre: kaisa.KFACPreconditioner, steps: range, offset: int = 0
) -> list[list[torch.Tensor]]:
    """Train ``steps`` steps with plain SGD; the preconditioned gradients of each."""
    dtype = next(model.parameters()).dtype
    grads = []
    for step in steps:
        x, y = batch(step + offset, dtype)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        grads.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)  # type: ignore[operator]
    return grads


def saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` after a trip through ``torch.save`` / ``torch.load``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # type: ignore[no-any-return]


def assert_same(x: object, y: object, where: str = "state") -> None:
    """Bit-identical nested dicts / lists / tensors (same keys, order, dtypes, values)."""
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor), where
        assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), where
        assert torch.equal(x, y), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and list(x) == list(y), f"{where}: {list(x)} != {y!r}"
        for key in x:
            assert_same(x[key], y[key], f"{where}[{key!r}]")
    elif isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y), where  # type: ignore[arg-type]
        for i, (a, b) in enumerate(zip(x, y, strict=True)):  # type: ignore[call-overload]
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert type(x) is type(y) and x == y, f"{where}: {x!r} != {y!r}"


def everything(pre: kaisa.KFACPreconditioner) -> dict[str, Any]:
    """All a load could change: the state dict and what is not in it."""
    return {
        "state": pre.state_dict(),
        "plan": pre.plan,
        "choice": pre.curvature_choice,
        "pending": pre.choice_pending,
        "force": pre.inverse_update_due,
        "capture": pre.capturing,
        "blocks": [(layer.curvature, layer.block.updates) for layer in pre.layers],
        "keys": [layer.capture_keys for layer in pre.layers],
        "second_order": [
            [[t.clone() for t in state] for state in layer.block.second_order.values()]
            for layer in pre.layers
        ],
        "hyper": {
            name: pre.hyperparameter(name)
            for name in ("factor_update_steps", "inv_update_steps", "factor_decay", "damping")
        },
    }


def assert_unchanged(before: dict[str, Any], pre: kaisa.KFACPreconditioner) -> None:
    after = everything(pre)
    for key in before:
        if key in ("plan", "choice"):
            assert before[key] == after[key], key
        else:
            assert_same(before[key], after[key], key)


# -- a table of bad checkpoints -------------------------------------------------------------

#: Fixed mixed curvature: a low-rank A with its warm start and an exact G;
#: Kronecker vectors and a diagonal; an all-exact layer with the outer product.
MIXED = {"fc1": ("lowrank:3", "exact"), "fc2": ("kvec", "diagonal"), "fc3": "exact"}
FIXED: dict[str, Any] = dict(
    curvature=MIXED,
    factor_update_steps=1,
    inv_update_steps=2,
    factor_decay=0.8,
    damping=0.01,
    kl_clip=1e-3,
    lr=0.1,
)
#: A well-formed automatic choice that agrees with MIXED.
CHOICE: dict[str, Any] = dict(
    specs={"fc1": ("lowrank:3", "exact"), "fc2": ("kvec", "diagonal"), "fc3": ("exact", "exact")},
    factor_update_steps=1,
    inv_update_steps=2,
    kfac_work=1.0,
    training_work=10.0,
    budget=0.1,
    within_budget=True,
)
TRAINED = 3  # the next step (3) refreshes no second-order state: a corrupted one shows


def donor_state(options: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    """A good checkpoint that differs from the targets' state everywhere."""
    torch.manual_seed(99)
    model = Net()
    pre = kaisa.KFACPreconditioner(model, **options)
    run(model, pre, range(steps), offset=100)
    return saved(pre.state_dict())


def layer(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda state: state["layers"][name]  # type: ignore[no-any-return]


def set_key(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(state: dict[str, Any]) -> None:
        target: Any = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value(target[path[-1]]) if callable(value) else value

    return mutate


def del_key(*path: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(state: dict[str, Any]) -> None:
        target: Any = state
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


def poisoned(value: float, index: tuple[int, ...] = (0,)) -> Callable[[torch.Tensor], torch.Tensor]:
    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[index] = value
        return t

    return poison


def format_1(state: dict[str, Any]) -> None:
    for key in ("format", "options", "curvature_choice"):
        del state[key]
    for entry in state["layers"].values():
        del entry["representation"]


NAN, INF = float("nan"), float("inf")
SO = "second_order"
BAD: list[tuple[str, Callable[[dict[str, Any]], None], type[Exception], str]] = [
    # shapes, later layers
    (
        "factor shape, last layer",
        set_key(("layers", "fc3", "a"), torch.eye(8)),
        ValueError,
        r"layer 'fc3': factor A has shape \(8, 8\), expected \(9, 9\)",
    ),
    (
        "moments shape, middle layer",
        set_key(("layers", "fc2", "g"), torch.zeros(3, 8)),
        ValueError,
        r"layer 'fc2': factor G has shape \(3, 8\), expected \(2, 8\)",
    ),
    (
        "eigenvalue shape, last layer",
        set_key(("layers", "fc3", SO, "g", 1), torch.ones(4)),
        ValueError,
        r"layer 'fc3': second-order state of 'g' does not match the representations "
        r"\['exact', 'exact'\] \(A, G\) and compute method 'eigen': expected eigenvectors "
        r"\(3, 3\), eigenvalues \(3,\); got \[\(3, 3\), \(4,\)\]",
    ),
    (
        "second-order count, low rank",
        set_key(("layers", "fc1", SO, "a"), lambda ts: ts[:2]),
        ValueError,
        r"layer 'fc1': second-order state of 'a' does not match .*expected basis U \(7, 3\), "
        r"eigenvalues \(3,\), sigma \(1,\); got \[\(7, 3\), \(3,\)\]",
    ),
    (
        "second-order count, eigen as inverse",
        set_key(("layers", "fc3", SO, "a"), lambda ts: ts[:1]),
        ValueError,
        r"layer 'fc3': second-order state of 'a' does not match",
    ),
    (
        "second-order of one side only",
        del_key("layers", "fc3", SO, "g"),
        ValueError,
        r"layer 'fc3': 'second_order' must hold the sides 'a' and 'g'; got \['a'\]",
    ),
    (
        "outer product shape",
        set_key(("layers", "fc3", "outer_inverse"), torch.ones(9, 3)),
        ValueError,
        r"layer 'fc3': eigenvalue outer product has shape \(9, 3\), expected \(3, 9\)",
    ),
    (
        "outer product missing",
        del_key("layers", "fc3", "outer_inverse"),
        ValueError,
        r"layer 'fc3': the state dict lacks 'outer_inverse'",
    ),
    (
        "outer product on a mixed layer",
        set_key(("layers", "fc1", "outer_inverse"), torch.ones(8, 7)),
        ValueError,
        r"layer 'fc1': the state dict holds an eigenvalue outer product",
    ),
    (
        "warm-start shape",
        set_key(("layers", "fc1", "warm_start", "a"), torch.zeros(7, 3)),
        ValueError,
        r"layer 'fc1': low-rank warm-start basis of A has shape \(7, 3\), expected \(7, 7\)",
    ),
    (
        "warm start for an exact side",
        set_key(("layers", "fc1", "warm_start", "g"), torch.zeros(8, 8)),
        ValueError,
        r"layer 'fc1': 'warm_start' holds a basis for G, which is held as 'exact'",
    ),
    # counters
    (
        "updates negative",
        set_key(("layers", "fc2", "updates"), -1),
        ValueError,
        r"layer 'fc2': state dict 'updates' must be an integer >= 0; got -1",
    ),
    (
        "updates a float",
        set_key(("layers", "fc3", "updates"), 2.0),
        TypeError,
        r"layer 'fc3': state dict 'updates' must be an integer >= 0; got 2.0",
    ),
    (
        "steps negative",
        set_key(("steps",), -3),
        ValueError,
        r"state_dict 'steps' must be an integer >= 0; got -3",
    ),
    (
        "steps a bool",
        set_key(("steps",), True),
        TypeError,
        r"state_dict 'steps' must be an integer >= 0; got True",
    ),
    (
        "world size 0",
        set_key(("world_size",), 0),
        ValueError,
        r"state_dict 'world_size' must be an integer >= 1; got 0",
    ),
    # missing and unexpected keys
    (
        "missing factor",
        del_key("layers", "fc3", "g"),
        ValueError,
        r"layer 'fc3': its state lacks the keys \['g'\]",
    ),
    (
        "missing steps",
        del_key("steps"),
        ValueError,
        r"not a KFACPreconditioner state dict \(format 2\): it lacks the keys \['steps'\]",
    ),
    (
        "missing representation",
        del_key("layers", "fc2", "representation"),
        ValueError,
        r"layer 'fc2': its state lacks the keys \['representation'\]",
    ),
    (
        "missing option",
        del_key("options", "damping_mode"),
        ValueError,
        r"state_dict 'options' is malformed: missing \['damping_mode'\]",
    ),
    (
        "missing layer",
        del_key("layers", "fc3"),
        ValueError,
        r"layers do not match the registered layers: missing \['fc3'\]",
    ),
    (
        "unexpected layer key",
        set_key(("layers", "fc1", "extra"), 1),
        ValueError,
        r"layer 'fc1': its state holds unexpected keys 'extra'",
    ),
    # wrong types
    ("not a dict", lambda s: s.clear(), ValueError, r"not a KFACPreconditioner state dict"),
    (
        "factor a list",
        set_key(("layers", "fc2", "a"), lambda t: t.tolist()),
        TypeError,
        r"layer 'fc2': factor A must be a tensor; got list",
    ),
    (
        "factor of integers",
        set_key(("layers", "fc3", "a"), lambda t: t.long()),
        TypeError,
        r"layer 'fc3': factor A must be a floating-point tensor; got dtype torch.int64",
    ),
    (
        "complex eigenvalues",
        set_key(("layers", "fc3", SO, "a", 1), lambda t: t.to(torch.complex64)),
        TypeError,
        r"layer 'fc3': eigenvalues of A must be a floating-point tensor",
    ),
    (
        "layers a list",
        set_key(("layers",), lambda layers: list(layers.values())),
        TypeError,
        r"state_dict 'layers' must be a dict of layer states; got list",
    ),
    (
        "layer state a string",
        set_key(("layers", "fc2"), "fc2"),
        TypeError,
        r"layer 'fc2': its state must be a dict; got str",
    ),
    (
        "representation a string",
        set_key(("layers", "fc2", "representation"), "kvec"),
        TypeError,
        r"layer 'fc2': 'representation' must be a pair \(A, G\) of strings",
    ),
    (
        "second order a tensor",
        set_key(("layers", "fc3", SO, "a"), torch.eye(9)),
        TypeError,
        r"layer 'fc3': second-order state of 'a' must be a list of tensors; got Tensor",
    ),
    # not finite
    (
        "NaN in eigenvectors",
        set_key(("layers", "fc3", SO, "a", 0), poisoned(NAN, (2, 1))),
        ValueError,
        r"layer 'fc3': eigenvectors of A holds NaN or Inf",
    ),
    (
        "Inf in eigenvalues",
        set_key(("layers", "fc1", SO, "g", 1), poisoned(INF)),
        ValueError,
        r"layer 'fc1': eigenvalues of G holds NaN or Inf",
    ),
    (
        "NaN in a low-rank basis",
        set_key(("layers", "fc1", SO, "a", 0), poisoned(NAN)),
        ValueError,
        r"layer 'fc1': basis U of A holds NaN or Inf",
    ),
    (
        "NaN in a factor",
        set_key(("layers", "fc2", "g"), poisoned(NAN, (1, 0))),
        ValueError,
        r"layer 'fc2': factor G holds NaN or Inf",
    ),
    (
        "a factor that overflows float32",
        set_key(("layers", "fc3", "a"), lambda t: t.double() * 1e300),
        ValueError,
        r"layer 'fc3': factor A holds NaN or Inf \(as torch.float32\)",
    ),
    (
        "Inf in the outer product",
        set_key(("layers", "fc3", "outer_inverse"), poisoned(-INF)),
        ValueError,
        r"layer 'fc3': eigenvalue outer product holds NaN or Inf",
    ),
    (
        "NaN in a warm start",
        set_key(("layers", "fc1", "warm_start", "a"), poisoned(NAN)),
        ValueError,
        r"layer 'fc1': low-rank warm-start basis of A holds NaN or Inf",
    ),
    # representations, options, choice, format
    (
        "other representation",
        set_key(("layers", "fc2", "representation"), ["kvec", "kvec"]),
        ValueError,
        r"layer 'fc2': the state dict holds representations \['kvec', 'kvec'\] \(A, G\), "
        r"this preconditioner \['kvec', 'diagonal'\]",
    ),
    (
        "unknown compute method",
        set_key(("options", "compute_method"), "cholesky"),
        ValueError,
        r"state_dict 'options': compute_method must be one of \('eigen', 'inverse'\); "
        r"got 'cholesky'",
    ),
    (
        "outer product not a bool",
        set_key(("options", "compute_eigenvalue_outer_product"), 1),
        TypeError,
        r"compute_eigenvalue_outer_product must be one of \(True, False\); got 1",
    ),
    (
        "choice not a dict",
        set_key(("curvature_choice",), "auto"),
        TypeError,
        r"state_dict 'curvature_choice' must be a dict or None; got str",
    ),
    (
        "choice without a field",
        set_key(("curvature_choice",), {k: v for k, v in CHOICE.items() if k != "budget"}),
        ValueError,
        r"'curvature_choice' is malformed: missing \['budget'\]",
    ),
    (
        "choice with a bad interval",
        set_key(("curvature_choice",), {**CHOICE, "factor_update_steps": 0}),
        ValueError,
        r"'curvature_choice': 'factor_update_steps' must be an integer >= 1; got 0",
    ),
    (
        "choice with a bad representation",
        set_key(
            ("curvature_choice",), {**CHOICE, "specs": {**CHOICE["specs"], "fc2": ("kvec", "x")}}
        ),
        ValueError,
        r"'curvature_choice' is malformed: specs\['fc2'\]: curvature representation must be",
    ),
    (
        "choice with a single representation",
        set_key(("curvature_choice",), {**CHOICE, "specs": {**CHOICE["specs"], "fc3": "exact"}}),
        TypeError,
        r"'curvature_choice' is malformed: specs\['fc3'\] must be a pair \(A, G\)",
    ),
    (
        "choice with specs as a list",
        set_key(("curvature_choice",), {**CHOICE, "specs": [("exact", "exact")]}),
        TypeError,
        r"'curvature_choice' is malformed: 'specs' must map layer names to \(A, G\)",
    ),
    (
        "choice against the fixed curvature",
        set_key(
            ("curvature_choice",), {**CHOICE, "specs": {**CHOICE["specs"], "fc2": ("kvec", "kvec")}}
        ),
        ValueError,
        r"state_dict holds G of layer 'fc2' as 'kvec', but curvature fixes it to 'diagonal'",
    ),
    (
        "unknown format version",
        set_key(("format",), STATE_FORMAT + 1),
        ValueError,
        r"state_dict has format version 3; this kaisa reads versions 1 and 2",
    ),
    # Finite but wrong second-order state (issue 30, item 5): it would precondition
    # wrongly, even uphill, until the next inverse update.
    (
        "outer product negated",
        set_key(("layers", "fc3", "outer_inverse"), lambda t: -t),
        ValueError,
        r"layer 'fc3': the eigenvalue outer product 'outer_inverse' has entries <= 0",
    ),
    (
        "outer product of other eigenvalues",
        set_key(("layers", "fc3", "outer_inverse"), lambda t: t.flip(0)),
        ValueError,
        r"layer 'fc3': the eigenvalue outer product 'outer_inverse' is not 1 ⊘ \(λ_G λ_Aᵀ \+ γ\)",
    ),
    (
        "eigenvalues negated",
        set_key(("layers", "fc3", "second_order", "g", 1), lambda t: -t),
        ValueError,
        r"layer 'fc3': second-order state of G: negative eigenvalues",
    ),
    (
        "eigenbasis not orthonormal",
        set_key(("layers", "fc1", "second_order", "g", 0), lambda t: 2 * t),
        ValueError,
        r"layer 'fc1': second-order state of G: the eigenbasis is not orthonormal",
    ),
    (
        "low-rank basis not orthonormal",
        set_key(("layers", "fc1", "second_order", "a", 0), lambda t: t + 0.5),
        ValueError,
        r"layer 'fc1': second-order state of A: the eigenbasis is not orthonormal",
    ),
    (
        "low-rank sigma negative",
        set_key(("layers", "fc1", "second_order", "a", 2), lambda t: -t - 1.0),
        ValueError,
        r"layer 'fc1': second-order state of A: negative sigma",
    ),
    (
        "diagonal negative",
        set_key(("layers", "fc2", "second_order", "g", 0), lambda t: -t - 1.0),
        ValueError,
        r"layer 'fc2': second-order state of G: negative diagonal entries",
    ),
    (
        "format a string",
        set_key(("format",), "2"),
        TypeError,
        r"state_dict 'format' must be an integer; got '2'",
    ),
    (
        "format 1 into mixed layers",
        format_1,
        ValueError,
        r"written before curvature representations \(format 1, exact curvature only\), but "
        r"this preconditioner holds layer 'fc1' as \('lowrank:3', 'exact'\)",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [pytest.param(m, e, msg, id=name) for name, m, e, msg in BAD],
)
def test_a_bad_checkpoint_is_refused_and_changes_nothing(
    mutate: Callable[[dict[str, Any]], None], error: type[Exception], message: str
) -> None:
    good = donor_state(FIXED)
    bad = copy.deepcopy(good)
    mutate(bad)
    torch.manual_seed(0)
    model = Net()
    reference_model = copy.deepcopy(model)
    pre = kaisa.KFACPreconditioner(model, **FIXED)
    reference = kaisa.KFACPreconditioner(reference_model, **FIXED)
    run(model, pre, range(TRAINED))
    run(reference_model, reference, range(TRAINED))
    before = everything(pre)
    with pytest.raises(error, match=message):
        pre.load_state_dict(bad)
    assert_unchanged(before, pre)
    # The next step is the one of a preconditioner that never saw the load.
    got = run(model, pre, range(TRAINED, TRAINED + 2))
    expected = run(reference_model, reference, range(TRAINED, TRAINED + 2))
    for step_got, step_expected in zip(got, expected, strict=True):
        for g, e in zip(step_got, step_expected, strict=True):
            assert torch.equal(g, e)
    # Teeth: without the mutation the same checkpoint loads.
    pre.load_state_dict(good)
    assert pre.steps == 4


@pytest.mark.parametrize(
    ("options", "mutate", "message"),
    [
        (
            {"compute_method": "inverse"},
            set_key(("layers", "fc2", "second_order", "a", 0), lambda t: -t),
            r"layer 'fc2': second-order state of A: the damped inverse has a diagonal entry <= 0",
        ),
        (
            {"eigenvalue_correction": "adam"},
            set_key(("layers", "fc2", "eigen_scales"), lambda t: t - 1.0),
            r"layer 'fc2': negative eigenvalue-corrected scales",
        ),
    ],
    ids=["inverse negated", "corrected scales negative"],
)
def test_finite_but_wrong_state_of_other_methods_is_refused(
    options: dict[str, Any], mutate: Callable[[dict[str, Any]], None], message: str
) -> None:
    """As the table's rows, for the inverse method and the eigenvalue correction."""
    settings = {**FIXED, "curvature": "exact", **options}
    good = donor_state(settings)
    bad = copy.deepcopy(good)
    mutate(bad)
    torch.manual_seed(0)
    model = Net()
    pre = kaisa.KFACPreconditioner(model, **settings)
    run(model, pre, range(TRAINED))
    before = everything(pre)
    with pytest.raises(ValueError, match=message):
        pre.load_state_dict(bad)
    assert_unchanged(before, pre)
    pre.load_state_dict(good)


def test_not_a_dict_is_a_type_error() -> None:
    pre = kaisa.KFACPreconditioner(Net(), **FIXED)
    state = pre.state_dict()
    with pytest.raises(TypeError, match=r"state_dict must be a dict .*; got list"):
        pre.load_state_dict([state])  # type: ignore[arg-type]


# -- a refused load does not adopt the checkpoint's automatic choice -------------------------

PENDING: dict[str, Any] = dict(
    curvature={"fc1": ("lowrank:3", "auto"), "fc2": "auto", "fc3": ("auto", "exact")},
    time_budget=1e-6,  # every free side goes to the cheapest rung
    factor_update_steps=1,
    inv_update_steps=2,
    factor_decay=0.8,
    lr=0.1,
)


@pytest.mark.filterwarnings("ignore:kaisa. time_budget")
@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        pytest.param(
            set_key(("layers", "fc3", "g"), poisoned(NAN, (0, 0))),
            ValueError,
            r"layer 'fc3': factor G holds NaN",
            id="NaN in the last layer",
        ),
        pytest.param(
            set_key(("curvature_choice", "specs", "fc2"), ("lowrank:20", "diagonal")),
            ValueError,
            r"'lowrank:20' has a rank above the factor's side 9",
            id="a rank above the side",
        ),
        pytest.param(
            set_key(("curvature_choice", "inv_update_steps"), "2"),
            TypeError,
            r"'inv_update_steps' must be an integer >= 1; got '2'",
            id="an interval as a string",
        ),
        pytest.param(
            set_key(("curvature_choice", "specs"), {"fc1": ("lowrank:3", "diagonal")}),
            ValueError,
            r"'curvature_choice' names other layers than registered",
            id="other layers",
        ),
        pytest.param(
            set_key(("layers", "fc2", "representation"), ["exact", "exact"]),
            ValueError,
            r"layer 'fc2': the state dict holds representations \['exact', 'exact'\]",
            id="representations other than the choice",
        ),
        pytest.param(
            set_key(("curvature_choice",), None),
            ValueError,
            r"no automatic curvature choice but holds folded factors",
            id="no choice for the auto sides",
        ),
    ],
)
def test_a_refused_load_leaves_the_choice_pending(
    mutate: Callable[[dict[str, Any]], None], error: type[Exception], message: str
) -> None:
    good = donor_state(PENDING)
    assert good["curvature_choice"] is not None
    bad = copy.deepcopy(good)
    mutate(bad)
    torch.manual_seed(0)
    model = Net()
    reference_model = copy.deepcopy(model)
    pre = kaisa.KFACPreconditioner(model, **PENDING)
    reference = kaisa.KFACPreconditioner(reference_model, **PENDING)
    assert pre.choice_pending
    before = everything(pre)
    with pytest.raises(error, match=message):
        pre.load_state_dict(bad)
    assert_unchanged(before, pre)
    assert pre.choice_pending and pre.curvature_choice is None
    got = run(model, pre, range(3))
    expected = run(reference_model, reference, range(3))
    assert pre.curvature_choice == reference.curvature_choice is not None
    for step_got, step_expected in zip(got, expected, strict=True):
        for g, e in zip(step_got, step_expected, strict=True):
            assert torch.equal(g, e)
    fresh = kaisa.KFACPreconditioner(Net(), **PENDING)
    fresh.load_state_dict(good)
    assert fresh.curvature_choice is not None
    assert fresh.curvature_choice.specs == good["curvature_choice"]["specs"]


# -- round trips ------------------------------------------------------------------------------


def test_a_mixed_preconditioner_round_trips_bit_identically() -> None:
    torch.manual_seed(3)
    model = Net()
    pre = kaisa.KFACPreconditioner(model, **FIXED)
    run(model, pre, range(TRAINED))
    state = saved(pre.state_dict())
    assert state["format"] == STATE_FORMAT
    assert state["options"] == {
        "compute_method": "eigen",
        "damping_mode": "relative",
        "compute_eigenvalue_outer_product": True,
        "factor_init": "first_batch",
        "eigenvalue_correction": "off",
    }
    assert set(state["layers"]["fc1"]) >= {"second_order", "warm_start"}
    assert "outer_inverse" in state["layers"]["fc3"]
    fresh_model = Net()
    fresh_model.load_state_dict(model.state_dict())
    fresh = kaisa.KFACPreconditioner(fresh_model, **FIXED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(state)
    assert_same(pre.state_dict(), fresh.state_dict())
    assert not fresh.inverse_update_due
    original = run(model, pre, range(TRAINED, TRAINED + 3))
    resumed = run(fresh_model, fresh, range(TRAINED, TRAINED + 3))
    for step_got, step_expected in zip(resumed, original, strict=True):
        for g, e in zip(step_got, step_expected, strict=True):
            assert torch.equal(g, e)


def test_a_checkpoint_casts_to_this_preconditioners_dtypes() -> None:
    torch.manual_seed(3)
    model = Net().double()
    pre = kaisa.KFACPreconditioner(model, **FIXED, inv_dtype=torch.float64)
    run(model, pre, range(TRAINED))
    state = saved(pre.state_dict())
    target = kaisa.KFACPreconditioner(Net(), **FIXED)
    target.load_state_dict(state)
    for mine, theirs in zip(target.layers, pre.layers, strict=True):
        assert mine.block.a.dtype == torch.float32
        assert torch.equal(mine.block.a, theirs.block.a.float())
        pairs = zip(
            mine.block.second_order.values(), theirs.block.second_order.values(), strict=True
        )
        for state, other in pairs:
            for t, u in zip(state, other, strict=True):
                assert t.dtype == torch.float32 and torch.equal(t, u.float())


def test_checkpoint_shapes_are_those_a_side_allocates() -> None:
    for text in ("exact", "lowrank:3", "lowrank:7", "kvec", "diagonal"):
        spec = SideSpec.parse(text)
        for method in ("eigen", "inverse"):
            side = make_side(
                spec,
                "x",
                7,
                method=method,
                device=torch.device("cpu"),
                factor_dtype=torch.float64,
                inv_dtype=torch.float64,
                relative=False,
            )
            factor, state, warm = checkpoint_shapes(spec, 7, method)
            assert factor == tuple(side.factor.shape)
            assert [shape for _, shape in state] == [tuple(t.shape) for t in side.allocate()]
            side.fold(torch.eye(7, dtype=torch.float64) * 2 if factor == (7, 7) else side.factor, 0)
            side.refresh(0.1)
            basis = getattr(side, "warm_basis", None)
            assert warm == (None if basis is None else tuple(basis.shape)), text


# -- options that shape the state: converted -------------------------------------------------

#: Exact curvature in float64 without KL clipping, so that the preconditioned
#: gradient is the damped solve itself; factors and inverses every 3 steps, so
#: that the step after the checkpoint (4) refreshes nothing by itself.
CONVERT: dict[str, Any] = dict(
    curvature="exact",
    factor_update_steps=3,
    inv_update_steps=3,
    factor_decay=0.5,
    damping=0.01,
    kl_clip=None,
    inv_dtype=torch.float64,
)
SAVE_AT = 4


def dense_preconditioned(
    grad: torch.Tensor, a: torch.Tensor, g: torch.Tensor, options: dict[str, Any]
) -> torch.Tensor:
    """The preconditioned gradient from the factors, densely (float64)."""
    damping = options["damping"]
    if options["damping_mode"] == "relative":
        a, g = a / (a.trace() / a.shape[0]), g / (g.trace() / g.shape[0])
    if options["compute_method"] == "inverse":
        eye_a, eye_g = torch.eye(a.shape[0], dtype=a.dtype), torch.eye(g.shape[0], dtype=g.dtype)
        return torch.linalg.solve(g + damping * eye_g, grad) @ torch.linalg.inv(a + damping * eye_a)
    # (G ⊗ A + γI)⁻¹ vec(∇) with the row-major vec: (G ⊗ A) vec(X) = vec(G X A).
    system = torch.kron(g, a) + damping * torch.eye(a.shape[0] * g.shape[0], dtype=a.dtype)
    return torch.linalg.solve(system, grad.reshape(-1)).reshape(grad.shape)


def options_of(
    method: str, damping_mode: str = "absolute", outer: bool = True, init: str = "identity"
) -> dict[str, Any]:
    return dict(
        compute_method=method,
        damping_mode=damping_mode,
        compute_eigenvalue_outer_product=outer,
        factor_init=init,
    )


@pytest.mark.parametrize(
    ("saved_with", "loaded_with", "named"),
    [
        pytest.param(options_of("eigen"), options_of("inverse"), "compute_method", id="eig-inv"),
        pytest.param(options_of("inverse"), options_of("eigen"), "compute_method", id="inv-eig"),
        pytest.param(
            options_of("eigen", outer=True),
            options_of("eigen", outer=False),
            "compute_eigenvalue_outer_product",
            id="outer-none",
        ),
        pytest.param(
            options_of("eigen", outer=False),
            options_of("eigen", outer=True),
            "compute_eigenvalue_outer_product",
            id="none-outer",
        ),
        pytest.param(
            options_of("eigen", "relative"),
            options_of("eigen", "absolute"),
            "damping_mode",
            id="eig-relative-absolute",
        ),
        pytest.param(
            options_of("inverse", "absolute"),
            options_of("inverse", "relative"),
            "damping_mode",
            id="inv-absolute-relative",
        ),
    ],
)
def test_other_options_convert_to_a_fresh_computation(
    saved_with: dict[str, Any], loaded_with: dict[str, Any], named: str
) -> None:
    torch.manual_seed(5)
    model = Net().double()
    pre = kaisa.KFACPreconditioner(model, **CONVERT, **saved_with)
    run(model, pre, range(SAVE_AT))
    state = saved(pre.state_dict())

    def target() -> tuple[nn.Module, kaisa.KFACPreconditioner]:
        copy_model = Net().double()
        copy_model.load_state_dict(model.state_dict())
        return copy_model, kaisa.KFACPreconditioner(copy_model, **CONVERT, **loaded_with)

    converted_model, converted = target()
    with pytest.warns(RuntimeWarning, match=rf"written with {named}=.*recomputed"):
        converted.load_state_dict(state)
    assert converted.inverse_update_due
    # A fresh computation from the same factors: the checkpoint as this
    # preconditioner would have written it, without second-order state.
    fresh_state = copy.deepcopy(state)
    fresh_state["options"] = dict(loaded_with)
    for entry in fresh_state["layers"].values():
        entry.pop("second_order")
        entry.pop("outer_inverse", None)
    fresh_model, fresh = target()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(fresh_state)

    x, y = batch(SAVE_AT, torch.float64)
    F.cross_entropy(converted_model(x), y).backward()
    raw = [layer.handler.grad_matrix() for layer in converted.layers]
    converted.step()
    F.cross_entropy(fresh_model(x), y).backward()
    fresh.step()
    for layer, other, grad in zip(converted.layers, fresh.layers, raw, strict=True):
        got = layer.handler.grad_matrix()
        assert got is not None and grad is not None
        assert torch.equal(got, other.handler.grad_matrix()), layer.name  # type: ignore[arg-type]
        saved_layer = state["layers"][layer.name]
        expected = dense_preconditioned(
            grad, saved_layer["a"], saved_layer["g"], {**CONVERT, **loaded_with}
        )
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-12)


def test_another_factor_init_is_accepted_as_it_is() -> None:
    torch.manual_seed(5)
    model = Net()
    pre = kaisa.KFACPreconditioner(model, **FIXED, factor_init="identity")
    run(model, pre, range(TRAINED))
    state = saved(pre.state_dict())
    fresh_model = Net()
    fresh_model.load_state_dict(model.state_dict())
    fresh = kaisa.KFACPreconditioner(fresh_model, **FIXED, factor_init="first_batch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(state)
    assert not fresh.inverse_update_due
    assert [layer.block.updates for layer in fresh.layers] == [TRAINED] * 3
    state["options"]["factor_init"] = "first_batch"
    assert_same(state, fresh.state_dict())


# -- format 1: written before representations --------------------------------------------------


def test_a_format_1_checkpoint_loads_into_exact_layers_only() -> None:
    exact: dict[str, Any] = {**FIXED, "curvature": "exact"}
    torch.manual_seed(5)
    model = Net()
    pre = kaisa.KFACPreconditioner(model, **exact)
    run(model, pre, range(TRAINED))
    state = saved(pre.state_dict())
    old = copy.deepcopy(state)
    format_1(old)
    for entry in old["layers"].values():
        entry["outer_damping"] = 0.01  # format 1 wrote it; it is ignored
    fresh = kaisa.KFACPreconditioner(Net(), **exact)
    fresh.load_state_dict(old)
    # Its options are not recorded: the second-order state is recomputed.
    assert fresh.inverse_update_due
    assert fresh.steps == TRAINED
    for mine, theirs in zip(fresh.layers, pre.layers, strict=True):
        assert torch.equal(mine.block.a, theirs.block.a) and mine.block.updates == TRAINED
    # Not into a preconditioner that leaves the curvature to the automatic choice.
    auto = kaisa.KFACPreconditioner(Net(), lr=0.1, factor_update_steps=1, inv_update_steps=2)
    before = everything(auto)
    with pytest.raises(ValueError, match=r"leaves fc1.A, fc1.G, .* to curvature='auto'"):
        auto.load_state_dict(old)
    assert_unchanged(before, auto)
    # An inverse checkpoint in format 1 is checked as one.
    inverse = kaisa.KFACPreconditioner(Net(), **exact, compute_method="inverse")
    run(inverse.model, inverse, range(TRAINED))
    old_inverse = saved(inverse.state_dict())
    format_1(old_inverse)
    fresh.load_state_dict(old_inverse)
    old_inverse["layers"]["fc2"]["second_order"]["g"][0][0, 0] = NAN
    with pytest.raises(ValueError, match=r"layer 'fc2': damped inverse of G holds NaN"):
        fresh.load_state_dict(old_inverse)
