"""The handler contract, checked against autograd on a probe (``kaisa.register_handler``).

A handler can be wrong in ways that raise nothing: an ``(in, out)`` weight
reshaped to ``(out, in)`` instead of transposed, a bias column in the wrong
place, factors from the wrong tensor. K-FAC then preconditions with
curvature that is not the layer's, and the steps are merely worse. This
module catches that once per handler, before any training.

**The probe.** The module (a copy, in float64 where it can be) is called on
:meth:`~kaisa.layers.base.LayerHandler.probe_input`, one input that makes
exactly one row, through the handler's own :meth:`attach`; a random output
gradient ``δ`` is sent back through it. For one row the K-FAC identity is
exact: the weight's gradient, as the handler reads it, is ``∇ = c · δ āᵀ``
and its factor sums are ``A = α āāᵀ`` and ``G = β δδᵀ`` (``c``, ``α``,
``β`` the layer kind's constant scalings of spec §3). So

* ``∇ᵀ∇ / ‖∇‖² = A / tr A``: the columns of the gradient matrix are the
  input side, bias column included;
* ``∇∇ᵀ / ‖∇‖² = G / tr G``: its rows are the output side;

which together pin ``∇`` down to ``± δ āᵀ``, scale free. Moreover
``set_grad_matrix`` followed by ``grad_matrix`` must give the written matrix
back, and the moments (``'kvec'``, ``'diagonal'``) must be those of the
same rows: ``(Σ ā)(Σ ā)ᵀ = A`` and ``Σ ā² = diag A`` for the one row.

A handler that breaks one of these is refused with
:class:`HandlerContractError`, naming the handler, the module and what is
off.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kaisa.layers.base import GradSelect, LayerHandler

__all__ = ["HandlerContractError", "check_factory", "check_handlers"]

#: Relative tolerance of the probe's comparisons by the dtype it ran in.
_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4}
_LOOSE = 3e-2  # half precision


class HandlerContractError(ValueError):
    """A handler breaks the contract: its gradient is not the one autograd computes."""


class _Call:
    """What one handler's capture saw on the probe."""

    def __init__(self) -> None:
        self.calls = 0
        self.x: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.select: GradSelect = None

    def capture(self, x: torch.Tensor, output: torch.Tensor, select: GradSelect) -> None:
        self.calls += 1
        self.x, self.select = x.detach(), select
        if output.requires_grad:
            output.register_hook(self._grad)  # type: ignore[no-untyped-call]

    def _grad(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.select is None else self.select(grad)


def _probe_copy(module: nn.Module) -> nn.Module:
    """A float64 (where possible), hook-free, trainable copy of ``module`` with no gradients."""
    probe = copy.deepcopy(module)
    for sub in probe.modules():
        # Hooks of whoever watches the original (a preconditioner's captures) stay there.
        for hooks in (sub._forward_hooks, sub._forward_pre_hooks, sub._backward_hooks):
            hooks.clear()
        sub._backward_pre_hooks.clear()
    params = list(probe.parameters())
    if params and all(p.is_floating_point() for p in params):
        probe.double()
    probe.train()
    for param in probe.parameters():
        param.requires_grad_(True)
        param.grad = None
    return probe


def _output_tensors(output: object) -> list[torch.Tensor]:
    """The floating-point tensors of a forward's output that carry a gradient."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad and output.is_floating_point() else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _output_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _output_tensors(item)]
    return []


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest entry of ``got − want`` relative to ``want``'s largest entry."""
    scale = float(want.abs().max())
    return float((got - want).abs().max()) / (scale if scale > 0 else 1.0)


def _normalised(m: torch.Tensor) -> torch.Tensor:
    trace = m.diagonal().sum()
    return m / trace if float(trace) != 0 else m


def check_handlers(
    factory_output: LayerHandler | Sequence[LayerHandler] | None,
    module: nn.Module,
    seed: int = 0,
) -> None:
    """Check the handler(s) a factory made for ``module`` against autograd, on a probe copy.

    ``factory_output`` is what the factory returned for a *probe copy* of the
    module (see :func:`check_factory`); ``module`` is that copy. Raises
    :class:`HandlerContractError` naming what is off.
    """
    if factory_output is None:
        return
    handlers = (
        [factory_output] if isinstance(factory_output, LayerHandler) else list(factory_output)
    )
    if not handlers:
        return
    names = ", ".join(sorted({type(h).__name__ for h in handlers}))
    where = f"kaisa: {names} for {type(module).__name__}"
    generator = torch.Generator().manual_seed(seed)
    try:
        inputs = handlers[0].probe_input(generator)
    except Exception as error:  # (the handler's own method)
        raise HandlerContractError(f"{where}: probe_input() raised {error!r}") from error
    if inputs is None:
        raise HandlerContractError(
            f"{where}: the handler cannot make a probe input of one row for this module "
            "(probe_input() returned None: e.g. a convolution padded so that every input has "
            "several output positions); register with example= a module it can probe, "
            "override probe_input, or register with check=False"
        )
    calls = [_Call() for _ in handlers]
    detach = [h.attach(c.capture) for h, c in zip(handlers, calls, strict=True)]
    try:
        try:
            outputs = _output_tensors(module(*inputs))
        except Exception as error:
            raise HandlerContractError(
                f"{where}: the module's forward failed on the probe input "
                f"{[tuple(t.shape) for t in inputs]} ({error!r}); override the handler's "
                "probe_input to return arguments for one forward call that make one row "
                "(the default is one row of a Linear layer's input, (1, a_size - bias))"
            ) from error
        if not outputs:
            raise HandlerContractError(f"{where}: the module's output on the probe has no gradient")
        grads = [torch.randn(t.shape, generator=generator, dtype=torch.float64) for t in outputs]
        torch.autograd.backward(outputs, [g.to(t) for g, t in zip(grads, outputs, strict=True)])
    finally:
        for handle in detach:
            handle.remove()
    for handler, call in zip(handlers, calls, strict=True):
        _check_one(handler, call, where)


def _check_one(handler: LayerHandler, call: _Call, where: str) -> None:
    where = where if not handler.suffix else f"{where}, block {handler.suffix!r}"
    if call.calls != 1 or call.x is None:
        raise HandlerContractError(
            f"{where}: the handler's capture saw {call.calls} call(s) of the module on one "
            "forward of the probe (attach() must call capture once per forward call)"
        )
    if call.grad is None:
        raise HandlerContractError(
            f"{where}: no output gradient reached the output the handler captured"
        )
    x, delta = call.x, call.grad.detach()
    a, a_rows = handler.a_sum(x)
    g, g_rows = handler.g_sum(delta)
    if (a_rows, g_rows) != (1, 1):
        raise HandlerContractError(
            f"{where}: the probe input made {a_rows} input row(s) and {g_rows} output-gradient "
            "row(s) in a_sum/g_sum; probe_input must make exactly one (override it)"
        )
    for side, m, n in (("a_sum", a, handler.a_size), ("g_sum", g, handler.g_size)):
        if tuple(m.shape) != (n, n):
            raise HandlerContractError(
                f"{where}: {side} gave a {tuple(m.shape)} matrix, not ({n}, {n}) "
                f"(a_size={handler.a_size}, g_size={handler.g_size})"
            )
    grad = handler.grad_matrix()
    if grad is None:
        raise HandlerContractError(
            f"{where}: grad_matrix() is None though the probe gave the weight a gradient "
            "(weight_slot() must name the parameter the module computes with)"
        )
    if tuple(grad.shape) != (handler.g_size, handler.a_size):
        raise HandlerContractError(
            f"{where}: grad_matrix() has shape {tuple(grad.shape)}, not (g_size, a_size) = "
            f"({handler.g_size}, {handler.a_size})"
        )
    dtype = grad.dtype
    tol = _TOLERANCE.get(dtype, _LOOSE)
    grad = grad.double()
    a, g = a.double(), g.double()
    norm2 = float(grad.square().sum())
    if norm2 == 0 or float(a.diagonal().sum()) == 0 or float(g.diagonal().sum()) == 0:
        raise HandlerContractError(
            f"{where}: the probe gave a zero gradient matrix or a zero factor "
            f"(‖∇‖² = {norm2:.3g}, tr A = {float(a.trace()):.3g}, tr G = {float(g.trace()):.3g}); "
            "probe_input must make one row that reaches the weight"
        )
    problems = []
    cols = _mismatch(grad.t() @ grad / norm2, _normalised(a))
    rows = _mismatch(grad @ grad.t() / norm2, _normalised(g))
    if rows > tol or cols > tol:
        layout = handler.weight_layout
        other = "in_out" if layout == "out_in" else "out_in"
        problems.append(
            "the gradient matrix is not the gradient autograd computed, δ āᵀ of the captured "
            f"rows: its rows do not match G from g_sum (error {rows:.2g}) and its columns do "
            f"not match A from a_sum (error {cols:.2g}). Is the weight stored as "
            f"weight_layout says ({layout!r})? A weight stored (in, out) is transposed into "
            f"the (out, in) gradient matrix, not reshaped: weight_layout = {other!r}"
            if rows > tol and cols > tol
            else f"the gradient matrix's {'rows' if rows > tol else 'columns'} do not match "
            f"{'G from g_sum' if rows > tol else 'A from a_sum'} (error {max(rows, cols):.2g}): "
            f"check the {'output' if rows > tol else 'input'} side"
            + ("" if rows > tol else " (a_sum, and where the bias column goes)")
        )
    # Writing a matrix and reading it back gives it back.
    written = torch.randn(grad.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    handler.set_grad_matrix(written.to(handler.weight.device))
    back = handler.grad_matrix()
    if back is None or tuple(back.shape) != tuple(written.shape):
        problems.append("set_grad_matrix then grad_matrix does not give a matrix of the same shape")
    else:
        error = _mismatch(back.double().cpu(), written.double())
        if error > tol:
            problems.append(
                f"set_grad_matrix then grad_matrix does not give the matrix back (error "
                f"{error:.2g}): set_grad_matrix must write the gradient the way grad_matrix "
                f"reads it (weight_layout {handler.weight_layout!r})"
            )
    problems += _moment_problems(handler, x, delta, a, g, tol)
    if problems:
        raise HandlerContractError(
            f"{where} is refused: on a probe (one input row, a random output "
            "gradient), " + "; ".join(problems)
        )


def _moment_problems(
    handler: LayerHandler,
    x: torch.Tensor,
    delta: torch.Tensor,
    a: torch.Tensor,
    g: torch.Tensor,
    tol: float,
) -> list[str]:
    """The moments (``[Σ r; Σ r²]``) of the one row must be those of the gram sums."""
    problems = []
    for side, moments, full in (
        ("a_moments", handler.a_moments(x)[0], a),
        ("g_moments", handler.g_moments(delta)[0], g),
    ):
        n = full.shape[0]
        if tuple(moments.shape) != (2, n):
            problems.append(f"{side} gave shape {tuple(moments.shape)}, not (2, {n})")
            continue
        moments = moments.double()
        squares = _mismatch(moments[1], full.diagonal())
        outer = _mismatch(torch.outer(moments[0], moments[0]), full)
        if squares > tol or outer > tol:
            problems.append(
                f"{side} are not the moments of the rows whose products "
                f"{'a_sum' if side == 'a_moments' else 'g_sum'} adds up (error "
                f"{max(squares, outer):.2g})"
            )
    return problems


def check_factory(
    factory: Callable[..., object], module: nn.Module, options: dict[str, object] | None = None
) -> bool:
    """Run ``factory`` on a probe copy of ``module`` and check what it makes (see above).

    Returns whether anything was checked: not when the factory skips the
    module (returns ``None``) nor for a module whose parameters are not plain
    local tensors (the meta device: nothing to compute with; FSDP2's
    DTensor shards: the copy could not compute alone); such a module's type
    is checked on the next plain one.
    """
    if any(p.is_meta or type(p.data) is not torch.Tensor for p in module.parameters()):
        return False
    probe = _probe_copy(module)
    made = factory(probe, **(options or {}))
    if made is None:
        return False
    handlers = [made] if isinstance(made, LayerHandler) else made
    if not isinstance(handlers, Sequence) or not all(isinstance(h, LayerHandler) for h in handlers):
        raise HandlerContractError(
            f"kaisa: the factory for {type(module).__name__} returned {made!r}, not a "
            "LayerHandler, a sequence of them or None"
        )
    if not handlers:
        return False
    check_handlers(handlers, probe)
    return True
