"""The package's rooms import downwards only (checked on the source, by ``ast``).

``kaisa.distributed`` knows shapes, not module types: it must not import the
layer handlers, the models or the demo. ``kaisa.curvature`` is plain tensor
maths. The library proper never imports the demo or the models.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kaisa"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _offending(room: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / room).rglob("*.py")):
        for module in _imports(path):
            if module.startswith(forbidden):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    return bad


@pytest.mark.parametrize(
    ("room", "forbidden"),
    [
        ("distributed", ("kaisa.layers", "kaisa.models", "kaisa.demo", "kaisa.preconditioner")),
        (
            "curvature",
            (
                "kaisa.layers",
                "kaisa.models",
                "kaisa.demo",
                "kaisa.distributed",
                "kaisa.preconditioner",
            ),
        ),
        ("layers", ("kaisa.models", "kaisa.demo", "kaisa.preconditioner")),
        ("integrations", ("kaisa.models", "kaisa.demo")),
    ],
)
def test_rooms_import_downwards_only(room: str, forbidden: tuple[str, ...]) -> None:
    assert _offending(room, forbidden) == []


def test_the_library_files_do_not_import_the_demo_or_the_models() -> None:
    library = ["preconditioner.py", "options.py", "schedules.py", "telemetry.py", "choices.py"]
    bad = [
        f"{name} imports {module}"
        for name in library
        for module in _imports(PACKAGE / name)
        if module.startswith(("kaisa.models", "kaisa.demo"))
    ]
    assert bad == []
