"""A weight shared by several layers (a tied embedding and head): summed curvature (issue 29).

The preconditioned gradient is checked against the formula of
``docs/shared-parameters.md`` computed densely in float64: the dense summed
curvature ``F = Σ_u L_u ⊗ R_u`` (row-major ``vec``) of the uses' running
averages, its partial traces taken from the dense matrix, their
eigenbases, ``F``'s diagonal in that Kronecker basis, and a dense
``torch.linalg.solve``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa

V, D = 11, 5


class Tied(nn.Module):
    """An embedding, a small nonlinear mixer, and a head tied to the embedding."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=bias)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(idx))))


def _dense_basis(pre: kaisa.KFACPreconditioner, m: int, n: int):
    """``(F, Q_L, Q_R)``: the dense summed curvature (owner's orientation) and the
    eigenbases of its partial traces."""
    layers = {layer.name: layer for layer in pre.layers}
    owner = "head" if pre.model.head.bias is not None else "embed"
    total = torch.zeros(m * n, m * n, dtype=torch.float64)
    for name in ("embed", "head"):
        block = layers[name].block
        a, g = block.a.double(), block.g.double()
        a_spec, g_spec = block.specs
        a_full = torch.diag(a[1]) if a_spec in ("diagonal", "kvec") else a
        g_full = torch.diag(g[1]) if g_spec in ("diagonal", "kvec") else g
        left, right = (g_full, a_full) if name == owner else (a_full, g_full)
        pad_l = torch.zeros(m, m, dtype=torch.float64)
        pad_l[: left.shape[0], : left.shape[1]] = left
        pad_r = torch.zeros(n, n, dtype=torch.float64)
        pad_r[: right.shape[0], : right.shape[1]] = right
        total += torch.kron(pad_l, pad_r)
    # Partial traces of the dense F, (m, n, m, n) in row-major vec.
    four = total.reshape(m, n, m, n)
    left_trace = torch.einsum("ajbj->ab", four)
    right_trace = torch.einsum("iaib->ab", four)
    q_l = torch.linalg.eigh(left_trace).eigenvectors
    q_r = torch.linalg.eigh(right_trace).eigenvectors
    return total, q_l, q_r


def _reference(pre: kaisa.KFACPreconditioner, grad: torch.Tensor, damping: float, relative: bool):
    """``B (diag(BᵀFB)/s + γI)⁻¹ Bᵀ vec(∇)`` densely, ``B = Q_L ⊗ Q_R``, owner's orientation."""
    m, n = grad.shape
    total, q_l, q_r = _dense_basis(pre, m, n)
    basis = torch.kron(q_l, q_r)
    values = torch.diagonal(basis.t() @ total @ basis)
    scale = values.mean() if relative else 1.0
    system = basis @ torch.diag(values / scale + damping) @ basis.t()
    return torch.linalg.solve(system, grad.double().reshape(-1)).reshape(m, n), total


def _float64_preconditioner(
    model: Tied, damping: float, damping_mode: str, curvature: object, **extra: object
) -> kaisa.KFACPreconditioner:
    """Factors and inverses refreshed every step, in float64, no KL clipping."""
    return kaisa.KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=1,
        kl_clip=None,
        damping=damping,
        damping_mode=damping_mode,
        curvature=curvature,
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
        lr=0.1,
        profile="general",  # the maths under test, not the language-model defaults
        **extra,
    )


def _owner_grad(model: Tied) -> torch.Tensor:
    weight = model.embed.weight.grad
    if model.head.bias is None:
        return weight.t().clone()  # the embedding's (dim, vocab) matrix
    return torch.cat([weight, model.head.bias.grad.reshape(-1, 1)], dim=1)  # the head's


@pytest.mark.parametrize(
    ("bias", "curvature", "damping_mode"),
    [
        (False, "exact", "relative"),
        (False, "exact", "absolute"),
        (True, "exact", "relative"),
        # The affordable vocabulary side: the head's G diagonal (with the
        # embedding's token counts, the vocabulary side is diagonal).
        (False, {"head": ("exact", "diagonal"), ".*": "exact"}, "relative"),
        (True, {"head": ("exact", "kvec"), "embed": ("diagonal", "exact")}, "absolute"),
    ],
)
def test_the_shared_block_equals_its_dense_float64_formula(bias, curvature, damping_mode) -> None:
    torch.manual_seed(0)
    model = Tied(bias).double()
    damping = 0.05
    pre = _float64_preconditioner(model, damping, damping_mode, curvature)
    names = [layer.name for layer in pre.layers]
    assert "embed" in names and "head" in names
    for _ in range(3):  # a few folds: the running averages are not one batch's
        model.zero_grad()
        idx = torch.randint(0, V, (4, 6))
        F.cross_entropy(model(idx).reshape(-1, V), torch.roll(idx, 1).reshape(-1)).backward()
        grad = _owner_grad(model)
        pre.step()
    expected, _ = _reference(pre, grad, damping, damping_mode == "relative")
    got = _owner_grad(model)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    # The embedding's mixer is untouched by the tie: an ordinary block.
    assert not torch.equal(got, grad)
    pre.remove_hooks()


def test_with_diagonal_sides_everywhere_it_is_the_exact_inverse_of_the_summed_curvature() -> None:
    """Diagonal factors commute: ``P = (F/s + γI)⁻¹ ∇`` exactly, ``F`` the sum of both uses."""
    torch.manual_seed(1)
    model = Tied(False).double()
    pre = _float64_preconditioner(model, 0.01, "absolute", "diagonal")
    idx = torch.randint(0, V, (5, 7))
    F.cross_entropy(model(idx).reshape(-1, V), idx.reshape(-1)).backward()
    grad = _owner_grad(model)
    pre.step()
    _, total = _reference(pre, grad, 0.01, False)
    eye = torch.eye(total.shape[0], dtype=torch.float64)
    exact = torch.linalg.solve(total + 0.01 * eye, grad.reshape(-1)).reshape(grad.shape)
    torch.testing.assert_close(_owner_grad(model), exact, rtol=1e-9, atol=1e-12)
    pre.remove_hooks()


@pytest.mark.parametrize(
    ("bias", "correction", "damping_mode"),
    [
        (False, "ekfac", "relative"),
        (False, "ekfac", "absolute"),
        (True, "ekfac", "relative"),
        (False, "adam", "relative"),
        (True, "adam", "absolute"),
    ],
)
def test_the_corrected_shared_block_equals_its_dense_float64_formula(
    bias, correction, damping_mode
) -> None:
    """``S`` of ``(Q_Lᵀ ∇ Q_R)²`` folded step by step in the basis of the step, then
    ``Q_L [V ⊘ D] Q_Rᵀ`` with the correction's divisor ``D`` (ekfac: ``S μ/mean S + γ``,
    ``μ = mean(Λ)`` under absolute damping and 1 under relative; adam:
    ``(S + γ s̄)^½``), computed densely in float64 from the uses' running averages."""
    torch.manual_seed(3)
    model = Tied(bias).double()
    damping, decay, relative = 0.05, 0.9, damping_mode == "relative"
    pre = _float64_preconditioner(
        model,
        damping,
        damping_mode,
        "exact",
        eigenvalue_correction=correction,
        eigenvalue_decay=decay,
    )
    assert all(layer.corrected for layer in pre.layers)
    scales = None
    for k in range(4):
        model.zero_grad()
        idx = torch.randint(0, V, (4, 6))
        F.cross_entropy(model(idx).reshape(-1, V), torch.roll(idx, 1).reshape(-1)).backward()
        grad = _owner_grad(model)
        pre.step()
        total, q_l, q_r = _dense_basis(pre, *grad.shape)
        rotated = q_l.t() @ grad @ q_r
        xi = min(decay, k / (k + 1))
        scales = rotated**2 if scales is None else xi * scales + (1 - xi) * rotated**2
        if correction == "ekfac":
            basis = torch.kron(q_l, q_r)
            values = torch.diagonal(basis.t() @ total @ basis)
            mu = 1.0 if relative else values.mean()
            divisor = scales * mu / scales.mean() + damping
        else:
            divisor = (scales + damping * (scales.mean() if relative else 1.0)).sqrt()
        expected = q_l @ (rotated / divisor) @ q_r.t()
        torch.testing.assert_close(_owner_grad(model), expected, rtol=1e-9, atol=1e-12)
    pre.remove_hooks()


def _assert_same(x: object, y: object) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and torch.equal(x, y)
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys()
        for key in x:
            _assert_same(x[key], y[key])
    elif isinstance(x, (list, tuple)):
        assert isinstance(y, (list, tuple)) and len(x) == len(y)
        for a, b in zip(x, y, strict=True):
            _assert_same(a, b)
    else:
        assert x == y


def test_the_corrected_shared_state_round_trips_and_a_bad_one_changes_nothing() -> None:
    torch.manual_seed(4)
    kwargs = {
        "factor_update_steps": 1,
        "inv_update_steps": 3,
        "lr": 0.1,
        "curvature": "exact",
        "eigenvalue_correction": "ekfac",
    }

    def backward(m: Tied, idx: torch.Tensor) -> None:
        m.zero_grad()
        F.cross_entropy(m(idx).reshape(-1, V), idx.reshape(-1)).backward()

    model = Tied(False)
    pre = kaisa.KFACPreconditioner(model, **kwargs)
    for _ in range(4):
        backward(model, torch.randint(0, V, (4, 6)))
        pre.step()
    shared = pre.state_dict()["layers"]["embed"]["shared"]
    assert set(shared) == {"a", "g", "scales", "scale_updates"}
    assert shared["scale_updates"] == 4 and shared["scales"].shape == (D, V)
    state = pre.state_dict()

    other = Tied(False)
    other.load_state_dict(model.state_dict())
    fresh = kaisa.KFACPreconditioner(other, **kwargs)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["layers"]["embed"]["shared"]["scale_updates"] == 4
    lone = {key: value for key, value in shared.items() if key != "scale_updates"}
    for saved, match in (
        ({**shared, "scales": -shared["scales"]}, "negative"),
        ({**shared, "scales": shared["scales"][:, :-1]}, "shape"),
        ({**shared, "scale_updates": -1}, "scale_updates"),
        ({**shared, "scales": None}, "tensor"),
        (lone, "both 'scales' and 'scale_updates'"),
    ):
        layers = {**state["layers"], "embed": {**state["layers"]["embed"], "shared": saved}}
        with pytest.raises((TypeError, ValueError), match=match):
            fresh.load_state_dict({**state, "layers": layers})
        # Refused: the loaded state (Q, ρ, S and its count) is all still there.
        _assert_same(fresh.state_dict()["layers"]["embed"]["shared"], shared)

    idx = torch.randint(0, V, (4, 6))
    backward(model, idx)
    backward(other, idx)
    pre.step()
    fresh.step()  # no inverse update at this step: the loaded Q and S are used
    assert torch.equal(model.embed.weight.grad, other.embed.weight.grad)
    pre.remove_hooks()
    fresh.remove_hooks()


def test_coverage_lists_the_tied_weight_as_preconditioned_by_both_uses() -> None:
    model = Tied(True)
    pre = kaisa.KFACPreconditioner(model, lr=0.1)
    by_name = {t.parameter: t for t in pre.coverage()}
    tied = by_name["embed.weight"]
    assert tied.kind.startswith(
        "kronecker (shared by head, embed: summed curvature)"
    )  # owner first
    assert set(tied.blocks) == {"embed", "head"}
    assert by_name["head.bias"].kind != "raw"  # in the owner's (the head's) matrix
    assert pre.coverage().raw() == []
    pre.remove_hooks()


def test_a_use_kaisa_cannot_see_leaves_the_weight_raw_with_the_warning() -> None:
    """A third holder kaisa does not handle (its use is not captured): raw, as before."""

    class Odd(nn.Module):
        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.weight = weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

    model = Tied(False)
    model.odd = Odd(model.embed.weight)
    with pytest.warns(UserWarning, match="shares a parameter"):
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    raw = {t.parameter: t.reason for t in pre.coverage().raw()}
    assert raw["embed.weight"].startswith("shared by")
    pre.remove_hooks()


def test_the_shared_state_round_trips_through_a_checkpoint_and_a_bad_one_is_refused() -> None:
    torch.manual_seed(2)
    model = Tied(False)
    kwargs = {"factor_update_steps": 1, "inv_update_steps": 3, "lr": 0.1, "profile": "general"}
    pre = kaisa.KFACPreconditioner(model, **kwargs)
    for _ in range(4):
        model.zero_grad()
        idx = torch.randint(0, V, (4, 6))
        F.cross_entropy(model(idx).reshape(-1, V), idx.reshape(-1)).backward()
        pre.step()
    state = pre.state_dict()
    assert set(state["layers"]["embed"]["shared"]) == {"a", "g"}
    assert "shared" not in state["layers"]["head"]
    pre.remove_hooks()

    other = Tied(False)
    other.load_state_dict(model.state_dict())
    fresh = kaisa.KFACPreconditioner(other, **kwargs)
    bad = {**state, "layers": dict(state["layers"])}
    embed = dict(bad["layers"]["embed"])
    embed["shared"] = {"a": [t.neg() for t in embed["shared"]["a"]], "g": embed["shared"]["g"]}
    bad["layers"]["embed"] = embed
    with pytest.raises(ValueError, match="negative eigenvalues"):
        fresh.load_state_dict(bad)
    fresh.load_state_dict(state)
    pre2 = kaisa.KFACPreconditioner(model, **kwargs)  # the original, continued
    pre2.load_state_dict(state)
    idx = torch.randint(0, V, (4, 6))
    for m in (model, other):
        m.zero_grad()
        F.cross_entropy(m(idx).reshape(-1, V), idx.reshape(-1)).backward()
    raw = other.embed.weight.grad.clone()
    pre2.step()
    fresh.step()  # step 4: no inverse update, the loaded shared state is used
    assert torch.equal(model.embed.weight.grad, other.embed.weight.grad)
    assert not torch.equal(other.embed.weight.grad, raw)
    pre2.remove_hooks()
    fresh.remove_hooks()


def _share_preconditioned(pre: kaisa.KFACPreconditioner, model: nn.Module) -> float:
    """The share of the elements of ≥2-D trainable parameters that are preconditioned."""
    params = dict(model.named_parameters())
    sizes = {t.parameter: params[t.parameter].numel() for t in pre.coverage()}
    matrices = [t for t in pre.coverage() if params[t.parameter].ndim >= 2]
    kept = sum(sizes[t.parameter] for t in matrices if t.kind != "raw")
    return kept / sum(sizes[t.parameter] for t in matrices)


@pytest.mark.parametrize("correction", ["off", "ekfac"])
def test_a_tiny_hf_gpt2_is_covered_and_trains_finitely(correction: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    assert model.lm_head.weight is model.transformer.wte.weight
    pre = kaisa.KFACPreconditioner(
        model,
        lr=1e-3,
        factor_update_steps=1,
        inv_update_steps=2,
        eigenvalue_correction=correction,
    )
    share = _share_preconditioned(pre, model)
    assert share >= 0.99, share
    # Corrected, every layer is reached, the tied wte/lm_head included.
    assert all(layer.corrected == (correction == "ekfac") for layer in pre.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 64, (2, 16))
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        raw = model.transformer.wte.weight.grad.clone()
        pre.step()
        assert torch.isfinite(model.transformer.wte.weight.grad).all()
        assert not torch.equal(model.transformer.wte.weight.grad, raw)
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    pre.remove_hooks()


def test_kaisa_gpt_with_a_tied_head_trains_finitely() -> None:
    from kaisa.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=32, context=16, n_layer=1, d_model=16, n_head=2, tied_head=True)
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2, lr=3e-3)
    assert _share_preconditioned(pre, model) == 1.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = (torch.arange(8 * 17) % 7).view(8, 17)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 32), x[:, 1:].reshape(-1))
        loss.backward()
        pre.step()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    pre.remove_hooks()
