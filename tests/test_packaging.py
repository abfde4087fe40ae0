"""The wheel is the library; the benchmark suite and its models stay in the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kaisa.cli import main as kaisa_main

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_the_wheel_holds_the_library_without_the_demo_or_the_models(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "kaisa", source / "kaisa", ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q"]
    result = subprocess.run(
        [*command, "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("kaisa-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [n for n in names if n.startswith(("kaisa/demo/", "kaisa/models/"))]
    for needed in (
        "kaisa/__init__.py",
        "kaisa/preconditioner.py",
        "kaisa/py.typed",
        "kaisa/cli/plan.py",
        "kaisa/integrations/lightning.py",
        "kaisa/layers/attention.py",
    ):
        assert needed in names


def test_kaisa_demo_without_the_demo_package_says_where_it_lives(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kaisa.demo.cli", None)  # as in an installed wheel
    assert kaisa_main(["demo", "--help"]) == 2
    err = capsys.readouterr().err
    assert "runs from a checkout" in err and "make demo" in err
