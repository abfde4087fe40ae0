"""KAISA over a data-parallel group smaller than the world (``process_group=``).

Four gloo processes form two data-parallel groups, ``{0, 2}`` and ``{1, 3}``
(not contiguous, so that group ranks and global ranks differ), as two
pipeline stages or model-parallel shards would. Each group trains its own
model (different seeds) with its own preconditioner over its own group,
concurrently, for every gradient-worker fraction two ranks allow; each must
reproduce one process that sees its group's whole batch, to the tolerance of
the whole-world equivalence tests (float32, summation order only). Also:
ranks of one group that disagree fail there, naming the difference, while the
other group trains on; a process outside the group, or something that is not
a process group, is refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import kaisa
from kaisa.distributed.agreement import RankDisagreementError

STEPS = 3
GROUP_BATCH = 16
TOLERANCE = 3e-6  # as tests/distributed/test_equivalence.py (float32, sum order)
GROUPS = ([0, 2], [1, 3])
FRACTIONS = ("comm-opt", "mem-opt")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2)
        self.fc1 = nn.Linear(12, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [
        (
            torch.randn(GROUP_BATCH, 2, 5, 5, generator=gen),
            torch.randint(0, 3, (GROUP_BATCH,), generator=gen),
        )
        for _ in range(STEPS)
    ]


def _train(
    seed: int, fraction: str, group: dist.ProcessGroup | None, part: int, parts: int
) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = kaisa.KFACPreconditioner(
        model,
        lr=0.1,
        factor_update_steps=1,
        inv_update_steps=1,
        curvature="exact",
        factor_decay=0.5,
        grad_worker_fraction=fraction,
        process_group=group,
    )
    for x, y in _data(seed):
        share = GROUP_BATCH // parts
        xs, ys = x[part * share : (part + 1) * share], y[part * share : (part + 1) * share]
        optimizer.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        if group is not None:
            for p in model.parameters():  # the data-parallel average, as DDP(process_group=)
                assert p.grad is not None
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(parts)
        pre.step()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _groups() -> tuple[int, dist.ProcessGroup, int]:
    """This rank's group index, its group and its rank in it (every rank makes both)."""
    made = [dist.new_group(ranks) for ranks in GROUPS]
    index = next(i for i, ranks in enumerate(GROUPS) if dist.get_rank() in ranks)
    return index, made[index], dist.get_rank(made[index])


def _worker(rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    index, group, part = _groups()
    return [_train(seed=index, fraction=f, group=group, part=part, parts=2) for f in FRACTIONS]


@pytest.mark.timeout(240)
def test_each_data_parallel_group_reproduces_one_process() -> None:
    results = run_distributed(_worker, 4, timeout=200)
    for index, ranks in enumerate(GROUPS):
        for f, fraction in enumerate(FRACTIONS):
            reference = _train(seed=index, fraction=fraction, group=None, part=0, parts=1)
            for rank in ranks:
                got = results[rank][f]
                for key, want in reference.items():
                    err = (got[key] - want).abs().max().item()
                    assert err <= TOLERANCE, (fraction, rank, key, err)
            # K-FAC moved the weights (the comparison has teeth).
            torch.manual_seed(index)
            initial = Net()
            moved = max(
                (reference[k] - v).abs().max().item() for k, v in initial.state_dict().items()
            )
            assert moved > 1e-2
    # The two groups trained different models.
    assert not torch.equal(results[0][0]["fc1.weight"], results[1][0]["fc1.weight"])


def _disagreeing(rank: int, world_size: int) -> str:
    torch.set_num_threads(1)
    index, group, part = _groups()
    # Group 0's ranks disagree on damping; group 1's agree.
    damping = 0.01 * (1 + part) if index == 0 else 0.01
    try:
        kaisa.KFACPreconditioner(Net(), lr=0.1, damping=damping, process_group=group)
    except RankDisagreementError as error:
        return f"refused: {error}"
    return "built"


@pytest.mark.timeout(120)
def test_disagreement_inside_a_group_fails_there_and_names_it() -> None:
    results = run_distributed(_disagreeing, 4, timeout=90)
    for rank in GROUPS[0]:
        assert results[rank].startswith("refused: ") and "damping" in results[rank], results
    for rank in GROUPS[1]:
        assert results[rank] == "built", results


def _outsider(rank: int, world_size: int) -> str:
    group = dist.new_group([0])
    try:
        kaisa.KFACPreconditioner(Net(), lr=0.1, process_group=group)
    except ValueError as error:
        return f"refused: {error}"
    return "built"


@pytest.mark.timeout(120)
def test_a_process_outside_the_group_is_refused() -> None:
    results = run_distributed(_outsider, 2, timeout=90)
    assert results[0] == "built"
    assert results[1].startswith("refused: ") and "does not contain this process" in results[1]


def test_process_group_must_be_a_process_group() -> None:
    with pytest.raises(TypeError, match=r"process_group must be a torch\.distributed"):
        kaisa.KFACPreconditioner(Net(), lr=0.1, process_group="dp")  # type: ignore[arg-type]


class _Stage0(nn.Module):
    """A language model's first pipeline stage: its token lookup and one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.fc = nn.Linear(4, 4)


def _profiles(rank: int, world_size: int) -> list[tuple[str, list[str]]]:
    # Two stages of one model, each its own data-parallel group of one rank.
    groups = [dist.new_group([r]) for r in range(world_size)]
    group = groups[rank]
    out = []
    for build, options in (
        (_Stage0 if rank == 0 else Net, {}),
        (Net, {"profile": "general"}),
        (Net, {"profile": "language-model"}),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre = kaisa.KFACPreconditioner(build(), lr=0.1, process_group=group, **options)
        out.append(
            (pre.options.profile, [str(w.message) for w in caught if "profile" in str(w.message)])
        )
        pre.remove_hooks()
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_a_general_profile_read_from_a_part_of_the_world_is_warned() -> None:
    # Stage 0 has the lookup and reads 'language-model'; stage 1 reads 'general'
    # from its part alone, which another stage's lookup may contradict: warned,
    # naming the way out. A profile given by name is not warned.
    stage0, stage1 = run_distributed(_profiles, 2, timeout=90)
    assert stage0[0] == ("language-model", [])
    profile, said = stage1[0]
    assert profile == "general" and len(said) == 1
    assert "process_group spans 1 of the 2 ranks" in said[0]
    assert "profile='language-model' on every stage" in said[0]
    for results in (stage0, stage1):
        assert results[1] == ("general", []) and results[2] == ("language-model", [])
