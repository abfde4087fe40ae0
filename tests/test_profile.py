"""``profile``: the values the options left ``'auto'`` take, read from the model.

A model with an ``nn.Embedding`` (it reads token ids) takes the
'language-model' profile (EKFAC, intervals 5/5 that stretch, a tolerance,
``time_budget=1.25``); any other model 'general' (the budget's intervals and
sides at 0.1, no correction). Options given win over the profile, a profile
given by name wins over the model, the resolved values are what every other
part of kaisa reads, and a run under the defaults equals the same run with the
profile's values given explicitly. The ranks compare the profile
(``tests/distributed/test_agreement.py``).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

import kaisa
from kaisa import choices
from kaisa.demo.cli import _parser as demo_parser
from kaisa.models import GPT, GapCNN, SmallCNN, ViT
from kaisa.options import REFERENCE_DEFAULTS, KFACOptions
from kaisa.profiles import PROFILE_DEFAULTS, PROFILED_OPTIONS, model_profile, token_embeddings

LM = PROFILE_DEFAULTS["language-model"]
GENERAL = PROFILE_DEFAULTS["general"]


def _tiny_gpt() -> GPT:
    return GPT(vocab_size=31, d_model=16, n_layer=1, n_head=2, context=8)


class _Tagger(nn.Module):
    """A token model written by hand: an ``nn.Embedding`` subclass, then a Linear."""

    class Scaled(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 2.0

    def __init__(self) -> None:
        super().__init__()
        self.embed = self.Scaled(11, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def _resolved(pre: kaisa.KFACPreconditioner) -> dict[str, object]:
    return {name: getattr(pre.options, name) for name in PROFILED_OPTIONS}


def test_the_two_profiles_differ_in_every_profiled_option_and_name_every_one() -> None:
    assert set(PROFILE_DEFAULTS) == set(choices.PROFILES) - {"auto"}
    for values in PROFILE_DEFAULTS.values():
        assert set(values) == set(PROFILED_OPTIONS)
    assert all(LM[name] != GENERAL[name] for name in PROFILED_OPTIONS)


@pytest.mark.parametrize(
    ("build", "profile"),
    [
        (_tiny_gpt, "language-model"),
        (_Tagger, "language-model"),
        (SmallCNN, "general"),
        (GapCNN, "general"),
        (ViT, "general"),  # patches and a position parameter, no nn.Embedding
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), "general"),
    ],
)
def test_the_profile_is_read_from_the_models_token_lookups(build, profile: str) -> None:
    model = build()
    assert model_profile(model) == profile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ViT's free parameters are named elsewhere
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
    assert pre.options.profile == profile
    assert _resolved(pre) == PROFILE_DEFAULTS[profile]
    assert pre.options.profiled == frozenset(PROFILED_OPTIONS)


def test_token_embeddings_names_every_lookup_subclasses_included() -> None:
    assert token_embeddings(_Tagger()) == ["embed"]
    assert token_embeddings(_tiny_gpt()) == ["tok_embed", "pos_embed"]
    assert token_embeddings(nn.Embedding(3, 2)) == ["<model>"]
    assert token_embeddings(SmallCNN()) == []


def test_options_given_win_over_the_profile_one_by_one() -> None:
    given = {
        "factor_update_steps": 3,
        "inv_update_steps": 6,
        "time_budget": 0.4,
        "eigenvalue_correction": "off",
        "eigenbasis_tolerance": 0.2,
        "adaptive_intervals": False,
    }
    for name, value in given.items():
        pre = kaisa.KFACPreconditioner(_tiny_gpt(), lr=0.1, **{name: value})
        assert getattr(pre.options, name) == value
        assert name not in pre.options.profiled
        others = {n: v for n, v in _resolved(pre).items() if n != name}
        expected = {n: LM[n] for n in others}
        # An interval left 'auto' follows the one given (bases refreshed at each
        # factor update, as the profile's own 5/5).
        twin = {
            "factor_update_steps": "inv_update_steps",
            "inv_update_steps": "factor_update_steps",
        }
        if name in twin:
            expected[twin[name]] = value
        assert others == expected, name
    # None still means "chosen by the budget", under either profile.
    pre = kaisa.KFACPreconditioner(
        _tiny_gpt(), lr=0.1, factor_update_steps=None, inv_update_steps=None
    )
    assert pre.options.auto >= {"factor_update_steps", "inv_update_steps"}
    assert pre.options.eigenvalue_correction == "ekfac"


def test_a_profile_given_by_name_wins_over_the_model() -> None:
    pre = kaisa.KFACPreconditioner(_tiny_gpt(), lr=0.1, profile="general")
    assert pre.options.profile == "general" and _resolved(pre) == GENERAL
    pre = kaisa.KFACPreconditioner(SmallCNN(), lr=0.1, profile="language-model")
    assert pre.options.profile == "language-model" and _resolved(pre) == LM
    # Without a model (KFACOptions alone), 'auto' is 'general'.
    assert KFACOptions(lr=0.1).profile == "general"
    assert KFACOptions(lr=0.1, profile="language-model").eigenvalue_correction == "ekfac"


def test_the_reference_defaults_are_the_general_profile_on_any_model() -> None:
    assert REFERENCE_DEFAULTS["profile"] == "general"
    pre = kaisa.KFACPreconditioner.with_reference_defaults(_tiny_gpt(), lr=0.1)
    assert pre.options.profile == "general"
    assert pre.options.eigenvalue_correction == "off"
    assert pre.options.eigenbasis_tolerance is None


def test_the_profiles_values_yield_where_the_options_given_exclude_them() -> None:
    # compute_method='inverse' holds no eigenbasis on exact sides: no tolerance,
    # so no adaptive intervals either (both would be refused if given).
    pre = kaisa.KFACPreconditioner(_tiny_gpt(), lr=0.1, compute_method="inverse", curvature="exact")
    assert pre.options.eigenbasis_tolerance is None
    assert pre.options.adaptive_intervals is False
    with pytest.raises(ValueError, match="eigenbasis_tolerance"):
        kaisa.KFACPreconditioner(
            _tiny_gpt(),
            lr=0.1,
            compute_method="inverse",
            curvature="exact",
            eigenbasis_tolerance=0.05,
        )
    # Interval schedules cannot be stretched: the profile's adaptive_intervals yields.
    pre = kaisa.KFACPreconditioner(
        _tiny_gpt(), lr=0.1, factor_update_steps=lambda step: 2, inv_update_steps=4
    )
    assert pre.options.adaptive_intervals is False
    assert pre.options.eigenbasis_tolerance == LM["eigenbasis_tolerance"]
    # No tolerance given: the adaptive intervals, which follow it, yield.
    pre = kaisa.KFACPreconditioner(_tiny_gpt(), lr=0.1, eigenbasis_tolerance=None)
    assert pre.options.adaptive_intervals is False


def test_a_bad_profile_names_itself_and_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="profile") as caught:
        kaisa.KFACPreconditioner(_tiny_gpt(), lr=0.1, profile="llm")
    for value in choices.PROFILES:
        assert repr(value) in str(caught.value)
    with pytest.raises(ValueError, match="eigenvalue_correction"):
        kaisa.KFACPreconditioner(_tiny_gpt(), lr=0.1, eigenvalue_correction="Auto")


def _train(build, steps: int, **options: object) -> torch.Tensor:
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pre = kaisa.KFACPreconditioner(model, optimizer=optimizer, **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 31, (4, 9), generator=g)
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        pre.step()
        optimizer.step()
    pre.remove_hooks()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_the_defaults_on_a_language_model_are_its_profile_given_explicitly() -> None:
    defaults = _train(_tiny_gpt, 12)
    explicit = _train(_tiny_gpt, 12, profile="general", **LM)
    general = _train(_tiny_gpt, 12, profile="general")
    assert torch.equal(defaults, explicit)
    assert not torch.equal(defaults, general)


def test_the_profile_is_logged_with_its_reason_and_the_correction_gap_is_not_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Kronecker-vector sides have no eigenbasis: the profile's correction misses
    # them, which is reported, not warned (the user asked for none).
    with (
        caplog.at_level(logging.INFO, logger="kaisa"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        kaisa.KFACPreconditioner(_tiny_gpt(), lr=0.1, curvature="kvec")
    text = caplog.text
    assert "profile 'language-model' (the model has nn.Embedding tok_embed, pos_embed)" in text
    assert "eigenvalue_correction='ekfac'" in text and "reaches 0 of" in text
    assert not [w for w in caught if "eigenvalue_correction" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # asked for: warned
        kaisa.KFACPreconditioner(
            _tiny_gpt(), lr=0.1, curvature="kvec", eigenvalue_correction="ekfac"
        )
    assert [w for w in caught if "eigenvalue_correction='ekfac' reaches" in str(w.message)]


def test_the_demo_offers_the_profiles() -> None:
    action = next(a for a in demo_parser()._actions if "--profile" in a.option_strings)
    assert tuple(action.choices) == choices.PROFILES
    args = demo_parser().parse_args(["--profile", "general"])
    assert args.profile == "general"


def test_a_checkpoint_from_the_general_profile_loads_under_the_language_models() -> None:
    # A language model's checkpoint written under the old defaults ('general'):
    # the new defaults load it with a warning (the correction starts afresh);
    # profile='general' resumes it exactly, with nothing said.
    def built(**options: object) -> tuple[GPT, kaisa.KFACPreconditioner]:
        torch.manual_seed(0)
        model = _tiny_gpt()
        return model, kaisa.KFACPreconditioner(model, lr=0.1, **options)

    model, pre = built(profile="general")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 31, (4, 9), generator=g)
        model.zero_grad()
        nn.functional.cross_entropy(
            model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()
        ).backward()
        pre.step()
    state = pre.state_dict()
    _, default = built()
    with pytest.warns(RuntimeWarning, match="eigenvalue_correction='off'"):
        default.load_state_dict(state)
    assert default.inverse_update_due
    _, resumed = built(profile="general")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(state)
    assert resumed.steps == 3


def test_the_language_model_profile_survives_the_loops_people_write() -> None:
    # The profile's options (EKFAC, kept bases, stretched intervals) under what
    # the 'general' defaults are tested under elsewhere: a frozen token
    # embedding, accumulation over two passes, a discarded batch, an evaluation
    # between steps and a gradient penalty through create_graph.
    torch.manual_seed(0)
    model = _tiny_gpt()
    model.tok_embed.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    pre = kaisa.KFACPreconditioner(model, optimizer=optimizer, accumulation_steps=2)
    assert pre.options.profile == "language-model"
    g = torch.Generator().manual_seed(1)

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    math = torch.nn.attention.SDPBackend.MATH
    for step in range(24):
        optimizer.zero_grad()
        for _ in range(2):
            if step % 6 == 5:  # a gradient penalty on the trainable weights
                # (double backward through attention needs SDPA's math kernel on a CPU)
                with torch.nn.attention.sdpa_kernel(math):
                    loss = loss_of(torch.randint(0, 31, (4, 9), generator=g)) / 2
                    params = [p for p in model.parameters() if p.requires_grad]
                    grads = torch.autograd.grad(loss, params, create_graph=True)
                    loss = loss + 0.01 * sum(q.pow(2).sum() for q in grads)
                    loss.backward()
                continue
            loss_of(torch.randint(0, 31, (4, 9), generator=g)).div(2).backward()
        if step == 7:  # a batch thrown away after its backward passes
            pre.discard_captures()
            continue
        pre.step()
        optimizer.step()
        if step % 8 == 3:  # an evaluation between steps
            model.eval()
            with torch.no_grad():
                loss_of(torch.randint(0, 31, (4, 9), generator=g))
            model.train()
    assert pre.steps == 23
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The profile's tolerance kept some bases (3 of 60 side refreshes here).
    assert 0 < pre.telemetry.kept_eigenbases < pre.telemetry.side_refreshes
    assert pre.interval_stretch in (1, 2, 4, 8)
    assert model.tok_embed.weight.grad is None  # frozen: never written
    names = [layer.name for layer in pre.layers]
    assert "tok_embed" not in names and "pos_embed" in names
    assert all(layer.block.updates >= 1 for layer in pre.layers)  # every layer's curvature
    assert any(layer.corrected for layer in pre.layers)
