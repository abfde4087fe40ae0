"""The package's rooms import downwards only, and never in a circle (checked on the source).

The import graph of every module under ``kaisa/`` is read with ``ast``:
absolute ``kaisa.*`` imports and relative ones, at module level or inside a
function (an import deferred to call time still ties the two modules together
in the design), but not those under ``if TYPE_CHECKING:`` (annotations only).
Two rules hold on it:

* no cycle: no two modules import each other, directly or through others;
* no arrow up: a module imports only modules of its own level of
  :data:`LEVELS` or of a lower one.

``kaisa.distributed`` knows shapes, not module types; ``kaisa.curvature`` is
plain tensor maths; the library proper never imports the demo or the models.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kaisa"

#: The rooms of the package, lowest level first. A room is a top-level module
#: or subpackage of ``kaisa`` (``"kaisa"`` itself is the package's
#: ``__init__``); a top-level module not named here is a front-door room
#: (:data:`FRONT_DOOR_ROOMS`).
LEVELS: list[tuple[str, ...]] = [
    # Leaves: choice vocabularies, argument checks, warnings at the user's line,
    # lazy attribute loading, hyperparameter schedules, phase timers and traffic
    # counters; torch at most.
    (
        "kaisa.choices",
        "kaisa.validation",
        "kaisa.warn",
        "kaisa._lazy",
        "kaisa.schedules",
        "kaisa.telemetry",
    ),
    # Plain tensor maths of one Kronecker block and its costs.
    ("kaisa.curvature",),
    # Where work and traffic go: plans and collectives over shapes, not module types.
    ("kaisa.distributed",),
    # Engines of parallelism the front door chooses (plain/DDP, DeepSpeed, FSDP2,
    # pipelining): how a full gradient is read and written.
    ("kaisa.engines",),
    # Layer handlers: capture of factor rows and gradient matrices per module family.
    ("kaisa.layers",),
    # The profiles: which defaults a model's 'auto' options take (read from the model).
    ("kaisa.profiles",),
    # Rooms of the front door: its options, the read-only views of its layers.
    ("kaisa.options", "kaisa.views"),
    # The capture bookkeeping of an iteration (the hooks' side).
    ("kaisa.capture",),
    # The automatic choice over a run, then the checkpoint schema (which reads it).
    ("kaisa.autochoice",),
    ("kaisa.checkpoint",),
    # The registered layers: handler, block, captures and placement of each.
    ("kaisa.roster",),
    # What step() tells the user about the loop around it (reports, checks).
    ("kaisa.watch",),
    # The front door, and the package that re-exports it.
    ("kaisa.preconditioner", "kaisa"),
    # Wrappers that build the front door inside a training framework.
    ("kaisa.integrations",),
    # Example models and the demo that trains them (users of the library).
    ("kaisa.models", "kaisa.demo"),
    # The command line: `kaisa plan` (planning the demo's models too) and `kaisa demo`.
    ("kaisa.cli",),
]
#: The level of the front door's rooms: where unnamed top-level modules belong.
FRONT_DOOR_ROOMS = next(i for i, rooms in enumerate(LEVELS) if "kaisa.options" in rooms)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import under ``node``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def _known(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, source: str, modules: set[str], package: bool) -> set[str]:
    """The modules of ``modules`` that ``module`` (its ``source``) imports.

    ``package``: ``module`` is a package's ``__init__`` (relative imports
    start from the module itself).
    """
    found: set[str] = set()
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from package import submodule` names the submodule.
            names = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
            names = [name if name in modules else base for name in names] or [base]
        for name in names:
            target = _known(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of ``kaisa`` and the modules of ``kaisa`` it imports."""
    paths = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    modules = set(paths)
    return {
        name: imports_of(name, path.read_text(), modules, path.name == "__init__.py")
        for name, path in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def level_of(module: str) -> int:
    """The index in :data:`LEVELS` of the room ``module`` belongs to."""
    room = module if module == "kaisa" else ".".join(module.split(".")[:2])
    for level, rooms in enumerate(LEVELS):
        if room in rooms:
            return level
    return FRONT_DOOR_ROOMS


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_no_arrow_up() -> None:
    graph = import_graph()
    upward = [
        f"{module} (level {level_of(module)}) imports {target} (level {level_of(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if level_of(target) > level_of(module)
    ]
    assert upward == []


@pytest.mark.parametrize(
    ("room", "forbidden"),
    [
        ("kaisa.curvature", ("kaisa.layers", "kaisa.distributed", "kaisa.engines")),
        ("kaisa.distributed", ("kaisa.layers", "kaisa.models", "kaisa.demo")),
        ("kaisa.engines", ("kaisa.layers", "kaisa.preconditioner", "kaisa.integrations")),
        ("kaisa.layers", ("kaisa.preconditioner", "kaisa.integrations")),
    ],
)
def test_rooms_import_downwards_only(room: str, forbidden: tuple[str, ...]) -> None:
    """The rules the levels imply that matter most, spelled out."""
    bad = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module == room or module.startswith(room + ".")
        for target in targets
        if target.startswith(forbidden)
    ]
    assert bad == []


def test_the_library_does_not_import_the_demo_or_the_models() -> None:
    top = {"kaisa.models", "kaisa.demo", "kaisa.cli"}
    bad = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if ".".join(module.split(".")[:2]) not in top
        for target in targets
        if target.startswith(("kaisa.models", "kaisa.demo"))
    ]
    assert bad == []


def test_the_graph_reader() -> None:
    """Relative and deferred imports count; ``TYPE_CHECKING`` ones do not."""
    modules = {"kaisa", "kaisa.a", "kaisa.a.b", "kaisa.a.c", "kaisa.d", "kaisa.e", "kaisa.f"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from . import c\n"
        "from .. import d\n"
        "if TYPE_CHECKING:\n"
        "    from kaisa.e import E\n"
        "else:\n"
        "    import kaisa.f\n"
        "def later():\n"
        "    from kaisa import KFACPreconditioner\n"
    )
    found = imports_of("kaisa.a.b", source, modules, package=False)
    assert found == {"kaisa.a.c", "kaisa.d", "kaisa.f", "kaisa"}
    assert imports_of("kaisa.a", "from .b import x\n", modules, package=True) == {"kaisa.a.b"}
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    assert level_of("kaisa") == level_of("kaisa.preconditioner")
    assert level_of("kaisa.unnamed_room") == FRONT_DOOR_ROOMS
