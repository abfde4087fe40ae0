"""Profiles: the values kaisa's options left ``'auto'`` take, read from the model.

A profile is a set of defaults for :data:`PROFILED_OPTIONS`
(:data:`PROFILE_DEFAULTS`): 'language-model' for a model that looks up tokens
(an ``nn.Embedding``), 'general' for any other. :class:`kaisa.options.KFACOptions`
applies the values; this module holds the rule, the values and what kaisa says
about them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from kaisa.choices import Profile

if TYPE_CHECKING:
    from kaisa.options import KFACOptions

#: The options whose default, ``'auto'``, takes its value from the profile.
PROFILED_OPTIONS = (
    "factor_update_steps",
    "inv_update_steps",
    "time_budget",
    "eigenvalue_correction",
    "eigenbasis_tolerance",
    "adaptive_intervals",
)
#: What each profile gives the options left ``'auto'`` (see ``profile``).
#: 'general' is kaisa's configuration for every model; 'language-model' the
#: one that took the fewest steps on the suite's language model and on
#: HuggingFace's GPT-2, Llama and OPT (``docs/language-models.md``).
PROFILE_DEFAULTS: dict[str, dict[str, Any]] = {
    "general": {
        "factor_update_steps": None,
        "inv_update_steps": None,
        "time_budget": 0.1,
        "eigenvalue_correction": "off",
        "eigenbasis_tolerance": None,
        "adaptive_intervals": False,
    },
    "language-model": {
        "factor_update_steps": 5,
        "inv_update_steps": 5,
        "time_budget": 1.25,
        "eigenvalue_correction": "ekfac",
        "eigenbasis_tolerance": 0.05,
        "adaptive_intervals": True,
    },
}


def token_embeddings(model: nn.Module) -> list[str]:
    """The names of the model's ``nn.Embedding`` modules (its token lookups)."""
    return [name or "<model>" for name, m in model.named_modules() if isinstance(m, nn.Embedding)]


def model_profile(model: nn.Module) -> Profile:
    """``profile='auto'`` for ``model``: 'language-model' if it looks up tokens, else 'general'.

    A model with an ``nn.Embedding`` (or a subclass: HuggingFace's scaled and
    learned-position embeddings) reads token ids, as a language model, an
    encoder of text or a sequence-to-sequence model does; vision models (CNNs,
    ViTs with their patches and position parameters) have none.
    """
    return "language-model" if token_embeddings(model) else "general"


def left_auto(value: object) -> bool:
    """Whether an option was left ``'auto'`` (the profile's, or the model's profile)."""
    return isinstance(value, str) and value == "auto"


def profile_report(options: KFACOptions, read_from: nn.Module | None) -> str | None:
    """The line saying which profile set which options, and why (``None``: it set none).

    ``read_from``: the model the profile was read from (``None``: it was named).
    """
    if not options.profiled:
        return None
    why = ""
    if read_from is not None:
        lookups = token_embeddings(read_from)
        why = (
            f" (the model has nn.Embedding {', '.join(lookups[:3])})"
            if lookups
            else " (the model has no nn.Embedding)"
        )
    values = ", ".join(f"{n}={getattr(options, n)!r}" for n in sorted(options.profiled))
    return f"kaisa: profile {options.profile!r}{why}: {values}"


def partial_profile_warning(
    options: KFACOptions, read: bool, group_size: int, world_size: int
) -> str | None:
    """The warning for 'general' read from what may be one stage of a language model.

    Under a data-parallel group smaller than the world (pipeline stages,
    model-parallel shards), this rank's module may be a part of the model whose
    token lookup sits on another stage, which would read another profile.
    ``None`` when the profile was named, is 'language-model', or the group is
    the world.
    """
    if not read or options.profile != "general" or group_size >= world_size:
        return None
    return (
        "kaisa: profile 'general' was read from this rank's part of the model, which has "
        f"no nn.Embedding, while process_group spans {group_size} of the {world_size} "
        "ranks: if it is a pipeline stage or shard of a language model whose token lookup "
        "lives elsewhere, give profile='language-model' on every stage (profile='general' "
        "says the default was meant)"
    )
