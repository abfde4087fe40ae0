"""Eigenvalue correction on low-rank sides against dense float64 references (spec §11).

A low-rank side holds its factor's top ``k`` eigenvectors ``U``; the rest of
its space has no basis of its own. The reference completes ``U`` to a full
orthonormal basis, rotates the gradient into it, holds one mean square per
rest block (each rest direction of a block shares its value) and divides
coordinate by coordinate: the dense Kronecker system the partial solve must
equal without ever forming the rest's basis.
"""

from __future__ import annotations

import pytest
import torch

from kaisa.curvature import eigencorrection
from kaisa.curvature.block import KroneckerBlock, check_block_state
from kaisa.curvature.eigencorrection import (
    EigenScales,
    has_rest,
    scale_counts,
    scale_length,
)

D = torch.float64


def _basis(n: int, k: int | None, gen: torch.Generator) -> torch.Tensor:
    """An orthonormal ``n × k`` basis (``k = None``: square)."""
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=D))
    return q[:, : (n if k is None else k)].contiguous()


def _complete(u: torch.Tensor | None, n: int, gen: torch.Generator) -> torch.Tensor:
    """A full orthonormal basis whose first columns are ``u`` (the identity for ``None``)."""
    if u is None:
        return torch.eye(n, dtype=D)
    rest = torch.randn(n, n - u.shape[1], generator=gen, dtype=D)
    rest -= u @ (u.t() @ rest)
    q, _ = torch.linalg.qr(rest)
    return torch.cat([u, q], 1)


def _expand(short: torch.Tensor, k_g: int, k_a: int, g: int, a: int) -> torch.Tensor:
    """An ``S``-shaped tensor spread over every coordinate of the completed bases."""
    full = torch.empty(g, a, dtype=D)
    full[:k_g, :k_a] = short[:k_g, :k_a]
    if k_g < g:
        full[k_g:, :k_a] = short[k_g, :k_a]
    if k_a < a:
        full[:k_g, k_a:] = short[:k_g, k_a : k_a + 1]
    if k_g < g and k_a < a:
        full[k_g:, k_a:] = short[k_g, k_a]
    return full


def _block_means(v: torch.Tensor, k_g: int, k_a: int) -> torch.Tensor:
    """``v²`` in the completed bases, each rest block's squares averaged to one entry."""
    g, a = v.shape
    sq = v.square()
    rows = [sq[:k_g, :k_a]]
    if k_a < a:
        rows = [torch.cat([sq[:k_g, :k_a], sq[:k_g, k_a:].mean(1, keepdim=True)], 1)]
    if k_g < g:
        bottom = sq[k_g:, :k_a].mean(0, keepdim=True)
        if k_a < a:
            bottom = torch.cat([bottom, sq[k_g:, k_a:].mean().reshape(1, 1)], 1)
        rows.append(bottom)
    return torch.cat(rows, 0)


CASES = {
    "G low-rank, A exact": (3, None),
    "A low-rank, G exact": (None, 2),
    "both low-rank": (3, 2),
    "G low-rank, A diagonal": (3, "diagonal"),
    "A low-rank, G diagonal": ("diagonal", 2),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("correction", ["ekfac", "adam"])
@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("shape", [(7, 5), (5, 7)], ids=["tall", "wide"])
def test_the_partial_solve_is_the_dense_system_in_the_completed_bases(
    case: str, correction: str, relative: bool, shape: tuple[int, int], scalar_reads: str
) -> None:
    """Both orders of the solve's products (a tall and a wide gradient) included."""
    gen = torch.Generator().manual_seed(11)
    g, a = shape
    k_g_spec, k_a_spec = CASES[case]
    qg = None if k_g_spec == "diagonal" else _basis(g, k_g_spec, gen)  # type: ignore[arg-type]
    qa = None if k_a_spec == "diagonal" else _basis(a, k_a_spec, gen)  # type: ignore[arg-type]
    g_rank = k_g_spec if isinstance(k_g_spec, int) else None
    a_rank = k_a_spec if isinstance(k_a_spec, int) else None
    k_g = g if g_rank is None else g_rank  # the directions with an entry of their own
    k_a = a if a_rank is None else a_rank
    scales = EigenScales.zeros(g, a, torch.device("cpu"), D, g_rank=g_rank, a_rank=a_rank)
    start = torch.rand(scales.scales.shape, generator=gen, dtype=D) + 0.2
    scales.scales.copy_(start)
    scales.updates = 50
    grad = torch.randn(g, a, generator=gen, dtype=D)
    damping, decay, kron_mean = 0.05, 0.9, 1.0 if relative else 1.7
    got = scales.solve(grad, qa, qg, damping, decay, correction, relative, kron_mean)  # type: ignore[arg-type]

    full_g, full_a = _complete(qg, g, gen), _complete(qa, a, gen)
    v = full_g.t() @ grad @ full_a
    folded = decay * start + (1 - decay) * _block_means(v, k_g, k_a)
    torch.testing.assert_close(scales.scales, folded, rtol=1e-12, atol=1e-12)
    s_full = _expand(folded, k_g, k_a, g, a)
    if correction == "ekfac":
        div = s_full * (kron_mean / s_full.mean()) + damping
    else:
        div = (s_full + (damping * s_full.mean() if relative else damping)).sqrt()
    expected = full_g @ (v / div) @ full_a.t()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", [*CASES, "both exact"])
@pytest.mark.parametrize("correction", ["ekfac", "adam"])
def test_both_ways_of_reading_the_scalars_fold_and_solve_alike(
    case: str, correction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU the solve reads the running sum on the host (a branch keeps ``S`` on a
    bad step, the sum gives the mean); on an accelerator it never leaves the device.
    Both give the same ``S``, the same steps and the same count, a NaN step included."""
    k_g_spec, k_a_spec = CASES.get(case, (None, None))
    g, a = 7, 5
    runs = {}
    for way in ("host", "device"):
        with monkeypatch.context() as patch:
            if way == "device":
                patch.setattr(eigencorrection, "_reads_on_host", lambda t: False)
            gen = torch.Generator().manual_seed(12)
            qg = None if k_g_spec == "diagonal" else _basis(g, k_g_spec, gen)  # type: ignore[arg-type]
            qa = None if k_a_spec == "diagonal" else _basis(a, k_a_spec, gen)  # type: ignore[arg-type]
            scales = EigenScales.zeros(
                g,
                a,
                torch.device("cpu"),
                D,
                g_rank=k_g_spec if isinstance(k_g_spec, int) else None,
                a_rank=k_a_spec if isinstance(k_a_spec, int) else None,
            )
            steps, kept = [], []
            for step in range(5):
                grad = torch.randn(g, a, generator=gen, dtype=D)
                if step == 2:
                    grad[1, 1] = float("nan")
                steps.append(scales.solve(grad, qa, qg, 0.05, 0.9, correction, True))
                kept.append(scales.scales.clone())
            runs[way] = (steps, kept, scales.updates)
    (host_steps, host_kept, host_updates), (dev_steps, dev_kept, dev_updates) = runs.values()
    assert host_updates == dev_updates == 5
    assert torch.equal(host_kept[2], host_kept[1])  # the NaN step left S as it was
    for host, dev in zip(host_kept, dev_kept, strict=True):
        torch.testing.assert_close(host, dev, rtol=1e-12, atol=0)
    for step, (host, dev) in enumerate(zip(host_steps, dev_steps, strict=True)):
        assert host.isnan().any() == (step == 2)
        torch.testing.assert_close(host, dev, rtol=1e-12, atol=1e-14, equal_nan=True)


def test_the_rest_of_a_low_rank_side_is_one_entry_standing_for_its_directions() -> None:
    assert scale_length(10, None) == 10
    assert scale_length(10, 4) == 5
    assert scale_length(10, 10) == 10  # full rank: no rest
    like = torch.zeros(1, dtype=D)
    assert scale_counts(6, 4, None, None, like) is None
    counts = scale_counts(6, 4, 2, None, like)
    assert counts is not None and counts.shape == (3, 4)
    assert counts[:2].eq(1).all() and counts[2].eq(4).all()
    both = scale_counts(6, 4, 2, 1, like)
    assert both is not None and both.sum() == 24 and both[2, 1] == 4 * 3
    assert not has_rest(None) and not has_rest(torch.eye(3)) and has_rest(torch.eye(3, 2))
    scales = EigenScales.zeros(6, 4, torch.device("cpu"), D, g_rank=2, a_rank=1)
    assert scales.scales.shape == (3, 2) and scales.shares is not None
    torch.testing.assert_close(scales.shares, both / 24)  # the divisor's mean weighs by these
    assert EigenScales.zeros(6, 4, torch.device("cpu"), D).shares is None


def _spd(n: int, gen: torch.Generator) -> torch.Tensor:
    m = torch.randn(n, 2 * n, generator=gen, dtype=D)
    return m @ m.t() / (2 * n) + 0.1 * torch.eye(n, dtype=D)


@pytest.mark.parametrize(("a_spec", "g_spec"), [("exact", "lowrank:3"), ("lowrank:2", "lowrank:3")])
def test_a_block_with_a_low_rank_side_is_corrected_in_its_top_eigenvectors(
    a_spec: str, g_spec: str
) -> None:
    """Through :class:`KroneckerBlock`: the low-rank side's refreshed ``U`` spans its
    factor's top eigenvectors, ``S`` has a rest row (column), the step is the dense
    system's, and the checkpoint round-trips ``S`` of that shape."""
    gen = torch.Generator().manual_seed(5)
    a_size, g_size = 5, 7
    kw = dict(
        device=torch.device("cpu"),
        factor_dtype=D,
        inv_dtype=D,
        method="eigen",
        eigen_outer_product=False,
        damping_mode="relative",
        a_spec=a_spec,
        g_spec=g_spec,
        correction="ekfac",
        correction_decay=0.9,
    )
    block = KroneckerBlock("layer", a_size, g_size, **kw)  # type: ignore[arg-type]
    assert block.correction == "ekfac"
    a, g = _spd(a_size, gen), _spd(g_size, gen)
    block.fold(a, g, 0.0)
    for which in ("a", "g"):
        assert block.decompose(which, 0.01)  # type: ignore[arg-type]
    block.finish_update(0.01)
    scales = block.eigen_scales
    assert scales is not None
    assert scales.scales.shape == block.layout().scale_shape
    grad = torch.randn(g_size, a_size, generator=gen, dtype=D)
    got = block.precondition(grad, 0.01)

    def side_basis(factor: torch.Tensor, spec: str) -> tuple[torch.Tensor, int]:
        vectors = torch.linalg.eigh(factor).eigenvectors.flip(1)  # largest first
        k = factor.shape[0] if spec == "exact" else int(spec.split(":")[1])
        return vectors, k

    (full_a, k_a), (full_g, k_g) = side_basis(a, a_spec), side_basis(g, g_spec)
    q_g = block.sides["g"].work_state()[0]
    # U spans the top-k eigenvectors (subspace iteration converges on a small factor).
    torch.testing.assert_close(
        q_g @ q_g.t(), full_g[:, :k_g] @ full_g[:, :k_g].t(), rtol=0, atol=1e-6
    )
    full_g = _complete(q_g, g_size, gen)
    q_a = block.sides["a"].work_state()[0]
    full_a = _complete(q_a, a_size, gen) if k_a < a_size else q_a
    v = full_g.t() @ grad @ full_a
    s_full = _expand(_block_means(v, k_g, k_a), k_g, k_a, g_size, a_size)  # the first fold
    div = s_full / s_full.mean() + 0.01
    torch.testing.assert_close(got, full_g @ (v / div) @ full_a.t(), rtol=1e-8, atol=1e-10)

    state = block.state_dict()
    restored = KroneckerBlock("layer", a_size, g_size, **kw)  # type: ignore[arg-type]
    restored.load_state_dict(state)
    assert restored.eigen_scales is not None
    torch.testing.assert_close(restored.eigen_scales.scales, scales.scales)
    bad = dict(state, eigen_scales=torch.zeros(g_size, a_size, dtype=D))
    with pytest.raises(ValueError, match="eigenvalue-corrected scales"):
        check_block_state(bad, block.layout())
