"""Which module types kaisa can precondition, and how to find them in a model."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from kaisa.layers.attention import attention_handlers
from kaisa.layers.base import LayerHandler
from kaisa.layers.conv import conv1d_handler, conv2d_handler, unsupported_reason
from kaisa.layers.embedding import embedding_handler
from kaisa.layers.linear import LinearHandler
from kaisa.warn import warn

#: ``factory(module, **options)`` returns a handler, several (one module holding
#: several blocks), or ``None`` to skip the module.
#: Options are the handler options of :func:`find_layers` (e.g. ``conv_estimator``);
#: a factory ignores the ones that do not concern it.
HandlerFactory = Callable[..., LayerHandler | Sequence[LayerHandler] | None]

_REGISTRY: dict[type[nn.Module], HandlerFactory] = {}


def register_handler(module_type: type[nn.Module], factory: HandlerFactory) -> None:
    """Teach kaisa a module type: ``factory(module)`` returns a handler or ``None`` to skip it.

    Subclasses of a registered type use the nearest registered ancestor's factory.
    """
    _REGISTRY[module_type] = factory


def handler_for(
    module: nn.Module, **options: object
) -> LayerHandler | Sequence[LayerHandler] | None:
    """The handler(s) for ``module``, or ``None`` if kaisa does not precondition it."""
    for cls in type(module).__mro__:
        factory = _REGISTRY.get(cls)
        if factory is not None:
            return factory(module, **options)
    return None


def _linear(module: nn.Module, **_: object) -> LayerHandler:
    assert isinstance(module, nn.Linear)
    return LinearHandler(module)


def _attention(module: nn.Module, **_: object) -> list[LayerHandler]:
    assert isinstance(module, nn.MultiheadAttention)
    return list(attention_handlers(module))


register_handler(nn.Linear, _linear)
register_handler(nn.Conv2d, conv2d_handler)
register_handler(nn.Conv1d, conv1d_handler)
register_handler(nn.MultiheadAttention, _attention)
register_handler(nn.Embedding, embedding_handler)


@dataclass(frozen=True)
class Treatment:
    """How one trainable parameter is treated: by which blocks, or left raw and why."""

    parameter: str
    shape: tuple[int, ...]
    blocks: tuple[str, ...]  # the registered layers that precondition it
    kind: str  # the block kind, or 'raw'
    reason: str = ""  # why it is left raw ('' when preconditioned)


@dataclass(frozen=True)
class Coverage:
    """Every trainable parameter of a model and how kaisa treats it; prints as a table."""

    entries: tuple[Treatment, ...]

    def raw(self) -> list[Treatment]:
        """The parameters left with their raw gradients."""
        return [t for t in self.entries if t.kind == "raw"]

    def __iter__(self) -> Iterator[Treatment]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __str__(self) -> str:
        rows = [("parameter", "shape", "treatment")]
        for t in self.entries:
            shape = "x".join(map(str, t.shape)) or "scalar"
            blocks = ", ".join(t.blocks)
            how = f"raw: {t.reason}" if t.kind == "raw" else f"{t.kind} in {blocks}"
            rows.append((t.parameter, shape, how))
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        kept = sum(t.kind != "raw" for t in self.entries)
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}" for r in rows]
        lines.append(f"{kept} of {len(self.entries)} trainable parameters preconditioned")
        return "\n".join(lines)


@dataclass(frozen=True)
class Survey:
    """The layers kaisa preconditions in a model, and every parameter's treatment."""

    layers: list[tuple[str, LayerHandler]]
    treatments: list[Treatment]
    warnings: list[str] = field(default_factory=list)


_NORMS = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,
    nn.RMSNorm,
)


def _why_unhandled(module: nn.Module) -> tuple[str, bool]:
    """Why a module with parameters is left raw, and whether that deserves a warning."""
    if isinstance(module, _NORMS):
        return "normalisation layer: affine parameters are left raw (a documented choice)", False
    reason = unsupported_reason(module)
    if reason is not None:
        return reason, True
    if isinstance(module, nn.Embedding) and module.sparse:
        return "sparse embedding (sparse=True): sparse gradients are not preconditioned", True
    return f"no handler for {type(module).__name__}", False


def survey(model: nn.Module, skip_layers: Sequence[str] = (), **options: object) -> Survey:
    """Every layer of ``model`` that kaisa preconditions, and how each parameter is treated.

    A module is left out, with everything inside it, when its name or class
    name matches one of the ``skip_layers`` regular expressions
    (``re.search``); a module is also left out when one of its
    handled parameters does not require a gradient, or when no handler
    supports it. A module that appears twice in the tree (one layer called by
    two parents) is registered once and gathers curvature from every call. A
    parameter held by two different modules (a head tied to an embedding) is
    left raw with a warning: its gradient sums both uses, and one use's
    curvature would precondition it wrongly. ``options`` go to the handler
    factories (``conv_estimator='expand'|'reduce'`` for convolutions).
    """
    patterns = [re.compile(p) for p in skip_layers]
    # Every module holding each parameter (by id), with its first name.
    holders: dict[int, dict[int, str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), {}).setdefault(id(module), name or type(model).__name__)
    found: list[tuple[str, LayerHandler]] = []
    raw: dict[int, str] = {}
    messages: list[str] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        label = name or type(module).__name__
        class_name = type(module).__name__
        direct = list(module.parameters(recurse=False))
        matched = next((p for p in patterns if p.search(name) or p.search(class_name)), None)
        if matched is not None:
            # The whole subtree: skip_layers=['Block'] leaves a Block's layers raw.
            reason = f"skip_layers matched {matched.pattern!r}"
            if name:
                reason += f" (on {label!r})"
            for sub in module.modules():
                seen.add(id(sub))
                for param in sub.parameters(recurse=False):
                    raw.setdefault(id(param), reason)
            continue
        if not direct:
            continue
        made = handler_for(module, **options)
        if made is None:
            reason, warn = _why_unhandled(module)
            for param in direct:
                raw.setdefault(id(param), reason)
            if warn:
                messages.append(
                    f"kaisa: skipping {label!r} ({module}): {reason}; its gradients are left as is"
                )
            continue
        handlers = [made] if isinstance(made, LayerHandler) else list(made)
        claimed = {id(m) for h in handlers for m in h.claimed_modules()}
        seen |= claimed
        for handler in handlers:
            params = handler.parameters()
            if not all(p.requires_grad for p in params):
                # A frozen weight (or bias) cannot be preconditioned as one matrix.
                for param in params:
                    raw.setdefault(id(param), "its layer's other parameter is frozen")
                continue
            shared = [p for p in params if holders[id(p)].keys() - claimed]
            if shared:
                users = sorted({o for p in shared for o in holders[id(p)].values()})
                others = [user for user in users if user != label] or users
                messages.append(
                    f"kaisa: {label!r} shares a parameter with {', '.join(map(repr, others))}; its "
                    "gradient sums every use, so it is left raw rather than preconditioned "
                    "with one use's curvature"
                )
                shared_ids = {id(p) for p in shared}
                for param in params:
                    raw[id(param)] = (
                        f"shared by {', '.join(users)}"
                        if id(param) in shared_ids
                        else f"its layer's other parameter is shared by {', '.join(users)}"
                    )
                continue
            block = f"{label}.{handler.suffix}" if handler.suffix else label
            found.append((block, handler))
        # Parameters of a claimed module that no handler covers (bias_k, bias_v).
        covered = {id(p) for h in handlers for p in h.parameters()}
        for claimed_module in (m for h in handlers[:1] for m in h.claimed_modules()):
            for param in claimed_module.parameters(recurse=False):
                if id(param) not in covered:
                    raw.setdefault(id(param), f"not a projection of {class_name}")
    by_param: dict[int, list[tuple[str, LayerHandler]]] = {}
    for block, handler in found:
        for param in handler.parameters():
            by_param.setdefault(id(param), []).append((block, handler))
    treatments = []
    for pname, param in model.named_parameters():
        if not param.requires_grad:
            continue
        blocks = by_param.get(id(param), [])
        if blocks and id(param) not in raw:
            names = tuple(b for b, _ in blocks)
            treatments.append(Treatment(pname, tuple(param.shape), names, blocks[0][1].kind))
        else:
            reason = raw.get(id(param), "not part of a registered layer")
            treatments.append(Treatment(pname, tuple(param.shape), (), "raw", reason))
    return Survey(found, treatments, messages)


def find_layers(
    model: nn.Module, skip_layers: Sequence[str] = (), **options: object
) -> list[tuple[str, LayerHandler]]:
    """Every layer of ``model`` that kaisa preconditions, with its qualified name.

    The root module, if it is itself a layer, is named by its class name; the
    blocks of a module holding several (``nn.MultiheadAttention``: ``.q``,
    ``.k``, ``.v``, ``.out_proj``) are named with a suffix. The rules are
    :func:`survey`'s; its warnings are issued here.
    """
    result = survey(model, skip_layers, **options)
    for message in result.warnings:
        warn(message, UserWarning)
    return result.layers


def coverage_of(
    treatments: Sequence[Treatment], blocks: Mapping[str, tuple[bool, str]]
) -> Coverage:
    """The coverage table now: each block's ``(dormant, 'A/G' representations)`` filled in.

    A preconditioned parameter names its blocks' representations; one whose
    block captured nothing (dormant) is shown raw, naming that block.
    """
    entries = []
    for t in treatments:
        if t.kind != "raw":
            dormant = [b for b in t.blocks if blocks[b][0]]
            if dormant:
                t = dataclasses.replace(
                    t, kind="raw", reason=f"{dormant[0]} captured nothing (see the warning)"
                )
            else:
                reps = sorted({blocks[b][1] for b in t.blocks})
                t = dataclasses.replace(t, kind=f"{t.kind} (A/G {', '.join(reps)})")
        entries.append(t)
    return Coverage(tuple(entries))
