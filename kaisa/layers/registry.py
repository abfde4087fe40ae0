"""Which module types kaisa can precondition, and how to find them in a model.

**Registration.** :func:`register_handler` maps a module type to a handler
factory; a module uses the factory of the nearest registered class in its
MRO. Classes of libraries kaisa does not import (HuggingFace's ``Conv1D``,
Falcon's ``FalconLinear``, timm's ``Linear`` and ``Conv2dSame``, the
attention of timm's EVA and BEiT, which applies its ``qkv`` layer itself)
are known by module and class name (:data:`_BY_NAME`), and HuggingFace's
``*ScaledWordEmbedding`` classes (Gemma's, BART's, …: a lookup times
``embed_scale``) by a name pattern (:data:`_BY_PATTERN`), each of those (and
``Conv2dSame``) taken only after a probe shows that it computes that product
(that convolution). Matching a model's classes by name imports nothing, so
``import kaisa`` never imports transformers. A factory
registered by the user is checked once against autograd on a probe
(:mod:`kaisa.layers.probe`): at registration when an ``example`` module is
given, else on the first module of the type kaisa meets; a handler that
breaks the contract is refused with
:class:`~kaisa.layers.probe.HandlerContractError`.

**Subclasses that compute something else.** A subclass of a registered class
that overrides ``forward`` (or a convolution's ``_conv_forward``) may no
longer compute its parent's function of its input (a convolution that
standardises its weight first): it is left raw, with a warning naming it and
the reason, unless a handler is registered for the subclass itself. The
exception is ``nn.Embedding``'s subclasses (learned position embeddings that
compute their positions): each lookup they make is read from its autograd
node as it runs (:class:`~kaisa.layers.embedding.ComputedIndexEmbeddingHandler`);
one whose output a probe shows is no lookup of its table is left raw with
the reason, and one that turns out so while training captures nothing (warned).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kaisa.layers.attention import attention_handlers
from kaisa.layers.base import LayerHandler
from kaisa.layers.conv import (
    conv1d_handler,
    conv2d_handler,
    same_conv2d_handler,
    same_conv2d_refusal,
)
from kaisa.layers.embedding import (
    computed_index_embedding_handler,
    computed_index_refusal,
    embedding_handler,
    scaled_embedding_handler,
    scaled_embedding_refusal,
)
from kaisa.layers.linear import LinearHandler, hosted_qkv_handler, transposed_linear_handler
from kaisa.layers.probe import HandlerContractError, check_factory
from kaisa.warn import warn

#: ``factory(module, **options)`` returns a handler, several (one module holding
#: several blocks), or ``None`` to skip the module.
#: Options are the handler options of :func:`find_layers` (e.g. ``conv_estimator``);
#: a factory ignores the ones that do not concern it.
HandlerFactory = Callable[..., LayerHandler | Sequence[LayerHandler] | None]

_REGISTRY: dict[type[nn.Module], HandlerFactory] = {}


def _linear_by_name(module: nn.Module, **_: object) -> LayerHandler | None:
    """A class known by name to compute ``nn.Linear``'s function (``None``: not an nn.Linear)."""
    return LinearHandler(module) if isinstance(module, nn.Linear) else None


#: Factories of classes that live in libraries kaisa does not import, by
#: ``(class.__module__, class.__qualname__)``; matched on the classes of a
#: model's modules, so nothing is imported. A class registered by type
#: (:data:`_REGISTRY`) comes first.
_BY_NAME: dict[tuple[str, str], HandlerFactory] = {
    # HuggingFace transformers' Conv1D (GPT-2, GPT, CTRL, ...): a Linear with an
    # (in, out) weight; its home before transformers 4.19 was modeling_utils.
    ("transformers.pytorch_utils", "Conv1D"): transposed_linear_handler,
    ("transformers.modeling_utils", "Conv1D"): transposed_linear_handler,
    # Falcon's Linear computes ``x Wᵀ + b`` itself, exactly nn.Linear's function.
    ("transformers.models.falcon.modeling_falcon", "FalconLinear"): _linear_by_name,
    # timm's Linear (MobileNetV3's, GhostNet's, Inception-v3's classifier, …) calls
    # F.linear itself (casting its weight to the input's dtype under TorchScript);
    # its home before timm 0.9 was timm.models.layers.linear.
    ("timm.layers.linear", "Linear"): _linear_by_name,
    ("timm.models.layers.linear", "Linear"): _linear_by_name,
    # timm's Conv2dSame (its tf_* models' strided convolutions) pads each input as
    # TensorFlow's 'SAME' in forward; taken after a probe input shows it does.
    ("timm.layers.conv2d_same", "Conv2dSame"): same_conv2d_handler,
    ("timm.models.layers.conv2d_same", "Conv2dSame"): same_conv2d_handler,
    # timm's EVA and BEiT attention apply their qkv Linear with F.linear themselves
    # (a bias assembled from q_bias, a zero k_bias and v_bias): captured from the host.
    ("timm.models.eva", "EvaAttention"): hosted_qkv_handler,
    ("timm.models.beit", "Attention"): hosted_qkv_handler,
}

#: Factories of classes matched by ``(module prefix, class-name suffix)``, for
#: a pattern that many classes of one library follow: HuggingFace writes one
#: ``<Model>ScaledWordEmbedding`` per model (Gemma 1–4, BART, mBART, M2M100,
#: NLLB, Blenderbot, BioGPT, …), each ``embed_scale · W[i]``.
_BY_PATTERN: tuple[tuple[str, str, HandlerFactory], ...] = (
    ("transformers.", "ScaledWordEmbedding", scaled_embedding_handler),
)

#: Why a factory refuses a module it was matched to (``None``: it does not), for
#: the warning that names the module left raw.
_REFUSALS: dict[HandlerFactory, Callable[[nn.Module], str | None]] = {
    scaled_embedding_handler: scaled_embedding_refusal,
    same_conv2d_handler: same_conv2d_refusal,
    computed_index_embedding_handler: computed_index_refusal,
}

#: Registered types whose factory has not been checked on a probe yet: the
#: first module of the type that :func:`handler_for` meets is.
_UNCHECKED: set[type[nn.Module]] = set()

#: The methods whose override makes a subclass compute something its
#: registered ancestor's handler may not describe.
_FORWARD_METHODS = ("forward", "_conv_forward")


def register_handler(
    module_type: type[nn.Module],
    factory: HandlerFactory,
    *,
    example: nn.Module | None = None,
    check: bool = True,
) -> None:
    """Teach kaisa a module type: ``factory(module)`` returns a handler or ``None`` to skip it.

    Subclasses of a registered type use the nearest registered ancestor's
    factory, unless they override ``forward`` (then they are left raw with a
    warning until their own class is registered).

    The handler is checked once against autograd (:mod:`kaisa.layers.probe`):
    on ``example`` (an instance of ``module_type``) right here, or, without
    one, on the first module of the type kaisa meets. A handler whose
    gradient matrix is not the gradient autograd computes (an ``(in, out)``
    weight reshaped instead of transposed: see
    :attr:`~kaisa.layers.base.LayerHandler.weight_layout`), or that
    ``set_grad_matrix`` does not write back as ``grad_matrix`` reads it, is
    refused with :class:`~kaisa.layers.probe.HandlerContractError` naming
    what is off (here the type is then not registered). ``check=False``
    registers without the check.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {factory!r}")
    if example is not None and not isinstance(example, module_type):
        raise TypeError(
            f"example must be an instance of {module_type.__name__}, got {type(example).__name__}"
        )
    if check and example is not None and not check_factory(factory, example):
        raise HandlerContractError(
            f"kaisa: the factory registered for {module_type.__name__} made no handler for "
            f"the example {example!r} (or its parameters are on the meta device): nothing "
            "to check; give an example it handles"
        )
    _REGISTRY[module_type] = factory
    if check and example is None:
        _UNCHECKED.add(module_type)
    else:
        _UNCHECKED.discard(module_type)


def _by_pattern(cls: type) -> HandlerFactory | None:
    for prefix, suffix, factory in _BY_PATTERN:
        if cls.__module__.startswith(prefix) and cls.__qualname__.endswith(suffix):
            return factory
    return None


def _registered(module: nn.Module) -> tuple[type[nn.Module] | None, HandlerFactory | None]:
    """The nearest registered class in ``module``'s MRO and its factory."""
    for cls in type(module).__mro__:
        factory = (
            _REGISTRY.get(cls)
            or _BY_NAME.get((cls.__module__, cls.__qualname__))
            or _by_pattern(cls)
        )
        if factory is not None:
            if factory is embedding_handler and _own_forward_reason(module, cls) is not None:
                # An nn.Embedding subclass with a forward of its own (a learned position
                # embedding computing its positions): its lookups are read as they run.
                return type(module), computed_index_embedding_handler
            return cls, factory
    return None, None


def _class_label(cls: type) -> str:
    """``nn.Embedding`` for torch's own modules, the class name otherwise."""
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__name__


def _own_forward_reason(module: nn.Module, registered: type[nn.Module]) -> str | None:
    """Why a subclass of ``registered`` is not taken for it (``None``: it is)."""
    own = type(module)
    if own is registered:
        return None
    for method in _FORWARD_METHODS:
        theirs = getattr(registered, method, None)
        if theirs is not None and getattr(own, method, None) is not theirs:
            parent = _class_label(registered)
            return (
                f"{own.__name__} overrides {parent}.{method}(): kaisa cannot tell that it still "
                f"computes {parent}'s function of its input, so it is not preconditioned as "
                f"one (register a handler for {own.__name__} itself to precondition it)"
            )
    return None


def handler_for(
    module: nn.Module, **options: object
) -> LayerHandler | Sequence[LayerHandler] | None:
    """The handler(s) for ``module``, or ``None`` if kaisa does not precondition it.

    A user's factory not yet checked is checked here first, on a probe copy
    of ``module`` (:class:`~kaisa.layers.probe.HandlerContractError` if it is
    refused).
    """
    registered, factory = _registered(module)
    if registered is None or factory is None or _own_forward_reason(module, registered):
        return None
    if registered in _UNCHECKED and check_factory(factory, module, dict(options)):
        _UNCHECKED.discard(registered)
    return factory(module, **options)


def _linear(module: nn.Module, **_: object) -> LayerHandler:
    assert isinstance(module, nn.Linear)
    return LinearHandler(module)


def _attention(module: nn.Module, **_: object) -> list[LayerHandler]:
    assert isinstance(module, nn.MultiheadAttention)
    return list(attention_handlers(module))


# kaisa's own handlers are tested (tests/layers/test_probe.py), not probed at import.
register_handler(nn.Linear, _linear, check=False)
register_handler(nn.Conv2d, conv2d_handler, check=False)
register_handler(nn.Conv1d, conv1d_handler, check=False)
register_handler(nn.MultiheadAttention, _attention, check=False)
register_handler(nn.Embedding, embedding_handler, check=False)


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
class Tie:
    """A weight shared by several registered layers, preconditioned with their summed curvature.

    ``uses``: ``(layer name, transposed)`` of each, the owner first (its
    gradient matrix is the one preconditioned; ``transposed``: this use's
    matrix is the owner's transposed). See :mod:`kaisa.curvature.shared`.
    """

    parameter: str
    weight: torch.Tensor = field(repr=False)
    uses: tuple[tuple[str, bool], ...]


@dataclass(frozen=True)
class Survey:
    """The layers kaisa preconditions in a model, and every parameter's treatment."""

    layers: list[tuple[str, LayerHandler]]
    treatments: list[Treatment]
    warnings: list[str] = field(default_factory=list)
    ties: list[Tie] = field(default_factory=list)


_NORMS = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,
    nn.RMSNorm,
)

#: Class names of normalisation layers kaisa does not know by type
#: (``LlamaRMSNorm``, ``T5LayerNorm``, timm's ``LayerNorm2d``, ``FrozenBatchNorm2d``).
_NORM_NAME = re.compile(r"Norm(alization)?(\d+d)?$")

_NORM_REASON = "normalisation layer: affine parameters are left raw (a documented choice)"


@dataclass(frozen=True)
class _Raw:
    """Why a module with parameters is left raw.

    ``reason`` goes to the coverage table. With ``group`` set, the module is
    also warned about: one warning for all the modules of one ``group``.
    """

    reason: str
    group: str = ""
    #: A module kaisa knows nothing of (no handler, not a norm): its
    #: parameters of two or more dimensions are named in one warning.
    unknown: bool = False


def _why_unhandled(module: nn.Module) -> _Raw:
    """Why a module with parameters is left raw, and whether (and with whom) to warn."""
    if isinstance(module, _NORMS) or _NORM_NAME.search(type(module).__name__):
        return _Raw(_NORM_REASON)
    registered, factory = _registered(module)
    if registered is not None:
        override = _own_forward_reason(module, registered)
        if override is not None:
            return _Raw(override, group=override)
        refuse = _REFUSALS.get(factory) if factory is not None else None
        refusal = refuse(module) if refuse is not None else None
        if refusal is not None:
            refused = f"{type(module).__name__}: {refusal}, so it is not preconditioned"
            return _Raw(refused, group=refused)
    if isinstance(module, nn.Embedding) and module.sparse:
        reason = "sparse embedding (sparse=True): sparse gradients are not preconditioned"
        return _Raw(reason, group=reason)
    kind = type(module).__name__
    if next(module.children(), None) is not None:
        # A module holding layers and tensors of its own (ViT's class token and
        # position embeddings in ViTEmbeddings): the tensors are no layer.
        return _Raw(f"a free parameter of {kind}, not a layer kaisa handles", unknown=True)
    return _Raw(f"no handler for {kind}", unknown=True)


def _unknown_warning(named: Sequence[Treatment]) -> list[str]:
    """One warning naming the raw parameters (two or more dimensions) of modules kaisa lacks."""
    if not named:
        return []
    listed = [
        f"{t.parameter!r} ({'x'.join(map(str, t.shape))}, {t.reason})"
        for t in named[:_NAMED_IN_WARNING]
    ]
    if len(named) > _NAMED_IN_WARNING:
        listed.append(f"and {len(named) - _NAMED_IN_WARNING} more")
    one = len(named) == 1
    count = "1 parameter" if one else f"{len(named)} parameters"
    verbs = (
        ("belongs", "is", "its gradient is") if one else ("belong", "are", "their gradients are")
    )
    return [
        f"kaisa: {count} of two or more dimensions {verbs[0]} to no layer kaisa handles and "
        f"{verbs[1]} left raw: {', '.join(listed)}; {verbs[2]} left as is (teach kaisa a "
        "layer type with kaisa.register_handler; coverage() lists every parameter)"
    ]


#: Modules named one by one in a warning about several.
_NAMED_IN_WARNING = 8


def _skip_warnings(skipped: Mapping[str, Sequence[tuple[str, nn.Module, _Raw]]]) -> list[str]:
    """One warning per group of modules left raw for one reason."""
    messages = []
    for group, members in skipped.items():
        if len(members) == 1:
            label, module, why = members[0]
            messages.append(
                f"kaisa: skipping {label!r} ({module}): {why.reason}; its gradients are left as is"
            )
            continue
        named = [repr(label) for label, _, _ in members[:_NAMED_IN_WARNING]]
        if len(members) > _NAMED_IN_WARNING:
            named.append(f"and {len(members) - _NAMED_IN_WARNING} more")
        messages.append(
            f"kaisa: skipping {len(members)} modules: {', '.join(named)}: {group}; their "
            "gradients are left as is"
        )
    return messages


#: The attribute under which ``torch.compile`` keeps the module it compiled
#: (an ``OptimizedModule``'s only child): a segment of every name below it.
_COMPILED = "_orig_mod"


def plain_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` segments that ``torch.compile`` inserts.

    ``torch.compile(model)`` returns a wrapper holding ``model`` as
    ``_orig_mod``, so ``model.0.weight`` becomes ``_orig_mod.0.weight`` (and a
    compiled submodule ``block`` puts ``block._orig_mod.`` before its own
    names). kaisa names layers and parameters as if nothing were compiled, so
    ``coverage()``, checkpoints, ``skip_layers`` and ``curvature`` patterns and
    warnings are the same either way (a checkpoint of an eager run loads into
    a compiled one and back).
    """
    if _COMPILED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != _COMPILED)


def _compiled_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper around the module it compiled."""
    return type(module).__name__ == "OptimizedModule" and isinstance(
        getattr(module, _COMPILED, None), nn.Module
    )


def named_modules(
    model: nn.Module, *, remove_duplicate: bool = True
) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` named by :func:`plain_name`."""
    for name, module in model.named_modules(remove_duplicate=remove_duplicate):
        yield plain_name(name), module


def named_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_parameters()`` named by :func:`plain_name`."""
    for name, param in model.named_parameters():
        yield plain_name(name), param


def survey(model: nn.Module, skip_layers: Sequence[str] = (), **options: object) -> Survey:
    """Every layer of ``model`` that kaisa preconditions, and how each parameter is treated.

    A module is left out, with everything inside it, when its name or class
    name matches one of the ``skip_layers`` regular expressions
    (``re.search``); a module is also left out when one of its
    handled parameters does not require a gradient, or when no handler
    supports it. A module that appears twice in the tree (one layer called by
    two parents) is registered once and gathers curvature from every call. A
    weight held by several registered layers (a head tied to an embedding)
    registers each of them, and :attr:`Survey.ties` says that they share it:
    its gradient, which sums every use, is preconditioned with the sum of
    their curvatures (:mod:`kaisa.curvature.shared`; :func:`_tie` says
    when). One that cannot be (also held by a module kaisa does not handle,
    or shared with a bias) is left raw with a warning: one use's curvature
    would precondition it wrongly. Modules left raw for a reason
    worth a warning (grouped convolutions, sparse embeddings, a subclass
    with its own ``forward``) get one warning per reason, listing them.
    ``options`` go to the handler factories
    (``conv_estimator='expand'|'reduce'`` for convolutions).
    """
    patterns = [re.compile(p) for p in skip_layers]
    # Every module holding each parameter (by id), with its first name.
    holders: dict[int, dict[int, str]] = {}
    param: torch.Tensor
    for name, module in named_modules(model, remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), {}).setdefault(id(module), name or type(module).__name__)
    found: list[tuple[str, LayerHandler]] = []
    raw: dict[int, str] = {}
    messages: list[str] = []
    skipped: dict[str, list[tuple[str, nn.Module, _Raw]]] = {}
    warned_shared: set[tuple[str, ...]] = set()
    sharing: list[_Sharing] = []
    unknown: dict[int, str] = {}  # parameters of modules kaisa knows nothing of: their reason
    seen: set[int] = set()
    for name, module in named_modules(model):
        if id(module) in seen:
            continue
        seen.add(id(module))
        label = name or type(module).__name__
        class_name = type(module).__name__
        direct = list(module.parameters(recurse=False))
        if _compiled_wrapper(module):
            continue  # torch.compile's wrapper: not a module of the model (no name, no class)
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
            why = _why_unhandled(module)
            for param in direct:
                raw.setdefault(id(param), why.reason)
                if why.unknown:
                    unknown.setdefault(id(param), why.reason)
            if why.group:
                skipped.setdefault(why.group, []).append((label, module, why))
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
            if any(id(p) not in holders for p in params):
                # Not a parameter of the model: computed in forward (torch's
                # parametrizations turn .weight into such a tensor).
                why = _Raw(
                    f"{handler.kind} of {class_name}: its weight is not a parameter of the model "
                    "but computed from one (a parametrization?), so it is not preconditioned",
                    group=f"their weight is not a parameter of the model but computed from one "
                    f"(a parametrization?), so the {handler.kind} blocks are not preconditioned",
                )
                for param in params:
                    raw.setdefault(id(param), why.reason)
                skipped.setdefault(why.group, []).append((label, module, why))
                continue
            block = f"{label}.{handler.suffix}" if handler.suffix else label
            # A layer registered through its parent (EVA's 'attn.qkv'): matched by its name.
            hosted = handler.module is not module
            hit = next((p for p in patterns if hosted and p.search(block)), None)
            if hit is not None:
                for param in params:
                    raw.setdefault(id(param), f"skip_layers matched {hit.pattern!r} (on {block!r})")
                continue
            # An alias a parent keeps of its layer's parameter (BERT's, RoBERTa's
            # and ALBERT's MLM head hold the decoder's bias as their own `bias`):
            # one use, the layer's; the parent, visited first, left it raw as a
            # free parameter.
            aliased = {
                id(p) for p in params if _held_by_ancestors_only(holders[id(p)], claimed, label)
            }
            for key in aliased:
                raw.pop(key, None)
                unknown.pop(key, None)
            shared = [p for p in params if holders[id(p)].keys() - claimed and id(p) not in aliased]
            if shared:  # decided once every use is known (see _tie)
                sharing.append(_Sharing(block, handler, label, shared))
            found.append((block, handler))
        # Parameters of a claimed module that no handler covers (bias_k, bias_v).
        covered = {id(p) for h in handlers for p in h.parameters()}
        for claimed_module in (m for h in handlers[:1] for m in h.claimed_modules()):
            for param in claimed_module.parameters(recurse=False):
                if id(param) not in covered:
                    raw.setdefault(id(param), f"not a projection of {class_name}")
        for param in direct:  # the host of a layer it applies itself (its own biases)
            if id(param) not in covered:
                raw.setdefault(id(param), f"a free parameter of {class_name}, not a layer")
    param_names = {id(p): n for n, p in named_parameters(model)}
    ties = _tie(sharing, holders, param_names)
    tied = {name for tie in ties for name, _ in tie.uses}
    for entry in sharing:
        if entry.block in tied:
            continue
        found = [(b, h) for b, h in found if b != entry.block]
        users = sorted({o for p in entry.shared for o in holders[id(p)].values()})
        others = [user for user in users if user != entry.label] or users
        if tuple(users) not in warned_shared:  # one warning per set of users
            warned_shared.add(tuple(users))
            messages.append(
                f"kaisa: {entry.label!r} shares a parameter with {', '.join(map(repr, others))}; "
                "its gradient sums every use, and kaisa sums the curvature of every use only "
                "for a whole 2-D weight shared by registered layers (at most one with a bias), "
                "so it is left raw rather than preconditioned with one use's curvature"
            )
        shared_ids = {id(p) for p in entry.shared}
        for param in entry.handler.parameters():
            raw[id(param)] = (
                f"shared by {', '.join(users)}"
                if id(param) in shared_ids
                else f"its layer's other parameter is shared by {', '.join(users)}"
            )
    tie_kind = {
        id(tie.weight): f"kronecker (shared by {', '.join(n for n, _ in tie.uses)}: "
        "summed curvature)"
        for tie in ties
    }
    by_param: dict[int, list[tuple[str, LayerHandler]]] = {}
    for block, handler in found:
        for param in handler.parameters():
            by_param.setdefault(id(param), []).append((block, handler))
    treatments = []
    unhandled: list[Treatment] = []  # raw matrices of modules kaisa knows nothing of
    for pname, param in named_parameters(model):
        if not param.requires_grad:
            continue
        blocks = by_param.get(id(param), [])
        if blocks and id(param) not in raw:
            names = tuple(b for b, _ in blocks)
            kind = tie_kind.get(id(param), blocks[0][1].kind)
            treatments.append(Treatment(pname, tuple(param.shape), names, kind))
        else:
            reason = raw.get(id(param), "not part of a registered layer")
            treatments.append(Treatment(pname, tuple(param.shape), (), "raw", reason))
            if param.dim() >= 2 and unknown.get(id(param)) == reason:
                unhandled.append(treatments[-1])
    warnings = _skip_warnings(skipped) + messages + _unknown_warning(unhandled)
    return Survey(found, treatments, warnings, ties)


def _held_by_ancestors_only(holders: Mapping[int, str], claimed: set[int], label: str) -> bool:
    """Whether every module holding a parameter besides the layer's own (``claimed``) is
    an ancestor of the layer (``label``, its name): a parent keeping an alias of it.

    Such a parent takes no part of its own in the gradient unless its
    ``forward`` uses the alias directly; the MLM heads of BERT, RoBERTa and
    ALBERT keep their decoder's bias this way and use it only through the
    decoder.
    """
    others = [name for module, name in holders.items() if module not in claimed]
    return bool(others) and all(label.startswith(f"{name}.") for name in others)


@dataclass(frozen=True)
class _Sharing:
    """A handled layer one of whose parameters another module holds too."""

    block: str
    handler: LayerHandler
    label: str
    shared: list[torch.Tensor]


def _weight_matrix(handler: LayerHandler) -> tuple[int, int] | None:
    """``(g, a)`` of the layer's weight columns when its weight is one whole 2-D matrix."""
    weight, rows = handler.weight_slot()
    if weight.dim() != 2 or rows != slice(None):
        return None
    return handler.g_size, handler.a_size - (1 if handler.has_bias else 0)


def _tie(
    sharing: Sequence[_Sharing],
    holders: Mapping[int, Mapping[int, str]],
    param_names: Mapping[int, str],
) -> list[Tie]:
    """The shared weights whose every use is a registered layer kaisa can sum.

    A weight is tied when every module holding it is claimed by one of the
    layers sharing it, it is each one's whole 2-D weight and the only
    parameter they share, and at most one of them has a bias (the owner,
    listed first; else the first use). Each other use is marked transposed
    when its gradient matrix is the owner's transposed (an embedding's
    ``(dim, vocab)`` against a head's ``(vocab, dim)``).
    """
    groups: dict[int, list[_Sharing]] = {}
    for entry in sharing:
        if len(entry.shared) != 1 or entry.shared[0] is not entry.handler.weight:
            continue
        groups.setdefault(id(entry.shared[0]), []).append(entry)
    ties = []
    for key, members in groups.items():
        claimed = {id(m) for e in members for m in e.handler.claimed_modules()}
        if len(members) < 2 or not holders[key].keys() <= claimed:
            continue
        if sum(e.handler.has_bias for e in members) > 1:
            continue
        members = sorted(members, key=lambda e: not e.handler.has_bias)  # stable: owner first
        shapes = [_weight_matrix(e.handler) for e in members]
        owner = members[0].handler
        uses: list[tuple[str, bool]] = []
        for entry, shape in zip(members, shapes, strict=True):
            if shape is None:
                break
            transposed = entry.handler.weight_layout != owner.weight_layout
            if (shape[::-1] if transposed else shape) != shapes[0]:
                break
            uses.append((entry.block, transposed))
        else:
            ties.append(Tie(param_names.get(key, members[0].label), owner.weight, tuple(uses)))
    return ties


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
