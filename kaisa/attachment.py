"""How a preconditioner is attached to its model, and what the model is since.

Three things the front door needs and the model must not pay for:

* **Hooks that hold the preconditioner weakly** (:class:`WeakCall`). The
  model owns its hooks; a hook that held the preconditioner would keep it, its
  factors and second-order state alive for as long as the model lives,
  although the user dropped it (a notebook cell run again). A weak hook calls
  the preconditioner while it lives and does nothing after; the
  preconditioner's finalizer removes its hooks when it is collected
  (:func:`detach_when_collected`), so nothing of it is left on the model.
* **One preconditioner per layer** (:func:`holders`, :func:`claim`). A
  registry keyed weakly on the registered modules says which live
  preconditioner holds a layer, so that a second one built on the same
  layers (without ``remove_hooks()`` on the first) is seen; the front door
  decides what to do (it takes over, with a warning).
* **The model's structure when attached** (:class:`Structure`): a registered
  layer replaced or removed, a module with parameters added after
  construction. Checked cheaply: a process-wide counter of module and
  parameter registrations (torch's global registration hooks, installed once)
  tells that something may have changed; the full comparison of module
  identities then runs, and also on the steps the caller asks (factor-update
  steps, for removals, which torch reports to no hook).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from kaisa.layers.registry import named_modules

__all__ = [
    "Structure",
    "WeakCall",
    "attach",
    "claim",
    "detach_when_collected",
    "holders",
    "release",
    "replaced",
    "taken_over",
]


class WeakCall:
    """``getattr(owner, method)(*bound, *args)`` while ``owner`` lives; ``None`` after.

    What the model's hooks hold instead of a bound method, so that they do
    not keep the preconditioner alive.
    """

    __slots__ = ("_bound", "_method", "_owner")

    def __init__(self, owner: object, method: str, *bound: object) -> None:
        self._owner = weakref.ref(owner)
        self._method = method
        self._bound = bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        if owner is None:
            return None
        return getattr(owner, self._method)(*self._bound, *args, **kwargs)


def attach(owner: Any, model: nn.Module, handlers: Sequence[Any], capturer: Any) -> list[Any]:
    """The hooks of a preconditioner, none of which keeps it alive.

    Every registered layer's handler calls ``capturer.capture_at(index, …)``
    and the model calls ``owner._root_forward`` before and
    ``owner._root_forward_done`` after (or on an exception in) each forward.
    All hold their targets weakly and are removed when ``owner`` is collected.
    """
    # Under torch.compile each capture is one opaque call (torch.compiler.disable):
    # the graph breaks there and resumes after it, at most one break per layer,
    # instead of Dynamo tracing into the capture bookkeeping and giving up on
    # whole frames (a loop over layers) at its first unsupported call.
    handles = [
        handler.attach(torch.compiler.disable(WeakCall(capturer, "capture_at", index)))  # type: ignore[no-untyped-call]
        for index, handler in enumerate(handlers)
    ]
    handles.append(model.register_forward_pre_hook(WeakCall(owner, "_root_forward")))
    handles.append(
        model.register_forward_hook(WeakCall(owner, "_root_forward_done"), always_call=True)
    )
    detach_when_collected(owner, handles)
    return handles


def taken_over(shared: Sequence[str], old: str) -> str:
    """The warning when a new preconditioner takes over layers ``old`` still held."""
    names = ", ".join(repr(name) for name in shared[:3]) + (", …" if len(shared) > 3 else "")
    return (
        f"kaisa: layers {names} are already preconditioned by KFACPreconditioner {old}, "
        "which was not detached with remove_hooks() (a notebook cell run again?): the new "
        "preconditioner takes over; the old one's hooks are removed and its step() raises, "
        "so no gradient is preconditioned twice. Call remove_hooks() on a preconditioner "
        "before building its replacement"
    )


def replaced(by: str) -> str:
    """The error of ``step()`` on a preconditioner that another took over (``by``: which)."""
    return (
        f"kaisa: this KFACPreconditioner was replaced by a newer KFACPreconditioner ({by}) "
        "built on the same layers: it no longer preconditions. Call step() on the new one "
        "(and remove_hooks() on a preconditioner before building its replacement)"
    )


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def detach_when_collected(owner: object, handles: list[Any]) -> None:
    """Remove ``handles`` (the list, as it is then) when ``owner`` is garbage-collected.

    ``handles`` must not refer to ``owner``; emptying it (``remove_hooks()``)
    leaves the finalizer nothing to do.
    """
    finalizer = weakref.finalize(owner, _remove_all, handles)
    finalizer.atexit = False


# -- one preconditioner per layer --------------------------------------------------------

_HOLDERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def holders(modules: Iterable[nn.Module], exclude: object = None) -> list[Any]:
    """The live owners (other than ``exclude``) that :func:`claim` ed any of ``modules``."""
    found: list[Any] = []
    for module in modules:
        ref = _HOLDERS.get(module)
        owner = None if ref is None else ref()
        if owner is not None and owner is not exclude and all(owner is not o for o in found):
            found.append(owner)
    return found


def claim(modules: Iterable[nn.Module], owner: object) -> None:
    """Record ``owner`` (held weakly) as the holder of ``modules``."""
    ref = weakref.ref(owner)
    for module in modules:
        _HOLDERS[module] = ref


def release(modules: Iterable[nn.Module], owner: object) -> None:
    """Forget ``owner`` as the holder of those of ``modules`` it holds."""
    for module in modules:
        ref = _HOLDERS.get(module)
        if ref is not None and ref() is owner:
            del _HOLDERS[module]


# -- the model's structure ---------------------------------------------------------------

#: Module and parameter registrations anywhere in the process since the hooks
#: were installed (:func:`_watch_registrations`).
_registrations = 0
_watching = False


def _registered(*_: object) -> None:
    global _registrations
    _registrations += 1


def _watch_registrations() -> None:
    """Install torch's global module and parameter registration hooks, once per process."""
    global _watching
    if not _watching:
        torch_module.register_module_module_registration_hook(_registered)
        torch_module.register_module_parameter_registration_hook(_registered)
        _watching = True


def _describe(module: nn.Module) -> str:
    return type(module).__name__


def _owns_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


class Structure:
    """A model's modules when the preconditioner was built, and what changed since.

    Args:
        model: the root module.
        registered: the registered layers' modules, in registration order
            (repeats allowed: an attention module holds four blocks).
    """

    def __init__(self, model: nn.Module, registered: Sequence[nn.Module]) -> None:
        _watch_registrations()
        self._model = weakref.ref(model)
        names = {id(m): name for name, m in named_modules(model)}
        self._registered: list[tuple[str, weakref.ref[nn.Module], str]] = []
        seen: set[int] = set()
        for module in registered:
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._registered.append(
                (names.get(id(module), "?"), weakref.ref(module), _describe(module))
            )
        self._known: dict[int, weakref.ref[nn.Module]] = {}
        self._remember(model.modules())
        self._generation = _registrations
        self._reported: set[str] = set()
        #: ``id()`` of the registered modules not in the model at the last comparison.
        self.removed: set[int] = set()

    def _remember(self, modules: Iterable[nn.Module]) -> None:
        self._known = {id(module): weakref.ref(module) for module in modules}

    def _is_known(self, module: nn.Module) -> bool:
        ref = self._known.get(id(module))
        return ref is not None and ref() is module

    def changes(self, *, thorough: bool) -> list[str]:
        """What changed since the last call, described; ``[]`` when nothing did.

        The module identities are compared only when a module or parameter
        was registered anywhere since the last comparison, or when
        ``thorough``. A registered layer gone is described once; a module
        added is described once, and known from then on.
        """
        model = self._model()
        if model is None or not (thorough or self._generation != _registrations):
            return []
        self._generation = _registrations
        present: dict[int, nn.Module] = {}
        found: list[str] = []
        for name, each in named_modules(model):
            present[id(each)] = each
            if not self._is_known(each) and _owns_trainable(each):
                found.append(
                    f"module {name!r} ({_describe(each)}) was added, with parameters kaisa "
                    "does not precondition"
                )
        gone: list[str] = []
        self.removed = set()
        for name, ref, kind in self._registered:
            module = ref()
            if module is None or present.get(id(module)) is not module:
                if module is not None:
                    self.removed.add(id(module))
                if name not in self._reported:
                    self._reported.add(name)
                    gone.append(f"registered layer {name!r} ({kind}) was replaced or removed")
        self._remember(present.values())
        return gone + found
