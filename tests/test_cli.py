"""The ``kaisa`` command's top level: argparse sub-commands, help, version, errors."""

from __future__ import annotations

import pytest

from kaisa import __version__
from kaisa.cli import main


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: kaisa" in out and "demo" in out and "plan" in out


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kaisa" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-V"]) == 0
    assert capsys.readouterr().out.strip() == f"kaisa {__version__}"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [(["frobnicate"], "invalid choice: 'frobnicate'"), (["--bogus", "plan"], "--bogus")],
)
def test_bad_top_level_arguments_are_one_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "kaisa: error:" in err and fragment in err and "Traceback" not in err


def test_the_command_gets_every_option_after_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    assert "usage: kaisa plan" in capsys.readouterr().out
    assert main(["plan", "--world-size", "2", "--model", "bert-base", "--json"]) == 0
    assert '"world_size": 2' in capsys.readouterr().out
