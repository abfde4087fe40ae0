"""The arms' optimizers, built from an :class:`~kaisa.demo.config.ArmConfig`.

* ``sgd``: ``torch.optim.SGD`` (momentum, coupled weight decay).
* ``adamw``: ``torch.optim.AdamW`` (its default betas and eps, decoupled decay).
* ``soap``: ``heavyball.SOAP`` with the library's defaults but ``lr`` and
  ``weight_decay``, run eagerly: heavyball would otherwise ``torch.compile``
  its step (inductor), whose compilation would land on the training clock
  while no other arm is compiled. heavyball is an optional dependency (the
  ``bench`` extra); without it the arm fails with :class:`MissingDependencyError`.
* ``muon``: Muon on the *hidden* weights, AdamW on everything else, as Muon's
  authors advise. :func:`muon_param_split` decides: the weights of the
  ``nn.Linear`` and ``nn.Conv2d`` layers other than the first and the last in
  definition order (for :mod:`kaisa.models`, the order the data flows through
  them) are hidden; the first layer, the classifier head, biases and norm
  parameters go to AdamW. In a network whose input layer is an
  ``nn.Embedding`` (the GPT: token and position embeddings) the embeddings are
  the input layer, so every Linear but the head is hidden (for the GPT: every
  Linear weight inside the blocks), and the embeddings go to AdamW. Hidden 2-D
  matrices go to ``torch.optim.Muon``.
  **Hidden conv filters go to Muon too**, through :class:`ConvMuon`, this
  module's own Muon step on the ``(out, in*kh*kw)`` flattening of each filter
  bank: ``torch.optim.Muon`` accepts 2-D parameters only, and leaving conv
  filters to AdamW would leave GapCNN and ResNet-20 (whose only 2-D weight is
  the head) without any Muon parameter. ``ConvMuon`` follows
  ``torch.optim.Muon``'s update (momentum 0.95 as an exponential average,
  Nesterov, five quintic Newton-Schulz steps with coefficients (3.4445,
  -4.7750, 2.0315), learning rate scaled by ``sqrt(max(1, rows/cols))``,
  decoupled weight decay) but iterates in float32 where ``torch.optim.Muon``
  uses bfloat16. **On a device without native bfloat16 matrix products**
  (:func:`native_bfloat16`: a CPU without AVX-512 BF16 or AMX, for one) the
  hidden matrices go to ``ConvMuon`` too: there ``torch.optim.Muon``'s
  bfloat16 iteration is emulated, and its step cost 8.8× AdamW's on the
  language model (AVX2-only EPYC, 2 threads), a handicap of the machine, not
  of Muon (float32 there: 1.3–1.6×). The arm's record (``matrices``) says which
  path it took. Both Muon parts and the AdamW part follow the arm's schedule,
  the AdamW part at ``ArmConfig.adamw_lr_ratio`` times the Muon peak.

Every optimizer's param groups carry an ``"lr_scale"`` (the group's peak over
the arm's peak, 1 unless stated) which the training loop multiplies into the
scheduled learning rate.
"""

from __future__ import annotations

import importlib.metadata
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from kaisa.demo.config import ArmConfig

__all__ = [
    "HEAVYBALL_HINT",
    "NS_COEFFICIENTS",
    "ConvMuon",
    "MissingDependencyError",
    "MuonSplit",
    "OptimizerChain",
    "TrainingOptimizer",
    "build_optimizer",
    "muon_param_split",
    "native_bfloat16",
    "newton_schulz",
    "require_heavyball",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients ``(a, b, c)`` of Muon (also ``torch.optim.Muon``'s)."""

HEAVYBALL_HINT = "pip install -c constraints.txt heavyball"
"""How to install SOAP's library (pinned by the ``bench`` extra)."""


class MissingDependencyError(RuntimeError):
    """An arm needs an optional package that is not installed."""


class TrainingOptimizer(Protocol):
    """What the training loop needs of an optimizer."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self) -> Any: ...


class OptimizerChain:
    """Several optimizers over disjoint parameters, stepped as one."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("OptimizerChain needs at least one optimizer")
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's param groups, in order."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """One step of every optimizer."""
        for opt in self.optimizers:
            opt.step()


# --- Muon ------------------------------------------------------------------------


def newton_schulz(matrix: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise a 2-D ``matrix``: ``U Vᵀ`` of its SVD ``U S Vᵀ``.

    Muon's quintic iteration, in float32: ``X ← M / ‖M‖_F`` (so every singular
    value is at most 1), then ``steps`` times ``A = X Xᵀ``,
    ``X ← a X + (b A + c A²) X`` with ``(a, b, c)`` = :data:`NS_COEFFICIENTS`,
    working on the wide orientation (``Xᵀ`` when there are more rows than
    columns) so that ``A`` is the smaller Gram matrix. The coefficients push
    every singular value into roughly [0.7, 1.2] in five steps rather than
    converging exactly to 1, which is all Muon needs.
    """
    if matrix.ndim != 2:
        raise ValueError(f"newton_schulz expects a 2-D matrix, got shape {tuple(matrix.shape)}")
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(torch.float32)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp_min(eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    result: Tensor = x.T if tall else x
    return result


class ConvMuon(torch.optim.Optimizer):
    """Muon for parameters of two or more dimensions, on their ``(dim 0, rest)`` flattening.

    Per parameter ``W`` with gradient ``g`` (both seen as ``(out, in*kh*kw)``
    matrices for a conv filter bank)::

        B ← momentum·B + (1 - momentum)·g                (exponential average)
        U ← (1 - momentum)·g + momentum·B  if nesterov else B
        O ← newton_schulz(U)
        W ← (1 - lr·weight_decay)·W - lr·sqrt(max(1, out / (in·kh·kw)))·O

    which is ``torch.optim.Muon``'s update (with its default learning-rate
    adjustment) for 2-D parameters, up to its bfloat16 iteration.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        eps: float = 1e-7,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if ns_steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {ns_steps}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "eps": eps,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(
                        f"ConvMuon needs parameters of 2 or more dimensions, got {tuple(p.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            mu = float(group["momentum"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf: Tensor = state["momentum_buffer"]
                buf.lerp_(grad, 1.0 - mu)
                update = grad.lerp(buf, mu) if group["nesterov"] else buf
                flat = update.reshape(update.shape[0], -1)
                ortho = newton_schulz(flat, group["ns_steps"], group["eps"])
                scale = math.sqrt(max(1.0, flat.shape[0] / flat.shape[1]))
                p.mul_(1.0 - lr * group["weight_decay"])
                p.add_(ortho.reshape(p.shape).to(p.dtype), alpha=-lr * scale)
        return loss


@dataclass(frozen=True)
class MuonSplit:
    """Parameter names by the optimizer the Muon arm gives them."""

    matrices: tuple[str, ...]
    """Hidden 2-D weights: ``torch.optim.Muon`` (:class:`ConvMuon` without native bfloat16)."""
    filters: tuple[str, ...]
    """Hidden conv filters (4-D): :class:`ConvMuon`."""
    adamw: tuple[str, ...]
    """Everything else (first layer, head, biases, norms): ``torch.optim.AdamW``."""


def _unwrap(model: nn.Module) -> nn.Module:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        inner: nn.Module = model.module
        return inner
    return model


def _is_hf_conv1d(module: nn.Module) -> bool:
    """HuggingFace transformers' ``Conv1D`` (GPT-2's projections), not imported here."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def muon_param_split(model: nn.Module) -> MuonSplit:
    """Which of ``model``'s trainable parameters go to Muon and which to AdamW.

    Hidden weights are the ``weight`` of every ``nn.Linear`` and ``nn.Conv2d``
    (and HuggingFace's ``Conv1D``, a Linear with its weight stored transposed)
    except the first and the last such layer in definition order (the input
    layer and the classifier head), and the Q/K/V projection weights of every
    ``nn.MultiheadAttention``. When an ``nn.Embedding`` comes before the first
    Linear or Conv2d, the embedding is the input layer and that first Linear
    is hidden too (a language model: everything between the embeddings and
    the head). A model with fewer than three such layers (two after an
    embedding) has no hidden weight; a weight shared with an embedding (a
    tied head) is never hidden. A DDP wrapper is looked through.
    """
    model = _unwrap(model)
    layers = [
        m
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding)) or _is_hf_conv1d(m)
    ]
    first = 1
    if layers and isinstance(layers[0], nn.Embedding):
        first = 0
    embeddings = {id(m.weight) for m in layers if isinstance(m, nn.Embedding)}
    layers = [m for m in layers if not isinstance(m, nn.Embedding)]
    hidden = {
        id(m.weight)
        for m in layers[first:-1]
        if m.weight.requires_grad and id(m.weight) not in embeddings
    }
    # Attention's Q/K/V projections are hidden matrices too (the packed
    # in_proj_weight is orthogonalised as one matrix).
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                weight = getattr(m, name, None)
                if isinstance(weight, nn.Parameter) and weight.requires_grad:
                    hidden.add(id(weight))
    matrices: list[str] = []
    filters: list[str] = []
    adamw: list[str] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in hidden and p.ndim == 2:
            matrices.append(name)
        elif id(p) in hidden:
            filters.append(name)
        else:
            adamw.append(name)
    return MuonSplit(tuple(matrices), tuple(filters), tuple(adamw))


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware.

    CUDA: ``torch.cuda.is_bf16_supported()``. CPU: oneDNN's check for
    AVX-512 BF16 or AMX (``torch.ops.mkldnn._is_mkldnn_bf16_supported``);
    without them bfloat16 products are converted to float32 and back, which
    costs more than float32 itself. Anything else: ``True`` (left to the
    device). A property of the machine, the same on every run of it.
    """
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
        return bool(check()) if check is not None else False
    return True


def _build_muon(model: nn.Module, arm: ArmConfig) -> tuple[TrainingOptimizer, dict[str, Any]]:
    split = muon_param_split(model)
    named = dict(_unwrap(model).named_parameters())
    device = next((p.device for p in named.values()), torch.device("cpu"))
    bfloat16_iteration = native_bfloat16(device)
    optimizers: list[torch.optim.Optimizer] = []
    muon_kw: dict[str, Any] = {
        "lr": arm.lr,
        "weight_decay": arm.weight_decay,
        "momentum": arm.momentum,
        "nesterov": True,
        "ns_steps": 5,
    }
    if split.matrices:
        group = {"params": [named[n] for n in split.matrices], "lr_scale": 1.0}
        muon_class = torch.optim.Muon if bfloat16_iteration else ConvMuon
        optimizers.append(muon_class([group], **muon_kw))
    if split.filters:
        group = {"params": [named[n] for n in split.filters], "lr_scale": 1.0}
        optimizers.append(ConvMuon([group], **muon_kw))
    if split.adamw:
        group = {"params": [named[n] for n in split.adamw], "lr_scale": arm.adamw_lr_ratio}
        optimizers.append(
            torch.optim.AdamW(
                [group], lr=arm.lr * arm.adamw_lr_ratio, weight_decay=arm.adamw_weight_decay
            )
        )
    info = {
        "muon_matrices": list(split.matrices),
        "muon_conv_filters": list(split.filters),
        "adamw_params": list(split.adamw),
        "conv_filters": "Muon: kaisa.demo.optimizers.ConvMuon on (out, in*kh*kw), float32",
        "matrices": "Muon: torch.optim.Muon, bfloat16 iteration"
        if bfloat16_iteration
        else f"Muon: kaisa.demo.optimizers.ConvMuon, float32 iteration ({device.type} has no "
        "native bfloat16 matrix products)",
    }
    return OptimizerChain(optimizers), info


# --- SOAP ------------------------------------------------------------------------


def require_heavyball() -> Any:
    """Import heavyball for the soap arm; :class:`MissingDependencyError` if it is missing."""
    try:
        import heavyball
    except ImportError:
        raise MissingDependencyError(
            f"arm 'soap' needs heavyball, which is not installed: {HEAVYBALL_HINT} "
            "(or the 'bench' extra)"
        ) from None
    return heavyball


def _build_soap(model: nn.Module, arm: ArmConfig) -> tuple[TrainingOptimizer, dict[str, Any]]:
    heavyball = require_heavyball()
    # Eager, like every other arm (see the module docstring); read at each call.
    heavyball.utils.compile_mode = None
    # The schedule sets the lr every step, which heavyball supports (with its
    # default multi_tensor=True) but warns about once as experimental.
    warnings.filterwarnings("ignore", message="Learning rate changed between steps")
    opt = heavyball.SOAP(model.parameters(), lr=arm.lr, weight_decay=arm.weight_decay)
    for group in opt.param_groups:
        group["lr_scale"] = 1.0
    try:
        version = importlib.metadata.version("heavyball")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed by pip
        version = "unknown"
    return opt, {"heavyball": version, "compiled": False}


# --- all arms --------------------------------------------------------------------


def build_optimizer(model: nn.Module, arm: ArmConfig) -> tuple[TrainingOptimizer, dict[str, Any]]:
    """``arm``'s optimizer over ``model``'s parameters at its peak LR, and a JSON record of it.

    The record says what the arm actually got (e.g. the Muon/AdamW parameter
    split, the heavyball version). Raises :class:`MissingDependencyError` for
    ``soap`` without heavyball and ``ValueError`` for an unknown optimizer.
    """
    if arm.optimizer == "sgd":
        sgd = torch.optim.SGD(
            model.parameters(), lr=arm.lr, momentum=arm.momentum, weight_decay=arm.weight_decay
        )
        return sgd, {}
    if arm.optimizer == "adamw":
        adamw = torch.optim.AdamW(model.parameters(), lr=arm.lr, weight_decay=arm.weight_decay)
        group = adamw.param_groups[0]
        return adamw, {"betas": list(group["betas"]), "eps": group["eps"]}
    if arm.optimizer == "muon":
        return _build_muon(model, arm)
    if arm.optimizer == "soap":
        return _build_soap(model, arm)
    raise ValueError(
        f"unknown optimizer {arm.optimizer!r} for arm {arm.name!r}; "
        "allowed: 'sgd', 'adamw', 'muon', 'soap'"
    )
